"""The user's own text: read, tokenized once by a checkpoint's tokenizer.json, packed into windows.

`data.source: text` reads `data.text_files` (paths or globs): a `.jsonl` file holds one
document per line (in field `data.text_field`), a `.parquet` file one per row (that column),
and any other file is one UTF-8 document. A document goes to validation by a hash of (its
file's path below the files' common folder, its line or row), as the stdlib corpus's files do,
so the split depends neither on file order nor on the machine.

Tokenizing happens once. The token stream of each split and the offset where each document
starts are written to a hidden `.meshwork-tokens-<key>` folder beside the first file (or
under `data.cache_dir`), atomically, keyed by every file's path, size and modification time,
the text field, the tokenizer's bytes and the split; a run whose inputs match reuses it.

Batches are windows of `seq_len + 1` tokens over the concatenated stream (as data/text.py's),
each with the document of every input token (`segment_ids`, renumbered from 1 in each row:
attention stays inside a document) and `loss_mask` (0 where the target opens the next
document, which nothing in the row before it can predict). `data.source: chat` (data/chat.py)
reuses the cache and the windows through `DocumentFormat` and `cached_corpus`: its format also
stores which tokens are targets, and `loss_mask` is 0 on the others.

    corpus = text_corpus(["~/notes/**/*.md"], tokenizer="~/Llama-3.2-1B", val_fraction=0.02)
    batch = next(train_iterator(corpus.train, seq_len=128, global_batch=8, seed=0))
    batch["segment_ids"].shape  # (8, 128), like inputs, targets and loss_mask
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time
import zlib
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grain
import numpy as np

from meshwork.config import ConfigError

CACHE_PREFIX = ".meshwork-tokens-"
FORMAT = 1  # bump when the cache's layout or the reading of documents changes
ENCODE_CHARS = 1 << 22  # text handed to the tokenizer per batch call (it encodes a batch on all cores)


# ---------------------------------------------------------------- tokenizer


class TextTokenizer:
    """A `tokenizers` tokenizer.json (or, with no path, UTF-8 bytes), with the EOS that ends a document.

    `encode(texts)` gives each text's ids: the tokenizer's post-processor decides BOS (Llama's adds
    it), then `eos_id` is appended when the checkpoint names an EOS token.
    """

    def __init__(self, path: pathlib.Path | None = None):
        self.path, self.eos_id, self._tok = path, None, None
        if path is None:
            self.vocab_size, self.fingerprint, self.name = 256, "bytes", "the byte tokenizer"
            return
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise ConfigError(
                f"data.tokenizer: {path} is not a tokenizers file ({str(e).splitlines()[0]}); "
                "point it to a Hugging Face checkpoint's tokenizer.json"
            ) from None
        # A checkpoint's file may pad or truncate to the model's context; a document must be whole.
        self._tok.no_truncation()
        self._tok.no_padding()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos = _named_eos(path.parent)
        if eos is not None:
            self.eos_id = self._tok.token_to_id(eos)
            if self.eos_id is None:
                raise ConfigError(
                    f"data.tokenizer: {path.parent} names eos_token {eos!r}, which {path.name} "
                    "does not hold; fix tokenizer_config.json or remove its eos_token"
                )
        self.fingerprint = hashlib.sha256(path.read_bytes() + f"\0eos={self.eos_id}".encode()).hexdigest()
        self.name = str(path)

    @property
    def dtype(self) -> np.dtype:
        """uint16 while every id fits (GPT-2, Llama 2), else uint32 (Llama 3's 128,256 ids)."""
        return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        if self._tok is None:
            return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(self.dtype) for t in texts]
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # no offsets: faster
        out = []
        for enc in encode(texts, add_special_tokens=True):
            ids = enc.ids
            if self.eos_id is not None and (not ids or ids[-1] != self.eos_id):
                ids.append(self.eos_id)
            out.append(np.asarray(ids, self.dtype))
        return out


def load_tokenizer(spec: str | None) -> TextTokenizer:
    """`data.tokenizer`: None (bytes), a tokenizer.json file, or a folder holding one."""
    if spec is None:
        return TextTokenizer()
    path = pathlib.Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(
            f"data.tokenizer: no tokenizer.json at {path}; point it to a tokenizer.json file or a "
            "Hugging Face checkpoint folder holding one (null: the byte tokenizer)"
        )
    return TextTokenizer(path)


def _named_eos(folder: pathlib.Path) -> str | None:
    """The eos_token of a checkpoint folder's tokenizer_config.json (or special_tokens_map.json)."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token")
        except (ValueError, AttributeError) as e:
            raise ConfigError(f"data.tokenizer: {path} is not a JSON object ({e}); fix or remove it") from None
        if isinstance(eos, dict):  # an AddedToken written out: {"content": "</s>", ...}
            eos = eos.get("content")
        if isinstance(eos, str) and eos:
            return eos
    return None


# ---------------------------------------------------------------- documents


def find_text_files(patterns: list[str]) -> list[pathlib.Path]:
    """The files `patterns` name (paths or globs, `~` expanded, `**` recursive), resolved, each once,
    in the order given (a glob's matches sorted); ConfigError naming a pattern that matches none."""
    files: dict[pathlib.Path, None] = {}
    for pattern in patterns:
        matches = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
        if not matches:
            raise ConfigError(
                f"data.text_files: {pattern!r} matches no file; check the path (globs such as "
                "data/**/*.jsonl are expanded)"
            )
        files.update((pathlib.Path(p).resolve(), None) for p in matches)
    return list(files)


def read_documents(path: pathlib.Path, text_field: str = "text") -> Iterator[tuple[int, str | None, int]]:
    """(index, text, bytes read) for each document of one file; text is None for a blank jsonl line
    or a null cell (nothing to train on, but the bytes count for progress)."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            yield from _jsonl_documents(path, text_field)
        elif suffix == ".parquet":
            yield from _parquet_documents(path, text_field)
        else:
            data = path.read_bytes()
            try:
                yield 0, data.decode("utf-8"), len(data)
            except UnicodeDecodeError as e:
                raise ConfigError(
                    f"data.text_files: {path} is not UTF-8 text (byte {e.start}); convert it to "
                    "UTF-8 or leave it out of data.text_files"
                ) from None
    except OSError as e:
        raise ConfigError(f"data.text_files: {path} cannot be read ({e.strerror}); check its permissions") from None


def _jsonl_documents(path: pathlib.Path, field: str):
    for i, value, nbytes in jsonl_records(path, field, "data.text_field", "the text"):
        if value is not None and not isinstance(value, str):
            raise ConfigError(
                f"data.text_field: {path}:{i + 1}: field {field!r} holds a "
                f"{type(value).__name__}, not a string; point data.text_field to the text"
            )
        yield i, value, nbytes


def jsonl_records(path: pathlib.Path, field: str, key: str, what: str) -> Iterator[tuple[int, Any, int]]:
    """(index, the value of `field`, bytes read) for each line of a .jsonl file; the value is None
    for a blank line. ConfigError naming the file and line for a line that is not a JSON object
    holding `field` (`key` is the config key that names the field, `what` what it holds)."""
    with open(path, "rb") as f:
        for i, line in enumerate(f):
            if not line.strip():
                yield i, None, len(line)
                continue
            try:
                record = json.loads(line.strip())
            except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
                why = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
                raise ConfigError(
                    f"data.text_files: {path}:{i + 1}: not valid JSON ({why}); fix the line or "
                    "remove it (a .jsonl file holds one JSON object per line)"
                ) from None
            if not isinstance(record, dict):
                raise ConfigError(
                    f"data.text_files: {path}:{i + 1}: a JSON {type(record).__name__}, not an object; "
                    f"write one object per line, with {what} in field {field!r}"
                )
            if field not in record:
                raise ConfigError(
                    f"{key}: {path}:{i + 1} has no field {field!r} (its fields: "
                    f"{', '.join(map(repr, record)) or 'none'}); set {key} to the one "
                    f"holding {what}"
                )
            yield i, record[field], len(line)


def _parquet_documents(path: pathlib.Path, field: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, ValueError) as e:
        raise ConfigError(f"data.text_files: {path} is not a Parquet file ({str(e).splitlines()[0]})") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise ConfigError(
            f"data.text_field: {path} has no column {field!r} (its columns: "
            f"{', '.join(map(repr, names))}); set data.text_field to the one holding the text"
        )
    kind = pf.schema_arrow.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ConfigError(
            f"data.text_field: column {field!r} of {path} holds {kind}, not strings; point data.text_field to the text"
        )
    rows, size, i = max(pf.metadata.num_rows, 1), path.stat().st_size, 0
    for batch in pf.iter_batches(columns=[field], batch_size=4096):
        for text in batch.column(0).to_pylist():
            yield i, text, size // rows
            i += 1


def _in_validation(key: str, val_fraction: float) -> bool:
    """The stdlib corpus's rule (data/text.py), so both split the same way."""
    return zlib.crc32(key.encode()) % 10_000 < val_fraction * 10_000


# ---------------------------------------------------------------- the cache


@dataclass(frozen=True)
class TokenSplit:
    """One split's token stream (flat ids of `dtype`) and where each of its documents starts."""

    tokens: str
    starts: str
    dtype: str
    n_tokens: int
    n_documents: int
    mask: str | None = None  # uint8, 1 where a token is a target (data.source: chat); None: every token is


@dataclass(frozen=True)
class DocumentFormat:
    """How a corpus's files become token streams: `read(path)` yields (index, document or None,
    bytes read) per document of one file; `encode(documents)` gives each document's ids and, for a
    masked format, which of them are targets (uint8 0/1; None: all). A document's `len` is its size
    in characters, which paces the tokenizer's batches."""

    read: Callable[[pathlib.Path], Iterator[tuple[int, Any, int]]]
    encode: Callable[[list[Any]], list[tuple[np.ndarray, np.ndarray | None]]]
    masked: bool = False


@dataclass(frozen=True)
class TextCorpus:
    """A tokenized `data.source: text` corpus, as `text_corpus` found or built it."""

    folder: pathlib.Path
    train: TokenSplit
    val: TokenSplit
    max_id: int  # the largest id in either split (-1 when empty)
    tokenizer: str
    vocab_size: int  # the tokenizer's
    built: bool  # tokenized by this call; False when the cache was reused


def text_corpus(
    text_files: list[str],
    *,
    tokenizer: str | None = None,
    text_field: str = "text",
    val_fraction: float = 0.02,
    cache_dir: str | None = None,
    progress: bool | None = None,
) -> TextCorpus:
    """The tokenized corpus of `text_files`, from its cache when every input still matches, else
    tokenized now (a tqdm bar on stderr when it is a terminal; `progress` forces it on or off).

    The cache goes beside the first file unless `cache_dir` is given or that folder is not
    writable (then `cache_dir`, default ~/.cache/meshwork or $MESHWORK_CACHE).

    >>> corpus = text_corpus(["notes/*.txt"], val_fraction=0.1)  # doctest: +SKIP
    >>> corpus.train.n_tokens, corpus.built  # doctest: +SKIP
    (48213, True)
    """
    files = find_text_files(text_files)
    tok = load_tokenizer(tokenizer)
    same_inputs = {"text_field": text_field, "tokenizer": tok.fingerprint, "val_fraction": val_fraction}
    fmt = DocumentFormat(
        read=lambda path: read_documents(path, text_field),
        encode=lambda texts: [(ids, None) for ids in tok.encode(texts)],
    )
    return cached_corpus(files, tok, fmt, same_inputs, val_fraction, cache_dir, progress)


def cached_corpus(
    files: list[pathlib.Path],
    tok: TextTokenizer,
    fmt: DocumentFormat,
    same_inputs: dict[str, Any],
    val_fraction: float,
    cache_dir: str | None,
    progress: bool | None,
) -> TextCorpus:
    """The corpus of `files` in `fmt`, from the cache keyed by `same_inputs` (what the tokens depend
    on besides the files) and the files' paths, sizes and times; else tokenized now and cached."""
    root = pathlib.Path(os.path.commonpath([str(p.parent) for p in files]))
    stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    same_inputs = {"format": FORMAT, "files": [s[0] for s in stats], **same_inputs}
    identity = _digest(same_inputs)  # what the cache is of; `key` adds the files' sizes and times
    key = _digest({**same_inputs, "stats": stats})
    default = pathlib.Path(os.environ.get("MESHWORK_CACHE", "~/.cache/meshwork")).expanduser()
    bases = [pathlib.Path(cache_dir).expanduser()] if cache_dir else [files[0].parent, default]
    for base in bases:
        if (base / f"{CACHE_PREFIX}{key}" / "meta.json").is_file():
            return _load(base / f"{CACHE_PREFIX}{key}", built=False)
    error = None
    for base in bases:
        try:
            base.mkdir(parents=True, exist_ok=True)
            tmp = pathlib.Path(tempfile.mkdtemp(prefix=f"{CACHE_PREFIX}{key}.tmp", dir=base))
        except OSError as e:  # read-only data folder: try the next place
            error = e
            continue
        return _build(
            files,
            root,
            tok,
            fmt,
            val_fraction,
            tmp,
            base / f"{CACHE_PREFIX}{key}",
            {"identity": identity, "key": key, **same_inputs},
            progress,
        )
    raise ConfigError(
        f"data.cache_dir: the token cache cannot be written in {' or '.join(map(str, bases))} "
        f"({error.strerror}); point data.cache_dir (or MESHWORK_CACHE) to a writable folder"
    )


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _build(files, root, tok, fmt: DocumentFormat, val_fraction, tmp, final, meta, progress) -> TextCorpus:
    from tqdm import tqdm

    total = sum(p.stat().st_size for p in files)
    _say(f"tokenizing {len(files)} file(s), {total / 2**20:.1f} MiB, with {tok.name} into {final}")
    t0, dtype = time.perf_counter(), tok.dtype
    n, starts, top = {"train": 0, "val": 0}, {"train": array("q"), "val": array("q")}, -1
    pending: list[tuple[str, Any]] = []
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="tokenizing",
        file=sys.stderr,
        disable=None if progress is None else not progress,
        dynamic_ncols=True,
    )
    try:
        with contextlib.ExitStack() as stack:
            outs = {s: stack.enter_context(open(tmp / f"{s}.bin", "wb")) for s in ("train", "val")}
            masks = {s: stack.enter_context(open(tmp / f"{s}.mask.bin", "wb")) for s in ("train", "val") if fmt.masked}

            def flush():
                nonlocal top
                for split, (ids, mask) in zip((s for s, _ in pending), fmt.encode([t for _, t in pending])):
                    if len(ids):  # an empty document has nothing to learn, and no place in `starts`
                        starts[split].append(n[split])
                        n[split] += len(ids)
                        outs[split].write(ids.tobytes())
                        if fmt.masked:
                            masks[split].write(np.asarray(mask, np.uint8).tobytes())
                        top = max(top, int(ids.max()))
                pending.clear()

            chars = 0
            for path in files:
                rel = path.relative_to(root).as_posix()
                for index, text, nbytes in fmt.read(path):
                    bar.update(nbytes)
                    if text:
                        pending.append(("val" if _in_validation(f"{rel}:{index}", val_fraction) else "train", text))
                        chars += len(text)
                    if chars >= ENCODE_CHARS:
                        flush()
                        chars = 0
            flush()
        for split in ("train", "val"):
            np.save(tmp / f"{split}.starts.npy", np.frombuffer(starts[split], np.int64))
        meta |= {
            "dtype": dtype.name,
            "max_id": top,
            "vocab_size": tok.vocab_size,
            "tokenizer_name": tok.name,
            "tokens": n,
            "documents": {s: len(v) for s, v in starts.items()},
            "n_files": len(files),
        }
        if fmt.masked:
            meta["masked"] = True
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared data folder's cache from its other users
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / "meta.json").is_file():  # not another process finishing first: a real error
                raise
    except OSError as e:
        raise ConfigError(
            f"data.cache_dir: the token cache {final} cannot be written ({e.strerror}); point "
            "data.cache_dir (or MESHWORK_CACHE) to a writable folder with space"
        ) from None
    finally:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename succeeded
    seconds = time.perf_counter() - t0
    _say(
        f"tokenized {n['train'] + n['val']:,} tokens ({n['val']:,} for validation) in {seconds:.1f} s "
        f"({total / 2**20 / max(seconds, 1e-9):.1f} MiB/s)"
    )
    _remove_stale(final, meta["identity"])
    return _load(final, built=True)


def _say(msg: str) -> None:
    """A line on stdout, as training's messages are (stderr is for the bar and for errors)."""
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stdout)
    sys.stdout.flush()


def _remove_stale(keep: pathlib.Path, identity: str) -> None:
    """Older caches of the same files (before an edit changed their size or time) are dead weight."""
    for other in keep.parent.glob(f"{CACHE_PREFIX}*"):
        if other == keep or ".tmp" in other.name:
            continue
        try:
            if json.loads((other / "meta.json").read_text()).get("identity") == identity:
                shutil.rmtree(other)
        except (OSError, ValueError):
            pass  # not ours to judge, or another process removing it first


def _load(folder: pathlib.Path, built: bool) -> TextCorpus:
    meta = json.loads((folder / "meta.json").read_text())
    splits = {
        s: TokenSplit(
            str(folder / f"{s}.bin"),
            str(folder / f"{s}.starts.npy"),
            meta["dtype"],
            meta["tokens"][s],
            meta["documents"][s],
            str(folder / f"{s}.mask.bin") if meta.get("masked") else None,
        )
        for s in ("train", "val")
    }
    return TextCorpus(
        folder, splits["train"], splits["val"], meta["max_id"], meta["tokenizer_name"], meta["vocab_size"], built
    )


# ---------------------------------------------------------------- grain pipeline


@dataclass
class PackedWindows:
    """Random-access source: window i is tokens [i*L, i*L + L + 1) of a split, with their documents.

    The files open lazily so the source pickles cheaply into grain workers; grain reads items on
    several threads, so both open before either is published (one attribute, set once).
    """

    split: TokenSplit
    seq_len: int

    def __post_init__(self):
        self._len = max(0, (self.split.n_tokens - 1) // self.seq_len)
        self._files = None

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if self._files is None:
            mask = None if self.split.mask is None else np.memmap(self.split.mask, dtype=np.uint8, mode="r")
            self._files = (
                np.memmap(self.split.tokens, dtype=self.split.dtype, mode="r"),
                np.load(self.split.starts),
                mask,
            )
        all_tokens, starts, all_mask = self._files
        start, L = int(i) * self.seq_len, self.seq_len
        tokens = np.asarray(all_tokens[start : start + L + 1], dtype=np.int32)
        doc = np.searchsorted(starts, np.arange(start, start + L + 1), side="right")
        segment = (doc - doc[0] + 1).astype(np.int32)
        loss_mask = segment[1:] == segment[:-1]
        if all_mask is not None:  # only the targets the format marks (a chat's assistant tokens)
            loss_mask &= all_mask[start + 1 : start + L + 1].astype(bool)
        return {
            "inputs": tokens[:-1],
            "targets": tokens[1:],
            "segment_ids": segment[:-1],
            "loss_mask": loss_mask.astype(np.int32),
        }

    def __getstate__(self):
        return {**self.__dict__, "_files": None}


def train_iterator(split: TokenSplit, seq_len: int, global_batch: int, seed: int) -> grain.DatasetIterator:
    """An infinite, shuffled, checkpointable iterator of {'inputs', 'targets', 'segment_ids',
    'loss_mask'} (B, L) global batches; the pipeline of data/text.py's `train_iterator`."""
    ds = grain.MapDataset.source(PackedWindows(split, seq_len)).shuffle(seed=seed).repeat(None)
    return iter(ds.batch(global_batch, drop_remainder=True).to_iter_dataset())


def eval_batches(split: TokenSplit, seq_len: int, global_batch: int, n_batches: int) -> list[dict[str, np.ndarray]]:
    """A fixed validation set: windows spread evenly over the split, the same every time."""
    src = PackedWindows(split, seq_len)
    total = global_batch * n_batches
    if len(src) < total:
        raise ValueError(
            f"{split.tokens}: {len(src)} windows of {seq_len + 1} tokens, need {total} for evaluation; "
            f"lower log.eval_batches or data.seq_len"
        )
    idx = np.linspace(0, len(src) - 1, total).astype(np.int64).reshape(n_batches, global_batch)
    batches = []
    for row in idx:
        examples = [src[i] for i in row]
        batches.append({k: np.stack([ex[k] for ex in examples]) for k in examples[0]})
    return batches
