"""Tokens in, batches out: a byte tokenizer, the default corpus, grain pipelines.

The default corpus is real text that every Python installation carries: the
standard library's own `.py` sources (about 1,800 files, 31 MB on CPython
3.11), byte-tokenized. Files are assigned to train or validation by a hash of
their relative path, so the split is deterministic and does not depend on file
order. The corpus is written once as nanoGPT-style uint16 `.bin` files, which
is also the format of a user's own token files (`data.source: tokens`).

Batches come from a grain pipeline over fixed windows of the token file:
shuffled by `run.seed`, infinite, and checkpointable (`iterator.get_state()`
is JSON), so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import functools
import os
import pathlib
import sys
import sysconfig
import zlib
from dataclasses import dataclass

import grain
import numpy as np

from meshwork.config import ConfigError

TOKEN_DTYPE = np.uint16


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255: nothing to download, nothing unknown."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(TOKEN_DTYPE)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


# ------------------------------------------------------------ default corpus


def stdlib_sources() -> list[pathlib.Path]:
    """The interpreter's standard-library `.py` files, sorted, without site-packages."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return [
        p
        for p in sorted(root.rglob("*.py"))
        if "site-packages" not in p.parts and "__pycache__" not in p.parts and p.is_file()
    ]


def stdlib_corpus(val_fraction: float, cache_dir: str | None = None) -> tuple[pathlib.Path, pathlib.Path]:
    """Returns (train.bin, val.bin) for the stdlib corpus, building them on first use.

    Files are cached under `cache_dir` (default ~/.cache/meshwork) in a folder
    named by the Python version and split, and written atomically, so parallel
    runs can share the cache.
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])

    def documents():
        for path in stdlib_sources():
            rel = path.relative_to(root).as_posix()
            # A file separator the model can learn: the path as a comment header.
            yield rel, f"# file: {rel}\n".encode() + path.read_bytes() + b"\n"

    return _cached_corpus("stdlib", documents, val_fraction, cache_dir)


def stdlib_docs_corpus(val_fraction: float, cache_dir: str | None = None) -> tuple[pathlib.Path, pathlib.Path]:
    """(train.bin, val.bin) of English prose: the Python reference manual's topics as `pydoc`
    ships them (pydoc_data.topics, ~0.5 MB), one document per topic.

    The other part of the default corpus, for fine-tuning a model trained on
    code: documentation text instead of source.
    """
    from pydoc_data.topics import topics

    def documents():
        for name in sorted(topics):
            yield name, topics[name].encode() + b"\n"

    return _cached_corpus("stdlib_docs", documents, val_fraction, cache_dir)


def _cached_corpus(
    name: str, documents, val_fraction: float, cache_dir: str | None
) -> tuple[pathlib.Path, pathlib.Path]:
    """Byte-tokenizes (key, bytes) documents into train/val .bin files, split by a hash of the key."""
    base = pathlib.Path(cache_dir or os.environ.get("MESHWORK_CACHE", "~/.cache/meshwork")).expanduser()
    out = base / f"{name}-py{sys.version_info.major}.{sys.version_info.minor}-val{val_fraction:g}"
    train, val = out / "train.bin", out / "val.bin"
    if train.exists() and val.exists():
        return train, val
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    for key, data in documents():
        split = "val" if zlib.crc32(key.encode()) % 10_000 < val_fraction * 10_000 else "train"
        parts[split].append(data)
    try:
        out.mkdir(parents=True, exist_ok=True)
        for split, dest in (("train", train), ("val", val)):
            tokens = np.frombuffer(b"".join(parts[split]), dtype=np.uint8).astype(TOKEN_DTYPE)
            tmp = dest.with_suffix(f".tmp{os.getpid()}")
            tokens.tofile(tmp)
            os.replace(tmp, dest)
    except OSError as e:
        raise ConfigError(
            f"data.cache_dir: the corpus cache {out} cannot be written ({e.strerror}); point "
            f"data.cache_dir (or MESHWORK_CACHE) to a writable folder"
        ) from None
    return train, val


def max_token_id(path: str | os.PathLike) -> int:
    """The largest id in a uint16 token file, read whole (in chunks, so memory stays flat); cached
    per (path, size, mtime), so a run that starts again does not read an unchanged file twice."""
    stat = os.stat(path)
    return _max_token_id(str(pathlib.Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _max_token_id(path: str, size: int, mtime_ns: int) -> int:
    tokens = np.memmap(path, dtype=TOKEN_DTYPE, mode="r")
    chunk = 1 << 26
    return max(int(tokens[i : i + chunk].max()) for i in range(0, len(tokens), chunk))


def unigram_entropy(path: str | os.PathLike, vocab_size: int = 65536) -> float:
    """Entropy of the token frequencies of a .bin file, in nats per token.

    A model that only learned token frequencies scores this loss; anything
    below it has learned context.
    """
    counts = np.bincount(np.memmap(path, dtype=TOKEN_DTYPE, mode="r"), minlength=vocab_size)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# ------------------------------------------------------------ grain pipeline


@dataclass
class TokenWindows:
    """Random-access source: window i is tokens [i*L, i*L + L + 1) of a uint16 file.

    The memmap opens lazily so the source pickles cheaply into grain workers.
    """

    path: str
    seq_len: int

    def __post_init__(self):
        n_tokens = os.path.getsize(self.path) // np.dtype(TOKEN_DTYPE).itemsize
        self._len = max(0, (n_tokens - 1) // self.seq_len)
        self._tokens = None

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> np.ndarray:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=TOKEN_DTYPE, mode="r")
        start = int(i) * self.seq_len
        return np.asarray(self._tokens[start : start + self.seq_len + 1], dtype=np.int32)

    def __getstate__(self):
        return {**self.__dict__, "_tokens": None}


def _to_example(batch_BL1: np.ndarray) -> dict[str, np.ndarray]:
    return {"inputs": batch_BL1[:, :-1], "targets": batch_BL1[:, 1:]}


def train_iterator(path: str, seq_len: int, global_batch: int, seed: int) -> grain.DatasetIterator:
    """An infinite, shuffled, checkpointable iterator of {'inputs', 'targets'} (B, L) global batches.

    Every process iterates the same global batches and keeps its own rows
    (see `train.loop.Trainer.to_device`), so the data a run sees, and its
    checkpointed iterator state, do not depend on the number of processes.
    """
    ds = grain.MapDataset.source(TokenWindows(str(path), seq_len)).shuffle(seed=seed).repeat(None)
    ds = ds.batch(global_batch, drop_remainder=True).map(_to_example)
    return iter(ds.to_iter_dataset())


def eval_batches(path: str, seq_len: int, global_batch: int, n_batches: int) -> list[dict[str, np.ndarray]]:
    """A fixed validation set: windows spread evenly over the file, the same every time."""
    src = TokenWindows(str(path), seq_len)
    total = global_batch * n_batches
    if len(src) < total:
        raise ValueError(
            f"{path}: {len(src)} windows of {seq_len + 1} tokens, need {total} for evaluation; "
            f"lower log.eval_batches or data.seq_len"
        )
    idx = np.linspace(0, len(src) - 1, total).astype(np.int64).reshape(n_batches, global_batch)
    return [_to_example(np.stack([src[i] for i in row])) for row in idx]
