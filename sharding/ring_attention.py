"""Context parallelism: ring attention over a `sequence` mesh axis.

The sequence is split over mesh axis `sequence` (size n). Every device keeps
its query block; key/value blocks, with their token positions, travel round
the ring with `ppermute`, one hop per step, for n steps. Each step folds one
K/V block into running softmax statistics (max, sum, float32 accumulator), so
no device ever holds more than two K/V blocks or a score matrix wider than a
block. The backward pass is a second ring: K/V travel again together with
their gradient accumulators dK/dV, which arrive home after n hops.

Causality is decided by explicit positions (key j is visible to query i iff
pos_k[j] <= pos_q[i]), so any token layout works. The layout matters for
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


def _visible(q_pos: jax.Array, kv_pos: jax.Array) -> jax.Array:
    """(B, Lq), (B, Lk) -> (B, 1, 1, Lq, Lk) bool, broadcastable to scores_BGRLS."""
    return (kv_pos[:, None, :] <= q_pos[:, :, None])[:, None, None]


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    kv_pos: jax.Array,
    *,
    causal: bool = True,
    scale: float | None = None,
) -> jax.Array:
    """Full softmax attention with a position mask; the oracle for `ring_attention_shard`.

    q: (B, Lq, H, K); k, v: (B, Lk, G, K) with H a multiple of G; q_pos: (B, Lq)
    and kv_pos: (B, Lk) integer positions. Key j is visible to query i iff
    kv_pos[j] <= q_pos[i] (when causal). A query that sees no key returns 0.

    >>> q = jnp.ones((1, 3, 2, 4)); k = v = jnp.arange(12.).reshape(1, 3, 1, 4)
    >>> pos = jnp.arange(3)[None]
    >>> attention_reference(q, k, v, pos, pos)[0, 0, 0]   # the first query sees only key 0
    Array([0., 1., 2., 3.], dtype=float32)
    """
    B, Lq, H, K = q.shape
    G = k.shape[2]
    scale = K**-0.5 if scale is None else scale
    q_BGRLK = q.reshape(B, Lq, G, H // G, K).transpose(0, 2, 3, 1, 4)
    s = jnp.einsum("bgrlk,bsgk->bgrls", q_BGRLK, k, preferred_element_type=F32) * scale
    if causal:
        s = jnp.where(_visible(q_pos, kv_pos), s, -jnp.inf)
    m = jax.lax.stop_gradient(s.max(-1, keepdims=True))
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = p.sum(-1, keepdims=True)
    p = p / jnp.where(l == 0, 1.0, l)
    o = jnp.einsum("bgrls,bsgk->bgrlk", p, v.astype(F32))
    return o.transpose(0, 3, 1, 2, 4).reshape(B, Lq, H, K).astype(q.dtype)


# --------------------------------------------------------------------------
# Per-device ring (runs inside shard_map)
# --------------------------------------------------------------------------


def _split(x: jax.Array, n: int, axis: int) -> tuple[jax.Array, ...]:
    return tuple(jnp.split(x, n, axis=axis)) if n > 1 else (x,)


def _skippable(causal: bool, q_pos: jax.Array, kv_pos: jax.Array) -> jax.Array | None:
    # A (query, key) block whose earliest key comes after the latest query is
    # all masked for every batch row: skipping it saves its two matmuls and the
    # exp (forward), four matmuls (backward). With contiguous blocks that is the
    # upper triangle of the block grid; with the zigzag layout and two
    # sub-blocks per side, half of every off-diagonal step, which is what
    # makes the zigzag layout faster rather than only balanced.
    if not causal:
        return None
    return kv_pos.min() > q_pos.max()


def _maybe(skip, update, state):
    return update(state) if skip is None else jax.lax.cond(skip, lambda s: s, update, state)


def _fwd_block(state, q, q_pos, k, v, kv_pos, *, scale, causal):
    """Folds one K/V sub-block into (max, sum, acc) of one query sub-block (online softmax)."""
    m, l, acc = state
    s = jnp.einsum("bgrlk,bgsk->bgrls", q, k, preferred_element_type=F32) * scale
    if causal:
        s = jnp.where(_visible(q_pos, kv_pos), s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(-1))
    # A row with no visible key yet has max -inf; shifting by 0 then keeps
    # exp() at exactly 0 instead of NaN (-inf - -inf).
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    corr = jnp.exp(m - m_safe)
    l = l * corr + p.sum(-1)
    acc = acc * corr[..., None] + jnp.einsum("bgrls,bgsk->bgrlk", p.astype(v.dtype), v, preferred_element_type=F32)
    return m_new, l, acc


def _bwd_block(grads, q, q_pos, do, lse, delta, k, v, kv_pos, *, scale, causal):
    """Adds one (query sub-block, K/V sub-block) pair's share to dq, dk, dv."""
    dq, dk, dv = grads
    s = jnp.einsum("bgrlk,bgsk->bgrls", q, k, preferred_element_type=F32) * scale
    p = jnp.exp(s - lse[..., None])
    if causal:
        p = jnp.where(_visible(q_pos, kv_pos), p, 0.0)
    dv = dv + jnp.einsum("bgrls,bgrlk->bgsk", p.astype(do.dtype), do, preferred_element_type=F32)
    dp = jnp.einsum("bgrlk,bgsk->bgrls", do, v, preferred_element_type=F32)
    ds = (p * (dp - delta[..., None]) * scale).astype(q.dtype)
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


def _ring_perm(n: int) -> list[tuple[int, int]]:
    # Device d sends to d+1, so at step t it holds the block that started on d-t.
    return [(i, (i + 1) % n) for i in range(n)]


def _ring_forward(q, k, v, q_pos, kv_pos, axis_name, scale, causal, sub_blocks):
    B, Lq, H, K = q.shape
    G = k.shape[2]
    n = jax.lax.axis_size(axis_name)
    perm = _ring_perm(n)
    q, k, v = _to_internal(q, k, v, G)
    qs, qps = _split(q, sub_blocks, 3), _split(q_pos, sub_blocks, 1)
    kv = (_split(k, sub_blocks, 2), _split(v, sub_blocks, 2), _split(kv_pos, sub_blocks, 1))

    stats = tuple(
        (jnp.full(qa.shape[:-1], -jnp.inf, F32), jnp.zeros(qa.shape[:-1], F32), jnp.zeros(qa.shape, F32)) for qa in qs
    )
    stats = vary_like(stats, q, k, v, q_pos, kv_pos)

    def fold(stats, kv):
        ks, vs, kps = kv
        out = []
        for qa, qpa, st in zip(qs, qps, stats):
            for kb, vb, kpb in zip(ks, vs, kps):
                update = functools.partial(
                    _fwd_block, q=qa, q_pos=qpa, k=kb, v=vb, kv_pos=kpb, scale=scale, causal=causal
                )
                st = _maybe(_skippable(causal, qpa, kpb), update, st)
            out.append(st)
        return tuple(out)

    def step(_, carry):
        stats, kv = carry
        # The next block is requested before this one is used: the two are
        # independent, so the collective-permute overlaps the compute.
        nxt = jax.lax.ppermute(kv, axis_name, perm)
        return fold(stats, kv), nxt

    # n-1 hops suffice; the last block is folded after the loop.
    stats, kv = jax.lax.fori_loop(0, n - 1, step, (stats, kv))
    stats = fold(stats, kv)

    m, l, acc = (jnp.concatenate(x, axis=3) for x in zip(*stats))
    out = acc / jnp.where(l == 0, 1.0, l)[..., None]
    # log-sum-exp per query; +inf for a query that saw no key, so the
    # backward's exp(s - lse) is 0 there rather than NaN.
    lse = jnp.where(l == 0, jnp.inf, m + jnp.log(jnp.where(l == 0, 1.0, l)))
    out = out.transpose(0, 3, 1, 2, 4).reshape(B, Lq, H, K).astype(q.dtype)
    return out, lse


def _ring_backward(axis_name, scale, causal, sub_blocks, res, d_out):
    q0, k0, v0, q_pos, kv_pos, out, lse = res
    B, Lq, H, K = q0.shape
    G = k0.shape[2]
    n = jax.lax.axis_size(axis_name)
    perm = _ring_perm(n)
    q, k, v = _to_internal(q0, k0, v0, G)
    do = _to_internal(d_out.astype(q0.dtype), k0, v0, G)[0]
    o = _to_internal(out, k0, v0, G)[0]
    # delta_i = sum_k dO_ik O_ik = sum_j P_ij dP_ij: the softmax-backward term.
    delta = jnp.einsum("bgrlk,bgrlk->bgrl", do.astype(F32), o.astype(F32))

    qs, qps = _split(q, sub_blocks, 3), _split(q_pos, sub_blocks, 1)
    dos, lses, deltas = _split(do, sub_blocks, 3), _split(lse, sub_blocks, 3), _split(delta, sub_blocks, 3)
    kv = (_split(k, sub_blocks, 2), _split(v, sub_blocks, 2), _split(kv_pos, sub_blocks, 1))
    dq = tuple(jnp.zeros(qa.shape, F32) for qa in qs)
    dkv = tuple(tuple(jnp.zeros(kb.shape, F32) for kb in ks) for ks in kv[:2])
    dq, dkv = vary_like((dq, dkv), q, k, v, q_pos, kv_pos, do)

    def accumulate(dq, kv, dkv):
        ks, vs, kps = kv
        dks, dvs = list(dkv[0]), list(dkv[1])
        dq = list(dq)
        for a, (qa, qpa, doa, lsea, dela) in enumerate(zip(qs, qps, dos, lses, deltas)):
            for b, (kb, vb, kpb) in enumerate(zip(ks, vs, kps)):
                update = functools.partial(
                    _bwd_block,
                    q=qa,
                    q_pos=qpa,
                    do=doa,
                    lse=lsea,
                    delta=dela,
                    k=kb,
                    v=vb,
                    kv_pos=kpb,
                    scale=scale,
                    causal=causal,
                )
                dq[a], dks[b], dvs[b] = _maybe(_skippable(causal, qpa, kpb), update, (dq[a], dks[b], dvs[b]))
        return tuple(dq), (tuple(dks), tuple(dvs))

    def step(_, carry):
        dq, kv, dkv = carry
        nxt = jax.lax.ppermute(kv, axis_name, perm)
        dq, dkv = accumulate(dq, kv, dkv)
        # dK/dV travel with their block: after n hops they are back on the
        # device that owns that block. They travel in float32 (twice the bytes
        # of bf16 K/V) so that n partial sums do not round n times.
        return dq, nxt, jax.lax.ppermute(dkv, axis_name, perm)

    dq, kv, dkv = jax.lax.fori_loop(0, n - 1, step, (dq, kv, dkv))
    dq, dkv = accumulate(dq, kv, dkv)
    dkv = jax.lax.ppermute(dkv, axis_name, perm)

    dq = jnp.concatenate(dq, axis=3).transpose(0, 3, 1, 2, 4).reshape(B, Lq, H, K).astype(q0.dtype)
    dk, dv = (jnp.concatenate(d, axis=2).transpose(0, 2, 1, 3) for d in dkv)
    # Integer positions get no cotangent (None means zero).
    return dq, dk.astype(k0.dtype), dv.astype(v0.dtype), None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _ring(q, k, v, q_pos, kv_pos, axis_name, scale, causal, sub_blocks):
    return _ring_forward(q, k, v, q_pos, kv_pos, axis_name, scale, causal, sub_blocks)[0]


def _ring_fwd(q, k, v, q_pos, kv_pos, axis_name, scale, causal, sub_blocks):
    # Residuals are this device's blocks, its output and one log-sum-exp per
    # query: O(L/n) memory, where autodiff through the loop would keep every
    # visiting K/V block and every probability block (O(L^2/n)).
    out, lse = _ring_forward(q, k, v, q_pos, kv_pos, axis_name, scale, causal, sub_blocks)
    return out, (q, k, v, q_pos, kv_pos, out, lse)


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
) -> jax.Array:
    """Ring attention on this device's blocks; call inside `jax.shard_map`.

    q: (B, Lq, H, K), k, v: (B, Lk, G, K) (G K/V heads, each shared by H/G
    query heads), q_pos: (B, Lq), kv_pos: (B, Lk) integer positions, all the
    local blocks of arrays whose sequence dimension is split over `axis_name`.
    Returns this device's (B, Lq, H, K) output in q's dtype. Differentiable
    (a custom VJP that runs a second ring). `sub_blocks` cuts each block into
    that many pieces per side so that masked pieces can be skipped; 2 matches
    the zigzag layout, and Lq, Lk must be multiples of it.

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
    if Lq % sub_blocks or k.shape[1] % sub_blocks:
        raise ValueError(
            f"ring attention: local lengths Lq={Lq}, Lk={k.shape[1]} must be multiples of "
            f"sub_blocks={sub_blocks}; choose sub_blocks=1 or a sequence length divisible by "
            f"{sub_blocks} x the sequence-axis size"
        )
    scale = float(K**-0.5 if scale is None else scale)
    return _ring(q, k, v, q_pos, kv_pos, axis_name, scale, bool(causal), int(sub_blocks))


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
) -> jax.Array:
    """Self-attention on global arrays, the sequence split over mesh axis `seq_axis`.

    Runs `ring_attention_shard` under `jax.shard_map`, manual over the named
    axes only (batch over `batch_axes`, sequence over `seq_axis`, query and
    K/V heads over `head_axis`); other mesh axes stay automatic. The mesh is
    `mesh`, else the one set by `jax.set_mesh`. `positions_BL` are the tokens'
    positions in the layout the arrays are in (permuted ones for zigzag).

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

    def body(q, k, v, pos):
        return ring_attention_shard(
            q, k, v, pos, pos, axis_name=seq_axis, scale=scale, causal=causal, sub_blocks=sub_blocks
        )

    f = jax.shard_map(
        body, mesh=mesh, in_specs=(spec_x, spec_x, spec_x, spec_pos), out_specs=spec_x, axis_names=frozenset(used)
    )
    return f(q_BLHK, k_BSGK, v_BSGK, positions_BL)
