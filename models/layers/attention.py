"""Grouped-query self-attention with RoPE, and the one attention dispatch.

`attend` is the single entry point for the attention math; later kernels
(Pallas flash attention, ring attention) plug in behind it by `impl`, so the
models never change when a faster kernel lands.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.layers.params import normal, param
from models.layers.rope import apply_rope
from sharding.rules import with_logical_constraint


def attend(q_BLHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array, *, causal: bool = True,
           scale: float | None = None, impl: str = "xla") -> jax.Array:
    """softmax(q k^T * scale + mask) v, with G key/value heads shared by H/G query heads.

    impl="xla": `jax.nn.dot_product_attention`, which handles grouped heads
    without materializing repeated K/V and lets XLA pick the fusion (cuDNN
    flash attention on GPU when asked for).
    """
    if impl != "xla":
        raise ValueError(f"attention impl {impl!r} is not available; use 'xla'")
    return jax.nn.dot_product_attention(q_BLHK, k_BSGK, v_BSGK, scale=scale, is_causal=causal)


class Attention(nnx.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, *, rope_theta: float,
                 init_std: float, out_std: float, dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        D, H, G, K = d_model, n_heads, n_kv_heads, head_dim
        self.wq = param(normal(init_std), rngs.params(), (D, H, K), param_dtype, ("embed", "heads", "head_dim"))
        self.wk = param(normal(init_std), rngs.params(), (D, G, K), param_dtype, ("embed", "kv_heads", "head_dim"))
        self.wv = param(normal(init_std), rngs.params(), (D, G, K), param_dtype, ("embed", "kv_heads", "head_dim"))
        self.wo = param(normal(out_std), rngs.params(), (H, K, D), param_dtype, ("heads", "head_dim", "embed"))
        self.rope_theta, self.dtype = rope_theta, dtype

    def __call__(self, x_BLD: jax.Array, positions_BL: jax.Array) -> jax.Array:
        w = lambda p: p[...].astype(self.dtype)  # noqa: E731
        q_BLHK = jnp.einsum("BLD,DHK->BLHK", x_BLD, w(self.wq))
        k_BLGK = jnp.einsum("BLD,DGK->BLGK", x_BLD, w(self.wk))
        v_BLGK = jnp.einsum("BLD,DGK->BLGK", x_BLD, w(self.wv))
        q_BLHK = with_logical_constraint(apply_rope(q_BLHK, positions_BL, self.rope_theta),
                                         ("act_batch", "act_seq", "act_heads", "act_head_dim"))
        k_BLGK = with_logical_constraint(apply_rope(k_BLGK, positions_BL, self.rope_theta),
                                         ("act_batch", "act_seq", "act_kv_heads", "act_head_dim"))
        o_BLHK = attend(q_BLHK, k_BLGK, v_BLGK, causal=True)
        return jnp.einsum("BLHK,HKD->BLD", o_BLHK, w(self.wo))
