"""Which run a run.dir belongs to, before anything in it is read or written.

Re-running a config resumes its run. A run.dir that holds a run of another
config is refused (its checkpoints would be resumed with the wrong model,
data or optimizer) unless `run.overwrite=true` asks to replace it; a folder
that is not empty and holds no run is always refused, since it may be
anything. What may change between invocations of one run: its length,
stop_after, the mesh, the sharding rules, gradient accumulation, remat,
logging and checkpoint cadence (an elastic resume changes exactly those).

What the run is, is what its newest verified checkpoint holds: the resolved config saved inside
it, beside the state a resume restores. The run dir's config.yaml is a copy of the config of the
last start, for people to read; edited, emptied, damaged or deleted it decides nothing (a warning
says so) and is written again at the next start.

A run dir that holds no committed checkpoint is fresh, whatever else it holds
(a config.yaml, metrics, an empty checkpoints/ left by a kill during the first
compile): the same command, or another config, starts it over.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import shutil
from collections.abc import Callable

import orbax.checkpoint as ocp

from meshwork.config import Config, ConfigError, dump_config
from meshwork.run.checkpoint import committed_steps
from meshwork.run.durable import replace_file
from meshwork.run.saved_config import differences, how_the_copy_differs, read_copy

RUN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "checkpoints",
    "checkpoints_rejected",
    "tensorboard",
    "samples",
    "owner.json",
    "config_history.jsonl",
)
HISTORY = "config_history.jsonl"


def claim(
    cfg: Config,
    run_dir: pathlib.Path,
    newest: tuple[int, pathlib.Path] | None = None,
    *,
    is_main: bool = True,
    warn: Callable[[str], None] = lambda msg: None,
) -> dict[str, list]:
    """Raises ConfigError unless `run_dir` is new, empty, or a run of `cfg`; replaces it when asked.

    Returns the changes `run.allow_changes` lets through ({dotted key: [stored, new]}, to be
    recorded once the run is written to), {} when there are none. `newest` is (step, folder) of
    the run's newest verified checkpoint: the config saved inside it is what the run is, since
    that checkpoint is what a resume restores. config.yaml is only a copy for people (written at
    every start); where it disagrees with the checkpoint's, or cannot be read, `warn` says so and
    it decides nothing. Only a run dir with committed but no verified checkpoint has nothing
    else: there config.yaml is compared, and one that cannot be read is refused in one line.
    """
    if not run_dir.exists():
        _check_creatable(run_dir)
        return {}
    if not run_dir.is_dir():
        raise ConfigError(f"run.dir: {run_dir} is a file; point run.dir to a folder")
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise ConfigError(
            f"run.dir: {run_dir} is not writable (read-only file system or permissions); "
            f"make it writable or use another run.dir"
        )
    if not any(run_dir.iterdir()):
        return {}
    if not any((run_dir / name).exists() for name in RUN_FILES):
        raise ConfigError(
            f"run.dir: {run_dir} is not empty and holds no meshwork run; point run.dir to a new or empty folder"
        )
    if not committed_steps(run_dir / "checkpoints"):
        return {}  # nothing was committed: a fresh run, whatever its first start left behind
    saved, where, problem = _stored_config(run_dir, newest)
    if saved is not None:
        diffs = differences(saved, cfg.to_dict())
        refused = [d for d in diffs if d[0] not in cfg.run.allow_changes]
        if not refused:
            if newest is not None and (note := _copy_note(run_dir, saved, newest[0])):
                warn(note)
            return {key: [a, b] for key, a, b in diffs}
        key, a, b = refused[0]
        problem = f"{key}: run.dir {run_dir} holds a run with {key}={a!r}, not {b!r}{where}"
        hint = (
            f"run.allow_changes=[{key}] to change it from the resumed step on, " if key.startswith("optimizer.") else ""
        )
        problem += f"; use {hint}a new run.dir, the original value, or run.overwrite=true to replace that run"
    if not cfg.run.overwrite:
        raise ConfigError(problem)
    for name in RUN_FILES if is_main else ():
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    return {}


def _stored_config(run_dir: pathlib.Path, newest: tuple[int, pathlib.Path] | None) -> tuple[dict | None, str, str]:
    """(the run's stored config or None, where it came from as a suffix of a message, why it is None).

    The newest verified checkpoint's own config first; config.yaml when there is no such checkpoint
    (or, from a checkpoint written without one, no readable config in it).
    """
    if newest is not None:
        try:
            saved = ocp.JsonCheckpointHandler().restore(newest[1] / "config")
        except (OSError, ValueError):
            saved = None
        if isinstance(saved, dict):
            # No step number in the refusal: the line stays the same however far the run got.
            return saved, " (the config saved in its newest checkpoint)", ""
    copy = run_dir / "config.yaml"
    saved, what = read_copy(copy)
    if newest is None:
        fix = (
            f"no checkpoint in {run_dir / 'checkpoints'} is verified to read the run's config from; move the "
            f"checkpoints away to start over, or set run.overwrite=true to replace the run"
        )
    else:
        fix = (
            f"checkpoint {newest[0]} holds no readable config either; put back this run's config.yaml, or set "
            f"run.overwrite=true to replace the run"
        )
    return saved, "", f"run.dir: {copy} {what}, and {fix}"


def _copy_note(run_dir: pathlib.Path, saved: dict, step: int) -> str | None:
    """The warning line when config.yaml is not what checkpoint `step` says the run is, else None."""
    what = how_the_copy_differs(run_dir / "config.yaml", saved, step)
    if what is None:
        return None
    return (
        f"warning: {run_dir / 'config.yaml'} {what}; the checkpoint's config is the run's, and config.yaml is "
        f"written again from this command's config as the run starts"
    )


def _check_creatable(run_dir: pathlib.Path) -> None:
    """A new run dir can be made: its nearest existing ancestor is a writable folder."""
    ancestor = next(p for p in run_dir.absolute().parents if p.exists())
    if not ancestor.is_dir():
        raise ConfigError(f"run.dir: {run_dir} cannot be created: {ancestor} is a file; point run.dir to a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(
            f"run.dir: {run_dir} cannot be created: {ancestor} is not writable; use a run.dir in a writable folder"
        )


def record_changes(run_dir: pathlib.Path, step: int, changes: dict[str, list]) -> None:
    """Appends the changes a resume made (run.allow_changes) to config_history.jsonl."""
    row = {"step": step, "time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "changes": changes}
    with (run_dir / HISTORY).open("a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def write_config(cfg: Config, run_dir: pathlib.Path) -> None:
    """config.yaml, replaced in one rename so a crash never leaves half of it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    replace_file(run_dir / "config.yaml", dump_config(cfg))
