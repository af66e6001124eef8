"""Collective algorithms spelled out with `jax.lax.ppermute`, and what each one sends.

`lax.psum` and `lax.all_to_all` hide their algorithm inside XLA. The
functions here build the same results out of point-to-point sends (each
`ppermute` is one round in which every listed source sends one buffer), so
the traffic is visible in the code, countable while tracing, and readable in
the compiled HLO as `collective-permute` ops:

- `naive_all_reduce`: everyone sends to device 0, which adds and sends back.
- `ring_all_reduce`: reduce-scatter then all-gather around a ring, 1/P chunks.
- `tree_all_reduce`: recursive doubling, partner `i XOR 2^k`, log2(P) rounds.
- `hierarchical_all_to_all`: exchange inside a node, then across nodes.

Each takes a per-device buffer and a mesh axis name, so it runs inside your
own `jax.shard_map`; `all_reduce` and `all_to_all` wrap it for a global array.

    >>> from meshwork.sharding.mesh import make_mesh
    >>> mesh = make_mesh({"data": -1})
    >>> x = jnp.arange(3.0 * mesh.size).reshape(mesh.size, 3)   # one row per device
    >>> y = all_reduce(x, mesh, "data", algorithm="ring")
    >>> bool((y == x.sum(0)).all())                             # every row is the sum
    True

Bytes sent per device, for an N-byte buffer on P devices (`bytes_sent_formula`):

    naive    device 0: (P-1) N; the others: N.     max (P-1) N, mean 2(P-1)N/P
    ring     2 (P-1) / P * N on every device        (N split into P chunks)
    tree     log2(P) * N on every device
    a2a      direct: (P-1)/P N; hierarchical (M nodes of L): ((L-1)/L + (M-1)/M) N

Naive and ring move the same total, 2(P-1)N, but naive pushes half of it
through device 0 one message at a time; ring spreads it evenly. Tree sends
more bytes than ring but in log2(P) rounds rather than 2(P-1): it wins when
latency, not bandwidth, dominates (small buffers).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import re
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

AxisName = str | tuple[str, ...]

ALL_REDUCE_ALGORITHMS = ("naive", "ring", "tree", "psum")
ALL_TO_ALL_ALGORITHMS = ("hierarchical", "direct", "lax")


# ---------------------------------------------------------------------------
# Traffic ledger: every send goes through `_send`, which notes its size.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One `ppermute` round: every source in `pairs` sends `nbytes` to its target.

    `pairs` are (source, target) positions along `axes` (linear index, first
    axis major), the same numbering `lax.axis_index(axes)` uses.
    """

    axes: tuple[str, ...]
    pairs: tuple[tuple[int, int], ...]
    nbytes: int


@dataclasses.dataclass
class TransferLog:
    """The `Transfer`s traced inside one `record_transfers()` block."""

    transfers: list[Transfer] = dataclasses.field(default_factory=list)

    def bytes_sent(self, mesh: Mesh) -> np.ndarray:
        """Bytes each device of `mesh` sent, as an int array shaped like `mesh.devices`.

        A `ppermute` over an axis subset (say `local`) runs once per group of
        the other axes, so every device whose position along `axes` is a
        source is charged, whatever its other coordinates.
        """
        out = np.zeros(mesh.devices.shape, dtype=np.int64)
        names = list(mesh.axis_names)
        for t in self.transfers:
            sources = {s for s, d in t.pairs if s != d}  # a self-send moves nothing
            dims = [names.index(a) for a in t.axes]
            sizes = [mesh.devices.shape[k] for k in dims]
            for coord in np.ndindex(mesh.devices.shape):
                if int(np.ravel_multi_index([coord[k] for k in dims], sizes)) in sources:
                    out[coord] += t.nbytes
        return out


_LOG: contextvars.ContextVar[TransferLog | None] = contextvars.ContextVar("meshwork_transfers", default=None)


@contextlib.contextmanager
def record_transfers() -> Iterator[TransferLog]:
    """Collects the sends of the algorithms in this module traced inside the block.

    Counting happens at trace time (shapes are static there, so the count is
    exact), so trace inside the block: a jitted function already in jit's
    cache is not retraced and records nothing. `jax.eval_shape` traces
    without compiling.

    >>> from meshwork.sharding.mesh import make_mesh
    >>> mesh = make_mesh({"data": -1})
    >>> x = jnp.zeros((mesh.size, 4), jnp.float32)       # 16 bytes per device
    >>> with record_transfers() as log:
    ...     _ = jax.eval_shape(lambda x: all_reduce(x, mesh, "data", algorithm="tree"), x)
    >>> len(log.transfers) == math.log2(mesh.size)
    True
    >>> bool((log.bytes_sent(mesh) == 16 * math.log2(mesh.size)).all())
    True
    """
    log = TransferLog()
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)


def _axes(axis_name: AxisName) -> tuple[str, ...]:
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def _send(x: jax.Array, axis_name: AxisName, pairs: Sequence[tuple[int, int]]) -> jax.Array:
    """`lax.ppermute`, noted in the active TransferLog. Devices not a target get zeros."""
    pairs = tuple((int(s), int(d)) for s, d in pairs)
    log = _LOG.get()
    if log is not None:
        log.transfers.append(Transfer(_axes(axis_name), pairs, int(x.size) * x.dtype.itemsize))
    return lax.ppermute(x, axis_name, pairs)


def _take(x: jax.Array, i: jax.Array) -> jax.Array:
    """x[i] along axis 0 for a traced index (the device's own position)."""
    return lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def _put(x: jax.Array, i: jax.Array, v: jax.Array) -> jax.Array:
    return lax.dynamic_update_index_in_dim(x, v, i, 0)


# ---------------------------------------------------------------------------
# All-reduce: three algorithms, each equal to lax.psum(x, axis_name).
# ---------------------------------------------------------------------------


def naive_all_reduce(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Sum of `x` over `axis_name`: gather to device 0, add there, send back.

    2(P-1) rounds, one message each, since a ppermute lets device 0 receive
    (and send) only one buffer per round. Device 0 sends (P-1) N bytes, the
    others N each. Call inside `jax.shard_map`.

    >>> from meshwork.sharding.mesh import make_mesh
    >>> mesh = make_mesh({"data": -1})
    >>> f = jax.jit(jax.shard_map(lambda x: naive_all_reduce(x, "data"), mesh=mesh,
    ...                           in_specs=PartitionSpec("data"), out_specs=PartitionSpec("data")))
    >>> f(jnp.ones((mesh.size,))).tolist() == [float(mesh.size)] * mesh.size
    True
    """
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    total = x
    for src in range(1, n):
        # Only device 0 receives a nonzero buffer; elsewhere this adds zeros.
        total = total + _send(x, axis_name, [(src, 0)])
    for dst in range(1, n):
        total = jnp.where(me == dst, _send(total, axis_name, [(0, dst)]), total)
    return total


def ring_all_reduce(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Sum of `x` over `axis_name` by a ring: reduce-scatter, then all-gather.

    The buffer is flattened and cut into P chunks (zero-padded at the end when
    P does not divide its size). In each of P-1 reduce-scatter rounds device i
    passes one partial chunk to i+1, which adds its own; afterwards device i
    owns the full sum of chunk i+1. P-1 all-gather rounds pass the finished
    chunks on around the ring. Every device sends 2(P-1) chunks: 2(P-1)/P * N
    bytes, independent of P for large P. Call inside `jax.shard_map`.

    >>> from meshwork.sharding.mesh import make_mesh
    >>> mesh = make_mesh({"data": -1})
    >>> f = jax.jit(jax.shard_map(lambda x: ring_all_reduce(x, "data"), mesh=mesh,
    ...                           in_specs=PartitionSpec("data"), out_specs=PartitionSpec("data")))
    >>> x = jnp.arange(mesh.size * 5.0).reshape(mesh.size, 5)  # 5 elements: padded
    >>> bool(jnp.allclose(f(x), x.sum(0)))
    True
    """
    n = lax.axis_size(axis_name)
    if n == 1:
        return x
    me = lax.axis_index(axis_name)
    flat = x.reshape(-1)
    chunk = -(-flat.size // n)
    chunks_PC = jnp.pad(flat, (0, chunk * n - flat.size)).reshape(n, chunk)
    right = [(i, (i + 1) % n) for i in range(n)]

    # Reduce-scatter. Round s: send the partial sum of chunk (me - s); receive
    # the partial of chunk (me - 1 - s) from the left and add our part.
    for s in range(n - 1):
        got = _send(_take(chunks_PC, (me - s) % n), axis_name, right)
        k = (me - 1 - s) % n
        chunks_PC = _put(chunks_PC, k, _take(chunks_PC, k) + got)

    # All-gather. Device me starts with chunk (me + 1) complete; round s sends
    # the complete chunk (me + 1 - s) and receives chunk (me - s).
    for s in range(n - 1):
        got = _send(_take(chunks_PC, (me + 1 - s) % n), axis_name, right)
        chunks_PC = _put(chunks_PC, (me - s) % n, got)

    return chunks_PC.reshape(-1)[: flat.size].reshape(x.shape)


def _require_power_of_two(n: int, what: str) -> None:
    if n & (n - 1) or n < 1:
        raise ValueError(
            f"{what}: recursive doubling needs a power-of-two number of devices, got {n}; "
            f"use ring_all_reduce, or a mesh axis of size 1, 2, 4, 8, ...")


def tree_all_reduce(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Sum of `x` over `axis_name` by recursive doubling (butterfly).

    Round k (k = 0 .. log2(P)-1): device i swaps its whole partial sum with
    device i XOR 2^k and adds. After round k every device holds the sum over
    its aligned group of 2^(k+1) devices. log2(P) rounds of N bytes each.
    Both partners compute a + b in the same floating-point order (addition is
    commutative), so all devices end bitwise equal. P must be a power of two
    (ValueError otherwise). Call inside `jax.shard_map`.

    >>> from meshwork.sharding.mesh import make_mesh
    >>> mesh = make_mesh({"data": -1})
    >>> f = jax.jit(jax.shard_map(lambda x: tree_all_reduce(x, "data"), mesh=mesh,
    ...                           in_specs=PartitionSpec("data"), out_specs=PartitionSpec("data")))
    >>> f(jnp.arange(float(mesh.size))).tolist() == [mesh.size * (mesh.size - 1) / 2] * mesh.size
    True
    """
    n = lax.axis_size(axis_name)
    _require_power_of_two(n, f"tree_all_reduce over {axis_name!r}")
    for k in range(n.bit_length() - 1):
        x = x + _send(x, axis_name, [(i, i ^ (1 << k)) for i in range(n)])
    return x


_ALL_REDUCE: dict[str, Callable[[jax.Array, AxisName], jax.Array]] = {
    "naive": naive_all_reduce,
    "ring": ring_all_reduce,
    "tree": tree_all_reduce,
    "psum": lambda x, axis_name: lax.psum(x, axis_name),
}


def all_reduce(x: jax.Array, mesh: Mesh, axis_name: AxisName, *, algorithm: str = "ring") -> jax.Array:
    """Runs one all-reduce algorithm on a global array whose rows are the devices' buffers.

    `x`'s dimension 0 is split over `axis_name` (P devices): device i's buffer
    is its slice. The result has `x`'s shape and sharding, every slice
    replaced by the sum of all slices. `algorithm` is one of
    ALL_REDUCE_ALGORITHMS ("psum" is XLA's own, as a reference). Traces and
    compiles on every call, so it can be counted with `record_transfers`;
    inside a real program call e.g. `ring_all_reduce` in your own shard_map.

    >>> from meshwork.sharding.mesh import make_mesh
    >>> mesh = make_mesh({"data": -1})
    >>> all_reduce(jnp.ones((mesh.size, 2)), mesh, "data", algorithm="naive")[0].tolist() == [mesh.size] * 2
    True
    """
    if algorithm not in _ALL_REDUCE:
        raise ValueError(f"all_reduce: unknown algorithm {algorithm!r}; choose one of {ALL_REDUCE_ALGORITHMS}")
    spec = PartitionSpec(axis_name)
    # A fresh function object each call, so jit retraces and a TransferLog sees the sends.
    body = functools.partial(_ALL_REDUCE[algorithm], axis_name=axis_name)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))(x)


# ---------------------------------------------------------------------------
# All-to-all, equal to lax.all_to_all(x, (outer, inner), split, concat, tiled).
# ---------------------------------------------------------------------------


def _to_blocks(x: jax.Array, n: int, split_axis: int, tiled: bool) -> jax.Array:
    """x -> (n, ...): block j is what goes to device j."""
    if tiled:
        if x.shape[split_axis] % n:
            raise ValueError(
                f"all_to_all: split_axis {split_axis} has size {x.shape[split_axis]}, not divisible by "
                f"the {n} devices; pad it or choose another axis")
        x = x.reshape(x.shape[:split_axis] + (n, x.shape[split_axis] // n) + x.shape[split_axis + 1:])
    elif x.shape[split_axis] != n:
        raise ValueError(
            f"all_to_all(tiled=False): split_axis {split_axis} has size {x.shape[split_axis]} but there are "
            f"{n} devices; it must equal the device count (or use tiled=True)")
    return jnp.moveaxis(x, split_axis, 0)


def _from_blocks(b: jax.Array, concat_axis: int, tiled: bool) -> jax.Array:
    """(n, ...) with block j from device j -> the all_to_all output layout."""
    b = jnp.moveaxis(b, 0, concat_axis)
    if not tiled:
        return b  # the device axis becomes a new dimension at concat_axis
    s = b.shape
    return b.reshape(s[:concat_axis] + (s[concat_axis] * s[concat_axis + 1],) + s[concat_axis + 2:])


def _exchange_blocks(blocks: jax.Array, axis_name: AxisName) -> jax.Array:
    """The all-to-all on a leading block axis of size P: out[j] = device j's blocks[me].

    P-1 rounds; in round s device i sends blocks[i + s] to device i + s (a
    shift by s is a permutation, so everyone sends and receives once).
    """
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    out = blocks
    for s in range(1, n):
        got = _send(_take(blocks, (me + s) % n), axis_name, [(i, (i + s) % n) for i in range(n)])
        out = _put(out, (me - s) % n, got)
    return out


def direct_all_to_all(x: jax.Array, axis_name: AxisName, split_axis: int, concat_axis: int, *,
                      tiled: bool = True) -> jax.Array:
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


def hierarchical_all_to_all(x: jax.Array, outer_axis: str, inner_axis: str, split_axis: int,
                            concat_axis: int, *, tiled: bool = True) -> jax.Array:
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
    stage1_LM = _exchange_blocks(jnp.swapaxes(blocks.reshape((m, l) + rest), 0, 1), inner_axis)
    # Now [source local l'', dest node m'], all bound for our local index; stage 2 moves row m' to node m'.
    stage2_ML = _exchange_blocks(jnp.swapaxes(stage1_LM, 0, 1), outer_axis)
    # [source node, source local]: flattening gives source order j = node * L + local.
    return _from_blocks(stage2_ML.reshape((m * l,) + rest), concat_axis, tiled)


def _normalize_axes(ndim: int, split_axis: int, concat_axis: int) -> tuple[int, int]:
    # The output has the input's rank either way (tiled=False drops one axis, adds one).
    for name, a in (("split_axis", split_axis), ("concat_axis", concat_axis)):
        if not -ndim <= a < ndim:
            raise ValueError(f"all_to_all: {name}={a} is out of range for a rank-{ndim} buffer")
    return split_axis % ndim, concat_axis % ndim


def all_to_all(x: jax.Array, mesh: Mesh, axis_names: tuple[str, str], *, split_axis: int, concat_axis: int,
               tiled: bool = True, algorithm: str = "hierarchical") -> jax.Array:
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


# ---------------------------------------------------------------------------
# Traffic: the formulas, and what a compiled program really contains.
# ---------------------------------------------------------------------------

TRAFFIC_ALGORITHMS = ("naive", "ring", "tree", "direct_all_to_all", "hierarchical_all_to_all")


def bytes_sent_formula(algorithm: str, n_bytes: int, n_devices: int, *, n_local: int | None = None,
                       itemsize: int = 1) -> np.ndarray:
    """Bytes each device sends, per the textbook formula, as an int array of length P.

    `n_bytes` (N) is the size of each device's buffer; entry i is device i
    along the collective's axis (for all-to-all: j = node * L + local).

    - naive: device 0 sends the sum to the P-1 others, (P-1) N; every other
      device sends its buffer once, N. Max (P-1) N; mean 2(P-1)N/P.
    - ring: 2 (P-1) chunks of ceil(N / P) bytes, i.e. 2(P-1)/P * N when P
      divides N. Padding is per element: pass `itemsize` so a chunk is a
      whole number of elements.
    - tree: log2(P) * N (P a power of two).
    - direct_all_to_all: (P-1)/P * N.
    - hierarchical_all_to_all: with L = `n_local` devices per node and
      M = P / L nodes, (L-1)/L * N inside the node + (M-1)/M * N across.

    >>> bytes_sent_formula("ring", 1024, 8).tolist() == [1792] * 8     # 2 * 7/8 * 1024
    True
    >>> bytes_sent_formula("naive", 100, 4).tolist()
    [300, 100, 100, 100]
    >>> int(bytes_sent_formula("hierarchical_all_to_all", 64, 8, n_local=4)[0])  # 3/4*64 + 1/2*64
    80
    """
    n, p = int(n_bytes), int(n_devices)
    if algorithm == "naive":
        return np.array([(p - 1) * n] + [n] * (p - 1), dtype=np.int64)
    if algorithm == "ring":
        if p == 1:
            return np.zeros(1, np.int64)
        if n % itemsize:
            raise ValueError(f"bytes_sent_formula: {n} bytes is not a whole number of {itemsize}-byte elements")
        chunk = -(-(n // itemsize) // p) * itemsize
        return np.full(p, 2 * (p - 1) * chunk, dtype=np.int64)
    if algorithm == "tree":
        _require_power_of_two(p, "bytes_sent_formula('tree')")
        return np.full(p, (p.bit_length() - 1) * n, dtype=np.int64)
    if algorithm in ("direct_all_to_all", "hierarchical_all_to_all"):
        if n % p:
            raise ValueError(f"bytes_sent_formula: an all-to-all cuts {n} bytes into {p} equal blocks; "
                             f"make N a multiple of {p}")
        if algorithm == "direct_all_to_all":
            return np.full(p, (p - 1) * (n // p), dtype=np.int64)
        if n_local is None or n_local < 1 or p % n_local:
            raise ValueError(f"bytes_sent_formula: hierarchical_all_to_all needs n_local, the devices per node, "
                             f"dividing {p}; got {n_local}")
        l, m = n_local, p // n_local
        return np.full(p, (l - 1) * (n // l) + (m - 1) * (n // m), dtype=np.int64)
    raise ValueError(f"bytes_sent_formula: unknown algorithm {algorithm!r}; choose one of {TRAFFIC_ALGORITHMS}")


_PERMUTE_RE = re.compile(
    r"=\s*\(?(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\][^=]*?\s"
    r"collective-permute(?:-start)?\((?P<rest>.*)$")


def _hlo_itemsize(dtype: str) -> int:
    if dtype == "pred":
        return 1
    bits = re.search(r"\d+", dtype)
    if bits is None:
        raise ValueError(f"compiled_traffic: unknown HLO element type {dtype!r}")
    return max(1, int(bits.group()) // 8)


def compiled_traffic(hlo_text: str, n_devices: int) -> tuple[int, np.ndarray]:
    """(number of collective-permutes, bytes each device sends) read from optimized HLO text.

    Parses every `collective-permute` (or `-start`) op: its payload shape
    and its `source_target_pairs`, whose ids are positions in the program's
    device assignment (`mesh.devices.flat` order for a shard_map over the
    whole mesh). This is what XLA will run, after its own optimizations.

    >>> from meshwork.sharding.mesh import make_mesh
    >>> mesh = make_mesh({"data": -1}); p = mesh.size
    >>> f = jax.jit(jax.shard_map(lambda x: ring_all_reduce(x, "data"), mesh=mesh,
    ...             in_specs=PartitionSpec("data"), out_specs=PartitionSpec("data")))
    >>> count, sent = compiled_traffic(f.lower(jnp.zeros((p, p), jnp.float32)).compile().as_text(), p)
    >>> count == 2 * (p - 1), sent.tolist() == [2 * (p - 1) * 4] * p
    (True, True)
    """
    count, sent = 0, np.zeros(n_devices, dtype=np.int64)
    for line in hlo_text.splitlines():
        if "collective-permute-done" in line:
            continue
        match = _PERMUTE_RE.search(line)
        if match is None:
            continue
        count += 1
        dims = [int(d) for d in match["dims"].split(",") if d]
        nbytes = math.prod(dims) * _hlo_itemsize(match["dtype"])
        pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", match["rest"])
        if pairs is None:
            raise ValueError(f"compiled_traffic: no source_target_pairs in {line.strip()[:120]!r}")
        for s, d in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1)):
            if s != d:
                sent[int(s)] += nbytes
    return count, sent
