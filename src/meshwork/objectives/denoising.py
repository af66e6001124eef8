"""Denoising: the diffusion models' objective."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshwork.config import Config
from meshwork.diffusion.schedule import diffusion_loss
from meshwork.objectives import Batch, Objective


def denoising_loss(graphdef: nnx.GraphDef, cfg: Config) -> Objective:
    """loss_fn(params, buffers, batch, noise_key=None) -> (objective, metrics) for a denoiser.

    The noise and timesteps come from `noise_key` (a pure function of the step
    in training, fixed in evaluation). For classifier-free guidance a share
    `label_dropout` of the labels becomes the null class, the last one.
    """
    dcfg, n_classes = cfg.model.diffusion, cfg.model.unet.num_class_embeds

    def loss_fn(params, buffers, batch: Batch, noise_key: jax.Array | None = None):
        model = nnx.merge(graphdef, params, buffers)
        key = noise_key if noise_key is not None else jax.random.key(0)
        key, drop_key = jax.random.split(key)
        labels = None
        if n_classes is not None:
            drop = jax.random.bernoulli(drop_key, dcfg.label_dropout, batch["labels"].shape)
            labels = jnp.where(drop & (noise_key is not None), n_classes - 1, batch["labels"])
        loss, metrics = diffusion_loss(model, batch["images"], key, labels, dcfg)
        return loss, {**metrics, "loss": loss}

    return loss_fn
