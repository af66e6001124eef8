"""AdamW with linear warmup and cosine decay, global-norm clipping (optax)."""

from __future__ import annotations

import jax
import optax

from meshwork.config_sections import OptimizerConfig


def lr_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=cfg.lr * cfg.init_lr_ratio,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=max(total_steps, cfg.warmup_steps + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def _decay_mask(params):
    # Norm scales multiply activations; decaying them toward 0 only hurts.
    return jax.tree_util.tree_map_with_path(lambda path, _: not any("norm" in str(k) for k in path), params)


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = lr_schedule(cfg, total_steps)
    adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=_decay_mask)
    clip = optax.clip_by_global_norm(cfg.clip_norm) if cfg.clip_norm else optax.identity()
    return optax.chain(clip, adamw), schedule
