"""Token embedding table, usable as the output projection when tied."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshwork.models.layers.params import normal, param
from meshwork.sharding.rules import with_logical_constraint


class Embed(nnx.Module):
    def __init__(self, vocab_size: int, d_model: int, *, init_std: float, dtype: jnp.dtype,
                 param_dtype: jnp.dtype, rngs: nnx.Rngs):
        self.table = param(normal(init_std), rngs.params(), (vocab_size, d_model), param_dtype, ("vocab", "embed"))
        self.dtype = dtype

    def __call__(self, tokens_BL: jax.Array) -> jax.Array:
        # Gather the table's embed dimension before the lookup (FSDP splits it):
        # the looked-up rows then come out split by batch like the tokens,
        # instead of split by embed, which the backward pass cannot undo cheaply
        # on a data x fsdp mesh. A vocab split (tensor parallelism) stays.
        with jax.named_scope("embed"):
            table_VD = with_logical_constraint(self.table[...], ("act_vocab", "act_embed"))
            return jnp.take(table_VD, tokens_BL, axis=0).astype(self.dtype)

    def attend(self, x_BLD: jax.Array) -> jax.Array:
        """Logits against the embedding table (tied output projection)."""
        return jnp.einsum("BLD,VD->BLV", x_BLD, self.table[...].astype(self.dtype))
