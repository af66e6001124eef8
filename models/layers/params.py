"""Creating weights that carry their logical axis names."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

Initializer = Callable[[jax.Array, Sequence[int], jnp.dtype], jax.Array]


def param(init: Initializer, key: jax.Array, shape: Sequence[int], dtype: jnp.dtype,
          names: Sequence[str]) -> nnx.Param:
    """An nnx.Param whose metadata `out_sharding` holds one logical name per dimension.

    Eager sharding is off per variable: placement is decided once, by the
    trainer, from these names and the rules table (abstract-first init), so a
    model can also be built on one device without any mesh.
    """
    assert len(names) == len(shape), (names, shape)
    return nnx.Param(init(key, tuple(shape), dtype), out_sharding=tuple(names), eager_sharding=False)


def normal(std: float) -> Initializer:
    return nnx.initializers.normal(std)
