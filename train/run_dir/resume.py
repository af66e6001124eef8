"""What a run dir holds to resume from: its verified checkpoints (refused before the compile when
none is readable), the two tiers opened, the newest of them chosen, and restored.

The order is the point (train/loop.py `train`): every refusal comes before the compile, nothing
in the run dir changes until the compiled step is known to fit, and a new run dir's first file
is its config.yaml. A kill at any moment of the start therefore leaves a run dir that the same
command starts or resumes.
"""

from __future__ import annotations

import pathlib
import shutil
from collections.abc import Callable

import jax

from meshwork.config import Config, ConfigError
from meshwork.run.checkpoint import Checkpointer, committed_steps, leftovers, manifest_problem
from meshwork.run.fast_tier import FastTier, Snapshot
from meshwork.run.saved_config import differences
from meshwork.train.run_dir.identity import claim


def check_checkpoints(
    cfg: Config, run_dir: pathlib.Path, warn: Callable[[str], None] = lambda msg: None
) -> tuple[int | None, dict[str, list]]:
    """(the newest verified step of the run or None for a fresh run, the changes run.allow_changes let
    through); refuses, before the compile and without writing anything, a run dir of another config
    (compared with the config saved in that newest checkpoint) or one whose checkpoints are all
    unreadable. `warn` gets the line saying that config.yaml disagrees with that checkpoint."""
    directory = run_dir / "checkpoints"
    steps = committed_steps(directory)
    problems = {s: manifest_problem(path) for s, path in steps.items()}
    good = [s for s, why in problems.items() if why is None]
    newest = (max(good), steps[max(good)]) if good else None
    changes = claim(cfg, run_dir, newest, is_main=jax.process_index() == 0, warn=warn)
    if not committed_steps(directory):  # a fresh run, or one run.overwrite=true has just replaced
        return None, changes
    if steps and not good and not cfg.run.overwrite:
        worst = "; ".join(f"step {s}: {problems[s]}" for s in sorted(steps, reverse=True)[:3])
        raise ConfigError(
            f"run.dir: no readable checkpoint in {directory} ({worst}); move "
            f"them away to start over, or set run.overwrite=true to replace the run"
        )
    return (newest[0] if newest else None), changes


def open_checkpoints(cfg: Config, run_dir: pathlib.Path, say) -> Checkpointer:
    """The run's checkpoints, with what interrupted writes and deletes left behind removed and
    the steps that fail verification set aside (the trainer owns the run dir by now)."""
    directory = run_dir / "checkpoints"
    if jax.process_index() == 0:
        for path in leftovers(directory):
            shutil.rmtree(path, ignore_errors=True)
            say(f"warning: removed {path}, left by an interrupted checkpoint write or delete")
    every = 1 if cfg.checkpoint.every == "auto" else cfg.checkpoint.every  # the loop decides (CheckpointSchedule)
    ckpt = Checkpointer(directory, every=every, keep=cfg.checkpoint.keep, use_async=cfg.checkpoint.async_)
    for message in ckpt.set_aside_unverified(run_dir):  # newer steps that failed verification
        say(f"warning: {message}")
    return ckpt


def open_fast_tier(cfg: Config) -> FastTier | None:
    """The fast tier checkpoint.fast_every asks for (RAM, or checkpoint.fast_path), or None."""
    ck = cfg.checkpoint
    if ck.fast_every is None:
        return None
    fast = FastTier(ck.fast_every, ck.fast_path, buffered=ck.async_)
    fast.remove_leftovers()
    return fast


def newest_tier(cfg: Config, ckpt: Checkpointer, fast: FastTier | None, say) -> tuple[int | None, Snapshot | None]:
    """(the step to resume from, the fast tier's snapshot when it is the newest complete and verified tier).

    A fast snapshot counts only if it belongs to this run (the identity keys of identity.py) and
    is newer than the persistent tier; fast snapshots past the chosen step are dropped, so a
    fresh run never meets another run's.
    """
    step = ckpt.latest_step()
    snap = fast.latest() if fast is not None else None
    if snap is not None and (differences(snap.identity, cfg.to_dict()) or (step is not None and snap.step <= step)):
        snap = None
    if snap is not None:
        say(
            f"the fast tier holds step {snap.step}, newer than the persistent tier's "
            f"{step if step is not None else 'none'}: restoring from it"
        )
        return snap.step, snap
    if fast is not None:
        fast.discard_after(step)
    return step, None


def restore_newest(ckpt: Checkpointer, fast: FastTier | None, target) -> tuple[int | None, object, dict]:
    """(step, state placed as `target` says, progress) from the newest tier; (None, None, {}) when none."""
    ckpt.wait()
    step, snap = ckpt.latest_step(), fast.latest() if fast is not None else None
    if snap is not None and (step is None or snap.step >= step):
        return snap.step, fast.restore(snap, target), snap.progress
    if step is None:
        return None, None, {}
    state, progress = ckpt.restore(step, target)
    return step, state, progress
