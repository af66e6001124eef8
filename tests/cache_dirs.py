"""Where the test suite keeps what outlives one run: jax's compilation cache and the shared trained runs.

Both live under the package's cache folder, `$MESHWORK_CACHE` (default `~/.cache/meshwork`).
The compilation cache is one folder per Python, jax and jaxlib version and entry codec (jax's own
cache key already holds the program, the XLA flags and the devices; a folder per version keeps an
upgrade from reading another version's entries) and is bounded: past `MAX_BYTES`, each session
starts by deleting the oldest entries (`prune`). jax's own bound (`jax_compilation_cache_max_size`) is not used: with it,
every write takes a lock and stats the whole folder, which made a cold quick tier 1.5x slower.
Deleting the folder costs one cold run, nothing else.
"""

import importlib.metadata
import os
import pathlib
import platform

MAX_BYTES = 4 << 30


def cache_root() -> pathlib.Path:
    """The package's own cache folder (its corpora live there too: meshwork/data/text.py)."""
    return pathlib.Path(os.environ.get("MESHWORK_CACHE", "~/.cache/meshwork")).expanduser()


def versions() -> str:
    """py3.11.7-jax0.10.2-jaxlib0.10.2: what a compiled program and a trained run depend on besides the code."""
    return (
        f"py{platform.python_version()}-jax{importlib.metadata.version('jax')}"
        f"-jaxlib{importlib.metadata.version('jaxlib')}"
    )


def entry_codec() -> str:
    """How jax compresses its cache entries here: zstd where `zstandard` (the test extra; Python 3.14's
    `compression.zstd`) is importable, else zlib. zstd writes the quick tier's ~80 MB of executables
    8x faster (0.18 s against 1.44 s per 330 programs, measured 2026-12-07) and reads them 2x faster;
    the folder's name carries it, since jax cannot read an entry the other codec wrote."""
    import importlib.util

    for module in ("compression.zstd", "zstandard"):
        try:
            if importlib.util.find_spec(module) is not None:
                return "zstd"
        except ModuleNotFoundError:  # no `compression` package before Python 3.14
            pass
    return "zlib"


def compilation_cache_dir() -> pathlib.Path:
    return pathlib.Path(
        os.environ.get("JAX_COMPILATION_CACHE_DIR") or cache_root() / f"jax-{versions()}-{entry_codec()}"
    )


def use_persistent_compilation_cache() -> None:
    """Points jax (in this process and, through the environment, in every process it starts) at the
    persistent cache, keeping every entry however quick its compile: a caller's own settings win."""
    path = compilation_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    # An empty value (a script that computed the folder before jax was installed) would switch
    # jax's cache off: it counts as unset.
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(path)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def prune(path: pathlib.Path, max_bytes: int = MAX_BYTES) -> int:
    """Deletes the oldest entries of a cache folder until it holds at most `max_bytes`; returns how
    many it deleted. Called by the session's first process, before any test compiles."""
    entries = sorted(
        ((st.st_mtime, st.st_size, p) for p in path.iterdir() if p.is_file() and (st := p.stat())), key=lambda e: e[0]
    )
    total, deleted = sum(size for _, size, _ in entries), 0
    for _, size, entry in entries:
        if total <= max_bytes:
            break
        entry.unlink(missing_ok=True)
        total, deleted = total - size, deleted + 1
    return deleted


# What a trained run depends on: the package's code and configs. A change to any of them trains anew.
_CODE = ("src", "models", "sharding", "train", "inference", "configs")


def code_digest(root: pathlib.Path) -> str:
    import hashlib

    h = hashlib.sha256()
    for top in _CODE:
        for path in sorted((root / top).rglob("*")):
            if path.suffix in (".py", ".yaml") and "__pycache__" not in path.parts:
                h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def shared_run(root: pathlib.Path, name: str, recipe: str, make) -> tuple[pathlib.Path, dict]:
    """(run dir, summary) of a run that `make(run_dir) -> summary` trains once per machine, not once
    per tier, worker or session: kept under the cache root, keyed by the code, the versions, the XLA
    flags and `recipe` (the settings `make` trains with), so a change to any of them trains anew. The
    first process to ask trains under a file lock; the others wait and read. `summary` must be
    JSON-safe; the run dir is shared, so callers only read it (copy it to change it)."""
    import hashlib
    import json
    import shutil

    from filelock import FileLock

    key = hashlib.sha256("\0".join([code_digest(root), versions(), os.environ.get("XLA_FLAGS", ""), recipe]).encode())
    runs = cache_root() / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    run_dir, done = runs / f"{name}-{key.hexdigest()[:16]}", runs / f"{name}-{key.hexdigest()[:16]}.json"
    import suite_timing

    with suite_timing.shared_work(), FileLock(str(run_dir) + ".lock"):
        if not done.exists():
            shutil.rmtree(run_dir, ignore_errors=True)  # a run that died half-way
            _forget_old_runs(runs, name)
            summary = make(run_dir)
            done.write_text(json.dumps(summary))
        os.utime(done)  # in use: not to be forgotten
        return run_dir, json.loads(done.read_text())


def _forget_old_runs(runs: pathlib.Path, name: str, days: float = 2) -> None:
    """Other versions of `name` unused for `days`: what earlier code trained."""
    import shutil
    import time

    for done in runs.glob(f"{name}-*.json"):
        if time.time() - done.stat().st_mtime > days * 86400:
            shutil.rmtree(done.with_suffix(""), ignore_errors=True)
            done.unlink(missing_ok=True)


if __name__ == "__main__":  # .ci/run: the folder every step's jax processes share
    print(compilation_cache_dir())
