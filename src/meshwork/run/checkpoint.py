"""Sharded, resumable, crash-consistent checkpoints with Orbax.

One checkpoint per saved step holds three items: the train state (each host
writes its own shards), the run's progress (data-iterator position, skipped
steps, time accounting) and the resolved config. Restoring takes an abstract
state whose leaves carry the target shardings, so a checkpoint written on one
mesh restores onto another.

A checkpoint counts only once it is complete and verified:
1. Orbax writes it into a temporary folder and renames it into place when
   every host has finished (its commit protocol), so a crash mid-write
   leaves no folder that looks like a checkpoint;
2. once that commit is seen (`poll`, between steps), a manifest (`meshwork_manifest.json`: the size and
   CRC-32 of every file) is written beside it, atomically. A step without a
   manifest, or whose files no longer match it (truncated, flipped byte), is
   not a checkpoint;
3. older checkpoints are deleted (down to `keep`) only after a newer one has
   its manifest.
Bad checkpoints are never deleted: `set_aside_unverified` moves them to
`checkpoints_rejected/` with a warning naming them, so a later save of the
same step cannot collide with them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import pathlib
import shutil
import sys
import time
import zlib
from typing import Any

import jax
import orbax.checkpoint as ocp

from meshwork.perf.reliability import daly_interval, young_interval
from meshwork.run.durable import StorageFull, replace_file, storage_problem

MANIFEST = "meshwork_manifest.json"


class Checkpointer:
    """Saves and restores checkpoints under `directory`; opening one changes nothing on disk."""

    def __init__(self, directory: str | pathlib.Path, *, every: int, keep: int, use_async: bool):
        self.directory = pathlib.Path(directory).absolute()
        self.keep, self.use_async = keep, use_async
        self._saving: int | None = None  # the step Orbax is committing in the background
        self.stalls: list[float] = []  # seconds each save held the step loop
        self._verifier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-manifest")
        self._verifying: concurrent.futures.Future | None = None
        # step -> (its files' fingerprint, the verdict on it): CRCs are read once per step and process.
        self._verdicts: dict[int, tuple[tuple, str | None]] = {}
        # Retention is ours (after verification), so Orbax keeps everything it writes.
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=every, max_to_keep=None, enable_async_checkpointing=use_async, create=True
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        _drop_late_writer_callbacks()

    # ------------------------------------------------------------ which steps count

    def step_dirs(self) -> dict[int, pathlib.Path]:
        """Every committed step folder, verified or not (Orbax's temporary folders are not steps)."""
        return committed_steps(self.directory)

    def problem(self, step: int) -> str | None:
        """Why checkpoint `step` cannot be trusted, or None when every file matches its manifest.

        The CRC-32s are read once per step: the verdict is remembered under the step's fingerprint
        (the manifest's bytes, every file's name, size and modification time), which is re-read on
        every call, so a rewritten, truncated, added or removed file, or a new manifest, is verified
        again, while an unchanged checkpoint costs a few `stat`s, not a read of every byte.
        """
        step_dir = self.directory / str(step)
        fingerprint = files_fingerprint(step_dir)
        known = self._verdicts.get(step)
        if known is not None and known[0] == fingerprint:
            return known[1]
        verdict = manifest_problem(step_dir)
        self._verdicts[step] = (fingerprint, verdict)
        return verdict

    def verified_steps(self) -> list[int]:
        """Steps whose files all match their manifest, oldest first."""
        return sorted(s for s in self.step_dirs() if self.problem(s) is None)

    def latest_step(self) -> int | None:
        steps = self.verified_steps()
        return steps[-1] if steps else None

    def set_aside_unverified(self, run_dir: pathlib.Path) -> list[str]:
        """Moves every step folder that fails verification to run_dir/checkpoints_rejected/; returns warnings.

        Only the trainer calls this (readers such as inference leave the run as it is).
        """
        stamp = time.strftime("%Y%m%d-%H%M%S")
        bad = {step: why for step in sorted(self.step_dirs()) if (why := self.problem(step)) is not None}
        if not bad:
            return []
        _sync("meshwork_set_aside_checked")  # every process has looked before any folder moves
        messages = []
        for step, why in bad.items():
            dest = run_dir / "checkpoints_rejected" / f"{step}-{stamp}"
            if jax.process_index() == 0:
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(self.directory / str(step), dest)
            messages.append(f"checkpoint {step} skipped ({why}); moved to {dest}")
        _sync("meshwork_set_aside_moved")
        self.manager.reload()
        return messages

    # ------------------------------------------------------------ save and restore

    def save(self, step: int, state: Any, progress: dict, config: dict, *, force: bool = False) -> bool:
        """Saves if `step` is on the interval (or `force`); returns whether it did.

        With async saving the device-to-host copy finishes before this returns,
        so the caller may donate `state` to the next step right away; `poll`
        then notices the commit and verifies it in a thread of its own.
        """
        if not (force or self.manager.should_save(step)):
            return False
        t0 = time.perf_counter()
        self.wait()  # one write in flight at a time (Orbax would wait here too)
        with self._storage_errors():
            self._saving = step
            saved = self.manager.save(
                step,
                force=True,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    data_iter=ocp.args.JsonSave(progress),
                    config=ocp.args.JsonSave(config),
                ),
            )
            self.poll()
        self.stalls.append(time.perf_counter() - t0)  # what the step loop paid: the cost Young/Daly weigh
        return saved

    def poll(self) -> None:
        """Call between steps: once Orbax has committed the pending step, writes its manifest (in a thread)."""
        if self._saving is None or self.manager.is_saving_in_progress():
            return
        # A background write that failed reports here. Not check_for_errors(): Orbax's own finalize
        # thread has already consumed the error there; wait_until_finished (immediate now) re-raises it.
        with self._storage_errors():
            self.manager.wait_until_finished()
        step, self._saving = self._saving, None
        if jax.process_index() == 0:
            self._verifying = self._verifier.submit(self._verify_and_prune, step)

    def _verify_and_prune(self, step: int) -> None:
        step_dir = self.directory / str(step)
        write_manifest(step_dir)  # the CRCs it records were just read: the step is verified
        self._verdicts[step] = (files_fingerprint(step_dir), None)
        # Only now may older checkpoints go: the newest verified ones are kept.
        for old in self.verified_steps()[: -self.keep]:
            _delete(self.directory / str(old))

    def wait(self) -> None:
        """Blocks until the pending save is committed and verified."""
        with self._storage_errors():
            if self._saving is not None:
                self.manager.wait_until_finished()
                self.poll()
            if self._verifying is not None:
                verifying, self._verifying = self._verifying, None
                verifying.result()
        _sync("meshwork_wait")

    @contextlib.contextmanager
    def _storage_errors(self):
        """A full or read-only disk becomes StorageFull, after removing the checkpoint it cut short."""
        try:
            yield
        except Exception as e:
            if (problem := storage_problem(e)) is None:
                raise
            step, self._saving = self._saving, None
            with contextlib.suppress(Exception):  # Orbax's writers end (failing too) before their folders go
                self.manager.wait_until_finished()
            raise StorageFull(
                storage_full_message(
                    self.directory, problem, f"saving step {step}" if step is not None else "saving a checkpoint"
                )
            ) from None

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """(state placed by `abstract_state`'s shardings, progress dict)."""
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data_iter=ocp.args.JsonRestore()),
        )
        return out["state"], out["data_iter"]

    def restore_parts(self, step: int, abstract_parts: dict[str, Any]) -> dict[str, Any]:
        """Only the named parts of the stored state (e.g. {"params": ..., "buffers": ...}), placed by
        the shardings their abstract leaves carry.

        Orbax partial restore: the other parts (Adam's moments, the EMA when not asked
        for) are neither read nor need a target, so inference restores a run's weights
        without building its optimizer.
        """
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_parts)
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(item=abstract_parts, restore_args=restore_args, partial_restore=True)
            ),
        )
        return out["state"]

    def saved_config(self, step: int) -> dict:
        """The resolved config stored with checkpoint `step`."""
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

    def close(self) -> None:
        self.wait()
        self.manager.close()
        self._verifier.shutdown()


def _drop_late_writer_callbacks() -> None:
    """Silence TensorStore's reports of writes that finish after Orbax stopped waiting for them.

    When one shard write fails (a full disk), Orbax's commit raises and closes its
    asyncio loop while the other shard writes are still in flight; each of those
    then fails to hand its result to the closed loop, and TensorStore reports that
    through `sys.unraisablehook` ("Event loop is closed", no object), a traceback
    apiece: tens of them before our one-line error. The failure itself still reaches
    us through Orbax, so only these late hand-offs are dropped; every other
    unraisable error goes to the hook that was there before.
    """
    previous = sys.unraisablehook
    if getattr(previous, "drops_late_writer_callbacks", False):
        return

    def hook(unraisable) -> None:
        late = (
            unraisable.object is None
            and isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed"
        )
        if not late:
            previous(unraisable)

    hook.drops_late_writer_callbacks = True
    sys.unraisablehook = hook


class CheckpointSchedule:
    """When the persistent tier saves: every `every` steps, or with every="auto" at the interval
    Young/Daly find from this run's measured checkpoint cost and the job's MTTF.

        schedule = CheckpointSchedule("auto", mttf_hours=24, start=0, productive_s=0.0)
        if schedule.due(step): ...save...; row = schedule.measured(step, ckpt.stalls, productive_s)

    The cost C is the mean stall of this invocation's saves (what the step loop pays each time);
    Daly's interval tau (meshwork.perf.reliability) is in seconds of training and becomes steps
    through the measured step time. Under auto the first save comes after the first step, to
    measure C; every later save measures again and the interval follows.
    """

    def __init__(self, every: int | str, mttf_hours: float | None, start: int, productive_s: float):
        self.auto = every == "auto"
        self.every = 1 if self.auto else int(every)
        self.mttf_s = None if mttf_hours is None else mttf_hours * 3600.0
        self.last_save = start
        self.start = (start, productive_s)  # where this invocation's step-time measurement begins

    def due(self, step: int) -> bool:
        if self.auto:
            return step - self.last_save >= self.every
        return step % self.every == 0

    def measured(self, step: int, stalls: list[float], productive_s: float) -> dict[str, Any] | None:
        """After a save at `step` (`productive_s`: the run's productive seconds so far): under auto, the new
        interval as a metrics row when it changed (else None)."""
        self.last_save = step
        if not self.auto or not stalls or step <= self.start[0]:
            return None
        step_time_s = (productive_s - self.start[1]) / (step - self.start[0])
        cost = sum(stalls) / len(stalls)
        cost = max(cost, 1e-6)  # a save too quick to time still costs something
        tau = daly_interval(cost, self.mttf_s)
        every = max(1, round(tau / step_time_s)) if step_time_s > 0 else self.every
        changed = every != self.every
        self.every = every
        if not changed and len(stalls) > 1:
            return None
        return {
            "checkpoint_every": every,
            "checkpoint_cost_s": cost,
            "checkpoint_interval_s": tau,
            "checkpoint_young_s": young_interval(cost, self.mttf_s),
            "checkpoint_step_time_s": step_time_s,
            "checkpoint_saves": len(stalls),
            "mttf_s": self.mttf_s,
        }

    @staticmethod
    def describe(row: dict[str, Any]) -> str:
        """The say() line of a new auto interval."""
        return (
            f"checkpoint.every=auto: every {row['checkpoint_every']} steps (Daly's interval "
            f"{row['checkpoint_interval_s']:.2f} s from a measured cost of {row['checkpoint_cost_s']:.3f} s per "
            f"checkpoint, {row['checkpoint_step_time_s'] * 1e3:.0f} ms per step and an MTTF of "
            f"{row['mttf_s'] / 3600:g} h)"
        )


# ---------------------------------------------------------------- on disk, without Orbax


def committed_steps(directory: pathlib.Path) -> dict[int, pathlib.Path]:
    """Step folders Orbax has committed (renamed into place) under `directory`; reads only."""
    if not directory.is_dir():
        return {}
    return {int(p.name): p for p in directory.iterdir() if p.is_dir() and p.name.isdigit()}


def leftovers(directory: pathlib.Path) -> list[pathlib.Path]:
    """What an interrupted write or delete leaves: Orbax's temporary step folders and our
    `.N.deleting` folders (a kill while pruning). Neither is a checkpoint."""
    if not directory.is_dir():
        return []
    return sorted(
        p
        for p in directory.iterdir()
        if p.is_dir()
        and (".orbax-checkpoint-tmp" in p.name or (p.name.startswith(".") and p.name.endswith(".deleting")))
    )


def storage_full_message(directory: pathlib.Path, problem: str, doing: str) -> str:
    """After a write failed for lack of storage: removes what it cut short (temporary folders, steps
    committed but never verified) and says, in one line, what happened and what is kept."""
    steps = committed_steps(directory)
    good = [s for s in steps if manifest_problem(steps[s]) is None]
    newest = max(good) if good else None
    if jax.process_index() == 0:
        for path in leftovers(directory):
            shutil.rmtree(path, ignore_errors=True)
        for s, path in steps.items():
            if s > (newest if newest is not None else -1):
                shutil.rmtree(path, ignore_errors=True)
    kept = f"the checkpoint of step {newest} is intact" if newest is not None else "no checkpoint exists yet"
    return f"{directory}: {problem} while {doing}; {kept}; free space (or make it writable) and run the same command"


# ---------------------------------------------------------------- manifests


def _files(step_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def _crc32(path: pathlib.Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def files_fingerprint(step_dir: pathlib.Path) -> tuple:
    """What changes when any file of `step_dir` (its manifest included) is rewritten, resized, added
    or removed: the manifest's bytes and every file's (name, size, modification time in ns)."""
    try:
        manifest = (step_dir / MANIFEST).read_bytes()
    except OSError:
        manifest = None
    stats = []
    for path in _files(step_dir):
        with contextlib.suppress(OSError):  # removed meanwhile: absent from the fingerprint
            st = path.stat()
            stats.append((str(path.relative_to(step_dir)), st.st_size, st.st_mtime_ns))
    return manifest, tuple(stats)


def write_manifest(step_dir: pathlib.Path) -> None:
    """Records size and CRC-32 of every file of a committed step; written to a temp name, then renamed."""
    files = {str(p.relative_to(step_dir)): {"bytes": p.stat().st_size, "crc32": _crc32(p)} for p in _files(step_dir)}
    replace_file(step_dir / MANIFEST, json.dumps({"files": files}))


def manifest_problem(step_dir: pathlib.Path) -> str | None:
    """None if every file of `step_dir` matches its manifest, else the first mismatch in words."""
    try:
        files = json.loads((step_dir / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return "no manifest: the write did not finish"
    except (ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    for name, want in files.items():
        path = step_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, {want['bytes']} were written"
        if _crc32(path) != want["crc32"]:
            return f"{name} fails its CRC-32 check"
    return None


def _delete(step_dir: pathlib.Path) -> None:
    """Renames first, so a crash mid-delete leaves no half-deleted folder named like a step."""
    doomed = step_dir.with_name(f".{step_dir.name}.deleting")
    os.replace(step_dir, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
