"""Writing a small file so that a crash or a power loss leaves either the old version or the new one.

`replace_file(path, text)` writes to a temporary name, fsyncs the bytes, renames over `path`
and fsyncs the folder (the rename itself lives in the folder's entry). What this gives after a
power loss, on a file system that honours fsync: config.yaml, owner.json, the config history,
each checkpoint's manifest and a truncated metrics.jsonl are whole, old or new. Appended
metrics rows reach the disk at the next fsync (each write flushes to the OS, which survives a
crash of the process but not of the machine); a checkpoint counts only once its manifest,
written after Orbax's commit, is durable.
"""

from __future__ import annotations

import os
import pathlib


def fsync_dir(folder: pathlib.Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: pathlib.Path, text: str) -> None:
    """`path` now holds `text`, atomically and durably (see the module docstring)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
