"""A hybrid model's per-sequence recurrent states, kept beside its KV cache (kv_cache.py).

Qwen3-Next's Gated DeltaNet layers (models/layers/gated_deltanet.py) carry a fixed-size state per
sequence instead of keys and values that grow with it. `RecurrentStates` holds them for every linear
layer and row (a contiguous cache's rows, a paged server's slots), inside `KVCache` and `PagedKVCache`
(their `states` field); `cache.linear_layer(j)` is layer j's view, which reads the batch's rows (the
cache's `rows`: which slot each batch row is), says which tokens are real (positions the cache can
hold: the engine parks padding and finished rows past it) and writes the new states back.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from meshwork.config_sections import LinearAttentionConfig, ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RecurrentStates:
    """A hybrid model's linear-attention (Gated DeltaNet) layers' per-sequence states, beside its KV
    cache: a fixed size per sequence however long it grows (models/layers/gated_deltanet.py's
    `GatedDeltaNetState`, field by field, with leading (linear layers, rows)): the last W - 1 inputs of
    the q, k and v convolutions, then the float32 (H, Kk, Kv) state of the delta rule."""

    arrays: tuple[jax.Array, ...]

    @classmethod
    def zeros(cls, cfg: ModelConfig, rows: int, dtype: jnp.dtype) -> RecurrentStates | None:
        """Zeroed states of `rows` sequences for `cfg`'s linear layers (None when it has none)."""
        if not cfg.linear_layers:
            return None
        n = len(cfg.linear_layers)
        return cls(tuple(jnp.zeros((n, rows, *shape), dt) for shape, dt in state_shapes(cfg.linear_attention, dtype)))

    def cleared(self, rows_B: jax.Array, when_B: jax.Array) -> RecurrentStates:
        """The states with rows `rows_B` zeroed where `when_B` (a sequence starting afresh in its slot)."""
        return RecurrentStates(
            tuple(a.at[:, rows_B].set(jnp.where(_expand(when_B, a.ndim - 1), 0, a[:, rows_B])) for a in self.arrays)
        )

    @staticmethod
    def bytes_per_sequence(cfg: ModelConfig, dtype: jnp.dtype) -> int:
        """What one sequence's states take over all linear layers."""
        return len(cfg.linear_layers) * state_bytes(cfg.linear_attention, dtype) if cfg.linear_layers else 0


def state_shapes(la: LinearAttentionConfig, dtype: jnp.dtype) -> tuple[tuple[tuple[int, ...], jnp.dtype], ...]:
    """(shape, dtype) of each array of one sequence's state in one linear layer, in the order of
    models/layers/gated_deltanet.py's `GatedDeltaNetState`: the last W - 1 inputs of the q, k and v
    convolutions (in `dtype`, the compute or cache dtype), then the float32 (H, Kk, Kv) delta-rule state."""
    S, G, H = la.conv_kernel - 1, la.num_k_heads, la.num_v_heads
    return (
        ((S, G, la.head_k_dim), dtype),
        ((S, G, la.head_k_dim), dtype),
        ((S, H, la.head_v_dim), dtype),
        ((H, la.head_k_dim, la.head_v_dim), jnp.float32),
    )


def state_bytes(la: LinearAttentionConfig, dtype: jnp.dtype) -> int:
    """Bytes of one sequence's state in one linear layer; independent of the sequence's length.

    >>> la = LinearAttentionConfig(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128)
    >>> state_bytes(la, jnp.bfloat16)   # Qwen3-Next: 3 x 8192 x 2 B + 32 x 128 x 128 x 4 B
    2146304
    """
    return sum(math.prod(shape) * jnp.dtype(dt).itemsize for shape, dt in state_shapes(la, dtype))


def _expand(x_B: jax.Array, ndim: int) -> jax.Array:
    return x_B.reshape(x_B.shape + (1,) * (ndim - 1))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StateLayerView:
    """Linear layer j's view of a cache's `RecurrentStates`, for the batch's rows (the cache's `rows`:
    which slot each batch row is; None: rows 0..B-1)."""

    cache: Any
    j: jax.Array

    def read(self) -> tuple[jax.Array, ...]:
        rows = self.cache.rows
        return tuple(a[self.j] if rows is None else a[self.j, rows] for a in self.cache.states.arrays)

    def valid(self, positions_BL: jax.Array) -> jax.Array:
        """Real tokens: those at positions the cache can hold (padding and finished rows sit past it)."""
        return positions_BL < self.cache.capacity

    def write(self, new: tuple[jax.Array, ...]) -> StateLayerView:
        rows = self.cache.rows
        arrays = tuple(
            a.at[self.j].set(x.astype(a.dtype)) if rows is None else a.at[self.j, rows].set(x.astype(a.dtype))
            for a, x in zip(self.cache.states.arrays, new, strict=True)
        )
        return StateLayerView(dataclasses.replace(self.cache, states=RecurrentStates(arrays)), self.j)
