"""Building the model a config names, and splitting it into what is trained and what is not.

    model = build_model(cfg)                          # Transformer, MoETransformer or UNet
    graphdef, params, buffers = split_model(model, cfg)

Both the trainer (meshwork.train.state) and inference (meshwork.inference.runs)
start here, so a run's checkpoint always matches the model that reads it.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from meshwork.config import Config
from meshwork.models.transformer import Transformer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def build_model(cfg: Config, seed: int | None = None, base_params: nnx.State | None = None) -> nnx.Module:
    """The model `cfg.model.kind` names, initialized from `run.seed` (or `seed`).

    With `finetune.method` set, the base model's weights are `base_params`
    (when given: the trained run's) and the method's wrappers, adapters or
    prefixes are added on top (meshwork.models.lora); QLoRA quantizes the base
    weights it finds, so they must be written in first.
    """
    model = _build_base_model(cfg, seed)
    if base_params is not None:
        nnx.update(model, base_params)
    if cfg.finetune.method not in ("none", "full"):
        from meshwork.models.lora import apply_finetune

        apply_finetune(model, cfg.finetune, nnx.Rngs(cfg.run.seed if seed is None else seed))
    return model


def _build_base_model(cfg: Config, seed: int | None) -> nnx.Module:
    kw = dict(
        dtype=DTYPES[cfg.train.compute_dtype],
        param_dtype=DTYPES[cfg.train.param_dtype],
        remat=cfg.train.remat,
        rngs=nnx.Rngs(cfg.run.seed if seed is None else seed),
    )
    if cfg.model.kind == "moe":
        from meshwork.models.moe import MoETransformer

        return MoETransformer(cfg.model, **kw)
    if cfg.model.kind == "unet":
        from meshwork.models.unet import UNet

        return UNet(cfg.model.unet, attention=cfg.model.attention, **kw)
    return Transformer(cfg.model, scan_layers=cfg.train.scan_layers, **kw)


def split_model(model: nnx.Module, cfg: Config | None = None) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, trainable params, buffers): buffers are the other variables
    (e.g. MoE routers' selection biases, a fine-tuned model's frozen base),
    carried in the state but never trained: no gradient, no optimizer state."""
    return nnx.split(model, trainable_filter(cfg), ...)


def trainable_filter(cfg: Config | None):
    """The variables the optimizer trains: every nnx.Param, or only the fine-tuning method's own."""
    if cfg is None or cfg.finetune.method in ("none", "full"):
        return nnx.Param
    from meshwork.models.lora import trainable

    return trainable(cfg.finetune)


def ema_decay(cfg: Config) -> float | None:
    """Decay of the weights' exponential moving average, when the model keeps one (diffusion
    samples with it): the trainer keeps `state.ema`, inference may read it instead of the weights."""
    return (cfg.model.diffusion.ema_decay or None) if cfg.model.kind == "unet" else None
