"""Build a `jax.sharding.Mesh` with meshwork's six named axes.

Axes, outermost first: `stage` (pipeline), `data`, `fsdp`, `expert`,
`sequence`, `tensor`. Inner axes change fastest over the device list, so
`tensor` (the most communication-hungry) lands on neighbouring devices.

    >>> mesh = make_mesh({"data": 2, "fsdp": -1})
    >>> dict(mesh.shape) == {**dict.fromkeys(MESH_AXES, 1), "data": 2, "fsdp": jax.device_count() // 2}
    True
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import AxisType, Mesh

MESH_AXES = ("stage", "data", "fsdp", "expert", "sequence", "tensor")


class MeshSizeError(ValueError):
    """Mesh sizes that cannot be laid over the available devices."""


def resolve_mesh_shape(sizes: Mapping[str, int], n_devices: int) -> tuple[int, ...]:
    """Returns the sizes in MESH_AXES order, with a single -1 filled in.

    Missing axes have size 1. Raises MeshSizeError (message names the axes and
    the fix) when the product is not `n_devices`.

    >>> resolve_mesh_shape({"data": -1, "tensor": 2}, 8)
    (1, 4, 1, 1, 1, 2)
    """
    unknown = set(sizes) - set(MESH_AXES)
    if unknown:
        raise MeshSizeError(f"mesh: unknown axes {sorted(unknown)}; the axes are {', '.join(MESH_AXES)}")
    shape = [int(sizes.get(a, 1)) for a in MESH_AXES]
    fill = [i for i, s in enumerate(shape) if s == -1]
    if len(fill) > 1:
        raise MeshSizeError("mesh: at most one axis may be -1")
    known = math.prod(s for s in shape if s != -1)
    desc = " x ".join(f"{a}={s}" for a, s in zip(MESH_AXES, shape) if s != 1)
    if fill:
        if n_devices % known:
            raise MeshSizeError(
                f"mesh: {desc or 'sizes'} cannot fill {n_devices} devices ({known} does not divide {n_devices}); "
                f"choose sizes whose product divides {n_devices}"
            )
        shape[fill[0]] = n_devices // known
    elif known != n_devices:
        raise MeshSizeError(
            f"mesh: {desc or 'all sizes 1'} uses {known} devices but {n_devices} are available; "
            f"make the sizes multiply to {n_devices} or set one axis to -1"
        )
    return tuple(shape)


def make_mesh(sizes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds a Mesh over `devices` (default: all) with Auto axis types.

    Auto (GSPMD) axes are explicit here because `jax.make_mesh` defaults to
    Explicit axes since jax 0.10, which rejects the sharding-in-types-free
    code in `models/`.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(sizes, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)
