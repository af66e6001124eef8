"""Attention on one device: the formula each `model.attention` impl computes, for the ParallelContext
(sharding/parallel.py) to run on whatever part of the batch, sequence and heads it hands it.

Besides the mask (causal by position, a sliding window, packed documents) the formulas take the two
score modifiers of 2024-2026 models:
- `softcap` (Gemma 2): scores s become softcap * tanh(s / softcap) before the mask, so no logit
  passes +-softcap;
- `sinks_H` (gpt-oss): one learned logit per query head that joins the softmax's denominator and
  weighs no value, so a head can put its attention "nowhere" instead of on the first token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from meshwork.kernels.flash_attention import flash_attention, flash_attention_reference
from meshwork.kernels.score_modifiers import soft_cap, softmax_with_sinks
from meshwork.kernels.tuning import tuned_blocks
from meshwork.models.layers.causal_blocks import QUERY_BLOCK, causal_blocks
from meshwork.models.layers.mixed_matmul import mixed_einsum
from meshwork.sharding.parallel import LocalAttention


def local_attention(
    impl: str,
    q_BLHK: jax.Array,
    k_BSGK: jax.Array,
    positions_BL: jax.Array | None,
    *,
    causal: bool,
    scale: float | None,
    window: int | None,
    softcap: float | None = None,
) -> LocalAttention:
    """The attention formula of `impl` as a function of (q, k, v, segment ids or None, sinks or None),
    for the ParallelContext to run on whatever part of the batch and heads it gives it (the sinks
    of those heads). `q_BLHK` and `k_BSGK` (the whole arrays) choose the Pallas kernel's blocks."""
    if impl == "xla":

        def xla(q_BLHK, k_BSGK, v_BSGK, segment_ids_BL, sinks_H=None, positions=None, kv_segment_ids_BS=None):
            # positions: (q_positions_BL, kv_positions_BS), the mask's positions when the ParallelContext
            # hands this device queries and keys other than the whole rows `positions_BL` describes
            # (context parallelism); kv_segment_ids_BS: the keys' segment ids then (None: segment_ids_BL).
            mask = None
            if positions is not None and (causal or segment_ids_BL is not None):
                kv_seg = segment_ids_BL if kv_segment_ids_BS is None else kv_segment_ids_BS
                mask = position_mask(*positions, segment_ids_BL, kv_seg, window, causal=causal)
            elif (positions_BL is not None or segment_ids_BL is not None or window is not None) and causal:
                mask = causal_mask(q_BLHK.shape[:2], positions_BL, segment_ids_BL, window)
            # jax.nn.dot_product_attention has neither modifier, and (for bf16) weighs values in bf16.
            if q_BLHK.dtype != jnp.float32 or softcap is not None or sinks_H is not None:
                return explicit_attention(
                    q_BLHK, k_BSGK, v_BSGK, mask, causal=causal, scale=scale, softcap=softcap, sinks_H=sinks_H
                )
            if mask is not None:
                return jax.nn.dot_product_attention(q_BLHK, k_BSGK, v_BSGK, scale=scale, mask=mask)
            return jax.nn.dot_product_attention(q_BLHK, k_BSGK, v_BSGK, scale=scale, is_causal=causal)

        xla.masks_by_position = True  # it takes `positions=` (sharding/parallel.py LocalAttention)
        return xla
    if impl == "cudnn":

        def cudnn(q_BLHK, k_BSGK, v_BSGK, segment_ids_BL, sinks_H=None):
            if segment_ids_BL is not None:
                raise ValueError("attention impl cudnn takes no segment ids (packed documents); use xla or pallas")
            if softcap is not None or sinks_H is not None:
                raise ValueError("attention impl cudnn has no logit soft-capping or sinks; use xla or pallas")
            return jax.nn.dot_product_attention(
                q_BLHK,
                k_BSGK,
                v_BSGK,
                scale=scale,
                is_causal=causal,
                local_window_size=(window - 1, 0) if window else None,
                implementation="cudnn",
            )

        return cudnn
    if impl == "reference":
        return lambda q, k, v, seg, sinks_H=None: flash_attention_reference(
            q, k, v, causal=causal, scale=scale, window=window, **_segments(seg), **_modifiers(softcap, sinks_H)
        )
    if impl == "pallas":

        def pallas(q, k, v, segment_ids_BL, sinks_H=None):
            # Block sizes (and GPU launch parameters) from the autotuner's cache, if it has this
            # shape: the whole arrays' shape, which the cache is keyed by.
            return flash_attention(
                q,
                k,
                v,
                causal=causal,
                scale=scale,
                window=window,
                **tuned_blocks(q_BLHK, k_BSGK, causal),
                **_segments(segment_ids_BL),
                **_modifiers(softcap, sinks_H),
            )

        return pallas
    raise ValueError(f"attention impl {impl!r}; choose xla, pallas, cudnn or reference")


def _segments(segment_ids_BL: jax.Array | None) -> dict[str, jax.Array]:
    return {"segment_ids_q": segment_ids_BL, "segment_ids_kv": segment_ids_BL} if segment_ids_BL is not None else {}


def _modifiers(softcap: float | None, sinks_H: jax.Array | None) -> dict:
    """The kernels' keywords for the score modifiers in use (none: the call is as before them)."""
    return {k: v for k, v in (("softcap", softcap), ("sinks", sinks_H)) if v is not None}


def explicit_attention(
    q_BLHK: jax.Array,
    k_BSGK: jax.Array,
    v_BSGK: jax.Array,
    mask_B1LS: jax.Array | None,
    *,
    causal: bool,
    scale: float | None,
    softcap: float | None = None,
    sinks_H: jax.Array | None = None,
) -> jax.Array:
    """jax.nn.dot_product_attention's XLA formula written out, for what it lacks: bf16 (or f16) q, k, v
    with every product, forward and backward, taking operands in that dtype and accumulating in
    float32 (mixed_matmul.mixed_einsum; JAX's own weighs the values with a bf16 x bf16 -> bf16
    product, and its backward multiplies float32 cotangents, both of which XLA:CPU runs as float32
    dots behind conversions), soft-capping and sinks. Scores and softmax stay float32. A plain causal
    mask over a long enough sequence is computed by query blocks that skip the masked keys
    (causal_blocks.py)."""
    (B, L, H, K), (_, S, G, _) = q_BLHK.shape, k_BSGK.shape
    q_BLGRK = q_BLHK.reshape(B, L, G, H // G, K)
    scale = K**-0.5 if scale is None else scale
    sinks_GR = None if sinks_H is None else sinks_H.astype(jnp.float32).reshape(G, H // G)
    formula = functools.partial(softmax_weighted_values, scale=scale, softcap=softcap, sinks_GR=sinks_GR)
    if mask_B1LS is None and causal and L == S and L >= 2 * QUERY_BLOCK:
        return causal_blocks(formula, q_BLGRK, k_BSGK, v_BSGK, QUERY_BLOCK).reshape(B, L, H, K)
    if mask_B1LS is None and causal:
        mask_B1LS = jnp.tril(jnp.ones((L, S), bool))[None, None]
    return formula(q_BLGRK, k_BSGK, v_BSGK, mask_B1LS).reshape(B, L, H, K)


def softmax_weighted_values(
    q_BLGRK: jax.Array,
    k_BSGK: jax.Array,
    v_BSGK: jax.Array,
    mask: jax.Array | None,
    *,
    scale: float,
    softcap: float | None = None,
    sinks_GR: jax.Array | None = None,
) -> jax.Array:
    """softmax(cap(q k^T * scale), where `mask`, beside the sinks) v in the compute dtype, scores in
    float32; `mask` is (L, S) or (B, 1, L, S), True where a query sees a key, or None."""
    s_BGRLS = mixed_einsum("BLGRK,BSGK->BGRLS", q_BLGRK, k_BSGK, out_dtype=jnp.float32) * scale
    s_BGRLS = soft_cap(s_BGRLS, softcap)
    if mask is not None:
        mask_BGRLS = mask[:, :, None] if mask.ndim == 4 else mask
        s_BGRLS = jnp.where(mask_BGRLS, s_BGRLS, jnp.finfo(jnp.float32).min)
    p_BGRLS = softmax_with_sinks(s_BGRLS, None if sinks_GR is None else sinks_GR[:, :, None, None])
    return mixed_einsum("BGRLS,BSGK->BLGRK", p_BGRLS.astype(q_BLGRK.dtype), v_BSGK)


def causal_mask(
    batch_len: tuple[int, int], positions_BL: jax.Array | None, segment_ids_BL: jax.Array | None, window: int | None
) -> jax.Array:
    """The (B, 1, L, L) causal mask by position (any token layout), within a document and a window."""
    B, L = batch_len
    pos_BL = positions_BL if positions_BL is not None else jnp.broadcast_to(jnp.arange(L), (B, L))
    return position_mask(pos_BL, pos_BL, segment_ids_BL, segment_ids_BL, window)


def position_mask(
    q_pos_BL: jax.Array,
    kv_pos_BS: jax.Array,
    q_seg_BL: jax.Array | None,
    kv_seg_BS: jax.Array | None,
    window: int | None,
    *,
    causal: bool = True,
) -> jax.Array:
    """The (B, 1, L, S) mask of queries and keys at explicit positions: key j is visible to query i
    iff kv_pos[j] <= q_pos[i] (causal), q_pos[i] - kv_pos[j] < window, and both are in one segment."""
    q_pos, k_pos = q_pos_BL[:, None, :, None], kv_pos_BS[:, None, None, :]
    mask = q_pos >= k_pos if causal else jnp.ones((q_pos.shape[0], 1, q_pos.shape[2], k_pos.shape[3]), bool)
    if window is not None and causal:
        mask &= q_pos - k_pos < window
    if q_seg_BL is not None:
        mask &= q_seg_BL[:, None, :, None] == kv_seg_BS[:, None, None, :]
    return mask
