"""Layers of one stack that differ in their attention's window and RoPE (Gemma 2 and gpt-oss
alternate sliding-window and full layers, Gemma 3 has five sliding layers to one full one, each
kind with its own RoPE base).

The layers keep one parameter shape, so they stay one stacked, scanned group; what differs is
static per layer. `LayerPattern` holds the distinct kinds and each layer's kind; a layer learns its
index from the scan (models/transformer.py sets `layer_index` on each layer's copy) and the pattern
turns it into that layer's window and RoPE: as data where the math takes a traced value (XLA's mask),
and otherwise by `lax.switch` over the kinds, each branch with its constants (a Pallas kernel's
window, the ring's block skipping).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshwork.models.layers.rope import apply_rope

# A window wider than any sequence: a full-attention layer's, where the window is traced data.
NO_WINDOW = 2**30

Rope = tuple[float, tuple | None]  # (theta, the HF scaling dict's sorted items, or None)


@dataclasses.dataclass(frozen=True)
class LayerPattern:
    """windows[k], ropes[k]: layer kind k's window (None: full attention) and RoPE; of_layer[i]:
    layer i's kind (None: one kind for all). Frozen and hashable: a static module attribute."""

    windows: tuple[int | None, ...]
    ropes: tuple[Rope, ...]
    of_layer: tuple[int, ...] | None = None

    @staticmethod
    def uniform(window: int | None, theta: float, scaling: dict | None) -> LayerPattern:
        return LayerPattern((window,), ((theta, _items(scaling)),))

    @staticmethod
    def from_config(cfg: Any) -> LayerPattern:
        """The pattern of a ModelConfig's layers: `attention_kinds`, `sliding_window`, and the RoPE of
        each kind (`local_rope_theta`/`local_rope_scaling` for sliding layers, when set)."""
        full_rope = (cfg.rope_theta, _items(cfg.rope_scaling))
        local_rope = (
            full_rope if cfg.local_rope_theta is None else (cfg.local_rope_theta, _items(cfg.local_rope_scaling))
        )
        by_kind = {"full_attention": (None, full_rope), "sliding_attention": (cfg.sliding_window, local_rope)}
        # A hybrid's linear layers have no window or RoPE: they count as full layers here, never asked.
        by_kind["linear_attention"] = by_kind["full_attention"]
        kinds = [by_kind[k] for k in cfg.attention_kinds]
        distinct = list(dict.fromkeys(kinds))
        if len(distinct) == 1:
            return LayerPattern((distinct[0][0],), (distinct[0][1],))
        return LayerPattern(
            tuple(w for w, _ in distinct), tuple(r for _, r in distinct), tuple(distinct.index(k) for k in kinds)
        )

    @property
    def mixed(self) -> bool:
        return self.of_layer is not None

    def with_window(self, window: int | None) -> LayerPattern:
        if self.mixed:
            raise ValueError("a mixed layer pattern has a window per kind of layer; build the model from its config")
        return dataclasses.replace(self, windows=(window,))

    def _kind(self, layer_index: jax.Array | None) -> jax.Array:
        if layer_index is None:
            raise ValueError(
                "this model's layers differ in window or RoPE (model.layer_types), which needs each layer's "
                "index; pipeline parallelism does not pass it yet: train it without pipeline stages"
            )
        return jnp.asarray(np.asarray(self.of_layer, np.int32))[layer_index]

    def by_window(self, fn: Callable[[Any], Any], layer_index: jax.Array | None, traced: bool = False) -> Any:
        """fn(this layer's window): `traced`, the window as int32 data (NO_WINDOW for full layers);
        otherwise lax.switch over the kinds, each calling fn with its window as a constant."""
        if not self.mixed:
            return fn(self.windows[0])
        kind = self._kind(layer_index)
        if traced:
            table = np.asarray([NO_WINDOW if w is None else w for w in self.windows], np.int32)
            return fn(jnp.asarray(table)[kind])
        return jax.lax.switch(kind, [lambda w=w: fn(w) for w in self.windows])

    def rope(self, x: jax.Array, *, positions_BL: jax.Array, layer_index: jax.Array | None) -> jax.Array:
        """RoPE of this layer's kind applied to x (B, L, heads, K)."""
        distinct = list(dict.fromkeys(self.ropes))
        if len(distinct) == 1:
            return apply_rope(x, positions_BL, distinct[0][0], _dict(distinct[0][1]))
        index = np.asarray([distinct.index(r) for r in self.ropes], np.int32)
        branches = [lambda x, r=r: apply_rope(x, positions_BL, r[0], _dict(r[1])) for r in distinct]
        return jax.lax.switch(jnp.asarray(index)[self._kind(layer_index)], branches, x)


def _items(scaling: dict | None) -> tuple | None:
    # A sorted tuple, not the dict: static module attributes must hash (the graphdef keys jit's cache).
    return tuple(sorted(scaling.items())) if scaling else None


def _dict(items: tuple | None) -> dict | None:
    return dict(items) if items else None
