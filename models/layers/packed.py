"""A float32 projection weight stored in the CPU matmul kernel's tiled layout, for decoding.

`PackedWeight` stands in a projection's nnx.Param where the weight was (models/pack.py puts it
there), like the quantized formats: `models.layers.params.matmul` hands it the product. The weight
(K..., N...) is read with its leading `n_in` dims contracted (e.g. wq (D, H, K) read as
"BLD,DHK->BLHK": n_in 1; wo (H, K, D) as "BLHK,HKD->BLD": n_in 2), so it is a (K, N) matrix, kept
as kernels/cpu_matmul.py's (T, K, 64) tiles. A stacked weight keeps its leading layers axis.

A product whose spec reads the weight that way is a (rows, K) @ (K, N) matmul, which the C++
kernel runs for a decode step's few rows and a prefill chunk's many alike. Any other spec gets the
weight unpacked first (a copy), so every einsum still gives the right values.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from meshwork.kernels import cpu_matmul
from meshwork.models.layers.quantized import parse_spec


@functools.partial(jax.tree_util.register_dataclass, data_fields=["tiles"], meta_fields=["in_shape", "out_shape"])
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """`tiles` (..., T, K, 64) of the weight of shape (..., *in_shape, *out_shape), K = prod(in_shape)."""

    tiles: jax.Array
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weight this stands for (with the layers axis, if stacked)."""
        return (*self.tiles.shape[:-3], *self.in_shape, *self.out_shape)

    @property
    def dtype(self):
        return self.tiles.dtype

    def unpack(self) -> jax.Array:
        lead = self.tiles.shape[:-3]
        w = cpu_matmul.unpack(self.tiles, math.prod(self.out_shape))
        return w.reshape(*lead, *self.in_shape, *self.out_shape)

    def matmul(self, spec: str, x: jax.Array, dtype: jnp.dtype) -> jax.Array:
        x_letters, w_letters, out = parse_spec(spec)
        if len(w_letters) != len(self.in_shape) + len(self.out_shape) or self.tiles.ndim != 3:
            raise ValueError(
                f"a packed weight of shape {self.shape} read as {w_letters!r}: a stacked weight must be "
                "sliced per layer before its matmul"
            )
        n_in = len(self.in_shape)
        contracted, kept = w_letters[:n_in], w_letters[n_in:]
        if not (x_letters.endswith(contracted) and out == x_letters[: len(x_letters) - n_in] + kept):
            return jnp.einsum(spec, x, self.unpack().astype(dtype))  # read some other way: unpack
        rows = x.shape[: x.ndim - n_in]
        x_MK = x.astype(self.tiles.dtype).reshape(math.prod(rows), math.prod(self.in_shape))
        y = cpu_matmul.matmul(x_MK, self.tiles, math.prod(self.out_shape))
        return y.reshape(*rows, *self.out_shape).astype(dtype)


def pack_weight(w: jax.Array, spec: str) -> PackedWeight:
    """`w` (a projection read as `spec`, optionally with leading layers axes) packed; the spec must
    contract the weight's leading dims (every projection of models/layers does)."""
    _, w_letters, out = parse_spec(spec)
    n_in = sum(c not in out for c in w_letters)
    if any(c in out for c in w_letters[:n_in]) or w.ndim < len(w_letters):
        raise ValueError(f"{spec!r} does not contract the weight's leading dims; it cannot be packed")
    lead = w.ndim - len(w_letters)
    in_shape, out_shape = w.shape[lead : lead + n_in], w.shape[lead + n_in :]
    w_KN = w.reshape(*w.shape[:lead], math.prod(in_shape), math.prod(out_shape))
    return PackedWeight(cpu_matmul.pack(w_KN), tuple(in_shape), tuple(out_shape))
