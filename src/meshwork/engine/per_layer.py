"""Stacked layer weights as one array per layer, for decoding.

    state = unstack_layers(state, model.layer_stacks())    # a Generator does this once, at load
    stacked = restack_layers(state)                          # the trainer's layout again

Training keeps each weight of the repeated blocks as one array with a leading
`layers` axis and runs the blocks with `lax.scan`: one compiled layer, whatever
the depth. A scan reads layer i's weights by slicing the stacked array, and for
a matmul XLA materializes that slice: the weights are copied once per layer per
step. Training does enough work per weight for the copy to hide; a decode step
does one row per sequence, so the copy is as costly as the matmul it feeds
(measured on a 2-core CPU: 9.6 ms of a 34M model's 10.9 ms step was copies).
With one array per layer each matmul reads its weight in place, and
`decode_layers` (models/transformer.py) runs the blocks in a Python loop over
the layers instead of a scan.

`PerLayer` holds the arrays; it is a pytree (its arrays are the leaves), so a
state holding it passes through `jax.jit`, `nnx.merge` and `jax.device_put`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PerLayer:
    """The arrays of one stacked weight, layer by layer: `parts[i]` is the stacked array's `[i]`."""

    parts: tuple[jax.Array, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        """The stacked array's shape (layers first)."""
        return (len(self.parts), *self.parts[0].shape)

    @property
    def dtype(self):
        return self.parts[0].dtype


def is_per_layer(x) -> bool:
    return isinstance(x, PerLayer)


def layer_slice(x, i: int):
    """Layer i of a stacked array or of a PerLayer (no copy for the latter)."""
    return x.parts[i] if isinstance(x, PerLayer) else x[i]


def unstack_layers(state: nnx.State, stacks: Iterable[str]) -> nnx.State:
    """`state` with every array under the top-level modules `stacks` (a model's stacked blocks,
    `model.layer_stacks()`) split into a PerLayer along its leading axis; the rest unchanged."""
    stacks = set(stacks)
    if not stacks:
        return state

    def split(path, x):
        if path[0].key not in stacks or not isinstance(x, jax.Array) or x.ndim == 0:
            return x
        return PerLayer(tuple(x[i] for i in range(x.shape[0])))

    return jax.tree_util.tree_map_with_path(split, state)


def abstract_stacked(state: nnx.State) -> nnx.State:
    """`restack_layers(state)` as ShapeDtypeStructs with their shardings (nothing is copied): the
    layout a trainer's stacked weights are moved into before they are split (engine/weight_sync.py)."""

    def one(x):
        if not is_per_layer(x):
            return x
        sharding = x.parts[0].sharding
        if isinstance(sharding, NamedSharding):  # the layers axis is whole on every device
            sharding = NamedSharding(
                sharding.mesh, PartitionSpec(None, *sharding.spec), memory_kind=sharding.memory_kind
            )
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, state, is_leaf=is_per_layer)


def restack_layers(state: nnx.State) -> nnx.State:
    """`unstack_layers` undone: each PerLayer stacked back into one array (a copy)."""
    return jax.tree.map(lambda x: jnp.stack(x.parts) if is_per_layer(x) else x, state, is_leaf=is_per_layer)
