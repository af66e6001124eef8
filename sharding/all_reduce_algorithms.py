"""All-reduce spelled out with `ppermute` sends: three algorithms, each equal to `lax.psum`.

- `naive_all_reduce`: everyone sends to device 0, which adds and sends back.
- `ring_all_reduce`: reduce-scatter then all-gather around a ring, 1/P chunks.
- `tree_all_reduce`: recursive doubling, partner `i XOR 2^k`, log2(P) rounds.

Each takes a per-device buffer and a mesh axis name, so it runs inside your
own `jax.shard_map`; `all_reduce` wraps it for a global array. Every send is
noted by `sharding/point_to_point.py`'s `record_transfers`.

    >>> from meshwork.sharding.mesh import make_mesh
    >>> mesh = make_mesh({"data": -1})
    >>> x = jnp.arange(3.0 * mesh.size).reshape(mesh.size, 3)   # one row per device
    >>> y = all_reduce(x, mesh, "data", algorithm="ring")
    >>> bool((y == x.sum(0)).all())                             # every row is the sum
    True

Naive and ring move the same total, 2(P-1)N, but naive pushes half of it
through device 0 one message at a time; ring spreads it evenly. Tree sends
more bytes than ring but in log2(P) rounds rather than 2(P-1): it wins when
latency, not bandwidth, dominates (small buffers). The bytes each sends:
`sharding/collective_traffic.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from meshwork.sharding.point_to_point import AxisName, put_block, send, take_block

__all__ = [
    "ALL_REDUCE_ALGORITHMS",
    "all_reduce",
    "naive_all_reduce",
    "require_power_of_two",
    "ring_all_reduce",
    "tree_all_reduce",
]

ALL_REDUCE_ALGORITHMS = ("naive", "ring", "tree", "psum")


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
        total = total + send(x, axis_name, [(src, 0)])
    for dst in range(1, n):
        total = jnp.where(me == dst, send(total, axis_name, [(0, dst)]), total)
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
    chunks_NC = jnp.pad(flat, (0, chunk * n - flat.size)).reshape(n, chunk)
    right = [(i, (i + 1) % n) for i in range(n)]

    # Reduce-scatter. Round s: send the partial sum of chunk (me - s); receive
    # the partial of chunk (me - 1 - s) from the left and add our part.
    for s in range(n - 1):
        got = send(take_block(chunks_NC, (me - s) % n), axis_name, right)
        k = (me - 1 - s) % n
        chunks_NC = put_block(chunks_NC, k, take_block(chunks_NC, k) + got)

    # All-gather. Device me starts with chunk (me + 1) complete; round s sends
    # the complete chunk (me + 1 - s) and receives chunk (me - s).
    for s in range(n - 1):
        got = send(take_block(chunks_NC, (me + 1 - s) % n), axis_name, right)
        chunks_NC = put_block(chunks_NC, (me - s) % n, got)

    return chunks_NC.reshape(-1)[: flat.size].reshape(x.shape)


def require_power_of_two(n: int, what: str) -> None:
    """ValueError naming `what` unless n is a power of two (recursive doubling's condition)."""
    if n & (n - 1) or n < 1:
        raise ValueError(
            f"{what}: recursive doubling needs a power-of-two number of devices, got {n}; "
            f"use ring_all_reduce, or a mesh axis of size 1, 2, 4, 8, ..."
        )


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
    require_power_of_two(n, f"tree_all_reduce over {axis_name!r}")
    for k in range(n.bit_length() - 1):
        x = x + send(x, axis_name, [(i, i ^ (1 << k)) for i in range(n)])
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
