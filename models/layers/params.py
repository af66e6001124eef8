"""Creating weights that carry their logical axis names, and multiplying by them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshwork.models.layers.mixed_matmul import weight_einsum

Initializer = Callable[[jax.Array, Sequence[int], jnp.dtype], jax.Array]


def param(
    init: Initializer,
    key: jax.Array,
    shape: Sequence[int],
    dtype: jnp.dtype,
    names: Sequence[str | None],
    kind: type[nnx.Param] = nnx.Param,
) -> nnx.Param:
    """An nnx.Param (or the subclass `kind`, e.g. models/lora.py's LoRAParam) whose metadata
    `out_sharding` holds one logical name per dimension.

    Eager sharding is off per variable: placement is decided once, by the
    trainer, from these names and the rules table (abstract-first init), so a
    model can also be built on one device without any mesh.
    """
    assert len(names) == len(shape), (names, shape)
    return kind(init(key, tuple(shape), dtype), out_sharding=tuple(names), eager_sharding=False)


def normal(std: float) -> Initializer:
    return nnx.initializers.normal(std)


def matmul(spec: str, x: jax.Array, weight: nnx.Param | nnx.Module, dtype: jnp.dtype) -> jax.Array:
    """`einsum(spec, x, weight)` in `dtype`: the one place models read a projection's weight.

    A weight may hold a quantized array instead (models/quantize.py: int8 or
    int4 values with scales); it then does its own product, dequantizing inside
    the jitted matmul so the weights stay small in memory. It may also be a
    module wrapping a weight (models/lora.py: a frozen weight plus a trainable
    low-rank delta), which likewise computes the product itself.
    """
    if not isinstance(weight, nnx.Variable):
        return weight.matmul(spec, x, dtype)
    w = weight.get_value()
    if isinstance(w, jax.Array | np.ndarray):
        return weight_einsum(spec, x, w.astype(dtype))
    return w.matmul(spec, x, dtype)
