"""In-process elasticity: the device set shrinks and grows between steps, the process goes on.

At every step boundary the trainer asks `Elastic.poll(step)` which devices are lost. On CPU a
fault file (`train.fault_file`, default run.dir/lost_devices) says so, one line per fault:

    4 5 6 7            devices 4-7 are lost from now on (edit the file again when they return)
    4 5 6 7 @ 10-20    lost after step 10, back after step 20 (a drill: deterministic, for tests)

When the set changes, `Elastic.change` rebuilds the mesh on the devices left: the same axis
names, the data-parallel axes (data, then fsdp) smaller, the same global batch in more
microbatches so each device's microbatch stays the size it was. The live state moves onto the
new mesh without reading a buffer on a lost device: each new shard is cut from the shards the
survivors hold (replicas, or the ZeRO/fsdp shards they own), and a shard that died with its
devices comes from the fast tier's host copy of this very step (run/fast_tier.py). When
neither covers it, the state goes back to the newest tier, fast or persistent, and the steps
since are trained again. Returning devices join the same way (all shards are alive then, so
`jax.device_put` moves them). Each change is a metrics row: the reason, the device count, the
layout and the seconds it cost.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import time
from collections.abc import Callable
from typing import Any

import jax

from meshwork.config import Config, ConfigError
from meshwork.partitioning import abstract_with_shardings
from meshwork.run.fast_tier import FastTier, block, place_tree
from meshwork.sharding.mesh import MESH_AXES, resolve_mesh_shape

_LINE = re.compile(r"^([\d\s,]+?)\s*(?:@\s*(\d+)\s*(?:-\s*(\d+))?)?\s*$")


@dataclasses.dataclass(frozen=True)
class Fault:
    devices: frozenset[int]
    after: int | None = None  # lost once this step is done (None: now)
    until: int | None = None  # back once this step is done (None: while the line is there)

    def active(self, step: int) -> bool:
        return (self.after is None or step >= self.after) and (self.until is None or step < self.until)


def read_faults(path: pathlib.Path, known: set[int]) -> list[Fault]:
    """The faults `path` lists (none when it is missing); ConfigError for a line it cannot read or a
    device this run does not have."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    faults = []
    for n, line in enumerate(text.splitlines(), 1):
        if not (line := line.split("#")[0].strip()):
            continue
        m = _LINE.match(line)
        if m is None:
            raise ConfigError(
                f"train.fault_file: {path} line {n}: {line!r} is not 'DEVICE_IDS' or "
                f"'DEVICE_IDS @ STEP[-STEP]' (e.g. '4 5 6 7 @ 10-20'); fix the line"
            )
        ids = frozenset(int(x) for x in re.split(r"[\s,]+", m[1].strip()) if x)
        if unknown := sorted(ids - known):
            raise ConfigError(
                f"train.fault_file: {path} line {n} names device {unknown[0]}, which this run does "
                f"not have (its devices: {', '.join(map(str, sorted(known)))}); fix the id"
            )
        faults.append(Fault(ids, int(m[2]) if m[2] else None, int(m[3]) if m[3] else None))
    return faults


def layout_for(cfg: Config, n_full: int, n_left: int) -> tuple[Config, int]:
    """(the config of the largest mesh `n_left` devices can hold, how many of them it uses).

    Only the data-parallel axes change; microbatches grow so each device's microbatch stays the
    size it was on the full mesh (the global batch never changes).
    """
    full = dict(zip(MESH_AXES, resolve_mesh_shape(cfg.mesh.sizes(), n_full)))
    dp_full = full["data"] * full["fsdp"]
    other = n_full // dp_full
    batch, micro = cfg.train.global_batch, cfg.train.microbatches
    for dp in range(min(dp_full, n_left // other), 0, -1):
        if dp_full % dp or (micro * dp_full // dp) > batch or batch % (micro * dp_full // dp * dp):
            continue
        fsdp = full["fsdp"] if dp % full["fsdp"] == 0 else dp
        sizes = {**full, "data": dp // fsdp, "fsdp": fsdp}
        new = cfg.model_copy(
            update={
                "mesh": cfg.mesh.model_copy(update=sizes),
                "train": cfg.train.model_copy(update={"microbatches": micro * dp_full // dp}),
            }
        )
        return new, dp * other
    raise ConfigError(
        f"train.elastic: {n_left} devices left cannot hold the mesh ({other} devices per "
        f"data-parallel replica) with train.global_batch={batch}; the run cannot go on"
    )


@dataclasses.dataclass
class Change:
    trainer: Any
    state: Any
    row: dict = dataclasses.field(default_factory=dict)  # the metrics row: reason, devices, seconds lost
    rolled_back_to: int | None = None  # the step the state went back to when shards were lost for good
    progress: dict | None = None  # ... and its progress (data position)


class Elastic:
    """Watches the fault file and moves the run between device sets (see the module docstring)."""

    def __init__(self, cfg: Config, devices: list, run_dir: pathlib.Path, say: Callable[[str], None]):
        if jax.process_count() > 1:
            raise ConfigError(
                "train.elastic: in-process elasticity runs in one process; with several, set "
                "train.elastic=false (a restart resumes on any mesh)"
            )
        self.cfg, self.devices, self.say = cfg, list(devices), say
        self.path = pathlib.Path(cfg.train.fault_file) if cfg.train.fault_file else run_dir / "lost_devices"
        self.ids = {d.id for d in self.devices}
        self._stamp: tuple | None = None
        self.faults = read_faults(self.path, self.ids)  # a bad file is refused before the compile
        self.lost: frozenset[int] = frozenset()
        self.reached = 0  # the furthest step trained: a drill's steps do not move back with a rollback
        self.trainers: dict[tuple[int, ...], Any] = {}  # compiled once per device set: a return is cheap

    def poll(self, step: int) -> frozenset[int] | None:
        """The lost devices after `step` if they differ from the current set, else None."""
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self.faults = read_faults(self.path, self.ids)
            except ConfigError as e:  # mid-run a bad edit is reported and the last good reading kept
                self.say(f"warning: {e}")
        self.reached = max(self.reached, step)
        lost = frozenset().union(*(f.devices for f in self.faults if f.active(self.reached)))
        return None if lost == self.lost else lost

    def change(
        self,
        lost: frozenset[int],
        trainer,
        state: Any,
        step: int,
        fast: FastTier | None,
        restore_newest: Callable[[Any], tuple[int | None, Any, dict]],
        make_trainer: Callable,
    ) -> Change:
        """Moves `state` (trained to `step`) onto the devices not in `lost`, compiling the step for a new
        device set; `restore_newest(target)` reads the newest tier when no copy of this step survives."""
        t0, before = time.perf_counter(), trainer.mesh.size
        moved = self._move(lost, trainer, state, step, fast, restore_newest, make_trainer)
        moved.row = self.row(lost, moved.trainer, time.perf_counter() - t0, before)
        if moved.rolled_back_to is not None:  # their time is lost too (the goodput clock counts it)
            moved.row["elastic_steps_redone"] = step - moved.rolled_back_to
        return moved

    def _move(self, lost, trainer, state, step, fast, restore_newest, make_trainer) -> Change:
        alive = [d for d in self.devices if d.id not in lost]
        cfg, n_used = layout_for(self.cfg, len(self.devices), len(alive))
        use = alive[:n_used]
        key = tuple(d.id for d in use)
        if key not in self.trainers:
            self.trainers[tuple(d.id for d in trainer.mesh.devices.flat)] = trainer
            self.trainers[key] = make_trainer(cfg, use, trainer.task)
        new = self.trainers[key]
        self.lost = lost
        target = abstract_with_shardings(new.abstract, new.shardings)
        if all(d.id not in lost for d in trainer.mesh.devices.flat):  # growing: every shard is alive
            return Change(new, jax.device_put(state, new.shardings))
        # Shrinking: what the lost devices held is gone (on CPU it is freed here, so a read of it
        # would fail loudly); the new shards are cut from the survivors'.
        for x in jax.tree.leaves(state):
            for shard in x.addressable_shards:
                if shard.device.id in lost:
                    shard.data.delete()
        leaves = [[(idx, data) for idx, data in _alive_pieces(x, lost)] for x in jax.tree.leaves(state)]
        snap = fast.latest() if fast is not None else None
        if snap is not None and snap.step == step:  # what died comes from the host copy of this step
            leaves = [survived + held for survived, held in zip(leaves, snap.leaves)]
        moved = place_tree(leaves, target)
        if moved is not None:
            return Change(new, moved)
        back, state, progress = restore_newest(target)
        if back is None:  # nothing saved yet: the run starts over on the new mesh
            back, state, progress = 0, new.init_state(), None
        self.say(
            f"warning: shards of step {step} died with devices {sorted(lost)} and no tier holds this "
            f"step; back to step {back}"
        )
        return Change(new, state, rolled_back_to=back, progress=progress)

    def row(self, lost: frozenset[int], trainer, seconds: float, previous: int) -> dict[str, Any]:
        """The metrics row of a change, and its say() line."""
        n = trainer.mesh.size
        alive = f"{len(self.devices) - len(lost)} of {len(self.devices)} alive"
        reason = (
            f"lost devices {sorted(lost)}"
            if n < previous
            else f"devices back ({alive})"
            if n > previous
            else f"device set changed ({alive})"
        )
        layout = " x ".join(f"{a} {s}" for a, s in trainer.mesh.shape.items() if s > 1) or "1 device"
        self.say(
            f"elastic: {reason}; now {n} devices ({layout}, {trainer.cfg.train.microbatches} microbatch(es)), "
            f"{seconds:.2f} s lost"
        )
        return {
            "elastic_reason": reason,
            "elastic_devices": n,
            "elastic_lost_s": seconds,
            "elastic_mesh": dict(trainer.mesh.shape),
            "elastic_microbatches": trainer.cfg.train.microbatches,
        }


def _alive_pieces(x: jax.Array, lost: frozenset[int]):
    """The blocks of `x` held by devices not in `lost`, as device arrays (no copy, no host trip)."""
    seen = set()
    for shard in x.addressable_shards:
        idx = block(shard.index, x.shape)
        if shard.device.id in lost or idx in seen:
            continue
        seen.add(idx)
        yield idx, shard.data
