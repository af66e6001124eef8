"""Paged attention on XLA:CPU without the page gather: a C++ kernel called through jax's FFI.

On the CPU, XLA can only read a paged cache by gathering every sequence's pages into a contiguous
copy per layer and step (`paged_attention.gather_pages`) before its products read them again; at
32 decoding rows that copy was half of the served step (benchmarks/RESULTS.md, 2026-12-06). The
kernel in cpu_paged_attention.cc walks the page table itself, like the Pallas kernel does on
accelerators, reading each visible key and value once, with every query head of a kv head served
by the same read.

It is C++ compiled on first use by the machine's C++ compiler (`$CXX`, else `c++`) against jaxlib's
FFI headers, for this CPU (`-march=native`), into the package's cache folder (`$MESHWORK_CACHE`,
default ~/.cache/meshwork) under a name that hashes the source, the flags, the compiler, the CPU's
features and jaxlib's version; later processes load the library built then. Without a compiler,
or with `MESHWORK_CPU_KERNEL=0`, `available()` is False and says why (`unavailable_reason()`):
the caller keeps the gather.

    >>> import jax.numpy as jnp
    >>> q = jnp.ones((2, 1, 4, 8)); pool = jnp.ones((1, 5, 4, 2, 8))
    >>> available() and cpu_paged_attention(q, pool, pool, jnp.array([[1, 2], [3, 4]]), jnp.array([[5], [6]])).shape
    (2, 1, 4, 8)
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib.metadata
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from meshwork.kernels.paged_attention import check_shapes

SOURCE = pathlib.Path(__file__).with_name("cpu_paged_attention.cc")
TARGET = "meshwork_cpu_paged_attention"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")
DISABLE = "MESHWORK_CPU_KERNEL"  # set to 0 to keep the gather (benchmarks compare the two)


def _cpu_features() -> str:
    """The CPU's feature flags: -march=native builds for them, so a library built on one machine is
    never loaded on another with a shared cache folder."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")


def _library_path(compiler: str) -> pathlib.Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(
        "\0".join(
            (SOURCE.read_text(), " ".join(FLAGS), version, _cpu_features(), importlib.metadata.version("jaxlib"))
        ).encode()
    ).hexdigest()[:16]
    root = pathlib.Path(os.environ.get("MESHWORK_CACHE", "~/.cache/meshwork")).expanduser()
    return root / "kernels" / f"cpu_paged_attention-{key}.so"


def _build(compiler: str, path: pathlib.Path) -> None:
    """Compiles into a temporary file beside `path` and renames it: processes building at once each
    write their own, and none loads a half-written library."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def _load() -> str | None:
    """Builds (once per machine) and registers the kernel; returns why it is unavailable, or None."""
    if os.environ.get(DISABLE, "1") == "0":
        return f"{DISABLE}=0"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        return "no C++ compiler (c++, g++ or clang++ on PATH, or $CXX)"
    try:
        path = _library_path(compiler)
        if not path.exists():
            _build(compiler, path)
        handler = ctypes.cdll.LoadLibrary(str(path)).MeshworkPagedAttention
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
        return f"building {SOURCE.name} failed: {e}"
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")
    return None


_switched_off = 0  # depth of `disabled()` contexts


@contextlib.contextmanager
def disabled():
    """Programs traced inside keep the gather: for measuring the kernel against it in one process."""
    global _switched_off
    _switched_off += 1
    try:
        yield
    finally:
        _switched_off -= 1


def available() -> bool:
    """Whether the kernel is built and registered (building it on the first call) and not `disabled()`."""
    return not _switched_off and _load() is None


def unavailable_reason() -> str | None:
    return _load()


def supports(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array) -> bool:
    """What the kernel takes: float32 queries and pools of one shape (not MLA's zero-width values)."""
    return (
        q.dtype == jnp.float32
        and k_pool.dtype == v_pool.dtype == jnp.float32
        and k_pool.shape == v_pool.shape
        and k_pool.shape[-1] == q.shape[-1]
    )


def cpu_paged_attention(
    q_BLHK: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    page_table_BP: jax.Array,
    positions_BL: jax.Array,
    *,
    layer: jax.Array | int = 0,
    scale: float | None = None,
    window: jax.Array | int | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """`paged_attention`'s result (kernels/paged_attention.py) computed on the CPU by the C++ kernel;
    the pools are (layers, N, T, G, K) or (N, T, G, K), read in place. `window` may be traced (a
    layer pattern's). float32 only (`supports`); builds the kernel if need be, and raises RuntimeError
    where it cannot be built (`unavailable_reason()`)."""
    if (why := _load()) is not None:
        raise RuntimeError(f"the CPU paged-attention kernel is unavailable: {why}")
    # The C++ reads by offsets computed from these shapes: they are checked here, not there.
    k_pool, v_pool = check_shapes(q_BLHK, k_pool, v_pool, page_table_BP, positions_BL)
    B, L, H, K = q_BLHK.shape
    # (layer, window): one small operand, so both may be traced; window 0 means none.
    window = jnp.asarray(0 if window is None else window, jnp.int32)
    layer_window = jnp.stack([jnp.asarray(layer, jnp.int32), window])
    sinks = jnp.zeros((0,), jnp.float32) if sinks is None else jnp.asarray(sinks, jnp.float32).reshape(H)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((B, L, H, K), jnp.float32))
    return call(
        q_BLHK,
        k_pool,
        v_pool,
        page_table_BP.astype(jnp.int32),
        positions_BL.astype(jnp.int32),
        layer_window,
        sinks,
        scale=np.float32(K**-0.5 if scale is None else scale),
        softcap=np.float32(0.0 if softcap is None else softcap),
    )
