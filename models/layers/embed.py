"""Token embedding table, usable as the output projection when tied."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from meshwork.models.layers.params import normal, param
from meshwork.sharding.parallel import current_rules, with_logical_constraint
from meshwork.sharding.rules import manual_axes, split_axes


class Embed(nnx.Module):
    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        *,
        init_std: float,
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
        scale: float | None = None,
    ):
        """scale: looked-up rows are multiplied by it, in the compute dtype (Gemma's sqrt(d_model));
        the tied output projection (`attend`) uses the table unscaled."""
        self.table = param(normal(init_std), rngs.params(), (vocab_size, d_model), param_dtype, ("vocab", "embed"))
        self.dtype, self.scale = dtype, scale

    def __call__(self, tokens_BL: jax.Array) -> jax.Array:
        rows = self._rows(tokens_BL)
        return rows if self.scale is None else rows * jnp.asarray(self.scale, self.dtype)

    def _rows(self, tokens_BL: jax.Array) -> jax.Array:
        with jax.named_scope("embed"):
            looked_up = _lookup_in_embed_shards(self.table[...], tokens_BL, self.dtype)
            if looked_up is not None:
                return looked_up
            # Otherwise gather the table's embed dimension before the lookup: the looked-up rows
            # then come out split by batch like the tokens, instead of split by embed, which the
            # backward pass cannot undo cheaply on a data x fsdp mesh. A vocab split (tensor
            # parallelism) stays.
            table_VD = with_logical_constraint(self.table[...], ("act_vocab", "act_embed"))
            return jnp.take(table_VD, tokens_BL, axis=0).astype(self.dtype)

    def attend(self, x_BLD: jax.Array) -> jax.Array:
        """Logits against the embedding table (tied output projection)."""
        return jnp.einsum("BLD,VD->BLV", x_BLD, self.table[...].astype(self.dtype))


def _lookup_in_embed_shards(table_VD: jax.Array, tokens_BL: jax.Array, dtype: jnp.dtype) -> jax.Array | None:
    """The lookup where FSDP splits the table's embed dimension over axes that also split the
    batch, without gathering the table; None where that is not the layout.

    Each device gathers its group's tokens (a few KiB of ints), looks up its own columns of
    the table for all of them, and an all-to-all hands every device its own rows with all
    columns. The backward pass is the mirror image: an all-to-all, then a scatter-add into
    this device's columns only. The gathered (V, D) table of the plain path, its zero-filled
    (V, D) gradient buffer and that gradient's all-reduce (3 x V x D x 4 bytes per device per
    step: 390 MiB at vocabulary 32,000, d 1024) become 2 x B x L x D activations. Only worth it
    when the table has more rows than a device has tokens (V > B x L per device): a small
    vocabulary's table is cheaper to gather.
    """
    rules, mesh = current_rules(), jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty or manual_axes():
        return None
    shape = dict(mesh.shape)
    embed, batch = split_axes("embed", rules, shape), split_axes("act_batch", rules, shape)
    if (
        not embed
        or not set(embed) <= set(batch)
        or split_axes("vocab", rules, shape)
        or split_axes("act_norm_seq", rules, shape)
        or split_axes("act_embed", rules, shape)
    ):
        return None
    ways = math.prod(shape[a] for a in batch)
    if tokens_BL.ndim != 2 or tokens_BL.shape[0] % ways or table_VD.shape[0] <= tokens_BL.size // ways:
        return None  # (shard_map needs whole rows per device; a small table is cheaper to gather)

    def lookup(table_Vd: jax.Array, tokens_bL: jax.Array) -> jax.Array:
        group_tokens = jax.lax.all_gather(tokens_bL, embed, axis=0, tiled=True)
        columns = jnp.take(table_Vd, group_tokens, axis=0).astype(dtype)  # (b x group, L, D / group)
        return jax.lax.all_to_all(columns, embed, split_axis=0, concat_axis=2, tiled=True)

    return jax.shard_map(
        lookup,
        mesh=mesh,
        in_specs=(PartitionSpec(None, embed), PartitionSpec(batch, None)),
        out_specs=PartitionSpec(batch, None, None),
    )(table_VD, tokens_BL)
