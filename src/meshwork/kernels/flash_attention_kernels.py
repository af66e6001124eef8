"""Flash attention's Pallas kernel bodies (forward, dQ, dK/dV) and their grids and BlockSpecs.

A program owns one query block (forward, dQ) or one key block (dK/dV) and
loops over the other sequence inside the kernel with `lax.fori_loop`, whose
bounds skip the blocks that causality or the sliding window mask out
entirely. The forward keeps float32 running max / sum / accumulator (online
softmax) and saves the log-sum-exp; the backward recomputes the
probabilities from it, with delta = rowsum(dO * O).

Two optional score transforms. Soft-capping (Gemma 2) replaces each scaled
score s by softcap * tanh(s / softcap) before the mask; the backward
recomputes it and multiplies dS by its derivative 1 - tanh^2. Attention sinks
(gpt-oss) give each query head h one more logit sink_h that joins the softmax
denominator and weighs no value: the forward starts its running max at sink_h
and its running sum at exp(sink_h - sink_h) = 1, so the saved lse includes the
sink and the dQ/dK/dV kernels need nothing new; the sinks' own gradient,
-sum exp(sink_h - lse) * delta, is a reduction over lse and delta (`sink_grad`).
A row that sees no key then outputs acc / 1 = 0, as without sinks.

Grouped-query attention never repeats K/V: the forward and dQ programs of
query head h read kv head h // (H/G) through the BlockSpec index map, and the
dK/dV program of kv head g loops over its H/G query heads.

Layouts. GPU and CPU read q/k/v/o in the model's (B, L, H, K) layout (a
strided block, no transpose); TPU needs the two minor block dims to be
(sequence, head_dim), so there the arrays are transposed to (B, H, L, K).
The kernel refs have the same shapes either way, so the body is shared.

Limits. A program sees the whole other sequence of its head(s) as one block
and slices it in the loop. On GPU that block is only a pointer. On TPU it is
a double-buffered VMEM buffer: forward/dQ hold K and V of one head (8*S*K
bytes in bf16: 8 MiB at S=8192, K=128), dK/dV hold q and dO of a whole group
(8*(H/G)*L*K bytes: 64 MiB at H/G=8), past the default scoped VMEM limit, so
long GQA sequences need `vmem_limit_bytes` raised or shorter blocks of work.
A TPU variant that moves the inner loop onto an "arbitrary" grid axis with
scratch accumulators would lift this; it would be a second kernel body.

The entry point, its custom_vjp and the pure-JAX reference are in flash_attention.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from meshwork.kernels.pallas_backend import (
    F32,
    MASKED,
    dot,
    dot_precision,
    floor_div,
    launch,
    round_up,
    soft_cap,
)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Query / key block lengths of the forward and of the two backward kernels."""

    q: int
    kv: int
    bwd_q: int
    bwd_kv: int


# --------------------------------------------------------------------------
# Kernel bodies (shared by all backends)
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """The static configuration of one flash-attention call, shared by its three kernels."""

    causal: bool
    window: int | None
    scale: float
    q_len: int  # real (unpadded) lengths: rows/cols beyond are masked
    kv_len: int
    blocks: BlockSizes
    rep: int  # query heads per kv head, H // G
    head_dim: int  # padded head dim
    backend: str
    interpret: object  # bool or pltpu.InterpretParams (hashable)
    heads_major: bool  # arrays in (B, H, L, K) (TPU) instead of (B, L, H, K)
    segmented: bool
    poison: bool = False
    num_warps: int | None = None  # Triton launch parameters (GPU only; None: compiler_params' defaults)
    num_stages: int | None = None
    softcap: float | None = None  # Gemma 2's logit cap: s -> softcap * tanh(s / softcap), before the mask
    sinks: bool = False  # the forward takes an (H,) float32 array of per-head sink logits (gpt-oss)

    @property
    def padded_q_len(self) -> int:  # whole blocks of both the forward and the backward
        return round_up(self.q_len, math.lcm(self.blocks.q, self.blocks.bwd_q))

    @property
    def padded_kv_len(self) -> int:
        return round_up(self.kv_len, math.lcm(self.blocks.kv, self.blocks.bwd_kv))


def _visible(cfg, q_start, kv_start, bq, bk, seg_q=None, seg_kv=None):
    """(bq, bk) bool: which keys each query of this tile may attend to."""
    rows = q_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    cols = kv_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    mask = (rows < cfg.q_len) & (cols < cfg.kv_len)
    if cfg.causal:
        mask &= cols <= rows
    if cfg.window is not None:
        mask &= cols > rows - cfg.window
    if seg_q is not None:
        mask &= seg_q == seg_kv  # (bq, 1) == (1, bk)
    return mask


def kv_block_range(cfg, q_start, bq, bk):
    """Key blocks [lo, hi) that hold any key visible to queries q_start..q_start+bq-1."""
    hi = pl.cdiv(cfg.kv_len, bk)
    if cfg.causal:
        hi = jnp.minimum(hi, floor_div(q_start + bq - 1, bk) + 1)
    lo = 0
    if cfg.window is not None:
        lo = floor_div(jnp.maximum(q_start - cfg.window + 1, 0), bk)
    return lo, hi


def q_block_range(cfg, kv_start, bq, bk):
    """Query blocks [lo, hi) holding any query that sees a key in kv_start..kv_start+bk-1."""
    hi = pl.cdiv(cfg.q_len, bq)
    if cfg.window is not None:
        hi = jnp.minimum(hi, floor_div(kv_start + bk - 1 + cfg.window - 1, bq) + 1)
    lo = floor_div(kv_start, bq) if cfg.causal else 0
    return lo, hi


def _scores(cfg, q, k, prec):
    """The tile's scaled, and with cfg.softcap soft-capped, scores (float32)."""
    return soft_cap(dot(q, k, (1, 1), prec) * cfg.scale, cfg.softcap)


def _dscores(cfg, p, dp, delta, s):
    """dL/d(scaled q.k) of a tile: softmax's p * (dP - delta), through the cap's 1 - tanh^2 with a softcap."""
    ds = p * (dp - delta)
    if cfg.softcap is not None:
        t = s / cfg.softcap  # tanh of the uncapped score, recovered from the capped one
        ds = ds * (1.0 - t * t)
    return ds


def _split_refs(refs, n_in, segmented):
    ins, outs = refs[:n_in], refs[n_in:]
    if segmented:
        return ins[:-2], ins[-2], ins[-1], outs
    return ins, None, None, outs


def _fwd_kernel(*refs, cfg: FlashConfig):
    n_in = 3 + cfg.sinks + 2 * cfg.segmented
    (q_ref, k_ref, v_ref, *sink_ref), sq_ref, skv_ref, (o_ref, lse_ref) = _split_refs(refs, n_in, cfg.segmented)
    bq, bk = cfg.blocks.q, cfg.blocks.kv
    q_start = pl.program_id(2) * bq
    q = q_ref[...]
    prec = dot_precision(q.dtype)
    seg_q = sq_ref[...] if cfg.segmented else None

    def step(j, carry):
        m, l, acc = carry
        kv_start = pl.multiple_of(j * bk, bk)
        k, v = k_ref[pl.ds(kv_start, bk), :], v_ref[pl.ds(kv_start, bk), :]
        s = _scores(cfg, q, k, prec)
        mask = _visible(cfg, q_start, kv_start, bq, bk, seg_q, skv_ref[j] if cfg.segmented else None)
        s = jnp.where(mask, s, MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        # where(), not just the finite MASKED: a row with no visible key yet
        # has m_new == MASKED and would otherwise count exp(0) = 1 per key.
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
        acc = alpha * acc + dot(p.astype(v.dtype), v, (1, 0), prec)
        return m_new, l, acc

    if cfg.sinks:  # the sink is the first "key" seen: max sink_h, sum exp(sink_h - sink_h) = 1, no value
        init = (jnp.full((bq, 1), sink_ref[0][pl.program_id(1)], F32), jnp.ones((bq, 1), F32))
    else:
        init = (jnp.full((bq, 1), MASKED, F32), jnp.zeros((bq, 1), F32))
    init = (*init, jnp.zeros((bq, cfg.head_dim), F32))
    m, l, acc = lax.fori_loop(*kv_block_range(cfg, q_start, bq, bk), step, init)
    # A row that sees no key (padding, or a segment absent from the keys)
    # outputs 0; lse = +inf makes the backward's exp(s - lse) vanish for it.
    # With sinks l >= 1 for such a row: acc = 0 gives 0 and lse = sink_h.
    empty = l == 0.0
    l = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc / l).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log(l))


def _dq_kernel(*refs, cfg: FlashConfig):
    ins, sq_ref, skv_ref, (dq_ref,) = _split_refs(refs, 6 + 2 * cfg.segmented, cfg.segmented)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
    bq, bk = cfg.blocks.bwd_q, cfg.blocks.bwd_kv
    q_start = pl.program_id(2) * bq
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    prec = dot_precision(q.dtype)
    seg_q = sq_ref[...] if cfg.segmented else None

    def step(j, dq):
        kv_start = pl.multiple_of(j * bk, bk)
        k, v = k_ref[pl.ds(kv_start, bk), :], v_ref[pl.ds(kv_start, bk), :]
        mask = _visible(cfg, q_start, kv_start, bq, bk, seg_q, skv_ref[j] if cfg.segmented else None)
        s = _scores(cfg, q, k, prec)
        p = jnp.where(mask, jnp.exp(s - lse), 0.0)
        ds = _dscores(cfg, p, dot(do, v, (1, 1), prec), delta, s)
        return dq + dot(ds.astype(k.dtype), k, (1, 0), prec)

    dq = lax.fori_loop(*kv_block_range(cfg, q_start, bq, bk), step, jnp.zeros((bq, cfg.head_dim), F32))
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkdv_kernel(*refs, cfg: FlashConfig):
    ins, sq_ref, skv_ref, (dk_ref, dv_ref) = _split_refs(refs, 6 + 2 * cfg.segmented, cfg.segmented)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
    bq, bk = cfg.blocks.bwd_q, cfg.blocks.bwd_kv
    kv_start = pl.program_id(2) * bk
    k, v = k_ref[...], v_ref[...]
    prec = dot_precision(k.dtype)
    seg_kv = skv_ref[...] if cfg.segmented else None

    def rows(ref, r, start):  # query rows of head r of this group, in either layout
        return ref[r, pl.ds(start, bq), :] if cfg.heads_major else ref[pl.ds(start, bq), r, :]

    def head(r, carry):
        def step(i, carry):
            dk, dv = carry
            q_start = pl.multiple_of(i * bq, bq)
            q, do = rows(q_ref, r, q_start), rows(do_ref, r, q_start)
            lse, delta = lse_ref[r, pl.ds(q_start, bq), :], delta_ref[r, pl.ds(q_start, bq), :]
            seg_q = sq_ref[pl.ds(q_start, bq), :] if cfg.segmented else None
            mask = _visible(cfg, q_start, kv_start, bq, bk, seg_q, seg_kv)
            s = _scores(cfg, q, k, prec)
            p = jnp.where(mask, jnp.exp(s - lse), 0.0)
            dv = dv + dot(p.astype(do.dtype), do, (0, 0), prec)
            ds = _dscores(cfg, p, dot(do, v, (1, 1), prec), delta, s)
            dk = dk + dot(ds.astype(q.dtype), q, (0, 0), prec)
            return dk, dv

        return lax.fori_loop(*q_block_range(cfg, kv_start, bq, bk), step, carry)

    zeros = jnp.zeros((bk, cfg.head_dim), F32)
    dk, dv = lax.fori_loop(0, cfg.rep, head, (zeros, zeros))
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# --------------------------------------------------------------------------
# pallas_call wiring: grids and BlockSpecs per layout
# --------------------------------------------------------------------------


def _seq_spec(cfg, block, index):
    """BlockSpec of `block` rows of one head of a q/k/v/o-shaped array; index(b, h, i) -> (head, row block)."""

    def index_map(b, h, i):
        head, blk = index(b, h, i)
        return (b, head, blk, 0) if cfg.heads_major else (b, blk, head, 0)

    shape = (None, None, block, cfg.head_dim) if cfg.heads_major else (None, block, None, cfg.head_dim)
    return pl.BlockSpec(shape, index_map)


def _group_spec(cfg, seq):
    """All rep query heads of kv head g, whole sequence: (rep, L, K) or (L, rep, K)."""
    if cfg.heads_major:
        return pl.BlockSpec((None, cfg.rep, seq, cfg.head_dim), lambda b, g, j: (b, g, 0, 0))
    return pl.BlockSpec((None, seq, cfg.rep, cfg.head_dim), lambda b, g, j: (b, 0, g, 0))


def _seg_args(cfg, seg_q, seg_kv, bq, bk, per_kv_block):
    """Segment ids as a (bq, 1) query column and (1, bk) key rows, the shapes the mask compares."""
    if not cfg.segmented:
        return (), ()
    B, L = seg_q.shape
    S = seg_kv.shape[1]
    col, rows = seg_q[:, :, None], seg_kv.reshape(B, S // bk, 1, bk)
    if per_kv_block:  # dK/dV: whole query column, this key block's row
        specs = [
            pl.BlockSpec((None, L, 1), lambda b, g, j: (b, 0, 0)),
            pl.BlockSpec((None, None, 1, bk), lambda b, g, j: (b, j, 0, 0)),
        ]
    else:  # forward / dQ: this query block's column, every key row
        specs = [
            pl.BlockSpec((None, bq, 1), lambda b, h, i: (b, i, 0)),
            pl.BlockSpec((None, S // bk, 1, bk), lambda b, h, i: (b, 0, 0, 0)),
        ]
    return (col, rows), specs


def _sink_spec(cfg, H):
    """The (H,) sink logits, whole: each program reads its head's scalar (TPU: from SMEM)."""
    if cfg.heads_major:
        return pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.BlockSpec((H,), lambda b, h, i: (0,))


def flash_forward(q, k, v, seg_q, seg_kv, cfg, sinks=None):
    """(o, lse) of padded (and, on TPU, heads-major) inputs; lse is (B, H, L, 1) float32.

    sinks: (H,) float32 sink logits, given iff cfg.sinks; lse then includes them.
    """
    B, H = q.shape[0], q.shape[1 if cfg.heads_major else 2]
    L, S = q.shape[2 if cfg.heads_major else 1], k.shape[2 if cfg.heads_major else 1]
    bq = cfg.blocks.q
    rep = cfg.rep
    seg_args, seg_specs = _seg_args(cfg, seg_q, seg_kv, bq, cfg.blocks.kv, per_kv_block=False)
    return launch(
        functools.partial(_fwd_kernel, cfg=cfg),
        cfg,
        grid=(B, H, L // bq),
        name="flash_attention_fwd",
        in_specs=[
            _seq_spec(cfg, bq, lambda b, h, i: (h, i)),
            _seq_spec(cfg, S, lambda b, h, i: (floor_div(h, rep), 0)),
            _seq_spec(cfg, S, lambda b, h, i: (floor_div(h, rep), 0)),
            *([_sink_spec(cfg, H)] if cfg.sinks else []),
            *seg_specs,
        ],
        out_specs=[
            _seq_spec(cfg, bq, lambda b, h, i: (h, i)),
            pl.BlockSpec((None, None, bq, 1), lambda b, h, i: (b, h, i, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, L, 1), F32)],
        args=(q, k, v, *((sinks.astype(F32),) if cfg.sinks else ()), *seg_args),
    )


def row_delta(o, do, cfg):
    """delta = rowsum(dO * O) in float32, (B, H, L, 1) like lse."""
    delta = jnp.sum(o.astype(F32) * do.astype(F32), axis=-1)
    return (delta if cfg.heads_major else delta.transpose(0, 2, 1))[..., None]


def sink_grad(sinks, lse, delta):
    """d sink_h = -sum over batch and queries of exp(sink_h - lse) * delta.

    The sink is one more softmax column whose value is 0: its dP is 0, so its
    dS = p_sink * (0 - delta). lse, delta: (B, H, L, 1) float32 (padded rows
    have delta = 0); sinks: (H,).
    """
    return -jnp.sum(jnp.exp(sinks.astype(F32)[None, :, None, None] - lse) * delta, axis=(0, 2, 3))


def flash_backward(q, k, v, seg_q, seg_kv, o, lse, do, cfg):
    """(dq, dk, dv) from the forward's inputs, o and lse, and the cotangent do, in the same layout."""
    B, H = q.shape[0], q.shape[1 if cfg.heads_major else 2]
    L, S = q.shape[2 if cfg.heads_major else 1], k.shape[2 if cfg.heads_major else 1]
    G, rep = H // cfg.rep, cfg.rep
    bq, bk = cfg.blocks.bwd_q, cfg.blocks.bwd_kv
    delta = row_delta(o, do, cfg)

    seg_args, seg_specs = _seg_args(cfg, seg_q, seg_kv, bq, bk, per_kv_block=False)
    row_stat = pl.BlockSpec((None, None, bq, 1), lambda b, h, i: (b, h, i, 0))
    (dq,) = launch(
        functools.partial(_dq_kernel, cfg=cfg),
        cfg,
        grid=(B, H, L // bq),
        name="flash_attention_dq",
        in_specs=[
            _seq_spec(cfg, bq, lambda b, h, i: (h, i)),
            _seq_spec(cfg, S, lambda b, h, i: (floor_div(h, rep), 0)),
            _seq_spec(cfg, S, lambda b, h, i: (floor_div(h, rep), 0)),
            _seq_spec(cfg, bq, lambda b, h, i: (h, i)),
            row_stat,
            row_stat,
            *seg_specs,
        ],
        out_specs=[_seq_spec(cfg, bq, lambda b, h, i: (h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)],
        args=(q, k, v, do, lse, delta, *seg_args),
    )

    seg_args, seg_specs = _seg_args(cfg, seg_q, seg_kv, bq, bk, per_kv_block=True)
    group_stat = pl.BlockSpec((None, rep, L, 1), lambda b, g, j: (b, g, 0, 0))
    kv_block = _seq_spec(cfg, bk, lambda b, g, j: (g, j))
    dk, dv = launch(
        functools.partial(_dkdv_kernel, cfg=cfg),
        cfg,
        grid=(B, G, S // bk),
        name="flash_attention_dkdv",
        in_specs=[_group_spec(cfg, L), kv_block, kv_block, _group_spec(cfg, L), group_stat, group_stat, *seg_specs],
        out_specs=[kv_block, kv_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        args=(q, k, v, do, lse, delta, *seg_args),
    )
    return dq, dk, dv
