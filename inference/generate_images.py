"""`python3 -m inference diffusion`: a grid of samples from a trained diffusion run, graded for digits."""

from __future__ import annotations

import pathlib

import numpy as np

from meshwork.config import ConfigError
from meshwork.diffusion.images import sample_images, save_grid


def generate_grid(run_dir, *, num: int, steps: int, sampler: str, guidance: float | None, labels, seed: int,
                  ema: bool, out) -> tuple[pathlib.Path, float | None]:
    """Writes a grid PNG; returns its path and, for digits, the classifier accuracy of the samples."""
    from meshwork.inference.runs import load_run

    cfg, model, _ = load_run(run_dir, ema=ema)
    if cfg.model.kind != "unet":
        raise ConfigError(f"--checkpoint: {run_dir} trained a {cfg.model.kind}; `diffusion` needs a unet run")
    images, y = sample_images(model, cfg, num=num, steps=steps, sampler=sampler, guidance=guidance,
                              labels=labels, seed=seed)
    path = save_grid(images, out, nrow=int(np.ceil(np.sqrt(num))))
    accuracy = None
    if cfg.data.source == "digits" and y is not None:
        from meshwork.evaluation.digit_quality import DigitClassifier

        accuracy = DigitClassifier(cfg.model.unet.sample_size).accuracy(images, y)
    return pathlib.Path(path), accuracy
