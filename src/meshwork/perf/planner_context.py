"""Planner, context parallelism: what each `train.context_parallel` algorithm sends per layer.

Per device, per layer, per microbatch, forward and backward, exactly as sharding/context_parallel.py
and sharding/ring_attention.py send it (tests/test_context_parallel.py reads the same bytes back
from the compiled HLO of one attention call and of a train step). One device holds b rows of
s = L/n tokens, h query and g kv heads of width K (after tensor parallelism) in p-byte elements;
positions and segment ids are int32:

    kv = b s g K p (one of K, V)        meta = b s 4 (positions) + b s 4 (segment ids, if packed)

- ring over n: forward n-1 permutes of (K, V); backward n-1 again, and n of float32 (dK, dV),
  which travel home with their block. Each hop overlaps one block's attention compute; only what
  the compute cannot cover is exposed (planner.py).
      permute  (n-1) 2 kv forward,  (n-1) 2 kv + n (2 b s g K 4) backward
- all_gather over n: one all-gather of (K, V), payload n 2 kv; backward one reduce-scatter of
  (dK, dV), payload n 2 kv. On the critical path.
- ulysses over u: kv heads repeated to g' = g r (r = u/g when g < u, else 1), kv' = b s g' K p;
  all-to-alls of q, k, v and of the output forward, of their cotangents backward, q = b s h K p:
      all-to-all  (2 q + 2 kv') forward, (2 q + 2 kv') backward.  On the critical path.
- usp, a ring over r and Ulysses over u: Ulysses' traffic over u, then the ring's over r on the
  assembled block (u s tokens of g'/u kv heads: the same kv' bytes).

Positions and segment ids are all-gathered, not sent with each block (the ring slices a visiting
block's from them): payload n meta (ulysses: only segment ids, its tokens being in order; usp: u
meta over Ulysses' axis, then r u meta over the ring's). Every layer gathers the same ones, so XLA
hoists that all-gather out of the layer loop: once per microbatch, not per layer.

Under a remat policy the layer's backward runs its attention's forward again, collectives included
(no policy saves a collective's output): the forward's collectives count twice (`forward_runs`).
The exception, measured: under dots_saveable the ring's forward (a custom VJP whose residuals
come out of batched matmuls) is kept, and its hops run once.
"""

from __future__ import annotations

import dataclasses

from meshwork.sharding.context_parallel import kv_repeats

POSITION_BYTES = 4  # int32 positions and segment ids


@dataclasses.dataclass(frozen=True)
class AttentionShard:
    """One device's attention inputs for one microbatch, before context parallelism moves them."""

    b: float  # rows
    s: float  # tokens of each row on this device (L / n)
    heads: int  # query heads (after tensor parallelism)
    kv_heads: int  # kv heads (after tensor parallelism)
    head_dim: int  # K (MLA's expanded form: the padded width)
    itemsize: int  # bytes of the compute dtype
    segments: bool = False  # packed documents: segment ids travel with the positions
    positions: bool = True  # the tokens come with positions (a permuted layout); Ulysses' are in order


@dataclasses.dataclass(frozen=True)
class CPCollective:
    """`count` collectives of `kind` over the mesh axes `axes` (one of the algorithm's two groups),
    each with per-device payload S (sharding/hlo.py's convention); `overlap`: "attention" (hidden
    under the layer's attention compute, the ring), or "none" (on the critical path)."""

    kind: str
    axes: tuple[str, ...]
    payload_bytes: float
    count: float
    what: str
    overlap: str = "none"
    per_layer: bool = True  # False: once per microbatch (the layer-invariant positions' gather)


def cp_collectives(
    algorithm: str,
    shard: AttentionShard,
    seq_axes: tuple[str, ...],
    sizes: dict[str, int],
    *,
    remat: str = "none",
) -> list[CPCollective]:
    """The collectives of one layer's attention under `algorithm`, forward and backward, for one
    microbatch on one device; `seq_axes` split the sequence (usp: the ring's, then Ulysses'),
    `sizes` gives their sizes; `remat` (train.remat) decides whether the forward's run twice.

    >>> sh = AttentionShard(b=1, s=512, heads=8, kv_heads=2, head_dim=128, itemsize=2)
    >>> [(c.kind, int(c.payload_bytes), c.count) for c in cp_collectives("all_gather", sh, ("sequence",), {"sequence": 4})]
    [('all-gather', 8192, 1), ('all-gather', 2097152, 1), ('reduce-scatter', 2097152, 1)]
    """
    b, s, h, g, K, p = shard.b, shard.s, shard.heads, shard.kv_heads, shard.head_dim, shard.itemsize
    forward_runs, ring_runs = forward_runs_under(remat), forward_runs_under(remat, ring=True)
    pos = b * s * POSITION_BYTES
    seg = pos if shard.segments else 0.0

    def gather(axis, payload, what):  # the row's positions and segment ids: once per microbatch
        return [CPCollective("all-gather", (axis,), payload, 1, what, per_layer=False)] if payload else []

    if algorithm in ("ring", "all_gather"):
        (axis,) = seq_axes
        n = sizes[axis]
        kv = b * s * g * K * p
        out = gather(axis, n * (pos + seg), "cp positions/segments")
        if algorithm == "all_gather":
            out.append(CPCollective("all-gather", (axis,), n * 2 * kv, forward_runs, "cp all_gather k/v"))
            out.append(CPCollective("reduce-scatter", (axis,), n * 2 * kv, 1, "cp all_gather dk/dv"))
            return out
        return out + _ring(axis, n, 2 * kv, 2 * b * s * g * K * 4, ring_runs)
    if algorithm not in ("ulysses", "usp"):
        raise ValueError(f"context_parallel={algorithm!r}; choose ring, all_gather, ulysses or usp")
    uly = seq_axes[-1]
    u = sizes[uly]
    g_rep = g * kv_repeats(g, u)
    q, kv = b * s * h * K * p, b * s * g_rep * K * p
    # Tokens in order (Ulysses' training layout) need no positions: each device makes the row's.
    out = gather(uly, u * (pos * shard.positions + seg), "cp ulysses positions/segments")
    out.append(CPCollective("all-to-all", (uly,), 2 * q + 2 * kv, forward_runs, "cp ulysses q/k/v/out forward"))
    out.append(CPCollective("all-to-all", (uly,), 2 * q + 2 * kv, 1, "cp ulysses backward"))
    if algorithm == "usp":
        # The ring's block: u s tokens of g'/u kv heads (the kv bytes unchanged).
        ring_axis = seq_axes[0]
        r = sizes[ring_axis]
        out += gather(ring_axis, r * u * (pos + seg), "cp ring positions/segments")
        out += _ring(ring_axis, r, 2 * kv, 2 * b * s * g_rep * K * 4, ring_runs)
    return out


def forward_runs_under(remat: str, ring: bool = False) -> int:
    """How many times a layer's attention forward (and its collectives) runs per step under `remat`.

    >>> forward_runs_under("none"), forward_runs_under("full"), forward_runs_under("dots_saveable", ring=True)
    (1, 2, 1)
    """
    return 1 if remat == "none" or (ring and remat == "dots_saveable") else 2


def _ring(axis: str, n: int, block: float, grads: float, forward_runs: int) -> list[CPCollective]:
    hops = [
        CPCollective("collective-permute", (axis,), block, (n - 1) * forward_runs, "cp ring k/v forward", "attention"),
        CPCollective("collective-permute", (axis,), block, n - 1, "cp ring k/v backward", "attention"),
        CPCollective("collective-permute", (axis,), grads, n, "cp ring dk/dv (float32)", "attention"),
    ]
    return [c for c in hops if c.count]
