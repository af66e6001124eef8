"""Flash attention: the differentiable entry point beside a pure-JAX reference with the same signature.

`flash_attention` checks its arguments, plans the static configuration
(backend, legal block sizes, padded head dim), pads the inputs and calls the
Pallas kernels of flash_attention_kernels.py under a `jax.custom_vjp`;
`flash_attention_reference` computes the same thing with the scores in memory.

    >>> q = jnp.ones((1, 64, 4, 32)); k = v = jnp.ones((1, 64, 2, 32))
    >>> flash_attention(q, k, v, causal=True).shape   # interpret mode on CPU
    (1, 64, 4, 32)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from meshwork.kernels.flash_attention_kernels import (
    BlockSizes,
    FlashConfig,
    flash_backward,
    flash_forward,
    row_delta,
    sink_grad,
)
from meshwork.kernels.pallas_backend import F32, check_features, fit_block, masked_softmax, resolve_backend, soft_cap

# Starting points. GPU: from the one autotuning run on an H200 (benchmarks/RESULTS.md,
# 2026-11-30: causal S=4096, K=128, fwd+bwd): 64x64 tiles with 4 warps took 3.90 ms
# where 128x64 tiles with 8 warps took 7.11 ms; other lengths and head dims are not tuned
# on a GPU yet (benchmarks/gpu_suite.sh's autotune step tunes them). TPU: the key block is the lane dim of the score tile
# (multiple of 128); bigger tiles amortize the ~0.35 us per-step overhead.
# CPU: the interpreter pays per grid step, so few large blocks are fastest.
DEFAULT_BLOCKS = {
    "gpu": BlockSizes(q=64, kv=64, bwd_q=64, bwd_kv=64),
    "tpu": BlockSizes(q=512, kv=512, bwd_q=256, bwd_kv=512),
    "cpu": BlockSizes(q=128, kv=128, bwd_q=128, bwd_kv=128),
}


# --------------------------------------------------------------------------
# Autodiff: the kernels' forward and backward under one custom_vjp
# --------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, seg_q, seg_kv, sinks, cfg):
    return flash_forward(q, k, v, seg_q, seg_kv, cfg, sinks)[0]


def _flash_fwd(q, k, v, seg_q, seg_kv, sinks, cfg):
    o, lse = flash_forward(q, k, v, seg_q, seg_kv, cfg, sinks)
    return o, (q, k, v, seg_q, seg_kv, sinks, o, lse)


def _flash_bwd(cfg, residuals, do):
    q, k, v, seg_q, seg_kv, sinks, o, lse = residuals
    dq, dk, dv = flash_backward(q, k, v, seg_q, seg_kv, o, lse, do, cfg)
    dsinks = None if sinks is None else sink_grad(sinks, lse, row_delta(o, do, cfg))
    return dq, dk, dv, None, None, dsinks


_flash.defvjp(_flash_fwd, _flash_bwd)


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def _check_args(q_BLHK, k_BSGK, v_BSGK, causal, segment_ids_q, segment_ids_kv, window, softcap=None, sinks=None):
    if q_BLHK.ndim != 4 or k_BSGK.ndim != 4 or k_BSGK.shape != v_BSGK.shape:
        raise ValueError(
            f"attention wants q (B, L, H, K) and k, v (B, S, G, K); got q {q_BLHK.shape}, "
            f"k {k_BSGK.shape}, v {v_BSGK.shape}"
        )
    (B, L, H, K), (Bk, S, G, Kk) = q_BLHK.shape, k_BSGK.shape
    if B != Bk or K != Kk or H % G:
        raise ValueError(
            f"q {q_BLHK.shape} and k/v {k_BSGK.shape} disagree: batch and head_dim must match and "
            f"the {H} query heads must be a multiple of the {G} kv heads"
        )
    if (segment_ids_q is None) != (segment_ids_kv is None):
        raise ValueError("pass both segment_ids_q and segment_ids_kv, or neither")
    if segment_ids_q is not None and (segment_ids_q.shape != (B, L) or segment_ids_kv.shape != (B, S)):
        raise ValueError(
            f"segment ids must be (B, L) = {(B, L)} and (B, S) = {(B, S)}; got "
            f"{segment_ids_q.shape} and {segment_ids_kv.shape}"
        )
    if window is not None and (not causal or window < 1):
        raise ValueError(
            f"window={window} needs causal=True and window >= 1 (key j is visible to query i iff i - window < j <= i)"
        )
    check_features(softcap, sinks, H)


def flash_attention(
    q_BLHK: jax.Array,
    k_BSGK: jax.Array,
    v_BSGK: jax.Array,
    *,
    causal: bool = True,
    scale: float | None = None,
    segment_ids_q: jax.Array | None = None,
    segment_ids_kv: jax.Array | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """softmax(cap(q k^T * scale) + mask) v without materializing the L x S scores; differentiable.

    G kv heads serve H/G query heads each (query head h uses kv head h // (H/G)).
    Mask: query i sees key j iff j <= i (causal; positions 0.., aligned at the
    start), i - window < j (window), segment_ids_q[i] == segment_ids_kv[j]
    (packed sequences). A query that sees no key outputs 0.
    scale: default 1/sqrt(K). softcap: cap(s) = softcap * tanh(s / softcap),
    applied before the mask (Gemma 2; static); None: no cap.
    sinks: (H,) float32 logits, one per query head, that join each row's softmax
    denominator but weigh no value (gpt-oss): o_i = sum_j e^(s_ij) v_j /
    (e^(sink_h) + sum_j e^(s_ij)); differentiable (traced). None: no sinks.
    block_q / block_kv: override DEFAULT_BLOCKS[backend]
    for all three kernels (rounded to what the backend accepts). Lengths need
    not be multiples of the blocks: the inputs are padded and the pad masked.
    num_warps / num_stages: Triton launch parameters of all three kernels on
    GPU (default: 4 warps for head_dim <= 64, else 8; 2 stages); ignored on
    TPU and CPU.
    backend: "gpu" | "tpu" | "cpu" (default: jax.default_backend());
    interpret: run the Pallas interpreter (default: only on CPU).

    >>> q = jnp.ones((2, 96, 8, 32)); k = v = jnp.ones((2, 96, 2, 32))
    >>> seg = jnp.repeat(jnp.array([[0, 1]]), 48, axis=1).repeat(2, axis=0)
    >>> flash_attention(q, k, v, segment_ids_q=seg, segment_ids_kv=seg, window=16).shape
    (2, 96, 8, 32)
    >>> flash_attention(q, k, v, softcap=50.0, sinks=jnp.zeros(8)).shape
    (2, 96, 8, 32)
    """
    _check_args(q_BLHK, k_BSGK, v_BSGK, causal, segment_ids_q, segment_ids_kv, window, softcap, sinks)
    cfg = plan(
        q_BLHK.shape,
        k_BSGK.shape,
        causal=causal,
        scale=scale,
        window=window,
        softcap=softcap,
        sinks=sinks is not None,
        segmented=segment_ids_q is not None,
        block_q=block_q,
        block_kv=block_kv,
        num_warps=num_warps,
        num_stages=num_stages,
        backend=backend,
        interpret=interpret,
    )
    q, k, v, seg_q, seg_kv = pad_inputs(q_BLHK, k_BSGK, v_BSGK, segment_ids_q, segment_ids_kv, cfg)
    # Padding and transposes stay outside the custom_vjp: autodiff undoes them for free.
    sinks = None if sinks is None else jnp.asarray(sinks, F32)
    o = _flash(q, k, v, seg_q, seg_kv, sinks, cfg)
    o = o.transpose(0, 2, 1, 3) if cfg.heads_major else o
    return o[:, : cfg.q_len, :, : q_BLHK.shape[3]]


def plan(
    q_shape,
    k_shape,
    *,
    causal,
    scale,
    window,
    segmented,
    block_q,
    block_kv,
    backend,
    interpret,
    num_warps=None,
    num_stages=None,
    softcap=None,
    sinks=False,
) -> FlashConfig:
    """The static configuration: backend, legal block sizes, padded head dim; sinks: whether sinks are passed."""
    backend, interpret = resolve_backend(backend, interpret)
    (_, L, H, K), (_, S, G, _) = q_shape, k_shape
    d = DEFAULT_BLOCKS[backend]
    bq_f, bq_b = (fit_block(block_q or b, L, backend) for b in (d.q, d.bwd_q))
    bk_f, bk_b = (fit_block(block_kv or b, S, backend, lanes=True) for b in (d.kv, d.bwd_kv))
    # Triton tensors need power-of-two sizes >= 16; zero columns change no score.
    Kp = max(16, pl.next_power_of_2(K)) if backend == "gpu" else K
    return FlashConfig(
        causal=causal,
        window=window,
        scale=float(K**-0.5 if scale is None else scale),
        q_len=L,
        kv_len=S,
        blocks=BlockSizes(bq_f, bk_f, bq_b, bk_b),
        rep=H // G,
        head_dim=Kp,
        backend=backend,
        interpret=interpret,
        heads_major=backend == "tpu",
        segmented=segmented,
        # Triton-only: dropped elsewhere so TPU/CPU configs (and their traces) do not vary with them.
        num_warps=num_warps if backend == "gpu" else None,
        num_stages=num_stages if backend == "gpu" else None,
        softcap=None if softcap is None else float(softcap),
        sinks=bool(sinks),
    )


def pad_inputs(q, k, v, seg_q, seg_kv, cfg):
    """Pad sequences to whole blocks and the head dim to cfg.head_dim; TPU: (B, L, H, K) -> (B, H, L, K)."""
    Lp, Sp, K = cfg.padded_q_len, cfg.padded_kv_len, q.shape[3]

    def prep(x, n):
        x = jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, cfg.head_dim - K)))
        return x.transpose(0, 2, 1, 3) if cfg.heads_major else x

    if cfg.segmented:  # the pad is masked by position anyway; any id will do
        seg_q = jnp.pad(seg_q.astype(jnp.int32), ((0, 0), (0, Lp - cfg.q_len)))
        seg_kv = jnp.pad(seg_kv.astype(jnp.int32), ((0, 0), (0, Sp - cfg.kv_len)))
    return prep(q, Lp), prep(k, Sp), prep(v, Sp), seg_q, seg_kv


def flash_attention_reference(
    q_BLHK: jax.Array,
    k_BSGK: jax.Array,
    v_BSGK: jax.Array,
    *,
    causal: bool = True,
    scale: float | None = None,
    segment_ids_q: jax.Array | None = None,
    segment_ids_kv: jax.Array | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """`flash_attention` in plain JAX, materializing the (L, S) scores in float32; same signature and mask.

    The order of Hugging Face's eager attention: scores * scale, the soft cap
    (Gemma 2), the mask, then a softmax with the sink as one more column that
    is dropped afterwards (gpt-oss).

    Block/backend arguments are accepted and ignored so the two swap freely.

    >>> q = jnp.ones((1, 8, 2, 4)); k = v = jnp.ones((1, 8, 1, 4))
    >>> flash_attention_reference(q, k, v).shape
    (1, 8, 2, 4)
    """
    del block_q, block_kv, backend, interpret
    _check_args(q_BLHK, k_BSGK, v_BSGK, causal, segment_ids_q, segment_ids_kv, window, softcap, sinks)
    (B, L, H, K), (_, S, G, _) = q_BLHK.shape, k_BSGK.shape
    scale = K**-0.5 if scale is None else scale
    q_BLGRK = q_BLHK.astype(F32).reshape(B, L, G, H // G, K)
    s_BGRLS = jnp.einsum("BLGRK,BSGK->BGRLS", q_BLGRK, k_BSGK.astype(F32), precision="highest") * scale
    s_BGRLS = soft_cap(s_BGRLS, softcap)
    i, j = jnp.arange(L)[:, None], jnp.arange(S)[None, :]
    mask_BLS = jnp.ones((1, L, S), bool)
    if causal:
        mask_BLS &= j <= i
    if window is not None:
        mask_BLS &= j > i - window
    if segment_ids_q is not None:
        mask_BLS &= segment_ids_q[:, :, None] == segment_ids_kv[:, None, :]
    sink = None if sinks is None else jnp.asarray(sinks, F32).reshape(1, G, H // G, 1, 1)
    p = masked_softmax(s_BGRLS, mask_BLS[:, None, None], sink)  # rows that see no key output 0, as in the kernel
    o_BLGRK = jnp.einsum("BGRLS,BSGK->BLGRK", p, v_BSGK.astype(F32), precision="highest")
    return o_BLGRK.reshape(B, L, H, K).astype(q_BLHK.dtype)
