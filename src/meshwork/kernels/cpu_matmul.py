"""Decode's projections on XLA:CPU at the memory's speed: a C++ kernel over a packed weight layout.

A decode step multiplies one row per sequence by every weight of the model, so it reads each weight
once and does two flops per 4 bytes read: its time is the weights' bytes over the read bandwidth.
XLA:CPU runs a matrix-vector dot on one thread, which on the 2-core host of benchmarks/RESULTS.md
reads about 21 GB/s of the 33-45 both cores read together. cpu_matmul.cc splits the columns over XLA's
intra-op threads and streams the weight in a tiled layout, `pack(w)`: (T, K, 64), tile t holding
columns 64t..64t+63 row after row, so each thread reads its tiles front to back.

    tiles = pack(w_KN)                         # once, at load: a copy in the packed layout
    y_MN = matmul(x_MK, tiles, n=w_KN.shape[1])

Each output is one multiply-add chain over k in order, so a row's result does not depend on the other
rows of its batch. A prefill chunk's products (hundreds of rows) run the same kernel: it reads each
tile once for every group of 6 rows while the tile is in cache, at about the FMA units' peak
(225 GFLOP/s on 2 AVX-512 cores against XLA's 200 here); XLA's own dot would first transpose the
tiles back, a copy of every weight per chunk. The kernel is built on first use by the machine's C++
compiler (kernels/cpu_build.py); without one, or with `MESHWORK_CPU_KERNEL=0`, `available()` is
False and `matmul` runs XLA's dot over the packed layout. `disabled()` does the same for programs
traced inside.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp

from meshwork.kernels import cpu_build

SOURCE = pathlib.Path(__file__).with_name("cpu_matmul.cc")
TARGET = "meshwork_cpu_packed_matmul"
TILE = 64  # columns per tile (cpu_matmul.cc's kTile)


KERNEL = cpu_build.CpuKernel(SOURCE, "MeshworkPackedMatmul", TARGET)
available, unavailable_reason = KERNEL.available, KERNEL.unavailable_reason
disabled = KERNEL.disabled  # Programs traced inside run XLA's dot over the packed layout.


def pack(w_KN: jax.Array) -> jax.Array:
    """(..., K, N) -> (..., T, K, 64), T = ceil(N / 64): the kernel's layout (a copy), the columns
    zero-padded to whole tiles; leading dims (a layers axis) are kept."""
    *lead, K, N = w_KN.shape
    T = -(-N // TILE)
    w = jnp.pad(w_KN, [(0, 0)] * len(lead) + [(0, 0), (0, T * TILE - N)])
    return jnp.swapaxes(w.reshape(*lead, K, T, TILE), -3, -2)


def unpack(tiles: jax.Array, n: int) -> jax.Array:
    """`pack` undone: (..., T, K, 64) -> (..., K, n)."""
    *lead, T, K, _ = tiles.shape
    return jnp.swapaxes(tiles, -3, -2).reshape(*lead, K, T * TILE)[..., :n]


def matmul(x_MK: jax.Array, tiles: jax.Array, n: int) -> jax.Array:
    """x (M, K) @ the (K, n) weight packed as `tiles` (T, K, 64): (M, n) float32 for float32
    operands. The C++ kernel runs it where available; otherwise (or for other dtypes) XLA's dot reads
    the packed layout (transposing it first: slower, but right)."""
    M, K = x_MK.shape
    T = tiles.shape[0]
    if tiles.shape != (T, K, TILE) or T * TILE < n:
        raise ValueError(f"x {x_MK.shape} does not match packed tiles {tiles.shape} of {n} columns")
    if x_MK.dtype == tiles.dtype == jnp.float32 and available():
        y = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((M, T * TILE), jnp.float32))(x_MK, tiles)
    else:
        y = jnp.einsum("mk,tkj->mtj", x_MK, tiles, preferred_element_type=jnp.float32).reshape(M, T * TILE)
    return y if n == T * TILE else y[:, :n]
