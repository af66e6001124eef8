"""Sampling image grids from a trained diffusion run (CLI and training-time grids)."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshwork.config import Config, ConfigError
from inference.diffusion_sampling import ddim_sample, ddpm_sample, save_grid


def _apply(graphdef, state, x_BHWC, t_B, labels_B):
    return nnx.merge(graphdef, state)(x_BHWC, t_B, labels_B)


def sample_images(model, cfg: Config, *, num: int, steps: int, sampler: str = "ddim", guidance: float | None = None,
                  labels: str | int = "cycle", seed: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
    """(images (N, H, W, C) in [-1, 1], the labels asked for or None) from a UNet."""
    u, d = cfg.model.unet, cfg.model.diffusion
    shape = (num, u.sample_size, u.sample_size, u.in_channels)
    y = None
    if u.num_class_embeds is not None:
        n_real = u.num_class_embeds - 1  # the last class is the null label of guidance
        y = jnp.arange(num) % n_real if labels == "cycle" else jnp.full((num,), int(labels))
        if int(y.max()) >= n_real:
            raise ConfigError(f"--labels: class {int(y.max())} does not exist; the run has classes 0..{n_real - 1}")
    kw = dict(labels=y, guidance_scale=guidance if y is not None else None,
              null_label=u.num_class_embeds - 1 if y is not None else None)
    key = jax.random.key(seed)
    # The weights travel as arguments of the jitted sampler, not as constants.
    graphdef, state = nnx.split(model)
    model_fn = jax.tree_util.Partial(_apply, graphdef, state)
    if sampler == "ddim":
        x = ddim_sample(model_fn, shape, key, d, steps=steps, clip_sample=1.0, **kw)
    else:
        x = ddpm_sample(model_fn, shape, key, d, steps=steps, clip_sample=1.0, **kw)
    return np.asarray(x), (np.asarray(y) if y is not None else None)


def generate_grid(run_dir, *, num: int, steps: int, sampler: str, guidance: float | None, labels, seed: int,
                  ema: bool, out) -> tuple[pathlib.Path, float | None]:
    """Writes a grid PNG; returns its path and, for digits, the classifier accuracy of the samples."""
    from inference.runs import load_run

    cfg, model, _ = load_run(run_dir, ema=ema)
    if cfg.model.kind != "unet":
        raise ConfigError(f"--checkpoint: {run_dir} trained a {cfg.model.kind}; `diffusion` needs a unet run")
    images, y = sample_images(model, cfg, num=num, steps=steps, sampler=sampler, guidance=guidance,
                              labels=labels, seed=seed)
    path = save_grid(images, out, nrow=int(np.ceil(np.sqrt(num))))
    accuracy = None
    if cfg.data.source == "digits" and y is not None:
        from meshwork.digit_quality import DigitClassifier

        accuracy = DigitClassifier(cfg.model.unet.sample_size).accuracy(images, y)
    return pathlib.Path(path), accuracy
