"""Storage: writing a small file so that a crash or a power loss leaves the old version or the new
one, and telling a full or read-only disk from other errors.

`replace_file(path, text)` writes to a temporary name, fsyncs the bytes, renames over `path`
and fsyncs the folder (the rename itself lives in the folder's entry). What this gives after a
power loss, on a file system that honours fsync: config.yaml, owner.json, the config history,
each checkpoint's manifest and a truncated metrics.jsonl are whole, old or new. Appended
metrics rows reach the disk at the next fsync (each write flushes to the OS, which survives a
crash of the process but not of the machine); a checkpoint counts only once its manifest,
written after Orbax's commit, is durable.
"""

from __future__ import annotations

import errno
import os
import pathlib


def fsync_dir(folder: pathlib.Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: pathlib.Path, text: str | bytes) -> None:
    """`path` now holds `text` (or bytes), atomically and durably (see the module docstring)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb" if isinstance(text, bytes) else "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class StorageFull(RuntimeError):
    """The run dir's storage refused a write (full, over quota, read-only). The checkpoint being
    written was removed; the previous verified one is intact, so the same command resumes from it
    once there is room."""

    exit_status = 74  # EX_IOERR


def storage_problem(error: BaseException) -> str | None:
    """What a write error says about the storage, in words, or None if it is about something else.
    Orbax reports a full disk as TensorStore's RESOURCE_EXHAUSTED; Python as ENOSPC, EDQUOT, EROFS."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return os.strerror(error.errno).lower()
    text = str(error)
    if "RESOURCE_EXHAUSTED" in text or "No space left on device" in text:
        return "no space left on device"
    if "Read-only file system" in text:
        return "read-only file system"
    return None
