"""Flash-decoding: one new query token per sequence against a KV cache, split along the sequence.

With one query row, a program per (batch, head) would leave most of a GPU/TPU
idle while it streams a long cache. So the cache is cut into chunks and one
Pallas program per (batch, kv head, chunk) computes the chunk's partial
softmax for all H/G query heads of that kv head: its normalized output and
log-sum-exp. The chunks are then merged exactly in plain JAX:
o = sum_c exp(lse_c - lse) o_c with lse = logsumexp_c lse_c.

Keys at positions >= lengths_B[b] are ignored; inside a chunk the loop stops
at the length, so a chunk past it does no work. With a sliding window (Mistral)
keys before lengths_B[b] - window are ignored too, and the loop also starts at
the window's first block, so a chunk wholly before it does no work either.
Soft-capping (Gemma 2) caps each chunk's scores in the kernel. Attention
sinks (gpt-oss) enter at the merge, as one more "chunk" with lse = sink_h and
output 0, which is exact: the sink joins the denominator and weighs no value.
Inference only: no gradient.

The kernel body is shared by all backends (see pallas_backend.py). GPU/CPU
read the cache in its (B, S, G, K) layout; TPU reads (B, G, S, K), so there
the cache is transposed here -- an inference engine on TPU should keep its
cache in that layout and skip the copy. Likewise S should be a multiple of
`chunk` (else the cache is padded, also a copy).

    >>> q = jnp.ones((2, 8, 32)); k = v = jnp.ones((2, 256, 2, 32))
    >>> decode_attention(q, k, v, jnp.array([100, 256])).shape
    (2, 8, 32)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from meshwork.kernels.pallas_backend import (
    F32,
    MASKED,
    check_features,
    dot,
    dot_precision,
    fit_block,
    floor_div,
    launch,
    masked_softmax,
    resolve_backend,
    round_up,
    soft_cap,
)


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
    """chunk: keys per program (the split); kv: keys per inner-loop step."""

    chunk: int
    kv: int


# Untuned starting points. GPU: 512-key chunks give B*G*S/512 programs (enough
# to fill an H200 from a few sequences at 8K+); TPU: lane-aligned, large steps.
DEFAULT_DECODE_BLOCKS = {
    "gpu": DecodeBlocks(chunk=512, kv=64),
    "tpu": DecodeBlocks(chunk=1024, kv=512),
    "cpu": DecodeBlocks(chunk=256, kv=128),
}


@dataclasses.dataclass(frozen=True)
class _Config:
    scale: float
    chunk: int
    kv: int
    rows: int  # query rows per program: H/G, padded to 16 for Triton's tl.dot
    head_dim: int
    backend: str
    interpret: bool
    heads_major: bool
    poison: bool = False
    window: int | None = None  # keys at lengths_B[b] - window .. lengths_B[b] - 1 only
    softcap: float | None = None  # Gemma 2: scores -> softcap * tanh(scores / softcap), before the mask


def online_softmax_step(m, l, acc, scores, mask, v, prec):
    """One block of keys folded into a running softmax (flash attention's update): the row maxima
    m, denominators l and unnormalized outputs acc after `scores` (rows, keys), masked where `mask`
    is False, and the block's values v (keys, head_dim). Shared by the decode and paged kernels."""
    scores = jnp.where(mask, scores, MASKED)
    m_new = jnp.maximum(m, jnp.max(scores, axis=1, keepdims=True))
    p = jnp.where(mask, jnp.exp(scores - m_new), 0.0)
    alpha = jnp.exp(m - m_new)
    return m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True), alpha * acc + dot(p.astype(v.dtype), v, (1, 0), prec)


def _decode_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, cfg: _Config):
    length = len_ref[pl.program_id(0)]
    chunk_start = pl.program_id(2) * cfg.chunk
    q = q_ref[...]
    prec = dot_precision(q.dtype)
    n_valid = jnp.clip(length - chunk_start, 0, cfg.chunk)
    # The new token at position length - 1 sees keys j > length - 1 - window: this chunk's first is `first`.
    first = jnp.clip(length - cfg.window - chunk_start, 0, cfg.chunk) if cfg.window else 0

    def step(j, carry):
        m, l, acc = carry
        start = pl.multiple_of(j * cfg.kv, cfg.kv)
        k, v = k_ref[pl.ds(start, cfg.kv), :], v_ref[pl.ds(start, cfg.kv), :]
        s = soft_cap(dot(q, k, (1, 1), prec) * cfg.scale, cfg.softcap)
        key = start + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        mask = (key < n_valid) & (key >= first) if cfg.window else key < n_valid
        return online_softmax_step(m, l, acc, s, mask, v, prec)

    rows = cfg.rows
    init = (jnp.full((rows, 1), MASKED, F32), jnp.zeros((rows, 1), F32), jnp.zeros((rows, cfg.head_dim), F32))
    lo = floor_div(first, cfg.kv) if cfg.window else 0
    m, l, acc = lax.fori_loop(lo, floor_div(n_valid + cfg.kv - 1, cfg.kv), step, init)
    empty = l == 0.0  # chunk wholly past the length (or before the window): weight exp(-inf) = 0 in the merge
    l = jnp.where(empty, 1.0, l)
    o_ref[...] = acc / l
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log(l))


def decode_attention(
    q_BHK: jax.Array,
    k_BSGK: jax.Array,
    v_BSGK: jax.Array,
    lengths_B: jax.Array,
    *,
    scale: float | None = None,
    chunk: int | None = None,
    block_kv: int | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Attention of one query per sequence over the first lengths_B[b] cached keys (flash-decoding).

    q_BHK: the new token's queries; k_BSGK, v_BSGK: the cache, G kv heads each
    serving H/G query heads. A sequence of length 0 gets zeros. scale: default
    1/sqrt(K). chunk / block_kv: keys per program / per inner step (default
    DEFAULT_DECODE_BLOCKS[backend]). backend, interpret: as in `flash_attention`.
    window: the query (at position lengths_B[b] - 1) sees only the last `window`
    keys, lengths_B[b] - window .. lengths_B[b] - 1 (Mistral's sliding window).
    softcap, sinks: Gemma 2's logit cap and gpt-oss's (H,) per-head sink logits,
    as in `flash_attention` (a sequence of length 0 still gets zeros).

    >>> q = jnp.ones((1, 4, 16)); k = v = jnp.ones((1, 64, 1, 16))
    >>> decode_attention(q, k, v, jnp.array([10]), chunk=32).shape
    (1, 4, 16)
    >>> decode_attention(q, k, v, jnp.array([10]), softcap=30.0, sinks=jnp.zeros(4)).shape
    (1, 4, 16)
    """
    (B, H, K), (Bk, S, G, Kk) = q_BHK.shape, k_BSGK.shape
    if B != Bk or K != Kk or H % G or v_BSGK.shape != k_BSGK.shape or lengths_B.shape != (B,):
        raise ValueError(
            f"decode_attention wants q (B, H, K), k and v (B, S, G, K) with H a multiple of G, and "
            f"lengths (B,); got q {q_BHK.shape}, k {k_BSGK.shape}, v {v_BSGK.shape}, "
            f"lengths {lengths_B.shape}"
        )
    if window is not None and window < 1:
        raise ValueError(f"decode_attention window={window}: a window must see at least the new key (>= 1)")
    check_features(softcap, sinks, H)
    backend, interpret = resolve_backend(backend, interpret)
    d = DEFAULT_DECODE_BLOCKS[backend]
    kv = fit_block(block_kv or d.kv, S, backend, lanes=True)
    chunk = round_up(min(chunk or d.chunk, round_up(S, kv)), kv)
    if backend == "gpu" and chunk & (chunk - 1):
        chunk = pl.next_power_of_2(chunk)  # Triton: the chunk is a tensor dim of the BlockSpec
    R = H // G
    rows = max(R, 16) if backend == "gpu" else R  # tl.dot needs M >= 16
    Kp = max(16, pl.next_power_of_2(K)) if backend == "gpu" else K
    cfg = _Config(
        scale=float(K**-0.5 if scale is None else scale),
        chunk=chunk,
        kv=kv,
        rows=rows,
        head_dim=Kp,
        backend=backend,
        interpret=interpret,
        heads_major=backend == "tpu",
        window=window,
        softcap=None if softcap is None else float(softcap),
    )
    sink = None
    if sinks is not None:  # (1, G, 1, rows, 1): the sink of each program row, query head g * R + r
        sink = jnp.pad(jnp.asarray(sinks, F32).reshape(G, R), ((0, 0), (0, rows - R)))[None, :, None, :, None]
    o_BGRK = merge_chunks(*_decode_chunks(q_BHK, k_BSGK, v_BSGK, lengths_B, cfg), axis=2, sink=sink)
    return o_BGRK[:, :, :R, :K].reshape(B, H, K).astype(q_BHK.dtype)


def _decode_chunks(q_BHK, k_BSGK, v_BSGK, lengths_B, cfg):
    """Pad and run the chunk kernel: per-chunk o (B, G, C, rows, head_dim) and lse (B, G, C, rows, 1), float32."""
    (B, H, K), (_, S, G, _) = q_BHK.shape, k_BSGK.shape
    Sp = round_up(S, cfg.chunk)
    C = Sp // cfg.chunk
    q = q_BHK.reshape(B, G, H // G, K)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, cfg.rows - H // G), (0, cfg.head_dim - K)))
    pad = ((0, 0), (0, Sp - S), (0, 0), (0, cfg.head_dim - K))
    k, v = jnp.pad(k_BSGK, pad), jnp.pad(v_BSGK, pad)
    if cfg.heads_major:
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        kv_spec = pl.BlockSpec((None, None, cfg.chunk, cfg.head_dim), lambda b, g, c: (b, g, c, 0))
        # Mosaic reads scalars from SMEM; the whole (B,) vector is tiny.
        len_spec = pl.BlockSpec(memory_space=pltpu.SMEM)
    else:
        kv_spec = pl.BlockSpec((None, cfg.chunk, None, cfg.head_dim), lambda b, g, c: (b, c, g, 0))
        len_spec = pl.BlockSpec((B,), lambda b, g, c: (0,))
    out_spec = lambda n: pl.BlockSpec((None, None, None, cfg.rows, n), lambda b, g, c: (b, g, c, 0, 0))  # noqa: E731
    return launch(
        functools.partial(_decode_kernel, cfg=cfg),
        cfg,
        grid=(B, G, C),
        name="decode_attention",
        in_specs=[
            len_spec,
            pl.BlockSpec((None, None, cfg.rows, cfg.head_dim), lambda b, g, c: (b, g, 0, 0)),
            kv_spec,
            kv_spec,
        ],
        out_specs=[out_spec(cfg.head_dim), out_spec(1)],
        out_shape=[
            jax.ShapeDtypeStruct((B, G, C, cfg.rows, cfg.head_dim), F32),
            jax.ShapeDtypeStruct((B, G, C, cfg.rows, 1), F32),
        ],
        # Clamped: a length past the cache must not count the padding.
        args=(jnp.minimum(lengths_B.astype(jnp.int32), S), q, k, v),
    )


def merge_chunks(o, lse, axis, sink=None):
    """Exact merge of per-chunk softmax results along `axis`.

    o_c is chunk c's own normalized output and lse_c the log of its softmax
    denominator; the merged output weights o_c by exp(lse_c - logsumexp(lse)).
    Empty chunks have lse = -inf (weight 0); all empty gives 0, not NaN.
    sink: attention-sink logits, shaped like lse with `axis` of size 1, merged
    as one more chunk whose output is 0 (it adds exp(sink) to the denominator).

    >>> merge_chunks(jnp.array([[1.0], [3.0]]), jnp.array([[0.0], [0.0]]), axis=0)
    Array([2.], dtype=float32)
    >>> merge_chunks(jnp.array([[1.0], [3.0]]), jnp.array([[0.0], [0.0]]), axis=0, sink=jnp.zeros((1, 1)))
    Array([1.3333334], dtype=float32)
    """
    m = jnp.max(lse, axis=axis, keepdims=True)
    if sink is not None:
        m = jnp.maximum(m, sink)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m)
    total = jnp.sum(w, axis=axis, keepdims=True)
    if sink is not None:
        total = total + jnp.exp(sink - m)
    return jnp.sum(w * o, axis=axis) / jnp.squeeze(jnp.where(total == 0.0, 1.0, total), axis)


def decode_attention_reference(
    q_BHK: jax.Array,
    k_BSGK: jax.Array,
    v_BSGK: jax.Array,
    lengths_B: jax.Array,
    *,
    scale: float | None = None,
    chunk: int | None = None,
    block_kv: int | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """`decode_attention` in plain JAX (float32 scores over the whole cache, capped, masked by length and window).

    >>> q = jnp.ones((1, 4, 16)); k = v = jnp.ones((1, 64, 1, 16))
    >>> decode_attention_reference(q, k, v, jnp.array([10])).shape
    (1, 4, 16)
    """
    del chunk, block_kv, backend, interpret
    (B, H, K), (_, S, G, _) = q_BHK.shape, k_BSGK.shape
    check_features(softcap, sinks, H)
    scale = K**-0.5 if scale is None else scale
    q_BGRK = q_BHK.astype(F32).reshape(B, G, H // G, K)
    s_BGRS = jnp.einsum("BGRK,BSGK->BGRS", q_BGRK, k_BSGK.astype(F32), precision="highest") * scale
    s_BGRS = soft_cap(s_BGRS, softcap)
    key_S, len_B1 = jnp.arange(S)[None, :], lengths_B[:, None]
    visible = (key_S < len_B1) & (key_S >= len_B1 - window) if window is not None else key_S < len_B1
    sink = None if sinks is None else jnp.asarray(sinks, F32).reshape(1, G, H // G, 1)
    p = masked_softmax(s_BGRS, visible[:, None, None, :], sink)
    o_BGRK = jnp.einsum("BGRS,BSGK->BGRK", p, v_BSGK.astype(F32), precision="highest")
    return o_BGRK.reshape(B, H, K).astype(q_BHK.dtype)
