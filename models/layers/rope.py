"""Rotary position embeddings (Su et al., 2021), in the "rotate half" layout
used by Llama and Hugging Face, so their weights load without permutation."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rope(x_BLHK: jax.Array, positions_BL: jax.Array, theta: float) -> jax.Array:
    """Rotates pairs (i, i + K/2) of the last dimension by position-dependent angles."""
    K = x_BLHK.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, K, 2, dtype=jnp.float32) / K))
    angles_BLk = positions_BL[..., None].astype(jnp.float32) * inv_freq
    sin = jnp.sin(angles_BLk)[:, :, None, :]
    cos = jnp.cos(angles_BLk)[:, :, None, :]
    x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHK.dtype)
