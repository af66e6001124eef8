"""Paged attention on XLA:CPU without the page gather: a C++ kernel called through jax's FFI.

On the CPU, XLA can only read a paged cache by gathering every sequence's pages into a contiguous
copy per layer and step (`paged_attention.gather_pages`) before its products read them again; at
32 decoding rows that copy was half of the served step (benchmarks/RESULTS.md, 2026-12-06). The
kernel in cpu_paged_attention.cc walks the page table itself, like the Pallas kernel does on
accelerators, reading each visible key and value once, with every query head of a kv head served
by the same read.

It is built on first use by the machine's C++ compiler (kernels/cpu_build.py); without one, or
with `MESHWORK_CPU_KERNEL=0`, `available()` is False and says why (`unavailable_reason()`): the
caller keeps the gather.

    >>> import jax.numpy as jnp
    >>> q = jnp.ones((2, 1, 4, 8)); pool = jnp.ones((1, 5, 4, 2, 8))
    >>> available() and cpu_paged_attention(q, pool, pool, jnp.array([[1, 2], [3, 4]]), jnp.array([[5], [6]])).shape
    (2, 1, 4, 8)
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from meshwork.kernels import cpu_build
from meshwork.kernels.paged_attention import check_shapes

SOURCE = pathlib.Path(__file__).with_name("cpu_paged_attention.cc")
TARGET = "meshwork_cpu_paged_attention"


KERNEL = cpu_build.CpuKernel(SOURCE, "MeshworkPagedAttention", TARGET)
available, unavailable_reason = KERNEL.available, KERNEL.unavailable_reason
disabled = KERNEL.disabled  # Programs traced inside keep the gather.


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
    if (why := unavailable_reason()) is not None:
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
