"""One trainer per run dir: an exclusive `flock` on the run dir itself, held for the whole invocation.

A second trainer on a live run dir would prune the first one's checkpoints and
replace its metrics file under it. The lock is the kernel's (`fcntl.flock` on
the directory's own descriptor), so it creates no file, and it is released
when the process ends however it ends: a lock left by a dead trainer never
blocks. Who holds it is written to `owner.json` (host, pid, start time) once
the run's identity (config.yaml) is on disk, so a refused trainer can name the
holder, and a trainer that finds the file of a dead predecessor says so.
With several processes, process 0 holds the lock for all of them.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import pathlib
import socket

import jax
import numpy as np

from meshwork.config import ConfigError
from meshwork.run.durable import replace_file

OWNER = "owner.json"


def _holder(run_dir: pathlib.Path) -> str:
    try:
        info = json.loads((run_dir / OWNER).read_text())
        return f"pid {info['pid']} on {info['host']} (started {info['started']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


class RunDirLock:
    """Exclusive ownership of `run_dir` by this process; `acquire` raises ConfigError if it is taken."""

    def __init__(self, run_dir: pathlib.Path):
        self.run_dir = run_dir
        self._fd: int | None = None
        self._recorded = False

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> str | None:
        """Takes the lock (the run dir must exist); returns a warning when a dead trainer's record is found."""
        fd = os.open(self.run_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"run.dir: {self.run_dir} is in use by {_holder(self.run_dir)}; wait for that "
                f"trainer to finish, stop it, or use another run.dir"
            ) from None
        self._fd = fd
        if (self.run_dir / OWNER).exists():
            return (
                f"warning: the trainer that last held {self.run_dir} ({_holder(self.run_dir)}) ended "
                f"without releasing it; taking the run over"
            )
        return None

    def record(self) -> None:
        """Writes who holds the lock (after config.yaml: a run dir's first file is its identity)."""
        info = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        }
        replace_file(self.run_dir / OWNER, json.dumps(info))
        self._recorded = True

    def release(self) -> None:
        if self._fd is None:
            return
        if self._recorded:  # a refused invocation leaves the run dir exactly as it found it
            (self.run_dir / OWNER).unlink(missing_ok=True)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def take_run_dir(lock: RunDirLock, is_main: bool, say) -> None:
    """Process 0 locks the run dir for all processes; every process learns whether it could."""
    error, warning = None, None
    if is_main:
        try:
            warning = lock.acquire()
        except ConfigError as e:
            error = e
    if jax.process_count() > 1:  # the others must not go on (and hang in a collective) without process 0
        from jax.experimental import multihost_utils

        if multihost_utils.broadcast_one_to_all(np.int32(error is not None)) and error is None:
            error = ConfigError(f"run.dir: {lock.run_dir} is in use; process 0 could not lock it")
    if error is not None:
        raise error
    if warning:
        say(warning)
