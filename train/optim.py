"""The optimizer of `optimizer.name`, with linear warmup and cosine decay and global-norm clipping
(optax): adamw for every weight, or muon (src/meshwork/optimizers/muon.py) for the weight matrices
with AdamW for the rest."""

from __future__ import annotations

import jax
import optax

from meshwork.config_sections import OptimizerConfig
from meshwork.optimizers.muon import muon
from meshwork.sharding.rules import Rules


def lr_schedule(cfg: OptimizerConfig, total_steps: int, peak: float | None = None) -> optax.Schedule:
    peak = cfg.lr if peak is None else peak
    return optax.warmup_cosine_decay_schedule(
        init_value=peak * cfg.init_lr_ratio,
        peak_value=peak,
        warmup_steps=cfg.warmup_steps,
        decay_steps=max(total_steps, cfg.warmup_steps + 1),
        end_value=peak * cfg.min_lr_ratio,
    )


def _decay_mask(params):
    # Norm scales multiply activations; decaying them toward 0 only hurts.
    return jax.tree_util.tree_map_with_path(lambda path, _: not any("norm" in str(k) for k in path), params)


def make_optimizer(
    cfg: OptimizerConfig, total_steps: int, rules: Rules | None = None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(the transformation, the learning-rate schedule the metrics report). `rules`: the optimizer
    state's logical-name table, which places Muon's orthogonalization on the mesh (None: one block)."""
    schedule = lr_schedule(cfg, total_steps)
    tx = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=_decay_mask)
    if cfg.name == "muon":  # AdamW stays for what is not a matrix
        tx = muon(cfg, tx, lr_schedule(cfg, total_steps, cfg.muon_settings.lr), rules)
    clip = optax.clip_by_global_norm(cfg.clip_norm) if cfg.clip_norm else optax.identity()
    return optax.chain(clip, tx), schedule
