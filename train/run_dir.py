"""Which run a run.dir belongs to, before anything in it is read or written.

Re-running a config resumes its run. A run.dir that holds a run of another
config is refused (its checkpoints would be resumed with the wrong model,
data or optimizer) unless `run.overwrite=true` asks to replace it; a folder
that is not empty and holds no run is always refused, since it may be
anything. What may change between invocations of one run: its length,
stop_after, the mesh, the sharding rules, gradient accumulation, remat,
logging and checkpoint cadence (an elastic resume changes exactly those).
"""

from __future__ import annotations

import pathlib
import shutil

import yaml

from meshwork.config import Config, ConfigError, dump_config

# The keys that define a run: change any and it is another run.
IDENTITY = ("model", "data", "optimizer", "finetune", "run.seed", "train.global_batch")
RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints", "checkpoints_rejected", "tensorboard", "samples")


def first_difference(saved: dict, now: dict) -> tuple[str, object, object] | None:
    """(dotted key, saved value, new value) of the first identity key that differs, else None."""
    for path in IDENTITY:
        a, b = saved, now
        for part in path.split("."):
            a, b = (a or {}).get(part), (b or {}).get(part)
        if a != b:
            return _deepest(path, a, b)
    return None


def _deepest(path: str, a: object, b: object) -> tuple[str, object, object]:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _deepest(f"{path}.{k}", a.get(k), b.get(k))
    return path, a, b


def claim(cfg: Config, run_dir: pathlib.Path, *, is_main: bool = True) -> None:
    """Raises ConfigError unless `run_dir` is new, empty, or a run of `cfg`; replaces it when asked.

    The run's own record of what it is: its config.yaml (written atomically
    at every start, and identical in the identity keys to the config saved
    inside each of its checkpoints).
    """
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise ConfigError(f"run.dir: {run_dir} is a file; point run.dir to a folder")
    if not any(run_dir.iterdir()):
        return
    if not any((run_dir / name).exists() for name in RUN_FILES):
        raise ConfigError(f"run.dir: {run_dir} is not empty and holds no meshwork run; "
                          "point run.dir to a new or empty folder")
    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
        diff = first_difference(saved, cfg.to_dict())
        problem = None if diff is None else "{0}: run.dir {dir} holds a run with {0}={1!r}, not {2!r}".format(
            *diff, dir=run_dir)
    except (OSError, yaml.YAMLError, AttributeError):
        problem = f"run.dir: {run_dir} holds a run whose config.yaml is missing or unreadable"
    if problem is None:
        return
    if not cfg.run.overwrite:
        raise ConfigError(f"{problem}; use a new run.dir, the original value, or run.overwrite=true "
                          f"to replace that run")
    for name in RUN_FILES if is_main else ():
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def write_config(cfg: Config, run_dir: pathlib.Path) -> None:
    """config.yaml, replaced in one rename so a crash never leaves half of it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "config.yaml.tmp"
    tmp.write_text(dump_config(cfg))
    tmp.replace(run_dir / "config.yaml")
