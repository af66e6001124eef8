"""Context parallelism: ring attention over a `sequence` mesh axis.

The sequence is split over mesh axis `sequence` (size n). Every device keeps
its query block; key/value blocks travel round the ring with `ppermute`, one
hop per step, for n steps (their positions and segment ids are all-gathered
once, and each hop slices the visiting block's). Each step folds one
K/V block into running softmax statistics (max, sum, float32 accumulator), so
no device ever holds more than two K/V blocks or a score matrix wider than a
block. The backward pass is a second ring: K/V travel again together with
their gradient accumulators dK/dV, which arrive home after n hops.

Causality is decided by explicit positions (key j is visible to query i iff
pos_k[j] <= pos_q[i]), so any token layout works; a sliding window masks by
positions too, and packed documents' segment ids travel with the blocks. Logit
soft-capping (softcap * tanh(s / softcap), before the mask) and per-head sinks
(one more logit in each softmax's denominator, folded in after the last hop)
are part of the block math, forward and backward. The layout matters for
speed only: with contiguous blocks the last device does n times the work of
the first; `zigzag_permutation` gives every device one early and one late
chunk so that each does the same work.

    >>> from meshwork.sharding.mesh import make_mesh
    >>> mesh = make_mesh({"sequence": 4, "data": -1})
    >>> B, L, H, G, K = 2, 32, 4, 2, 8
    >>> q = jnp.ones((B, L, H, K)); k = v = jnp.ones((B, L, G, K))
    >>> pos = jnp.broadcast_to(jnp.arange(L), (B, L))
    >>> with jax.set_mesh(mesh):
    ...     out = jax.jit(ring_attention)(q, k, v, pos)
    >>> out.shape
    (2, 32, 4, 8)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from meshwork.sharding.shard_map_util import vary_like

F32 = jnp.float32


# --------------------------------------------------------------------------
# Token layouts
# --------------------------------------------------------------------------


def zigzag_permutation(seq_len: int, n_shards: int) -> np.ndarray:
    """Token order that balances causal attention work over `n_shards` devices.

    The sequence is cut into 2n equal chunks; device i gets chunks i and
    2n-1-i, so an early (cheap) chunk is paired with a late (expensive) one.
    Apply it to tokens, targets and positions alike (`x[:, perm]`) before the
    sequence is sharded; undo it with `zigzag_inverse`.

    >>> zigzag_permutation(8, 2)
    array([0, 1, 6, 7, 2, 3, 4, 5])
    """
    if n_shards < 1 or seq_len % (2 * n_shards):
        raise ValueError(
            f"zigzag_permutation: seq_len={seq_len} must be a multiple of 2 * n_shards "
            f"= {2 * n_shards}; pad the sequence or choose another sequence-axis size"
        )
    chunks = np.arange(seq_len).reshape(2 * n_shards, -1)
    order = [c for i in range(n_shards) for c in (i, 2 * n_shards - 1 - i)]
    return chunks[order].reshape(-1)


def zigzag_inverse(seq_len: int, n_shards: int) -> np.ndarray:
    """Inverse of `zigzag_permutation`: `x_zigzag[:, inv]` is back in token order.

    >>> perm, inv = zigzag_permutation(8, 2), zigzag_inverse(8, 2)
    >>> bool((perm[inv] == np.arange(8)).all())
    True
    """
    return np.argsort(zigzag_permutation(seq_len, n_shards))


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------


def _visible(
    q_pos: jax.Array,
    kv_pos: jax.Array,
    q_seg: jax.Array | None = None,
    kv_seg: jax.Array | None = None,
    *,
    causal: bool = True,
    window: int | None = None,
) -> jax.Array | None:
    """(B, Lq), (B, Lk) -> (B, 1, 1, Lq, Lk) bool, broadcastable to scores_BGRLS: key j is visible to
    query i iff pos_k[j] <= pos_q[i] (causal), pos_q[i] - pos_k[j] < window, and both are in one
    segment (document). None when nothing is masked."""
    qp, kp = q_pos[:, :, None], kv_pos[:, None, :]
    mask = None
    if causal:
        mask = kp <= qp
        if window is not None:
            mask &= qp - kp < window
    if q_seg is not None:
        same = q_seg[:, :, None] == kv_seg[:, None, :]
        mask = same if mask is None else mask & same
    return None if mask is None else mask[:, None, None]


def _cap(s: jax.Array, softcap: float | None) -> jax.Array:
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    kv_pos: jax.Array,
    *,
    causal: bool = True,
    scale: float | None = None,
    q_seg: jax.Array | None = None,
    kv_seg: jax.Array | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Full softmax attention with a position mask; the oracle for `ring_attention_shard`.

    q: (B, Lq, H, K); k, v: (B, Lk, G, K) with H a multiple of G; q_pos: (B, Lq)
    and kv_pos: (B, Lk) integer positions. Key j is visible to query i iff
    kv_pos[j] <= q_pos[i] (when causal), within `window` and in the same segment
    (q_seg, kv_seg: (B, Lq), (B, Lk) document ids, or None). Scores are soft-capped
    (softcap * tanh(s / softcap)) before the mask; `sinks` (H,) join each head's
    softmax denominator. A query that sees no key (and no sink) returns 0.

    >>> q = jnp.ones((1, 3, 2, 4)); k = v = jnp.arange(12.).reshape(1, 3, 1, 4)
    >>> pos = jnp.arange(3)[None]
    >>> attention_reference(q, k, v, pos, pos)[0, 0, 0]   # the first query sees only key 0
    Array([0., 1., 2., 3.], dtype=float32)
    """
    B, Lq, H, K = q.shape
    G = k.shape[2]
    scale = K**-0.5 if scale is None else scale
    q_BGRLK = q.reshape(B, Lq, G, H // G, K).transpose(0, 2, 3, 1, 4)
    s = _cap(jnp.einsum("bgrlk,bsgk->bgrls", q_BGRLK, k, preferred_element_type=F32) * scale, softcap)
    mask = _visible(q_pos, kv_pos, q_seg, kv_seg, causal=causal, window=window)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(F32).reshape(1, G, H // G, 1, 1), (*s.shape[:-1], 1))
        s = jnp.concatenate([s, sink], axis=-1)
    m = jax.lax.stop_gradient(s.max(-1, keepdims=True))
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = p.sum(-1, keepdims=True)
    p = (p / jnp.where(l == 0, 1.0, l))[..., : k.shape[1]]
    o = jnp.einsum("bgrls,bsgk->bgrlk", p, v.astype(F32))
    return o.transpose(0, 3, 1, 2, 4).reshape(B, Lq, H, K).astype(q.dtype)


# --------------------------------------------------------------------------
# Per-device ring (runs inside shard_map)
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Spec:
    """The ring's static settings (a hashable custom_vjp argument)."""

    axis_name: str
    scale: float
    causal: bool
    window: int | None
    softcap: float | None
    sub_blocks: int


def _split(x: jax.Array | None, n: int, axis: int) -> tuple:
    if x is None:
        return (None,) * n
    return tuple(jnp.split(x, n, axis=axis)) if n > 1 else (x,)


def _skippable(spec: _Spec, q_pos: jax.Array, kv_pos: jax.Array) -> jax.Array | None:
    # A (query, key) block whose earliest key comes after the latest query (or whose latest key
    # is out of the window of the earliest query) is all masked for every batch row: skipping it
    # saves its two matmuls and the exp (forward), four matmuls (backward). With contiguous blocks
    # that is the upper triangle of the block grid; with the zigzag layout and two sub-blocks per
    # side, half of every off-diagonal step, which is what makes the zigzag layout faster rather
    # than only balanced. Segments are not looked at: a block they mask is computed and masked.
    if not spec.causal:
        return None
    skip = kv_pos.min() > q_pos.max()
    if spec.window is not None:
        skip |= q_pos.min() - kv_pos.max() >= spec.window
    return skip


def _maybe(skip, update, state):
    return update(state) if skip is None else jax.lax.cond(skip, lambda s: s, update, state)


def _fwd_block(state, q, q_pos, q_seg, k, v, kv_pos, kv_seg, *, spec):
    """Folds one K/V sub-block into (max, sum, acc) of one query sub-block (online softmax)."""
    m, l, acc = state
    s = _cap(jnp.einsum("bgrlk,bgsk->bgrls", q, k, preferred_element_type=F32) * spec.scale, spec.softcap)
    mask = _visible(q_pos, kv_pos, q_seg, kv_seg, causal=spec.causal, window=spec.window)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(-1))
    # A row with no visible key yet has max -inf; shifting by 0 then keeps
    # exp() at exactly 0 instead of NaN (-inf - -inf).
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    corr = jnp.exp(m - m_safe)
    l = l * corr + p.sum(-1)
    acc = acc * corr[..., None] + jnp.einsum("bgrls,bgsk->bgrlk", p.astype(v.dtype), v, preferred_element_type=F32)
    return m_new, l, acc


def _bwd_block(grads, q, q_pos, q_seg, do, lse, delta, k, v, kv_pos, kv_seg, *, spec):
    """Adds one (query sub-block, K/V sub-block) pair's share to dq, dk, dv."""
    dq, dk, dv = grads
    s = _cap(jnp.einsum("bgrlk,bgsk->bgrls", q, k, preferred_element_type=F32) * spec.scale, spec.softcap)
    p = jnp.exp(s - lse[..., None])
    mask = _visible(q_pos, kv_pos, q_seg, kv_seg, causal=spec.causal, window=spec.window)
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    dv = dv + jnp.einsum("bgrls,bgrlk->bgsk", p.astype(do.dtype), do, preferred_element_type=F32)
    dp = jnp.einsum("bgrlk,bgsk->bgrls", do, v, preferred_element_type=F32)
    ds = p * (dp - delta[..., None])
    if spec.softcap is not None:  # d/dx c tanh(x / c) = 1 - tanh^2 = 1 - (capped / c)^2
        ds = ds * (1.0 - jnp.square(s / spec.softcap))
    ds = (ds * spec.scale).astype(q.dtype)
    dq = dq + jnp.einsum("bgrls,bgsk->bgrlk", ds, k, preferred_element_type=F32)
    dk = dk + jnp.einsum("bgrls,bgrlk->bgsk", ds, q, preferred_element_type=F32)
    return dq, dk, dv


def _to_internal(q, k, v, G):
    # Query heads are grouped under their shared K/V head, (B, L, H, K) ->
    # (B, G, R, L, K), so each K/V block is used by R = H/G query heads without
    # being repeated in memory; (B, G) are the matmul batch dimensions.
    B, L, H, K = q.shape
    q = q.reshape(B, L, G, H // G, K).transpose(0, 2, 3, 1, 4)
    return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def _sinks_GR(sinks: jax.Array, G: int) -> jax.Array:
    """(H,) -> (1, G, R, 1), broadcastable to the (B, G, R, L) statistics."""
    return sinks.astype(F32).reshape(1, G, -1, 1)


def _ring_perm(n: int) -> list[tuple[int, int]]:
    # Device d sends to d+1, so at step t it holds the block that started on d-t.
    return [(i, (i + 1) % n) for i in range(n)]


def _block_meta(kv_pos_all, kv_seg_all, t, Lk: int, spec: _Spec):
    """The positions and segment ids of the block this device holds at hop t (the block that
    started on device d - t), sliced from the row's gathered ones and cut into sub-blocks."""
    n = jax.lax.axis_size(spec.axis_name)
    start = ((jax.lax.axis_index(spec.axis_name) - t) % n) * Lk
    cut = lambda x: _split(None if x is None else jax.lax.dynamic_slice_in_dim(x, start, Lk, 1), spec.sub_blocks, 1)  # noqa: E731
    return cut(kv_pos_all), cut(kv_seg_all)


def _ring_forward(q, k, v, q_pos, kv_pos_all, q_seg, kv_seg_all, sinks, spec: _Spec):
    B, Lq, H, K = q.shape
    Lk, G = k.shape[1], k.shape[2]
    n, sb = jax.lax.axis_size(spec.axis_name), spec.sub_blocks
    perm = _ring_perm(n)
    q, k, v = _to_internal(q, k, v, G)
    qs, qps, qss = _split(q, sb, 3), _split(q_pos, sb, 1), _split(q_seg, sb, 1)
    kv = (_split(k, sb, 2), _split(v, sb, 2))

    stats = tuple(
        (jnp.full(qa.shape[:-1], -jnp.inf, F32), jnp.zeros(qa.shape[:-1], F32), jnp.zeros(qa.shape, F32)) for qa in qs
    )
    stats = vary_like(stats, q, k, v, q_pos, kv_pos_all)

    def fold(stats, kv, t):
        kps, kss = _block_meta(kv_pos_all, kv_seg_all, t, Lk, spec)
        out = []
        for qa, qpa, qsa, st in zip(qs, qps, qss, stats):
            for kb, vb, kpb, ksb in zip(*kv, kps, kss):
                update = functools.partial(
                    _fwd_block, q=qa, q_pos=qpa, q_seg=qsa, k=kb, v=vb, kv_pos=kpb, kv_seg=ksb, spec=spec
                )
                st = _maybe(_skippable(spec, qpa, kpb), update, st)
            out.append(st)
        return tuple(out)

    def step(t, carry):
        stats, kv = carry
        # The next block is requested before this one is used: the two are
        # independent, so the collective-permute overlaps the compute.
        nxt = jax.lax.ppermute(kv, spec.axis_name, perm)
        return fold(stats, kv, t), nxt

    # n-1 hops suffice; the last block is folded after the loop.
    stats, kv = jax.lax.fori_loop(0, n - 1, step, (stats, kv))
    stats = fold(stats, kv, n - 1)

    m, l, acc = (jnp.concatenate(x, axis=3) for x in zip(*stats))
    if sinks is not None:
        # The sink is one more logit in each row's softmax, weighing no value.
        sink = _sinks_GR(sinks, G)
        m_new = jnp.maximum(m, sink)
        corr = jnp.exp(m - m_new)
        l, acc, m = l * corr + jnp.exp(sink - m_new), acc * corr[..., None], m_new
    out = acc / jnp.where(l == 0, 1.0, l)[..., None]
    # log-sum-exp per query; +inf for a query that saw no key, so the
    # backward's exp(s - lse) is 0 there rather than NaN.
    lse = jnp.where(l == 0, jnp.inf, m + jnp.log(jnp.where(l == 0, 1.0, l)))
    out = out.transpose(0, 3, 1, 2, 4).reshape(B, Lq, H, K).astype(q.dtype)
    return out, lse


def _ring_backward(spec: _Spec, res, d_out):
    q0, k0, v0, q_pos, kv_pos_all, q_seg, kv_seg_all, sinks, out, lse = res
    B, Lq, H, K = q0.shape
    Lk, G = k0.shape[1], k0.shape[2]
    n, sb = jax.lax.axis_size(spec.axis_name), spec.sub_blocks
    perm = _ring_perm(n)
    q, k, v = _to_internal(q0, k0, v0, G)
    do = _to_internal(d_out.astype(q0.dtype), k0, v0, G)[0]
    o = _to_internal(out, k0, v0, G)[0]
    # delta_i = sum_k dO_ik O_ik = sum_j P_ij dP_ij: the softmax-backward term (a sink weighs no
    # value, so its dP is 0 and it adds nothing here).
    delta = jnp.einsum("bgrlk,bgrlk->bgrl", do.astype(F32), o.astype(F32))

    qs, qps, qss = _split(q, sb, 3), _split(q_pos, sb, 1), _split(q_seg, sb, 1)
    dos, lses, deltas = _split(do, sb, 3), _split(lse, sb, 3), _split(delta, sb, 3)
    kv = (_split(k, sb, 2), _split(v, sb, 2))
    dq = tuple(jnp.zeros(qa.shape, F32) for qa in qs)
    dkv = tuple(tuple(jnp.zeros(kb.shape, F32) for kb in ks) for ks in kv)
    dq, dkv = vary_like((dq, dkv), q, k, v, q_pos, kv_pos_all, do)

    def accumulate(dq, kv, dkv, t):
        kps, kss = _block_meta(kv_pos_all, kv_seg_all, t, Lk, spec)
        dks, dvs = list(dkv[0]), list(dkv[1])
        dq = list(dq)
        for a, (qa, qpa, qsa, doa, lsea, dela) in enumerate(zip(qs, qps, qss, dos, lses, deltas)):
            for b, (kb, vb, kpb, ksb) in enumerate(zip(*kv, kps, kss)):
                update = functools.partial(
                    _bwd_block,
                    q=qa,
                    q_pos=qpa,
                    q_seg=qsa,
                    do=doa,
                    lse=lsea,
                    delta=dela,
                    k=kb,
                    v=vb,
                    kv_pos=kpb,
                    kv_seg=ksb,
                    spec=spec,
                )
                dq[a], dks[b], dvs[b] = _maybe(_skippable(spec, qpa, kpb), update, (dq[a], dks[b], dvs[b]))
        return tuple(dq), (tuple(dks), tuple(dvs))

    def step(t, carry):
        dq, kv, dkv = carry
        nxt = jax.lax.ppermute(kv, spec.axis_name, perm)
        dq, dkv = accumulate(dq, kv, dkv, t)
        # dK/dV travel with their block: after n hops they are back on the
        # device that owns that block. They travel in float32 (twice the bytes
        # of bf16 K/V) so that n partial sums do not round n times.
        return dq, nxt, jax.lax.ppermute(dkv, spec.axis_name, perm)

    dq, kv, dkv = jax.lax.fori_loop(0, n - 1, step, (dq, kv, dkv))
    dq, dkv = accumulate(dq, kv, dkv, n - 1)
    dkv = jax.lax.ppermute(dkv, spec.axis_name, perm)

    dq = jnp.concatenate(dq, axis=3).transpose(0, 3, 1, 2, 4).reshape(B, Lq, H, K).astype(q0.dtype)
    dk, dv = (jnp.concatenate(d, axis=2).transpose(0, 2, 1, 3) for d in dkv)
    d_sinks = None
    if sinks is not None:
        # d loss / d sink = -sum over queries of p_sink * delta (its dP is 0), p_sink = exp(sink - lse).
        d_sinks = -(jnp.exp(_sinks_GR(sinks, G) - lse) * delta).sum((0, 3)).reshape(H).astype(sinks.dtype)
    # Integer positions and segment ids get no cotangent (None means zero).
    return dq, dk.astype(k0.dtype), dv.astype(v0.dtype), None, None, None, None, d_sinks


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _ring(q, k, v, q_pos, kv_pos_all, q_seg, kv_seg_all, sinks, spec):
    return _ring_forward(q, k, v, q_pos, kv_pos_all, q_seg, kv_seg_all, sinks, spec)[0]


def _ring_fwd(q, k, v, q_pos, kv_pos_all, q_seg, kv_seg_all, sinks, spec):
    # Residuals are this device's blocks, its output and one log-sum-exp per
    # query: O(L/n) memory, where autodiff through the loop would keep every
    # visiting K/V block and every probability block (O(L^2/n)); and the row's
    # positions (and segment ids), integers, which the backward slices as the forward did.
    out, lse = _ring_forward(q, k, v, q_pos, kv_pos_all, q_seg, kv_seg_all, sinks, spec)
    return out, (q, k, v, q_pos, kv_pos_all, q_seg, kv_seg_all, sinks, out, lse)


_ring.defvjp(_ring_fwd, _ring_backward)


def ring_attention_shard(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    kv_pos: jax.Array,
    *,
    axis_name: str,
    scale: float | None = None,
    causal: bool = True,
    sub_blocks: int = 2,
    q_seg: jax.Array | None = None,
    kv_seg: jax.Array | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Ring attention on this device's blocks; call inside `jax.shard_map`.

    q: (B, Lq, H, K), k, v: (B, Lk, G, K) (G K/V heads, each shared by H/G
    query heads), q_pos: (B, Lq), kv_pos: (B, Lk) integer positions, all the
    local blocks of arrays whose sequence dimension is split over `axis_name`.
    q_seg, kv_seg: the tokens' segment (document) ids, travelling with the blocks
    like the positions; window: keys within `window` positions of the query (causal
    only); softcap: scores become softcap * tanh(s / softcap) before the mask;
    sinks: (H,) one logit per query head joining its softmax's denominator.
    Returns this device's (B, Lq, H, K) output in q's dtype. Differentiable
    (a custom VJP that runs a second ring; the sinks' gradient too). `sub_blocks`
    cuts each block into that many pieces per side so that masked pieces can be
    skipped; 2 matches the zigzag layout, and Lq, Lk must be multiples of it.

    >>> from meshwork.sharding.mesh import make_mesh
    >>> mesh = make_mesh({"sequence": -1})
    >>> f = jax.shard_map(lambda q, k, v, p: ring_attention_shard(q, k, v, p, p, axis_name="sequence"),
    ...                   mesh=mesh, in_specs=(PartitionSpec(None, "sequence"),) * 4,
    ...                   out_specs=PartitionSpec(None, "sequence"))
    >>> q = k = v = jnp.ones((1, 32, 1, 4)); pos = jnp.arange(32)[None]
    >>> jax.jit(f)(q, k, v, pos).shape
    (1, 32, 1, 4)
    """
    B, Lq, H, K = q.shape
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != B or k.shape[3] != K or H % k.shape[2]:
        raise ValueError(
            f"ring attention: q {q.shape} must be (B, Lq, H, K) and k, v {k.shape}, {v.shape} "
            f"(B, Lk, G, K) with H a multiple of G"
        )
    if q_pos.shape != (B, Lq) or kv_pos.shape != (B, k.shape[1]):
        raise ValueError(
            f"ring attention: positions {q_pos.shape}, {kv_pos.shape} must be (B, Lq) = {(B, Lq)} "
            f"and (B, Lk) = {(B, k.shape[1])}"
        )
    if (q_seg is None) != (kv_seg is None):
        raise ValueError("ring attention: pass both q_seg and kv_seg (segment ids), or neither")
    if window is not None and (not causal or window < 1):
        raise ValueError(f"ring attention: window={window} needs causal=True and window >= 1")
    if sinks is not None and sinks.shape != (H,):
        raise ValueError(f"ring attention: sinks {sinks.shape} must be one logit per query head, ({H},)")
    if Lq % sub_blocks or k.shape[1] % sub_blocks:
        raise ValueError(
            f"ring attention: local lengths Lq={Lq}, Lk={k.shape[1]} must be multiples of "
            f"sub_blocks={sub_blocks}; choose sub_blocks=1 or a sequence length divisible by "
            f"{sub_blocks} x the sequence-axis size"
        )
    spec = _Spec(
        axis_name,
        float(K**-0.5 if scale is None else scale),
        bool(causal),
        None if window is None else int(window),
        None if softcap is None else float(softcap),
        int(sub_blocks),
    )
    if sinks is not None:
        # The sinks are the same on every device of the ring; made varying like q, their
        # cotangents (one per device) are summed by the transpose of that cast.
        sinks = vary_like(sinks, q)
    # Only K/V go round the ring: the keys' positions and segment ids (small integers) are
    # all-gathered once, and each hop slices those of the block it holds. A model's layers all
    # gather the same ones, so XLA hoists the gather out of the layer loop: once per step.
    gather = functools.partial(jax.lax.all_gather, axis_name=axis_name, axis=1, tiled=True)
    kv_seg_all = None if kv_seg is None else gather(kv_seg)
    return _ring(q, k, v, q_pos, gather(kv_pos), q_seg, kv_seg_all, sinks, spec)


# --------------------------------------------------------------------------
# Global wrapper
# --------------------------------------------------------------------------


def _current_mesh(mesh: Mesh | AbstractMesh | None) -> Mesh | AbstractMesh:
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        raise ValueError("ring_attention: no mesh; pass mesh=... or call it under `with jax.set_mesh(mesh):`")
    return mesh


def ring_attention(
    q_BLHK: jax.Array,
    k_BSGK: jax.Array,
    v_BSGK: jax.Array,
    positions_BL: jax.Array,
    *,
    mesh: Mesh | AbstractMesh | None = None,
    seq_axis: str = "sequence",
    batch_axes: Sequence[str] = ("data", "fsdp"),
    head_axis: str | None = "tensor",
    causal: bool = True,
    scale: float | None = None,
    segment_ids_BL: jax.Array | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks_H: jax.Array | None = None,
) -> jax.Array:
    """Self-attention on global arrays, the sequence split over mesh axis `seq_axis`.

    Runs `ring_attention_shard` under `jax.shard_map`, manual over the named
    axes only (batch over `batch_axes`, sequence over `seq_axis`, query and
    K/V heads over `head_axis`); other mesh axes stay automatic. The mesh is
    `mesh`, else the one set by `jax.set_mesh`. `positions_BL` are the tokens'
    positions in the layout the arrays are in (permuted ones for zigzag);
    `segment_ids_BL` (packed documents), `window`, `softcap` and `sinks_H` as in
    `ring_attention_shard` (the segment ids split like the positions, the sinks by heads).

    >>> from meshwork.sharding.mesh import make_mesh
    >>> mesh = make_mesh({"data": 2, "sequence": 4})
    >>> x = jnp.ones((2, 16, 2, 4)); pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
    >>> jax.jit(lambda x, pos: ring_attention(x, x, x, pos, mesh=mesh))(x, pos).shape
    (2, 16, 2, 4)
    """
    mesh = _current_mesh(mesh)
    batch_axes = tuple(batch_axes)
    used = (*batch_axes, seq_axis, *((head_axis,) if head_axis else ()))
    missing = [a for a in used if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"ring_attention: mesh axes {missing} are not in the mesh {tuple(mesh.axis_names)}; "
            f"pass existing names as seq_axis/batch_axes/head_axis"
        )
    size = dict(mesh.shape)
    B, L, H, _ = q_BLHK.shape
    G = k_BSGK.shape[2]
    n_batch, n_seq, n_head = math.prod(size[a] for a in batch_axes), size[seq_axis], size.get(head_axis, 1)
    for what, dim, parts, axes in (
        ("batch", B, n_batch, batch_axes),
        ("sequence", L, n_seq, seq_axis),
        ("query heads", H, n_head, head_axis),
        ("kv heads", G, n_head, head_axis),
    ):
        if dim % parts:
            raise ValueError(
                f"ring_attention: {what} size {dim} is not divisible by mesh axes {axes} "
                f"(size {parts}); change the shape or the mesh"
            )
    sub_blocks = 2 if (L // n_seq) % 2 == 0 else 1

    b = batch_axes if len(batch_axes) > 1 else (batch_axes[0] if batch_axes else None)
    spec_x = PartitionSpec(b, seq_axis, head_axis, None)
    spec_pos = PartitionSpec(b, seq_axis)

    optional = [(x, s) for x, s in ((segment_ids_BL, spec_pos), (sinks_H, PartitionSpec(head_axis))) if x is not None]

    def body(q, k, v, pos, *rest):
        it = iter(rest)
        seg = next(it) if segment_ids_BL is not None else None
        sinks = next(it) if sinks_H is not None else None
        return ring_attention_shard(
            q,
            k,
            v,
            pos,
            pos,
            axis_name=seq_axis,
            scale=scale,
            causal=causal,
            sub_blocks=sub_blocks,
            q_seg=seg,
            kv_seg=seg,
            window=window,
            softcap=softcap,
            sinks=sinks,
        )

    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(spec_x, spec_x, spec_x, spec_pos, *(s for _, s in optional)),
        out_specs=spec_x,
        axis_names=frozenset(used),
    )
    return f(q_BLHK, k_BSGK, v_BSGK, positions_BL, *(x for x, _ in optional))
