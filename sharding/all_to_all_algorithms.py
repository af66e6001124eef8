"""All-to-all spelled out with `ppermute` sends, equal to
`lax.all_to_all(x, (outer, inner), split, concat, tiled)`.

- `direct_all_to_all`: P-1 flat rounds, one block to every other device.
- `hierarchical_all_to_all`: exchange inside a node, then across nodes.

Each takes a per-device buffer and mesh axis names, so it runs inside your
own `jax.shard_map`; `all_to_all` wraps it for a global array. Every send is
noted by `sharding/point_to_point.py`'s `record_transfers`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from meshwork.sharding.point_to_point import AxisName, put_block, send, take_block

__all__ = ["ALL_TO_ALL_ALGORITHMS", "all_to_all", "direct_all_to_all", "hierarchical_all_to_all"]

ALL_TO_ALL_ALGORITHMS = ("hierarchical", "direct", "lax")


def _to_blocks(x: jax.Array, n: int, split_axis: int, tiled: bool) -> jax.Array:
    """x -> (n, ...): block j is what goes to device j."""
    if tiled:
        if x.shape[split_axis] % n:
            raise ValueError(
                f"all_to_all: split_axis {split_axis} has size {x.shape[split_axis]}, not divisible by "
                f"the {n} devices; pad it or choose another axis"
            )
        x = x.reshape(x.shape[:split_axis] + (n, x.shape[split_axis] // n) + x.shape[split_axis + 1 :])
    elif x.shape[split_axis] != n:
        raise ValueError(
            f"all_to_all(tiled=False): split_axis {split_axis} has size {x.shape[split_axis]} but there are "
            f"{n} devices; it must equal the device count (or use tiled=True)"
        )
    return jnp.moveaxis(x, split_axis, 0)


def _from_blocks(b: jax.Array, concat_axis: int, tiled: bool) -> jax.Array:
    """(n, ...) with block j from device j -> the all_to_all output layout."""
    b = jnp.moveaxis(b, 0, concat_axis)
    if not tiled:
        return b  # the device axis becomes a new dimension at concat_axis
    s = b.shape
    return b.reshape(s[:concat_axis] + (s[concat_axis] * s[concat_axis + 1],) + s[concat_axis + 2 :])


def _exchange_blocks(blocks: jax.Array, axis_name: AxisName) -> jax.Array:
    """The all-to-all on a leading block axis of size P: out[j] = device j's blocks[me].

    P-1 rounds; in round s device i sends blocks[i + s] to device i + s (a
    shift by s is a permutation, so everyone sends and receives once).
    """
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    out = blocks
    for s in range(1, n):
        got = send(take_block(blocks, (me + s) % n), axis_name, [(i, (i + s) % n) for i in range(n)])
        out = put_block(out, (me - s) % n, got)
    return out


def direct_all_to_all(
    x: jax.Array, axis_name: AxisName, split_axis: int, concat_axis: int, *, tiled: bool = True
) -> jax.Array:
    """`lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=tiled)` in P-1 flat rounds.

    The one-level baseline for `hierarchical_all_to_all`: every device sends
    P-1 messages of N/P bytes, (P-1)/P * N in all. Call inside `jax.shard_map`.

    >>> from meshwork.sharding.mesh import make_mesh
    >>> mesh = make_mesh({"data": -1}); p = mesh.size
    >>> spec = PartitionSpec("data")
    >>> mine = jax.jit(jax.shard_map(lambda x: direct_all_to_all(x, "data", 1, 0), mesh=mesh,
    ...                               in_specs=spec, out_specs=spec))
    >>> ref = jax.jit(jax.shard_map(lambda x: lax.all_to_all(x, "data", 1, 0, tiled=True), mesh=mesh,
    ...                             in_specs=spec, out_specs=spec))
    >>> x = jnp.arange(p * p * 1.0).reshape(p, p)
    >>> bool((mine(x) == ref(x)).all())
    True
    """
    n = lax.axis_size(axis_name)
    split_axis, concat_axis = _normalize_axes(x.ndim, split_axis, concat_axis)
    return _from_blocks(_exchange_blocks(_to_blocks(x, n, split_axis, tiled), axis_name), concat_axis, tiled)


def hierarchical_all_to_all(
    x: jax.Array, outer_axis: str, inner_axis: str, split_axis: int, concat_axis: int, *, tiled: bool = True
) -> jax.Array:
    """`lax.all_to_all(x, (outer_axis, inner_axis), split_axis, concat_axis, tiled=tiled)`, in two levels.

    Semantics matched exactly (as `lax.all_to_all` with the tuple axis name):
    devices are numbered j = outer * L + inner (outer major; M outer, L inner
    devices). `x` is cut along `split_axis` into P = M*L blocks (tiled=True:
    equal pieces; tiled=False: the axis must have size P and is consumed),
    block j goes to device j, and the received blocks, ordered by source j,
    are concatenated along `concat_axis` (tiled=True) or stacked as a new
    axis at output position `concat_axis` (tiled=False).

    Algorithm: (1) inside the node (over `inner_axis`), send to inner peer l
    all M blocks bound for column l, L-1 rounds of N/L bytes; (2) across
    nodes (over `outer_axis`), send to node m all L blocks bound for it, M-1
    rounds of N/M bytes. Per device: ((L-1)/L + (M-1)/M) N bytes, more than
    direct's (P-1)/P N, but the (M-1)/M N crossing nodes (the same bytes as
    direct) travel as M-1 large messages instead of P-L small ones.
    Negative axes count from the end (normalize them before passing them
    to `lax.all_to_all`, which in jax 0.10.2 does not and may segfault).
    Call inside `jax.shard_map`.

    >>> import numpy as np
    >>> from jax.sharding import AxisType
    >>> mesh = jax.make_mesh((2, 4), ("node", "local"), axis_types=(AxisType.Auto,) * 2)
    >>> spec = PartitionSpec(("node", "local"))
    >>> f = jax.jit(jax.shard_map(lambda x: hierarchical_all_to_all(x, "node", "local", 1, 1), mesh=mesh,
    ...                           in_specs=spec, out_specs=spec))
    >>> x = jnp.arange(64.0).reshape(8, 8)   # device i holds row i: [8i, ..., 8i+7]
    >>> bool((f(x) == x.T).all())            # device j receives element j of every row
    True
    """
    m, l = lax.axis_size(outer_axis), lax.axis_size(inner_axis)
    split_axis, concat_axis = _normalize_axes(x.ndim, split_axis, concat_axis)
    blocks = _to_blocks(x, m * l, split_axis, tiled)
    rest = blocks.shape[1:]
    # [dest node m', dest local l'] -> [dest local, dest node]: stage 1 moves column l' to local peer l'.
    stage1_lm = _exchange_blocks(jnp.swapaxes(blocks.reshape((m, l) + rest), 0, 1), inner_axis)
    # Now [source local l'', dest node m'], all bound for our local index; stage 2 moves row m' to node m'.
    stage2_ml = _exchange_blocks(jnp.swapaxes(stage1_lm, 0, 1), outer_axis)
    # [source node, source local]: flattening gives source order j = node * l + local.
    return _from_blocks(stage2_ml.reshape((m * l,) + rest), concat_axis, tiled)


def _normalize_axes(ndim: int, split_axis: int, concat_axis: int) -> tuple[int, int]:
    # The output has the input's rank either way (tiled=False drops one axis, adds one).
    for name, a in (("split_axis", split_axis), ("concat_axis", concat_axis)):
        if not -ndim <= a < ndim:
            raise ValueError(f"all_to_all: {name}={a} is out of range for a rank-{ndim} buffer")
    return split_axis % ndim, concat_axis % ndim


def all_to_all(
    x: jax.Array,
    mesh: Mesh,
    axis_names: tuple[str, str],
    *,
    split_axis: int,
    concat_axis: int,
    tiled: bool = True,
    algorithm: str = "hierarchical",
) -> jax.Array:
    """Runs an all-to-all over two mesh axes on a global array, one dim-0 slice per device.

    `x`'s dimension 0 is split over `axis_names` = (outer, inner); each
    device applies the all-to-all to its slice (`split_axis`/`concat_axis`
    index the slice), and the outputs are joined again along dimension 0.
    `algorithm`: "hierarchical" (two levels), "direct" (flat rounds over
    both axes) or "lax" (`lax.all_to_all`, the reference). Recompiles every
    call, like `all_reduce`.

    >>> from jax.sharding import AxisType
    >>> mesh = jax.make_mesh((2, 4), ("node", "local"), axis_types=(AxisType.Auto,) * 2)
    >>> x = jnp.arange(64.0).reshape(8, 8)
    >>> y = all_to_all(x, mesh, ("node", "local"), split_axis=1, concat_axis=1)
    >>> bool((y == all_to_all(x, mesh, ("node", "local"), split_axis=1, concat_axis=1, algorithm="lax")).all())
    True
    """
    outer, inner = axis_names
    # lax.all_to_all (jax 0.10.2) hands negative axes unnormalized to the StableHLO
    # op, which can crash the process; normalize for every algorithm alike.
    split_axis, concat_axis = _normalize_axes(x.ndim, split_axis, concat_axis)
    ops = {
        "hierarchical": lambda b: hierarchical_all_to_all(b, outer, inner, split_axis, concat_axis, tiled=tiled),
        "direct": lambda b: direct_all_to_all(b, (outer, inner), split_axis, concat_axis, tiled=tiled),
        "lax": lambda b: lax.all_to_all(b, (outer, inner), split_axis, concat_axis, tiled=tiled),
    }
    if algorithm not in ops:
        raise ValueError(f"all_to_all: unknown algorithm {algorithm!r}; choose one of {ALL_TO_ALL_ALGORITHMS}")
    spec = PartitionSpec((outer, inner))
    return jax.jit(jax.shard_map(ops[algorithm], mesh=mesh, in_specs=spec, out_specs=spec))(x)
