"""Weight sync: a trainer's sharded parameters into a serving engine's layout, on device.

    sync = WeightSync(server, trainer_shardings)             # a Generator or a Server; compiles once
    stats = sync(trainer_params)                             # after each update: move, then swap in
    print(stats.line())                                      # bytes and seconds of this sync
    sync = WeightSync(server, lora_shardings, kind=LoRAParam)  # LoRA: only the adapters move

`trainer_params` is an nnx.State (or the matching tree) of the engine's parameters as the trainer
holds them, e.g. FSDP over 8 devices; `trainer_shardings` says how (a tree prefix, as
`partitioning.variable_shardings` gives). The engine's layout is read from the arrays it holds
(data replicas x tensor, `Generator(model, mesh=..., rules=...)`). Two placements, chosen from the
device sets:

- colocated (the engine's devices are the trainer's, time-shared): one compiled program takes the
  trainer's arrays and returns the engine's. Without help GSPMD reshards fsdp -> tensor by
  all-gathering each whole weight and slicing it ("involuntary full rematerialization"); every
  array is first constrained to a waypoint (`waypoint`: the engine's spec plus the trainer's split
  dim over the engine axes that would otherwise replicate it), so the program is an all-to-all over
  `tensor` then an all-gather over `data`, and each device receives exactly the part of its engine
  shard it does not already hold (`missing_bytes`).
- split (disjoint device sets, e.g. trainer on 0-3, engine on 4-7): a compiled program on the
  trainer's devices reshards to the engine's layout laid over the trainer's devices (same specs,
  same mesh shape), then `jax.device_put` copies each shard to the engine device with the same
  index: a device-to-device copy of exactly the engine's shard bytes. A direct `device_put` from
  the trainer's layout would take jax's slow path, which reads the whole array to the host.

With `kind=LoRAParam` (models/lora.py) only the adapters move; the engine keeps base and adapters unmerged
(models/lora.py's `LoRA` modules), so the frozen base never moves and nothing is re-merged.

The new arrays replace the engine's through its public `state` attribute (a new nnx.State: the
programs the engine compiled take the state as an argument, so nothing recompiles). Swap between
engine steps: from the thread that steps the Server, or while no request runs. A Server's prefix
cache is dropped with the swap (its pages hold the old weights' keys and values).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshwork.engine.per_layer import abstract_stacked, unstack_layers
from meshwork.partitioning import per_leaf
from meshwork.sharding.hlo import collective_summary

__all__ = ["SyncStats", "WeightSync", "missing_bytes", "shard_bytes", "waypoint"]


@dataclasses.dataclass(frozen=True)
class SyncStats:
    """What one sync moved and how long it took.

    `engine_bytes`: the moved parameters' bytes in the engine's layout, summed over the engine's
    devices (every replica's copy counted). `collective_bytes`: what one device sends in the
    compiled reshard program's collectives (sharding/hlo.py's ring accounting); `expected_bytes`:
    the most any device must receive, its engine shards less what it already holds
    (`missing_bytes`). `copied_bytes`: bytes copied shard by shard from the trainer's devices to
    the engine's (split placement; 0 colocated). `seconds`: wall time of the sync, arrays ready.
    """

    placement: str
    leaves: int
    engine_bytes: int
    collective_bytes: int
    expected_bytes: int
    copied_bytes: int
    seconds: float

    def line(self) -> str:
        return (
            f"weight sync ({self.placement}): {self.leaves} arrays, {self.engine_bytes / 2**20:.3f} MiB in the "
            f"engine's layout, {self.collective_bytes} B per device in collectives (expected "
            f"{self.expected_bytes}), {self.copied_bytes} B copied across devices, {self.seconds * 1e3:.1f} ms"
        )


def shard_bytes(shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.Sharding) -> int:
    """Bytes of one device's shard of an array of `shape` laid out by `sharding`."""
    return math.prod(sharding.shard_shape(tuple(shape))) * np.dtype(dtype).itemsize


def _overlap(a: tuple[slice, ...], b: tuple[slice, ...], shape: tuple[int, ...]) -> int:
    """Elements in both index boxes (slices as `devices_indices_map` gives them)."""
    n = 1
    for sa, sb, size in zip(a, b, shape):
        lo_a, hi_a, _ = sa.indices(size)
        lo_b, hi_b, _ = sb.indices(size)
        n *= max(0, min(hi_a, hi_b) - max(lo_a, lo_b))
    return n


def missing_bytes(arrays: list[Any], src: list[jax.sharding.Sharding], dst: list[jax.sharding.Sharding]) -> dict:
    """{device: bytes} each destination device must receive to hold its shards under `dst`: for
    every array, its `dst` shard less the part of it that the same device holds under `src`.
    The least any reshard can move; for fsdp 8 -> data 4 x tensor 2 over the same devices in the
    same order it is 7/8 of every device's engine shard."""
    out: dict = {}
    for x, s, d in zip(arrays, src, dst):
        shape, itemsize = tuple(x.shape), np.dtype(x.dtype).itemsize
        held = s.devices_indices_map(shape)
        for device, index in d.devices_indices_map(shape).items():
            need = math.prod(d.shard_shape(shape))
            have = _overlap(index, held[device], shape) if device in held else 0
            out[device] = out.get(device, 0) + (need - have) * itemsize
    return out


def _axes(entry) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def waypoint(src: jax.sharding.Sharding, dst: jax.sharding.Sharding, shape: tuple[int, ...]):
    """The layout between `src` and `dst` (both over the same devices) that keeps a reshard minimal:
    `dst`'s spec, with the first dim that `src` splits and `dst` does not split over the axes of
    `dst`'s mesh that `dst` leaves unused for this array. Reaching it is an all-to-all (the split
    moves to the dims `dst` splits), leaving it an all-gather over those unused axes. `dst` itself
    when there is nothing to keep."""
    if not isinstance(src, NamedSharding) or not isinstance(dst, NamedSharding):
        return dst
    mesh = dst.mesh
    used = {a for entry in dst.spec for a in _axes(entry)}
    free = tuple(a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1)
    spec = list(dst.spec) + [None] * (len(shape) - len(dst.spec))
    ways = math.prod(mesh.shape[a] for a in free)
    for i, entry in enumerate(list(src.spec)[: len(shape)]):
        if free and _axes(entry) and spec[i] is None and shape[i] % ways == 0:
            spec[i] = free if len(free) > 1 else free[0]
            break
    return NamedSharding(mesh, PartitionSpec(*spec))


def _staged(src: list, dst: list, shapes: list) -> Any:
    """The identity on a list of arrays, each constrained to its waypoint (jitted with out `dst`)."""
    mids = [waypoint(s, d, shape) for s, d, shape in zip(src, dst, shapes)]

    def move(leaves):
        return [jax.lax.with_sharding_constraint(x, m) for x, m in zip(leaves, mids)]

    return move


def _over(devices: list, dst: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """`dst`'s layout laid over `devices` (in mesh order) instead of its own devices."""
    if not isinstance(dst, NamedSharding):
        raise ValueError(f"weight sync: the split placement needs NamedShardings on the engine; got {dst}")
    mesh = Mesh(np.array(devices).reshape(dst.mesh.devices.shape), dst.mesh.axis_names, axis_types=dst.mesh.axis_types)
    return NamedSharding(mesh, dst.spec, memory_kind=dst.memory_kind)


def _device_order(sharding: jax.sharding.Sharding) -> list:
    mesh = getattr(sharding, "mesh", None)
    return list(mesh.devices.flat) if mesh is not None else sorted(sharding.device_set, key=lambda d: d.id)


class WeightSync:
    """Moves a trainer's parameters into `engine` (a Generator, or a Server through its `gen`) on
    device, in the engine's layout, then swaps them in. Compiles its reshard program once, here.

    `trainer_shardings`: how the trainer holds the parameters it will pass (a tree prefix of the
    engine's `kind` state: `nnx.Param`, or `LoRAParam` for the adapters alone). The placement is
    colocated when both sides use the same devices, split when the device sets are disjoint.
    """

    def __init__(self, engine: Any, trainer_shardings: Any, *, kind: type = nnx.Param):
        self.engine, self.gen = engine, getattr(engine, "gen", engine)
        self.kind = kind  # the nnx.Variable type that moves
        # The trainer's layout: stacked blocks (the engine holds them layer by layer, src/meshwork/engine/per_layer.py).
        target = nnx.filter_state(abstract_stacked(self.gen.state), self.kind)
        arrays, self.treedef = jax.tree.flatten(target)
        if not arrays:
            raise ValueError(f"weight sync: the engine holds no {self.kind.__name__} to sync")
        src = jax.tree.leaves(
            per_leaf(trainer_shardings, target), is_leaf=lambda s: isinstance(s, jax.sharding.Sharding)
        )
        dst = [x.sharding for x in arrays]
        if len(src) != len(arrays):
            raise ValueError(f"weight sync: {len(src)} trainer shardings for {len(arrays)} engine arrays")
        self.dst, shapes = dst, [tuple(x.shape) for x in arrays]
        src_devices, dst_devices = set(src[0].device_set), set(dst[0].device_set)
        if src_devices == dst_devices:
            self.placement, out = "colocated", dst
        elif not src_devices & dst_devices and len(src_devices) == len(dst_devices):
            self.placement = "split"
            out = [_over(_device_order(s), d) for s, d in zip(src, dst)]  # the engine's layout, trainer's devices
        else:
            raise ValueError(
                f"weight sync: trainer on {len(src_devices)} devices, engine on {len(dst_devices)}, "
                "sharing some; use the same devices (colocated) or as many disjoint ones (split)"
            )
        abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(arrays, src)]
        self.program = jax.jit(_staged(src, out, shapes), out_shardings=out).lower(abstract).compile()
        self.collective_bytes = sum(v["bytes"] for v in collective_summary(self.program.as_text()).values())
        self.expected_bytes = max(missing_bytes(arrays, src, out).values())
        self.engine_bytes = sum(shard_bytes(x.shape, x.dtype, d) * len(d.device_set) for x, d in zip(arrays, dst))
        self.copied_bytes = self.engine_bytes if self.placement == "split" else 0

    def __call__(self, params: Any) -> SyncStats:
        """Moves `params` (the trainer's arrays; of another `kind`, extra leaves are
        dropped) into the engine's layout and swaps them into the engine. Returns the sync's stats."""
        start = time.perf_counter()
        leaves = jax.tree.leaves(nnx.filter_state(params, self.kind) if isinstance(params, nnx.State) else params)
        if len(leaves) != self.treedef.num_leaves:
            raise ValueError(f"weight sync: {len(leaves)} arrays given for the engine's {self.treedef.num_leaves}")
        moved = self.program(leaves)
        if self.placement == "split":
            moved = jax.device_put(moved, self.dst)  # shard for shard: the indices already match
        moved = jax.block_until_ready(moved)
        layered = unstack_layers(jax.tree.unflatten(self.treedef, moved), self.gen.layer_stacks)
        self.gen.state = nnx.merge_state(self.gen.state, layered)
        if (pages := getattr(self.engine, "pages", None)) is not None:
            pages.forget_cached()  # a Server's prefix cache holds the old weights' keys and values
        return SyncStats(
            self.placement,
            len(moved),
            self.engine_bytes,
            self.collective_bytes,
            self.expected_bytes,
            self.copied_bytes,
            time.perf_counter() - start,
        )
