"""RMSNorm (Zhang & Sennrich, 2019), as in Llama: no mean subtraction, no bias."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshwork.models.layers.params import param


class RMSNorm(nnx.Module):
    def __init__(
        self, dim: int, *, eps: float, dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs, axis: str = "embed"
    ):
        """Normalizes the last axis, of size `dim`; `axis` is its logical name ("head_dim" for
        Qwen3's per-head q/k norms, whose one scale all heads share)."""
        self.scale = param(nnx.initializers.ones, rngs.params(), (dim,), param_dtype, (axis,))
        self.eps, self.dtype = eps, dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        # Statistics in float32 even under bfloat16 compute: the mean of squares
        # of a wide vector loses too many bits in bf16.
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(self.dtype)
