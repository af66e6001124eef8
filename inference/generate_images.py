"""`python3 -m inference diffusion`: a grid of samples from a trained diffusion run, graded for digits."""

from __future__ import annotations

import pathlib

from meshwork.config import ConfigError
from meshwork.diffusion.images import sample_images, save_class_grid

PER_CLASS = 4  # the default --num: this many images of each class (one grid row per class)
UNCONDITIONAL = 16  # ... and this many from a model without classes


def default_num(cfg) -> int:
    """Images that fill whole rows: PER_CLASS per class of a class-conditional UNet."""
    classes = cfg.model.unet.num_class_embeds
    return PER_CLASS * (classes - 1) if classes is not None else UNCONDITIONAL  # the last class is the null one


def generate_grid(
    run_dir,
    *,
    num: int | None,
    steps: int,
    sampler: str,
    guidance: float | None,
    labels,
    seed: int,
    ema: bool,
    out,
    patch_parallel: int = 1,
    warmup: int = 4,
) -> tuple[pathlib.Path, float | None]:
    """Writes a grid PNG (one row per class when the images have several) and returns its path and, for
    digits, the classifier accuracy of the samples. `num=None`: `default_num(cfg)`. patch_parallel > 1:
    DistriFusion over that many devices, `warmup` synchronous steps first."""
    from meshwork.inference.runs import load_run

    cfg, model, _ = load_run(run_dir, ema=ema)
    if cfg.model.kind != "unet":
        raise ConfigError(f"--checkpoint: {run_dir} trained a {cfg.model.kind}; `diffusion` needs a unet run")
    images, y = sample_images(
        model,
        cfg,
        num=num or default_num(cfg),
        steps=steps,
        sampler=sampler,
        guidance=guidance,
        labels=labels,
        seed=seed,
        patch_parallel=patch_parallel,
        warmup=warmup,
    )
    path = save_class_grid(images, y, out)
    accuracy = None
    if cfg.data.source == "digits" and y is not None:
        from meshwork.evaluation.digit_quality import DigitClassifier

        accuracy = DigitClassifier(cfg.model.unet.sample_size).accuracy(images, y)
    return pathlib.Path(path), accuracy
