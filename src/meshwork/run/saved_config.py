"""A run's config as it is saved: the keys that make it that run, how two saved configs differ in
them, and reading the run dir's `config.yaml`, a copy a user may have edited, emptied or deleted.

The config saved inside a checkpoint is what the run is; `config.yaml` is for people to read.
Training (train/run_dir/identity.py) and loading a run for inference (inference/runs.py) both
compare the copy with the checkpoint's config and say so when they differ.
"""

from __future__ import annotations

import pathlib

import yaml

# The keys that define a run: change any and it is another run.
IDENTITY = ("model", "data", "optimizer", "finetune", "run.seed", "train.global_batch")


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


def read_copy(path: pathlib.Path) -> tuple[dict | None, str]:
    """(config.yaml's mapping, "") or (None, what is wrong with it, in words that follow its name)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, "is missing"
    except OSError as e:
        return None, f"cannot be read ({e.strerror or type(e).__name__})"
    if not raw.strip():
        return None, "is empty"
    try:
        saved = yaml.safe_load(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "is not a text file"
    except yaml.YAMLError as e:
        return None, f"is not valid YAML ({str(e).splitlines()[0]})"
    if not isinstance(saved, dict):
        return None, f"holds a {type(saved).__name__}, not a mapping of config sections"
    return saved, ""


def how_the_copy_differs(copy: pathlib.Path, saved: dict, step: int) -> str | None:
    """None when config.yaml (`copy`) agrees with checkpoint `step`'s config (`saved`) in every
    identity key; else what is wrong with it, in words that follow its name."""
    own, what = read_copy(copy)
    if own is None:
        return what
    diffs = differences(saved, own)
    if not diffs:
        return None
    key, a, b = diffs[0]
    return f"differs from the checkpoint of step {step}: {key} is {b!r} in it, {a!r} in the checkpoint"
