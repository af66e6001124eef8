"""Owning a run dir: one room for what decides whose it is and what it holds.

- identity.py  which run a run.dir belongs to (the identity keys of the config saved in its newest
               verified checkpoint), what may change between invocations, config.yaml (a copy
               for people) and the record of changes.
- lock.py      one trainer per run.dir: the lock file, taken by process 0 for all processes.
- resume.py    what it holds to resume from: verified checkpoints, the fast tier, the newest of them.

The checkpoints' own format, verification and writes are the engine room's
(src/meshwork/run/checkpoint.py, fast_tier.py, durable.py).
"""

from meshwork.train.run_dir.identity import claim, record_changes, write_config
from meshwork.train.run_dir.lock import RunDirLock, take_run_dir
from meshwork.train.run_dir.resume import (
    check_checkpoints,
    newest_tier,
    open_checkpoints,
    open_fast_tier,
    restore_newest,
)

__all__ = [
    "RunDirLock",
    "check_checkpoints",
    "claim",
    "newest_tier",
    "open_checkpoints",
    "open_fast_tier",
    "record_changes",
    "restore_newest",
    "take_run_dir",
    "write_config",
]
