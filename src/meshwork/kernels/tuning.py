"""Autotuned flash-attention launch parameters: a JSON file keyed by device kind and shape.

`benchmarks/autotune_attention.py` measures block sizes (and, on GPU, Triton
warps/stages) per shape and calls `record`; the attention dispatch calls
`tuned_blocks` at trace time and passes what it returns to the kernel, so an
empty answer means "use the kernel's DEFAULT_BLOCKS".

Where. `$MESHWORK_TUNING_CACHE` if set (the value `off` disables the cache),
else `~/.cache/meshwork/attention_tuning.json`.

Key. entries[device_kind][shape_key], with device_kind as JAX reports it
("NVIDIA H100 80GB HBM3", "TPU v5 lite", "cpu") and

    shape_key = "L{L}-S{S}-K{K}-{dtype}-{causal|full}"

where L and S are the query and key lengths rounded up to a power of two (at
least 128) and K is the head dim. What is left out, and why: batch and head
counts only multiply the number of programs (B*H*L/block_q), which at training
sizes fills many waves on any chip, so they rarely move the best tile; head
dim, dtype (tile bytes, registers, shared memory), causality (skipped blocks,
waste on the diagonal) and sequence length (loop trip count, padding) do.
Lengths are bucketed so 4000 and 4096 share an entry; `tuned_blocks` also
falls back to the nearest tuned length bucket within a factor of 4 (see
`lookup(nearest=True)`), because a tile that is best at 8K is a sound guess
at 16K but not at 128.

File format (version 1), written atomically:

    {"format": 1, "entries": {"NVIDIA H100 80GB HBM3": {"L4096-S4096-K128-bfloat16-causal":
        {"config": {"block_q": 128, "block_kv": 64, "num_warps": 8, "num_stages": 3},
         "measured": {"ms": 1.9, "default_ms": 2.3, "objective": "fwd+bwd", ...}}}}}

An empty "config" is a real answer: the kernel's defaults measured best.

Importing this module does not import jax; only `tuned_blocks` does.

    >>> import tempfile; path = tempfile.mkdtemp() + "/tuning.json"
    >>> key = shape_key(L=4000, S=4000, K=128, dtype="bfloat16", causal=True)
    >>> key
    'L4096-S4096-K128-bfloat16-causal'
    >>> _ = record("NVIDIA H100 80GB HBM3", key, {"block_q": 64, "block_kv": 128}, path=path)
    >>> lookup("NVIDIA H100 80GB HBM3", key, path=path)
    {'block_q': 64, 'block_kv': 128}
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import tempfile
import warnings

FORMAT = 1
ENV_VAR = "MESHWORK_TUNING_CACHE"
DEFAULT_PATH = pathlib.Path("~/.cache/meshwork/attention_tuning.json")
# Every launch parameter a cache entry may hold.
CONFIG_FIELDS = ("block_q", "block_kv", "num_warps", "num_stages")
# The subset `flash_attention` accepts; `tuned_blocks` returns only these
# (num_warps / num_stages are Triton-only: the kernel ignores them on TPU/CPU).
KERNEL_KWARGS = ("block_q", "block_kv", "num_warps", "num_stages")
MIN_BUCKET = 128
# lookup(nearest=True) accepts entries whose log2(L) and log2(S) distances sum to at most this.
MAX_BUCKET_DISTANCE = 2

_memo: dict[pathlib.Path, tuple[tuple[int, int], dict]] = {}


def cache_path(path: str | os.PathLike | None = None) -> pathlib.Path | None:
    """The cache file: `path` if given, else $MESHWORK_TUNING_CACHE, else the default; None when disabled.

    >>> cache_path("/tmp/x.json")
    PosixPath('/tmp/x.json')
    """
    if path is None:
        path = os.environ.get(ENV_VAR) or DEFAULT_PATH
        if str(path).lower() == "off":
            return None
    return pathlib.Path(path).expanduser()


def _bucket(n: int) -> int:
    if n < 1:
        raise ValueError(f"sequence length must be positive, got {n}")
    return max(MIN_BUCKET, 1 << (n - 1).bit_length())


def shape_key(*, L: int, S: int, K: int, dtype, causal: bool) -> str:
    """The cache key of one attention shape; see the module docstring for what it leaves out.

    dtype: a numpy/JAX dtype, scalar type or name.

    >>> shape_key(L=1000, S=1000, K=64, dtype="float32", causal=False)
    'L1024-S1024-K64-float32-full'
    """
    return f"L{_bucket(L)}-S{_bucket(S)}-K{int(K)}-{_dtype_name(dtype)}-{'causal' if causal else 'full'}"


def _dtype_name(dtype) -> str:
    """'bfloat16' from a dtype, a scalar type (np.float32, jnp.bfloat16) or a name."""
    if isinstance(dtype, str):
        return dtype
    for candidate in (dtype, getattr(dtype, "dtype", None)):  # jnp.bfloat16 carries its dtype as .dtype
        if isinstance(getattr(candidate, "name", None), str):
            return candidate.name
    import numpy as np  # numpy, not jax: still cheap to import

    return np.dtype(dtype).name


def _parse_key(key: str) -> tuple[int, int, str] | None:
    """(L, S, rest) of a shape key, rest being the part nearest-bucket matching must equal."""
    parts = key.split("-", 2)
    if len(parts) != 3 or parts[0][:1] != "L" or parts[1][:1] != "S":
        return None
    try:
        return int(parts[0][1:]), int(parts[1][1:]), parts[2]
    except ValueError:
        return None


def _load(path: pathlib.Path | None) -> dict:
    """The file's entries, memoized on (mtime, size): the dispatch calls this on every trace."""
    if path is None or not path.is_file():
        return {}
    st = path.stat()
    stamp = (st.st_mtime_ns, st.st_size)
    hit = _memo.get(path)
    if hit and hit[0] == stamp:
        return hit[1]
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
        entries = data["entries"]
    except (OSError, ValueError, AttributeError) as e:
        # A broken cache must not break training: fall back to the defaults, loudly.
        warnings.warn(
            f"ignoring attention tuning cache {path}: {e}; delete it or rerun benchmarks/autotune_attention.py",
            stacklevel=3,
        )
        entries = {}
    _memo[path] = (stamp, entries)
    return entries


def lookup(
    device_kind: str, shape_key: str, *, nearest: bool = False, path: str | os.PathLike | None = None
) -> dict | None:
    """The tuned config for (device_kind, shape_key), or None when there is none.

    nearest: when the exact key is missing, take the entry of the same device,
    head dim, dtype and causality whose length buckets are closest (log2
    distances summed, at most MAX_BUCKET_DISTANCE; ties go to the longer).

    >>> lookup("no such device", "L128-S128-K64-float32-full", path="/nonexistent.json") is None
    True
    """
    by_shape = _load(cache_path(path)).get(device_kind, {})
    entry = by_shape.get(shape_key)
    if entry is None and nearest and (want := _parse_key(shape_key)):
        best = None
        for key, candidate in by_shape.items():
            have = _parse_key(key)
            if have is None or have[2] != want[2]:
                continue
            dist = abs(math.log2(have[0] / want[0])) + abs(math.log2(have[1] / want[1]))
            rank = (dist, -have[0] - have[1])
            if dist <= MAX_BUCKET_DISTANCE and (best is None or rank < best[0]):
                best = (rank, candidate)
        entry = best and best[1]
    if entry is None:
        return None
    return dict(entry.get("config", {}))


def _check_config(config: dict) -> None:
    for name, value in config.items():
        if name not in CONFIG_FIELDS:
            raise ValueError(f"unknown tuning field {name!r}; a config holds only {CONFIG_FIELDS}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"tuning field {name}={value!r} must be a positive int")


def record(
    device_kind: str,
    shape_key: str,
    config: dict,
    *,
    measured: dict | None = None,
    path: str | os.PathLike | None = None,
) -> pathlib.Path:
    """Store `config` (a subset of CONFIG_FIELDS) for (device_kind, shape_key); returns the file written.

    measured: free-form JSON facts about the measurement (times, date, jax
    version) kept beside the config for people, never read back by lookup.
    The file is rewritten whole through a temporary file and os.replace, so a
    reader never sees half of it.

    >>> import tempfile; path = tempfile.mkdtemp() + "/tuning.json"
    >>> record("cpu", "L128-S128-K32-float32-full", {"block_q": 32}, path=path).name
    'tuning.json'
    """
    _check_config(config)
    target = cache_path(path)
    if target is None:
        raise ValueError(f"the tuning cache is disabled (${ENV_VAR}=off); pass path= or unset it")
    entries = {dev: dict(shapes) for dev, shapes in _load(target).items()}
    ordered = {name: config[name] for name in CONFIG_FIELDS if name in config}
    entries.setdefault(device_kind, {})[shape_key] = {"config": ordered, "measured": dict(measured or {})}
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"format": FORMAT, "entries": entries}, f, indent=1)
        os.replace(tmp, target)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    return target


def device_kind_for(backend: str | None) -> str | None:
    """device_kind of the first device of `backend` ("gpu" | "tpu" | "cpu" | None: default), None if absent.

    Lowering for a backend this host lacks (GPU kernels lowered on a CPU
    machine, as the tests do) finds no device and so no tuned config.
    """
    import jax  # deferred: importing the cache module must stay cheap

    platform = {"cuda": "gpu", "rocm": "gpu"}.get(backend, backend) or jax.default_backend()
    try:
        devices = jax.devices(platform)
    except RuntimeError:
        return None
    return devices[0].device_kind if devices else None


def tuned_blocks(q, k, causal: bool, backend: str | None = None, *, path: str | os.PathLike | None = None) -> dict:
    """Keyword arguments for `flash_attention` from the cache: {} when nothing is tuned for this shape.

    q: (B, L, H, K) and k: (B, S, G, K), arrays, tracers or ShapeDtypeStructs
    (only shape and dtype are read, so this is safe inside jit). Only the
    fields the kernel accepts (KERNEL_KWARGS) are returned; the dispatch
    should apply them only to arguments its caller left as None.

    >>> import jax, jax.numpy as jnp
    >>> q = jax.ShapeDtypeStruct((1, 64, 4, 32), jnp.float32)
    >>> tuned_blocks(q, q, True, "cpu", path="/nonexistent.json")
    {}
    """
    device = device_kind_for(backend)
    if device is None:
        return {}
    key = shape_key(L=q.shape[1], S=k.shape[1], K=q.shape[3], dtype=q.dtype, causal=causal)
    config = lookup(device, key, nearest=True, path=path) or {}
    return {name: value for name, value in config.items() if name in KERNEL_KWARGS}
