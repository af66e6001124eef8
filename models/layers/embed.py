"""Token embedding table, usable as the output projection when tied."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.layers.params import normal, param


class Embed(nnx.Module):
    def __init__(self, vocab_size: int, d_model: int, *, init_std: float, dtype: jnp.dtype,
                 param_dtype: jnp.dtype, rngs: nnx.Rngs):
        self.table = param(normal(init_std), rngs.params(), (vocab_size, d_model), param_dtype, ("vocab", "embed"))
        self.dtype = dtype

    def __call__(self, tokens_BL: jax.Array) -> jax.Array:
        return jnp.take(self.table[...], tokens_BL, axis=0).astype(self.dtype)

    def attend(self, x_BLD: jax.Array) -> jax.Array:
        """Logits against the embedding table (tied output projection)."""
        return jnp.einsum("BLD,VD->BLV", x_BLD, self.table[...].astype(self.dtype))
