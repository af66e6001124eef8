"""Images out of a diffusion model: sampling a UNet as its run's config says, and image grids.

images, labels = sample_images(model, cfg, num=40, steps=50)   # (N, H, W, C) in [-1, 1]
save_class_grid(images, labels, "grid.png")                    # row r: class r; tiles >= 48 px
save_grid(images, "plain.png")                                 # 8 a row, actual size
sample_images(model, cfg, num=40, steps=50, patch_parallel=4, warmup=4)   # DistriFusion on 4 devices
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshwork.config import Config, ConfigError
from meshwork.diffusion.sampling import ddim_sample, ddpm_sample

MIN_TILE_PX = 48  # saved grids scale smaller tiles up (nearest neighbour): 16 px digits are unreadable at 1:1


def _apply(graphdef, state, x_BHWC, t_B, labels_B):
    return nnx.merge(graphdef, state)(x_BHWC, t_B, labels_B)


def sample_images(
    model,
    cfg: Config,
    *,
    num: int,
    steps: int,
    sampler: str = "ddim",
    guidance: float | None = None,
    labels: str | int = "cycle",
    seed: int = 0,
    patch_parallel: int = 1,
    warmup: int = 4,
) -> tuple[np.ndarray, np.ndarray | None]:
    """(images (N, H, W, C) in [-1, 1], the labels asked for or None) from a UNet.

    patch_parallel n > 1: DDIM with the UNet split into n horizontal patches over the
    first n devices (`meshwork.diffusion.distrifusion`), the first `warmup` steps synchronous.
    """
    u, d = cfg.model.unet, cfg.model.diffusion
    shape = (num, u.sample_size, u.sample_size, u.in_channels)
    y = None
    if u.num_class_embeds is not None:
        n_real = u.num_class_embeds - 1  # the last class is the null label of guidance
        y = jnp.arange(num) % n_real if labels == "cycle" else jnp.full((num,), int(labels))
        if int(y.max()) >= n_real:
            raise ConfigError(f"--labels: class {int(y.max())} does not exist; the run has classes 0..{n_real - 1}")
    kw = dict(
        labels=y,
        guidance_scale=guidance if y is not None else None,
        null_label=u.num_class_embeds - 1 if y is not None else None,
    )
    key = jax.random.key(seed)
    # The weights travel as arguments of the jitted sampler, not as constants.
    graphdef, state = nnx.split(model)
    model_fn = jax.tree_util.Partial(_apply, graphdef, state)
    if patch_parallel > 1:
        x = _distrifusion(model_fn, shape, key, d, steps=steps, sampler=sampler, n=patch_parallel, warmup=warmup, **kw)
    elif sampler == "ddim":
        x = ddim_sample(model_fn, shape, key, d, steps=steps, clip_sample=1.0, **kw)
    else:
        x = ddpm_sample(model_fn, shape, key, d, steps=steps, clip_sample=1.0, **kw)
    return np.asarray(x), (np.asarray(y) if y is not None else None)


def _distrifusion(model_fn, shape, key, d, *, steps, sampler, n, warmup, **kw):
    from meshwork.diffusion.distrifusion import distrifusion_sample
    from meshwork.sharding.mesh import make_mesh

    if sampler != "ddim":
        raise ConfigError(f"--patch-parallel runs DDIM, not {sampler}; drop --sampler {sampler}")
    if jax.device_count() < n:
        raise ConfigError(
            f"--patch-parallel {n} needs {n} devices; this machine has {jax.device_count()} "
            f"({jax.devices()[0].platform}); pick at most {jax.device_count()}"
        )
    if not 1 <= warmup <= steps:
        raise ConfigError(f"--warmup {warmup} must be between 1 and --steps {steps}")
    if shape[1] % n:
        raise ConfigError(
            f"--patch-parallel {n}: the images' {shape[1]} rows do not split into {n} patches; "
            f"pick a divisor of {shape[1]}"
        )
    mesh = make_mesh({"sequence": n}, devices=jax.devices()[:n])
    # The weights sit on one device; the patch-parallel program wants them replicated on its mesh.
    model_fn = jax.device_put(model_fn, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    try:
        return distrifusion_sample(
            model_fn, shape, key, d, mesh=mesh, steps=steps, warmup=warmup, clip_sample=1.0, **kw
        )
    except ValueError as e:  # patch boundaries that the downsampling cannot keep aligned
        if not str(e).startswith("DistriFusion"):
            raise
        raise ConfigError(f"--patch-parallel {n}: {e}") from None


def image_grid(
    images_NHWC, nrow: int = 8, *, value_range: tuple[float, float] = (-1.0, 1.0), padding: int = 2, scale: int = 1
) -> np.ndarray:
    """Tiles N images, `nrow` per row, into one uint8 image: (H', W') for 1 channel,
    (H', W', 3) for 3. Values in `value_range` map to 0..255 (clipped); `padding`
    black pixels separate and surround the tiles; `scale` repeats each pixel
    scale x scale times (nearest neighbour) first.

    >>> image_grid(np.zeros((3, 4, 4, 1)), nrow=2).shape   # 2 rows of 2 tiles
    (14, 14)
    >>> image_grid(np.zeros((3, 4, 4, 1)), nrow=2, scale=3).shape   # 12 px tiles
    (30, 30)
    """
    x = np.asarray(images_NHWC, np.float32)
    if x.ndim != 4 or x.shape[-1] not in (1, 3):
        raise ValueError(f"image_grid: images shape {x.shape} must be (N, H, W, C) with C = 1 or 3")
    lo, hi = value_range
    x = np.clip(np.rint((x - lo) / (hi - lo) * 255), 0, 255).astype(np.uint8)
    if scale > 1:
        x = np.repeat(np.repeat(x, scale, axis=1), scale, axis=2)
    N, H, W, C = x.shape
    cols = max(1, min(nrow, N))
    rows = -(-N // cols)
    grid = np.zeros((rows * (H + padding) + padding, cols * (W + padding) + padding, C), np.uint8)
    for i in range(N):
        r, c = divmod(i, cols)
        y0, x0 = padding + r * (H + padding), padding + c * (W + padding)
        grid[y0 : y0 + H, x0 : x0 + W] = x[i]
    return grid[..., 0] if C == 1 else grid


def save_grid(images_NHWC, path, nrow: int = 8, **kwargs) -> pathlib.Path:
    """Writes `image_grid(images_NHWC, nrow, **kwargs)` as a PNG at `path`; returns the path.

    >>> save_grid(np.zeros((4, 8, 8, 1)), "/tmp/grid.png")   # doctest: +SKIP
    """
    from PIL import Image  # Pillow ships with matplotlib; imported here so sampling does not need it

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image_grid(images_NHWC, nrow, **kwargs)).save(path, format="PNG")
    return path


def by_class(images_NHWC, labels_N) -> tuple[np.ndarray, int]:
    """(images, per_row): the images reordered so that a grid `per_row` wide holds class r's images
    in its row r (classes in increasing order, black tiles where a class has fewer images).

    >>> x, per_row = by_class(np.zeros((5, 4, 4, 1)), np.array([0, 1, 2, 0, 1]))
    >>> x.shape, per_row      # 3 rows (classes 0, 1, 2) of 2
    ((6, 4, 4, 1), 2)
    """
    x, y = np.asarray(images_NHWC), np.asarray(labels_N)
    classes = np.unique(y)
    members = [np.flatnonzero(y == c) for c in classes]
    per_row = max(len(m) for m in members)
    out = np.full((len(classes) * per_row, *x.shape[1:]), -np.inf, np.float32)  # clipped to black
    for r, m in enumerate(members):
        out[r * per_row : r * per_row + len(m)] = x[m]
    return out, per_row


def class_grid(images_NHWC, labels_N=None, *, min_tile: int = MIN_TILE_PX, **kwargs) -> np.ndarray:
    """`image_grid` with one row per class (labels given and not all equal; a square-ish grid
    otherwise) and tiles scaled up to at least `min_tile` pixels.

    >>> class_grid(np.zeros((20, 16, 16, 1)), np.arange(20) % 10).shape   # 10 rows of 2 tiles of 48 px
    (502, 102)
    """
    x = np.asarray(images_NHWC)
    if labels_N is not None and len(np.unique(labels_N)) > 1:
        x, per_row = by_class(x, labels_N)
    else:
        per_row = int(np.ceil(np.sqrt(len(x))))
    return image_grid(x, per_row, scale=max(1, -(-min_tile // x.shape[1])), **kwargs)


def save_class_grid(images_NHWC, labels_N, path, **kwargs) -> pathlib.Path:
    """Writes `class_grid(images_NHWC, labels_N, **kwargs)` as a PNG at `path`; returns the path."""
    from PIL import Image

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(class_grid(images_NHWC, labels_N, **kwargs)).save(path, format="PNG")
    return path
