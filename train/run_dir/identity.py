"""Which run a run.dir belongs to, before anything in it is read or written.

Re-running a config resumes its run. A run.dir that holds a run of another
config is refused (its checkpoints would be resumed with the wrong model,
data or optimizer) unless `run.overwrite=true` asks to replace it; a folder
that is not empty and holds no run is always refused, since it may be
anything. What may change between invocations of one run: its length,
stop_after, the mesh, the sharding rules, gradient accumulation, remat,
logging and checkpoint cadence (an elastic resume changes exactly those).

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

import yaml

from meshwork.config import Config, ConfigError, dump_config
from meshwork.run.checkpoint import committed_steps
from meshwork.run.durable import replace_file

# The keys that define a run: change any and it is another run.
IDENTITY = ("model", "data", "optimizer", "finetune", "run.seed", "train.global_batch")
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


def differences(saved: dict, now: dict) -> list[tuple[str, object, object]]:
    """(dotted key, saved value, new value) of every identity leaf that differs, in IDENTITY order."""
    out = []
    for path in IDENTITY:
        a, b = saved, now
        for part in path.split("."):
            a, b = (a or {}).get(part), (b or {}).get(part)
        out += _leaves_that_differ(path, a, b)
    return out


def _leaves_that_differ(path: str, a: object, b: object) -> list[tuple[str, object, object]]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _leaves_that_differ(f"{path}.{k}", a.get(k), b.get(k))]
    return [(path, a, b)] if a != b else []


def claim(cfg: Config, run_dir: pathlib.Path, *, is_main: bool = True) -> dict[str, list]:
    """Raises ConfigError unless `run_dir` is new, empty, or a run of `cfg`; replaces it when asked.

    Returns the changes `run.allow_changes` lets through ({dotted key: [stored, new]}, to be
    recorded once the run is written to), {} when there are none. The run's own record of
    what it is: its config.yaml (written atomically at every start, and identical in the
    identity keys to the config saved inside each of its checkpoints).
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
    hint = ""
    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
        diffs = differences(saved, cfg.to_dict())
    except (OSError, yaml.YAMLError, AttributeError):
        diffs, problem = None, f"run.dir: {run_dir} holds a run whose config.yaml is missing or unreadable"
    if diffs is not None:
        refused = [d for d in diffs if d[0] not in cfg.run.allow_changes]
        if not refused:
            return {key: [a, b] for key, a, b in diffs}
        key, a, b = refused[0]
        problem = f"{key}: run.dir {run_dir} holds a run with {key}={a!r}, not {b!r}"
        if key.startswith("optimizer."):
            hint = f"run.allow_changes=[{key}] to change it from the resumed step on, "
    if not cfg.run.overwrite:
        raise ConfigError(
            f"{problem}; use {hint}a new run.dir, the original value, or run.overwrite=true to replace that run"
        )
    for name in RUN_FILES if is_main else ():
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    return {}


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
