"""Image data for the diffusion UNet: scikit-learn's bundled handwritten digits
(real scans, no download) or a folder of the user's own PNG/JPEG files.

Images come out as float32 (N, H, W, C) in [-1, 1] with integer class labels;
batches go through the same checkpointable grain pipeline as the LM's tokens.

    >>> images, labels = digits(16)          # doctest: +SKIP
    >>> images.shape, labels[:3]             # doctest: +SKIP
    ((1797, 16, 16, 1), array([0, 1, 2], dtype=int32))
"""

from __future__ import annotations

import pathlib
import zlib

import grain
import numpy as np
from PIL import Image, UnidentifiedImageError

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg"}


def _resize(img_HW_or_HWC: np.ndarray, size: int) -> np.ndarray:
    """Bilinear resize of one float image in [0, 1] to size x size."""
    channels = img_HW_or_HWC.shape[2:] or (1,)
    planes = img_HW_or_HWC.reshape(*img_HW_or_HWC.shape[:2], -1)
    out = [
        np.asarray(Image.fromarray(planes[..., c].astype(np.float32), mode="F").resize((size, size), Image.BILINEAR))
        for c in range(planes.shape[-1])
    ]
    return np.stack(out, axis=-1).reshape(size, size, *channels[-1:])


def digits(image_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 8x8 digits of scikit-learn (UCI ML hand-written digits), upsampled."""
    from sklearn.datasets import load_digits

    d = load_digits()
    images = np.stack([_resize(im / 16.0, image_size) for im in d.images]).astype(np.float32)
    return images * 2 - 1, d.target.astype(np.int32)


def image_folder(path: str | pathlib.Path, image_size: int, channels: int) -> tuple[np.ndarray, np.ndarray]:
    """Every PNG/JPEG under `path`, sorted; the names of first-level subfolders are the
    classes (label = rank of the folder name), files directly in `path` get class 0.

    Raises FileNotFoundError when there is no such file, ValueError naming one that is not an image."""
    root = pathlib.Path(path).expanduser()
    files = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise FileNotFoundError(f"{root}: no .png/.jpg/.jpeg files")
    classes = sorted({p.relative_to(root).parts[0] for p in files if len(p.relative_to(root).parts) > 1})
    images, labels = [], []
    for p in files:
        try:
            img = Image.open(p).convert("L" if channels == 1 else "RGB")
        except OSError as e:  # PIL's UnidentifiedImageError, a truncated or corrupt file
            why = "not an image format PIL knows" if isinstance(e, UnidentifiedImageError) else str(e)
            raise ValueError(
                f"{p} is not a readable image ({why}); remove it or replace it with a PNG or JPEG file"
            ) from None
        arr = np.asarray(img, np.float32) / 255.0
        images.append(_resize(arr if channels > 1 else arr[..., None], image_size))
        parts = p.relative_to(root).parts
        labels.append(classes.index(parts[0]) + 0 if len(parts) > 1 else 0)
    return np.stack(images).astype(np.float32) * 2 - 1, np.asarray(labels, np.int32)


def split(images: np.ndarray, labels: np.ndarray, val_fraction: float):
    """Deterministic train/validation split by a hash of each image's index."""
    is_val = np.array([zlib.crc32(str(i).encode()) % 10_000 < val_fraction * 10_000 for i in range(len(images))])
    return (images[~is_val], labels[~is_val]), (images[is_val], labels[is_val])


class ImageSource:
    """Random-access source of {'images', 'labels'} examples for grain."""

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"images": self.images[i], "labels": self.labels[i]}


def image_train_iterator(images: np.ndarray, labels: np.ndarray, global_batch: int, seed: int) -> grain.DatasetIterator:
    """Infinite, shuffled, checkpointable global batches (as the token iterator)."""
    ds = grain.MapDataset.source(ImageSource(images, labels)).shuffle(seed=seed).repeat(None)
    return iter(ds.batch(global_batch, drop_remainder=True).to_iter_dataset())


def image_eval_batches(
    images: np.ndarray, labels: np.ndarray, global_batch: int, n_batches: int
) -> list[dict[str, np.ndarray]]:
    """A fixed validation set: images spread evenly over the split (repeating if it is small)."""
    idx = np.linspace(0, len(images) - 1, global_batch * n_batches).astype(np.int64)
    return [{"images": images[row], "labels": labels[row]} for row in idx.reshape(n_batches, global_batch)]
