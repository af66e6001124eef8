"""RMSNorm (Zhang & Sennrich, 2019), as in Llama: no mean subtraction, no bias."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshwork.models.layers.params import param


class RMSNorm(nnx.Module):
    def __init__(
        self,
        dim: int,
        *,
        eps: float,
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
        axis: str = "embed",
        offset: float = 0.0,
    ):
        """Normalizes the last axis, of size `dim`; `axis` is its logical name ("head_dim" for
        Qwen3's per-head q/k norms, whose one scale all heads share). `offset` 1: the scale is
        1 + weight, the weight starting at 0 (Gemma's zero-centered norm, kept so that a
        checkpoint's weight loads and exports unchanged)."""
        init = nnx.initializers.zeros if offset == 1.0 else nnx.initializers.ones
        self.scale = param(init, rngs.params(), (dim,), param_dtype, (axis,))
        self.eps, self.dtype, self.offset = eps, dtype, offset

    def __call__(self, x: jax.Array) -> jax.Array:
        # Statistics in float32 even under bfloat16 compute: the mean of squares
        # of a wide vector loses too many bits in bf16.
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        return (y * (scale + self.offset if self.offset else scale)).astype(self.dtype)
