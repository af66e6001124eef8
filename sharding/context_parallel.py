"""Context parallelism: attention over a sequence split across mesh axes, four ways.

When the rules split `act_seq` (the `cp` preset), each device holds L/n of every row's tokens, and
attention needs keys and values from all of them. `train.context_parallel` picks how they meet:

- `ring` (sharding/ring_attention.py): K/V blocks go round the sequence axis by collective-permute,
  one hop per block of compute, overlapping the two; online softmax, its own block math (any
  `model.attention`), and a second ring in the backward pass.
- `all_gather` (Llama 3's): each device all-gathers K/V (with their positions and segment ids) and
  runs the attention formula for its own queries against the whole row, masked by position; the
  backward reduce-scatters dK/dV. Simple, and K/V are small under GQA, but no overlap.
- `ulysses` (DeepSpeed-Ulysses): an all-to-all turns the sequence split into a head split (each
  device: the whole row for H/n query and G/n kv heads), the single-device formula of any impl
  (Pallas included: the tokens are put back in order first) runs on it, and an all-to-all turns
  the output back. Needs the heads divisible by n (kv heads are repeated when n is a multiple of G).
- `usp` (unified sequence parallelism, Fang & Zhao 2024): `act_seq` split over two mesh axes, the
  first a ring, the second Ulysses: an all-to-all over the second axis gives each device its ring
  block's whole stretch of tokens for 1/n2 of the heads, then the ring runs over the first axis.

Every algorithm masks by the tokens' positions (so the load-balancing zigzag layout is correct),
keeps packed documents apart (segment ids), and supports a sliding window, grouped kv heads, logit
soft-capping and per-head sinks. Inside a pipeline stage (a shard_map already manual over the
sequence axis) the ring runs as `all_gather`: XLA:CPU's collective-permute waits for every device
of the program, and the stages run different branches of the schedule.

    >>> from meshwork.sharding.mesh import make_mesh
    >>> mesh = make_mesh({"sequence": 4, "data": -1})
    >>> q = jnp.ones((2, 16, 4, 8)); k = v = jnp.ones((2, 16, 4, 8))
    >>> def local(q, k, v, seg, sinks, positions=None, kv_segment_ids_BS=None):
    ...     return jax.nn.dot_product_attention(q, k, v)  # (positions unused: not causal)
    >>> local.masks_by_position = True
    >>> f = lambda q, k, v: context_parallel_attention("ulysses", local, q, k, v, None, seq_axes=("sequence",),
    ...                                                 batch_axes=("data",), causal=False, scale=None)
    >>> with jax.set_mesh(mesh):
    ...     jax.jit(f)(q, k, v).shape
    (2, 16, 4, 8)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from meshwork.sharding.ring_attention import ring_attention, ring_attention_shard
from meshwork.sharding.rules import manual_axes

ALGORITHMS = ("ring", "all_gather", "ulysses", "usp")


# --------------------------------------------------------------------------
# Checks (also called at config time: train/trainer.py check_runtime)
# --------------------------------------------------------------------------


def kv_repeats(kv_heads: int, n: int) -> int:
    """How many times Ulysses repeats each of a device's `kv_heads` so that `n` devices get whole
    ones: 1 when n divides them, n / kv_heads when kv_heads divides n (GQA with fewer kv heads
    than the sequence axis).

    >>> kv_repeats(8, 4), kv_repeats(2, 8)
    (1, 4)
    """
    return 1 if kv_heads % n == 0 else n // kv_heads


def check_heads(algorithm: str, heads: int, kv_heads: int, n: int, head_ways: int = 1) -> None:
    """Raises a one-line ValueError when `algorithm` cannot split `heads` query and `kv_heads` kv
    heads (already split `head_ways` ways by tensor parallelism) over a Ulysses axis of size `n`.

    >>> check_heads("ulysses", 8, 2, 4)          # kv heads repeated twice
    >>> check_heads("ulysses", 6, 6, 4)
    Traceback (most recent call last):
    ...
    ValueError: train.context_parallel=ulysses: 6 query heads (6 per tensor shard) do not split over the 4 devices of the Ulysses axis; use a head count divisible by 4 (with tensor parallelism: by 4 x the tensor size), a smaller sequence axis, or context_parallel ring or all_gather
    """
    if algorithm not in ("ulysses", "usp") or n <= 1:
        return
    h, g = heads // head_ways, kv_heads // head_ways
    fix = (
        f"use a head count divisible by {n} (with tensor parallelism: by {n} x the tensor size), "
        "a smaller sequence axis, or context_parallel ring or all_gather"
    )
    if h % n:
        raise ValueError(
            f"train.context_parallel={algorithm}: {heads} query heads ({h} per tensor shard) do not split "
            f"over the {n} devices of the Ulysses axis; {fix}"
        )
    if g % n and n % g:
        raise ValueError(
            f"train.context_parallel={algorithm}: {kv_heads} kv heads ({g} per tensor shard) neither split "
            f"over the {n} devices of the Ulysses axis nor divide {n} (to be repeated); {fix}"
        )


def masks_by_position(local: Callable) -> bool:
    """Whether the single-device formula `local` takes explicit query and key positions
    (`positions=`, sharding/parallel.py LocalAttention): XLA's does; the kernels mask by index."""
    return bool(getattr(local, "masks_by_position", False))


# --------------------------------------------------------------------------
# Per-device bodies (inside a shard_map manual over the sequence axes)
# --------------------------------------------------------------------------


def gathered_kv_shard(local, q_BLHK, k_BSGK, v_BSGK, pos_BL, seg_BL, sinks_H, *, axis: str):
    """all_gather on this device's queries: K/V, their positions and segment ids all-gathered over
    `axis` (tiled, in device order), the formula run for the local queries against the whole row,
    masked by position. Its transpose reduce-scatters dK/dV. Also the pipeline stages' attention."""
    if not masks_by_position(local):
        raise ValueError(
            "context parallelism by all-gathered keys (train.context_parallel=all_gather, or any inside a "
            "pipeline stage) runs each device's queries against the whole row, masked by position, which "
            "only model.attention=xla does (the kernels mask by index); use model.attention=xla, or "
            "train.context_parallel=ulysses outside a pipeline"
        )
    gather = functools.partial(jax.lax.all_gather, axis_name=axis, axis=1, tiled=True)
    kv_pos = gather(pos_BL)
    kv_seg = None if seg_BL is None else gather(seg_BL)
    return local(
        q_BLHK, gather(k_BSGK), gather(v_BSGK), seg_BL, sinks_H, positions=(pos_BL, kv_pos), kv_segment_ids_BS=kv_seg
    )


def _in_order(pos_BL, *xs):
    """Each row's tokens sorted by position: (order, the sorted arrays)."""
    order = jnp.argsort(pos_BL, axis=1)
    take = lambda x: jnp.take_along_axis(x, order.reshape(*order.shape, *(1,) * (x.ndim - 2)), axis=1)  # noqa: E731
    return order, [None if x is None else take(x) for x in xs]


def ulysses_shard(attend, q_BLHK, k_BSGK, v_BSGK, pos_BL, seg_BL, sinks_H, *, axis: str, in_order: bool = False):
    """Ulysses on this device's block: all-to-all from sequence-split to head-split over `axis`,
    `attend(q, k, v, positions, segment ids, sinks)` on the whole stretch of tokens the axis holds
    for H/n heads (their sinks), and the all-to-all back. Kv heads fewer than the axis are
    repeated (`kv_repeats`); their gradients sum back through the repeat. `in_order`: the tokens
    are in order 0..L-1, so each device makes the row's positions instead of gathering them."""
    n = jax.lax.axis_size(axis)
    H, G = q_BLHK.shape[2], k_BSGK.shape[2]
    check_heads("ulysses", H, G, n)
    if (r := kv_repeats(G, n)) > 1:
        k_BSGK, v_BSGK = (jnp.repeat(x, r, axis=2) for x in (k_BSGK, v_BSGK))
    to_heads = functools.partial(jax.lax.all_to_all, axis_name=axis, split_axis=2, concat_axis=1, tiled=True)
    gather = functools.partial(jax.lax.all_gather, axis_name=axis, axis=1, tiled=True)
    if sinks_H is not None:
        sinks_H = jax.lax.dynamic_slice_in_dim(sinks_H, jax.lax.axis_index(axis) * (H // n), H // n)
    seg = None if seg_BL is None else gather(seg_BL)
    B, L = pos_BL.shape[0], pos_BL.shape[1] * n
    pos = jnp.broadcast_to(jnp.arange(L, dtype=pos_BL.dtype), (B, L)) if in_order else gather(pos_BL)
    o = attend(to_heads(q_BLHK), to_heads(k_BSGK), to_heads(v_BSGK), pos, seg, sinks_H)
    return jax.lax.all_to_all(o, axis, split_axis=1, concat_axis=2, tiled=True)


def _local_on_rows(local, in_order: bool):
    """`attend` for Ulysses: the formula on whole rows. Tokens in order (the layer passed no
    positions, so its formula assumes 0..L-1 too): the formula as it is, causal fast paths and
    kernels alike. Otherwise XLA's masks by the positions, and a kernel (which masks by index) gets
    the tokens sorted by position, its output going back to their layout."""
    if in_order:
        return lambda q, k, v, pos, seg, sinks: local(q, k, v, seg, sinks)
    if masks_by_position(local):
        return lambda q, k, v, pos, seg, sinks: local(q, k, v, seg, sinks, positions=(pos, pos))

    def sorted_rows(q, k, v, pos, seg, sinks):
        order, (q, k, v, seg) = _in_order(pos, q, k, v, seg)
        o = local(q, k, v, seg, sinks)
        back = jnp.argsort(order, axis=1)
        return jnp.take_along_axis(o, back[:, :, None, None], axis=1)

    return sorted_rows


def _ring_on_rows(axis: str, *, causal, scale, window, softcap):
    """`attend` for USP: the ring over `axis` on the block Ulysses assembled."""

    def ring(q, k, v, pos, seg, sinks):
        return ring_attention_shard(
            q,
            k,
            v,
            pos,
            pos,
            axis_name=axis,
            scale=scale,
            causal=causal,
            sub_blocks=2 if q.shape[1] % 2 == 0 else 1,
            q_seg=seg,
            kv_seg=seg,
            window=window,
            softcap=softcap,
            sinks=sinks,
        )

    return ring


# --------------------------------------------------------------------------
# Global entry point
# --------------------------------------------------------------------------


def context_parallel_attention(
    algorithm: str,
    local: Callable,
    q_BLHK: jax.Array,
    k_BSGK: jax.Array,
    v_BSGK: jax.Array,
    positions_BL: jax.Array | None,
    *,
    seq_axes: Sequence[str],
    batch_axes: Sequence[str] = (),
    head_axes: Sequence[str] = (),
    causal: bool,
    scale: float | None,
    segment_ids_BL: jax.Array | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks_H: jax.Array | None = None,
    opaque: bool = False,
) -> jax.Array:
    """Attention on global arrays whose sequence is split over the mesh axes `seq_axes`, by
    `algorithm` (ALGORITHMS; module docstring). `local` is the single-device formula
    (sharding/parallel.py LocalAttention); batch and heads stay split over `batch_axes` and
    `head_axes` as the rules split them. `positions_BL`: the tokens' positions in the layout the
    arrays are in (None: 0..L-1); a kernel that masks by index (`opaque` or not) needs them to be a
    permutation of 0..L-1 per row under ulysses, and is refused by all_gather.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"train.context_parallel={algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    seq_axes = tuple(seq_axes)
    n_axes = 2 if algorithm == "usp" else 1
    if len(seq_axes) != n_axes:
        raise ValueError(
            f"train.context_parallel={algorithm} needs act_seq split over {n_axes} mesh axis(es), got "
            f"{seq_axes}; "
            + (
                "split it over two (ring, then Ulysses), e.g. rules.overrides act_seq=[sequence, tensor], or use ring"
                if algorithm == "usp"
                else "use context_parallel=usp for two axes (ring, then Ulysses), or split act_seq over one"
            )
        )
    in_order = positions_BL is None
    manual = manual_axes()
    in_stage = any(a in manual for a in seq_axes)
    if positions_BL is None:
        # Tokens in order: the whole row's positions, or (inside a stage, which holds its shard
        # of the sequence) this shard's.
        B, L = q_BLHK.shape[:2]
        first = jax.lax.axis_index(seq_axes[0]) * L if in_stage else 0
        positions_BL = jnp.broadcast_to(first + jnp.arange(L, dtype=jnp.int32), (B, L))
    if in_stage:
        return _in_stage(
            algorithm,
            local,
            q_BLHK,
            k_BSGK,
            v_BSGK,
            positions_BL,
            segment_ids_BL,
            sinks_H,
            seq_axes[0],
            opaque,
            in_order,
        )
    batch = tuple(a for a in batch_axes if a not in manual)
    heads = tuple(a for a in head_axes if a not in manual)
    if algorithm == "ring":
        return ring_attention(
            q_BLHK,
            k_BSGK,
            v_BSGK,
            positions_BL,
            seq_axis=seq_axes[0],
            batch_axes=batch,
            head_axis=heads[0] if heads else None,
            causal=causal,
            scale=scale,
            segment_ids_BL=segment_ids_BL,
            window=window,
            softcap=softcap,
            sinks_H=sinks_H,
        )
    if algorithm == "all_gather":
        body = functools.partial(gathered_kv_shard, local, axis=seq_axes[0])
    elif algorithm == "ulysses":
        body = functools.partial(ulysses_shard, _local_on_rows(local, in_order), axis=seq_axes[0], in_order=in_order)
    else:
        ring = _ring_on_rows(seq_axes[0], causal=causal, scale=scale, window=window, softcap=softcap)
        body = functools.partial(ulysses_shard, ring, axis=seq_axes[1])
    return _shard_mapped(body, q_BLHK, k_BSGK, v_BSGK, positions_BL, segment_ids_BL, sinks_H, seq_axes, batch, heads)


def _spec_entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _shard_mapped(body, q, k, v, pos, seg, sinks, seq_axes, batch, heads):
    """`body(q, k, v, pos, seg, sinks)` per device, in a shard_map manual over the batch, sequence
    and head axes only (others stay with the compiler)."""
    b, s, h = _spec_entry(batch), _spec_entry(seq_axes), _spec_entry(heads)
    spec_x, spec_pos = PartitionSpec(b, s, h, None), PartitionSpec(b, s)
    optional = [(x, sp) for x, sp in ((seg, spec_pos), (sinks, PartitionSpec(h))) if x is not None]

    def run(q, k, v, pos, *rest):
        it = iter(rest)
        return body(q, k, v, pos, next(it) if seg is not None else None, next(it) if sinks is not None else None)

    # check_vma=False: a Pallas kernel's output cannot declare the axes it varies over. The sinks'
    # cotangents are then summed over the axes their spec leaves out, as shard_map's transpose does.
    return jax.shard_map(
        run,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(spec_x, spec_x, spec_x, spec_pos, *(sp for _, sp in optional)),
        out_specs=spec_x,
        axis_names=frozenset((*batch, *seq_axes, *heads)),
        check_vma=False,
    )(q, k, v, pos, *(x for x, _ in optional))


def _in_stage(algorithm, local, q, k, v, pos, seg, sinks, axis, opaque, in_order):
    """Inside a pipeline stage, whose shard_map is already manual over the sequence axis (and the data
    axes): the bodies run as they are, the heads left to the compiler. The ring runs as all_gather."""
    if opaque:
        raise ValueError(
            "context parallelism inside a pipeline stage runs the attention formula on arrays the compiler "
            "still splits by heads, which a Pallas kernel cannot be; use model.attention=xla there"
        )
    if algorithm in ("ring", "all_gather"):
        return gathered_kv_shard(local, q, k, v, pos, seg, sinks, axis=axis)
    if algorithm == "ulysses":
        return ulysses_shard(_local_on_rows(local, in_order), q, k, v, pos, seg, sinks, axis=axis, in_order=in_order)
    raise ValueError(
        "train.context_parallel=usp inside a pipeline stage is not built (its ring cannot run inside the "
        "schedule's branches); use all_gather or ulysses with train.pipeline, or usp without it"
    )
