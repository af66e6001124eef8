"""Multi-head latent attention (DeepSeek-V2/V3): every head's keys and values from one small latent per token.

Per token, x (D) is compressed to a latent c (kv_lora_rank = R, RMS-normed) and one RoPE key
k_rope (qk_rope_head_dim = Dr) shared by all heads; head h's key is [c W_uk[h], k_rope] and its value
c W_uv[h] (W_uk, W_uv: the two halves of `wkv_b`, (R, H, Dn + Dv)). Queries are [q_nope, q_rope]
(Dn + Dr per head), from x directly or through a low-rank projection with its own norm (q_lora_rank).

Training runs the expanded form: keys and values are materialized per head and go through the one
attention dispatch (`attention.attend`), so every kernel and parallel layout dense attention has
(flash, ring, all-gathered keys) serves MLA too; values narrower than the keys are zero-padded to
the key width (their extra output columns are zero and dropped).

Inference runs the absorbed form: since q_nope . (c W_uk[h]) = (q_nope W_uk[h]^T) . c, the query is
moved into the latent space once per new token, scores are taken against the cached [c, k_rope]
directly, and the softmax-weighted latent is mapped to head values by W_uv afterwards. The cache
holds R + Dr numbers per token and layer (against 2 x kv_heads x head_dim for dense attention) and
is never expanded.

The softmax scale is (Dn + Dr)^-0.5, times mscale^2 under YaRN with `mscale_all_dim` (DeepSeek-V3's
long-context setting: scores of all dims, not only the rotated ones, are sharpened).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshwork.config_sections import MLAConfig
from meshwork.models.layers.attention import OUT_PROJ, QKV_PROJ, attend
from meshwork.models.layers.norm import RMSNorm
from meshwork.models.layers.params import matmul, normal, param
from meshwork.models.layers.rope import apply_rope
from meshwork.sharding.parallel import with_logical_constraint


def mla_softmax_scale(mla: MLAConfig, rope_scaling: dict | None) -> float:
    """(qk_nope + qk_rope)^-0.5, times mscale(factor, mscale_all_dim)^2 when YaRN sets mscale_all_dim.

    >>> m = MLAConfig(qk_nope_head_dim=128, qk_rope_head_dim=64)
    >>> round(mla_softmax_scale(m, None) * 192**0.5, 6), round(mla_softmax_scale(m,
    ...     {"rope_type": "yarn", "factor": 40, "mscale_all_dim": 1.0}) * 192**0.5, 4)
    (1.0, 1.8739)
    """
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    s = rope_scaling or {}
    if s.get("rope_type", "default") != "default" and s.get("mscale_all_dim"):
        factor = float(s["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * float(s["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class MLAttention(nnx.Module):
    """Multi-head latent attention; the same call signatures as `attention.Attention`.

    Parameters: `wq` (D, H, Dn+Dr) or `wq_a` (D, Rq), `q_norm`, `wq_b` (Rq, H, Dn+Dr); `wkv_a`
    (D, R+Dr), `kv_norm` (R), `wkv_b` (R, H, Dn+Dv); `wo` (H, Dv, D). The RoPE dims are the last Dr
    of each query head and of `wkv_a`'s output, in meshwork's rotate-half pairing.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        mla: MLAConfig,
        *,
        rope_theta: float,
        rope_scaling: dict | None,
        init_std: float,
        out_std: float,
        norm_eps: float,
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
        impl: str = "xla",
        window: int | None = None,
    ):
        D, H, R, Dr = d_model, n_heads, mla.kv_lora_rank, mla.qk_rope_head_dim
        Dq = mla.qk_nope_head_dim + Dr
        w = lambda std, shape, names: param(normal(std), rngs.params(), shape, param_dtype, names)  # noqa: E731
        norm = dict(eps=norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if mla.q_lora_rank:
            self.wq_a = w(init_std, (D, mla.q_lora_rank), ("embed", "q_lora"))
            self.q_norm = RMSNorm(mla.q_lora_rank, axis="q_lora", **norm)
            self.wq_b = w(init_std, (mla.q_lora_rank, H, Dq), ("q_lora", "heads", "head_dim"))
        else:
            self.wq = w(init_std, (D, H, Dq), ("embed", "heads", "head_dim"))
        self.wkv_a = w(init_std, (D, R + Dr), ("embed", "kv_lora"))
        self.kv_norm = RMSNorm(R, axis="kv_lora", **norm)
        self.wkv_b = w(init_std, (R, H, mla.qk_nope_head_dim + mla.v_head_dim), ("kv_lora", "heads", "head_dim"))
        self.wo = w(out_std, (H, mla.v_head_dim, D), ("heads", "head_dim", "embed"))
        self.mla, self.rope_theta, self.dtype, self.impl, self.window = mla, rope_theta, dtype, impl, window
        self.rope_scaling = tuple(sorted(rope_scaling.items())) if rope_scaling else None  # hashable, as Attention's
        self.scale = mla_softmax_scale(mla, rope_scaling)
        self.prefix = nnx.data(None)  # prefix tuning is not built for MLA (config.py refuses it)

    @property
    def _scaling(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def _rope(self, x: jax.Array, positions_BL: jax.Array) -> jax.Array:
        return apply_rope(x, positions_BL, self.rope_theta, self._scaling)

    def queries(self, x_BLD: jax.Array, positions_BL: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(q_nope (B, L, H, Dn), q_rope (B, L, H, Dr) rotated to `positions_BL`)."""
        if self.mla.q_lora_rank:
            q_BLQ = self.q_norm(matmul("BLD,DQ->BLQ", x_BLD, self.wq_a, self.dtype))
            q_BLHK = matmul("BLQ,QHK->BLHK", q_BLQ, self.wq_b, self.dtype)
        else:
            q_BLHK = matmul("BLD,DHK->BLHK", x_BLD, self.wq, self.dtype)
        q_BLHK = checkpoint_name(q_BLHK, QKV_PROJ[0])
        Dn = self.mla.qk_nope_head_dim
        return q_BLHK[..., :Dn], self._rope(q_BLHK[..., Dn:], positions_BL)

    def latent(self, x_BLD: jax.Array, positions_BL: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(the normed latent c (B, L, R), the shared RoPE key (B, L, Dr) rotated to `positions_BL`):
        what the cache keeps per token."""
        R = self.mla.kv_lora_rank
        kv_BLC = checkpoint_name(matmul("BLD,DC->BLC", x_BLD, self.wkv_a, self.dtype), QKV_PROJ[1])
        k_rope_BL1K = self._rope(kv_BLC[..., None, R:], positions_BL)
        return self.kv_norm(kv_BLC[..., :R]), k_rope_BL1K[:, :, 0]

    def __call__(
        self, x_BLD: jax.Array, positions_BL: jax.Array | None = None, segment_ids_BL: jax.Array | None = None
    ) -> jax.Array:
        """The expanded form (training and full-sequence forward passes), as `Attention.__call__`."""
        B, L, _ = x_BLD.shape
        rope_pos_BL = positions_BL if positions_BL is not None else jnp.broadcast_to(jnp.arange(L), (B, L))
        q_nope, q_rope = self.queries(x_BLD, rope_pos_BL)
        c_BLR, k_rope_BLK = self.latent(x_BLD, rope_pos_BL)
        kv_BLHK = checkpoint_name(matmul("BLR,RHK->BLHK", c_BLR, self.wkv_b, self.dtype), QKV_PROJ[2])
        Dn, Dv, H = self.mla.qk_nope_head_dim, self.mla.v_head_dim, q_nope.shape[2]
        k_rope_BLHK = jnp.broadcast_to(k_rope_BLK[:, :, None], (*k_rope_BLK.shape[:2], H, k_rope_BLK.shape[-1]))
        q_BLHK = jnp.concatenate([q_nope, q_rope], axis=-1)
        k_BLHK = jnp.concatenate([kv_BLHK[..., :Dn], k_rope_BLHK], axis=-1)
        v_BLHK = kv_BLHK[..., Dn:]
        width = max(q_BLHK.shape[-1], Dv)  # one head width for q, k and v: zeros change no score or value
        q_BLHK, k_BLHK, v_BLHK = (_pad_last(t, width) for t in (q_BLHK, k_BLHK, v_BLHK))
        names = ("act_batch", "act_seq", "act_heads", "act_head_dim")
        q_BLHK, k_BLHK, v_BLHK = (with_logical_constraint(t, names) for t in (q_BLHK, k_BLHK, v_BLHK))
        o_BLHK = attend(
            q_BLHK,
            k_BLHK,
            v_BLHK,
            positions_BL,
            causal=True,
            scale=self.scale,
            impl=self.impl,
            segment_ids_BL=segment_ids_BL,
            window=self.window,
        )[..., :Dv]
        return checkpoint_name(matmul("BLHK,HKD->BLD", o_BLHK, self.wo, self.dtype), OUT_PROJ)

    def cached(self, x_BLD: jax.Array, positions_BL: jax.Array, kv):
        """The absorbed form over a latent KV cache (src/meshwork/engine/kv_cache.py): writes this call's
        [c, k_rope] at `positions_BL` and attends over every cached one; (output, updated cache)."""
        q_nope, q_rope = self.queries(x_BLD, positions_BL)
        c_BLR, k_rope_BLK = self.latent(x_BLD, positions_BL)
        wkv_b = _plain_weight(self.wkv_b)
        Dn = self.mla.qk_nope_head_dim
        w_uk_RHK, w_uv_RHK = wkv_b[..., :Dn], wkv_b[..., Dn:]
        q_lat_BLHR = jnp.einsum("BLHK,RHK->BLHR", q_nope, w_uk_RHK.astype(q_nope.dtype))
        query_BLHC = jnp.concatenate([q_lat_BLHR, q_rope.astype(q_lat_BLHR.dtype)], axis=-1)
        entry_BLC = jnp.concatenate([c_BLR, k_rope_BLK.astype(c_BLR.dtype)], axis=-1)
        o_BLHR, kv = kv.attend_latent(
            query_BLHC,
            entry_BLC,
            positions_BL,
            scale=self.scale,
            values=self.mla.kv_lora_rank,
            window=self.window,
            impl=self.impl,
        )
        o_BLHK = jnp.einsum("BLHR,RHK->BLHK", o_BLHR.astype(self.dtype), w_uv_RHK.astype(self.dtype))
        return matmul("BLHK,HKD->BLD", o_BLHK, self.wo, self.dtype), kv


def _pad_last(x: jax.Array, width: int) -> jax.Array:
    extra = width - x.shape[-1]
    return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def _plain_weight(w) -> jax.Array:
    """The array of a weight the absorbed decode multiplies into the query and output sides itself: a
    plain weight, or a LoRA-wrapped one as its merged value W0 + (alpha / r) A B (models/lora.py)."""
    if isinstance(w, nnx.Variable) and isinstance(w.get_value(), jax.Array):
        return w[...]
    if hasattr(w, "lora_a") and isinstance(getattr(w.base, "get_value", lambda: None)(), jax.Array):
        from meshwork.models.lora import lora_delta  # lora.py builds on the layers: imported where it is used

        return w.base[...] + lora_delta(w.lora_a[...], w.lora_b[...], w.spec, w.scale).astype(w.base.dtype)
    raise NotImplementedError(
        "absorbed MLA decoding needs a plain (or LoRA-wrapped) wkv_b weight, not a quantized one; "
        "leave wkv_b out of quantization"
    )
