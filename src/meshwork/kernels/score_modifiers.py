"""The two modifiers 2024-2026 models put on attention scores, as plain functions every XLA path
shares (training's formula in models/layers/attention_local.py, the KV caches' in
meshwork/engine/kv_cache.py); the Pallas kernels compute the same inside their loops.

- Logit soft-capping (Gemma 2): s -> softcap * tanh(s / softcap), before the mask, so no score
  passes +-softcap.
- Attention sinks (gpt-oss): one learned logit per query head that joins the softmax's
  denominator and weighs no value, so a head can attend "nowhere".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def soft_cap(s: jax.Array, softcap: float | None) -> jax.Array:
    """softcap * tanh(s / softcap), or s unchanged when softcap is None.

    >>> float(soft_cap(jnp.float32(1e4), 30.0))
    30.0
    """
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def softmax_with_sinks(s: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """softmax over the last axis of (already masked) float32 scores, with `sinks` (broadcastable to
    s[..., :1], one logit per row) as one more column of the softmax, dropped after it.

    >>> p = softmax_with_sinks(jnp.zeros((1, 3)), jnp.zeros((1, 1)))
    >>> [round(float(x), 2) for x in p[0]]
    [0.25, 0.25, 0.25]
    """
    if sinks is None:
        return jax.nn.softmax(s, axis=-1)
    sink = jnp.broadcast_to(sinks.astype(s.dtype), s[..., :1].shape)
    return jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
