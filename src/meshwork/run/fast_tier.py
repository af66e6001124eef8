"""The fast checkpoint tier: a host copy of the train state every `checkpoint.fast_every` steps.

The persistent tier (checkpoint.py, Orbax) is what a run can always come back to; this tier is
what it comes back to quickly. Each process copies the shards its devices hold into host
memory (numpy) at the step that saves, and goes on: with `buffered` writes that copy is the
whole stall, and a thread writes it to `path` (a local disk) behind the next steps. Without a
path the copy stays in RAM, where only this process can read it back: an elastic change reads
it for the shards that died with their devices (train/elastic.py). A disk copy also survives a
kill -9 of the process; the start-up restores it when it is newer than the persistent tier.

On disk a snapshot is a folder per step, `<path>/<step>/`: `state.npz` (one array per shard),
`index.json` (which leaf and which global block each array is, the progress and the run's
identity) and the same verified manifest as the persistent tier (size and CRC-32 per file). It
is written under a temporary name and renamed into place, and counts only with a manifest its
files still match, so a kill mid-write leaves the previous snapshot as the newest.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import pathlib
import shutil
import time
from typing import Any

import jax
import numpy as np

from meshwork.run.checkpoint import manifest_problem, write_manifest
from meshwork.run.durable import fsync_dir

Index = tuple[tuple[int, int], ...]  # a global block: (start, stop) per dimension
Piece = tuple[Index, Any]  # that block's data: numpy, or a jax array on one device


@dataclasses.dataclass
class Snapshot:
    """One step's host copy: per leaf (in tree order) the blocks this process held."""

    step: int
    leaves: list[list[Piece]]
    paths: list[str]
    progress: dict
    identity: dict


def block(index: tuple[slice, ...], shape: tuple[int, ...]) -> Index:
    """A shard's index (slices, None for a whole dimension) as (start, stop) per dimension."""
    return tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape))


def host_pieces(x: jax.Array) -> list[Piece]:
    """Copies of the distinct blocks of `x` this process's devices hold (one per replica group)."""
    pieces: dict[Index, np.ndarray] = {}
    for shard in x.addressable_shards:
        key = block(shard.index, x.shape)
        if key not in pieces:
            # A copy, not a view: the step donates the state, and on CPU a view would see it change.
            pieces[key] = np.array(shard.data, copy=True)
    return list(pieces.items())


def _slices(inner: Index, outer: Index) -> tuple[slice, ...]:
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inner, outer))


def region_from(pieces: list[Piece], region: Index, dtype) -> Any:
    """The global block `region` cut out of `pieces`, or None if they do not cover all of it.

    A block inside one piece is sliced from it (a jax piece stays on its device); one that
    spans several is put together on the host.
    """
    for idx, data in pieces:
        if all(o0 <= a and b <= o1 for (a, b), (o0, o1) in zip(region, idx)):
            return data[_slices(region, idx)]
    out = np.empty([b - a for a, b in region], dtype)
    covered, seen = 0, set()
    for idx, data in pieces:
        inter = tuple((max(a, o0), min(b, o1)) for (a, b), (o0, o1) in zip(region, idx))
        if idx in seen or any(a >= b for a, b in inter):
            continue
        seen.add(idx)
        out[_slices(inter, region)] = np.asarray(data[_slices(inter, idx)])
        covered += math.prod(b - a for a, b in inter)
    return out if covered == out.size else None


def place(pieces: list[Piece], target: jax.ShapeDtypeStruct) -> jax.Array | None:
    """A global array laid out by `target.sharding`, built only from `pieces`; None if they fall short.

    place(host_pieces(x), jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=other))  # x, resharded
    """
    index_map = target.sharding.addressable_devices_indices_map(target.shape)
    regions = {d: block(i, target.shape) for d, i in index_map.items()}
    parts = {d: region_from(pieces, r, target.dtype) for d, r in regions.items()}
    if any(p is None for p in parts.values()):
        return None
    return jax.make_array_from_callback(
        target.shape,
        target.sharding,
        lambda i: parts[next(d for d, r in regions.items() if r == block(i, target.shape))],
        dtype=target.dtype,
    )


def place_tree(leaves: list[list[Piece]], abstract: Any) -> Any | None:
    """`abstract` (ShapeDtypeStructs with shardings) filled from per-leaf pieces; None if any leaf falls short."""
    targets, treedef = jax.tree.flatten(abstract)
    out = [place(p, t) for p, t in zip(leaves, targets)]
    return None if any(x is None for x in out) else jax.tree.unflatten(treedef, out)


class FastTier:
    """Saves and reads back host copies of the state; `path` None keeps them in RAM only.

    fast = FastTier(every=5, path="/local/ssd/run1", buffered=True)
    stall_s = fast.save(step, state, progress, identity)   # at a step boundary
    snap = fast.latest()                                   # the newest complete copy, or None
    """

    def __init__(self, every: int, path: str | pathlib.Path | None, *, buffered: bool):
        self.every, self.buffered = every, buffered
        self.path = None if path is None else pathlib.Path(path).absolute() / f"process_{jax.process_index()}"
        self.in_ram: Snapshot | None = None
        self.stalls: list[float] = []  # seconds each save held the step loop
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fast-tier")
        self._writing: concurrent.futures.Future | None = None

    def remove_leftovers(self) -> None:
        """Deletes what writes cut short by a kill left (never a snapshot); only the trainer that owns
        the folder calls this, a reader leaves it as it is."""
        for leftover in self.path.glob(".tmp-*") if self.path is not None and self.path.is_dir() else []:
            shutil.rmtree(leftover, ignore_errors=True)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, step: int, state: Any, progress: dict, identity: dict) -> float:
        """Copies `state` to host memory (and writes it: in a thread when buffered); returns the stall in s."""
        t0 = time.perf_counter()
        self.wait()  # one write at a time; the previous one has had `every` steps to finish
        flat, _ = jax.tree_util.tree_flatten_with_path(state)
        snap = Snapshot(
            step, [host_pieces(x) for _, x in flat], [jax.tree_util.keystr(p) for p, _ in flat], progress, identity
        )
        self.in_ram = snap  # also with a disk path: this process reads its own copy from RAM
        if self.path is not None and self.buffered:
            self._writing = self._writer.submit(self._write, snap)
        elif self.path is not None:
            self._write(snap)
        stall = time.perf_counter() - t0
        self.stalls.append(stall)
        return stall

    def wait(self) -> None:
        if self._writing is not None:
            writing, self._writing = self._writing, None
            writing.result()

    def _write(self, snap: Snapshot) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.path / f".tmp-{snap.step}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        arrays, index = {}, []
        for i, pieces in enumerate(snap.leaves):
            index.append([[list(map(list, idx)), f"{i}_{j}"] for j, (idx, _) in enumerate(pieces)])
            arrays.update({f"{i}_{j}": data for j, (_, data) in enumerate(pieces)})
        with (tmp / "state.npz").open("wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        meta = {
            "step": snap.step,
            "paths": snap.paths,
            "index": index,
            "progress": snap.progress,
            "identity": snap.identity,
        }
        (tmp / "index.json").write_text(json.dumps(meta))
        final = self.path / str(snap.step)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(self.path)
        write_manifest(final)  # from here on the snapshot counts
        for old in self.on_disk():
            if old < snap.step:
                shutil.rmtree(self.path / str(old), ignore_errors=True)

    def on_disk(self) -> list[int]:
        """Steps of complete, verified snapshots in `path`, oldest first."""
        if self.path is None or not self.path.is_dir():
            return []
        steps = [int(p.name) for p in self.path.iterdir() if p.is_dir() and p.name.isdigit()]
        return sorted(s for s in steps if manifest_problem(self.path / str(s)) is None)

    def latest(self) -> Snapshot | None:
        """The newest complete snapshot (waiting for one being written), from RAM or disk."""
        self.wait()
        if self.in_ram is not None:
            return self.in_ram
        steps = self.on_disk()
        return self.read(steps[-1]) if steps else None

    def read(self, step: int) -> Snapshot:
        folder = self.path / str(step)
        meta = json.loads((folder / "index.json").read_text())
        with np.load(folder / "state.npz") as arrays:
            leaves = [[(tuple(map(tuple, idx)), arrays[name]) for idx, name in leaf] for leaf in meta["index"]]
        return Snapshot(meta["step"], leaves, meta["paths"], meta["progress"], meta["identity"])

    def discard_after(self, step: int | None) -> None:
        """Drops snapshots newer than `step` (None: all): another run's, or a future this run left."""
        self.in_ram = None if self.in_ram is None or step is None or self.in_ram.step > step else self.in_ram
        for s in self.on_disk() if self.path is not None else []:
            if step is None or s > step:
                shutil.rmtree(self.path / str(s), ignore_errors=True)

    def restore(self, snap: Snapshot, abstract: Any) -> Any:
        """The snapshot's state laid out as `abstract` says (any mesh this process's pieces cover)."""
        names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
        if names != snap.paths:
            raise ValueError(f"the fast tier's snapshot of step {snap.step} holds another state's leaves")
        state = place_tree(snap.leaves, abstract)
        if state is None:
            raise ValueError(
                f"the fast tier's snapshot of step {snap.step} does not cover the new layout "
                f"(another process held the rest)"
            )
        return state

    def close(self) -> None:
        self.wait()
        self._writer.shutdown()
