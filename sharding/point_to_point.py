"""Point-to-point sends, the one building block of the hand-written collectives, and a ledger of them.

`lax.psum` and `lax.all_to_all` hide their algorithm inside XLA. The
algorithms in `sharding/all_reduce_algorithms.py` and
`sharding/all_to_all_algorithms.py` build the same results out of
point-to-point sends (each `ppermute` is one round in which every listed
source sends one buffer), so the traffic is visible in the code, countable
while tracing, and readable in the compiled HLO as `collective-permute` ops.
Every send goes through `send`, which notes its size in the active
`TransferLog` (see `record_transfers`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh

__all__ = ["AxisName", "Transfer", "TransferLog", "put_block", "record_transfers", "send", "take_block"]

AxisName = str | tuple[str, ...]


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
    """Collects the sends of the collective algorithms traced inside the block.

    Counting happens at trace time (shapes are static there, so the count is
    exact), so trace inside the block: a jitted function already in jit's
    cache is not retraced and records nothing. `jax.eval_shape` traces
    without compiling.

    >>> import math, jax.numpy as jnp
    >>> from meshwork.sharding.all_reduce_algorithms import all_reduce
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


def send(x: jax.Array, axis_name: AxisName, pairs: Sequence[tuple[int, int]]) -> jax.Array:
    """`lax.ppermute`, noted in the active TransferLog. Devices not a target get zeros."""
    pairs = tuple((int(s), int(d)) for s, d in pairs)
    log = _LOG.get()
    if log is not None:
        log.transfers.append(Transfer(_axes(axis_name), pairs, int(x.size) * x.dtype.itemsize))
    return lax.ppermute(x, axis_name, pairs)


def take_block(x: jax.Array, i: jax.Array) -> jax.Array:
    """x[i] along axis 0 for a traced index (the device's own position)."""
    return lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def put_block(x: jax.Array, i: jax.Array, v: jax.Array) -> jax.Array:
    """x with x[i] along axis 0 replaced by v, for a traced index."""
    return lax.dynamic_update_index_in_dim(x, v, i, 0)
