"""Building meshwork's C++ kernels for XLA:CPU on first use and registering them with jax's FFI.

Each kernel is one C++ source beside its Python module (cpu_paged_attention.cc, cpu_matmul.cc). It is
compiled by the machine's C++ compiler (`$CXX`, else `c++`, `g++` or `clang++`) against jaxlib's FFI
headers, for this CPU (`-march=native`), into the package's cache folder (`$MESHWORK_CACHE`, default
~/.cache/meshwork) under a name that hashes the source, the flags, the compiler, the CPU's features
and jaxlib's version; later processes load the library built then. Without a compiler, or with
`MESHWORK_CPU_KERNEL=0`, a kernel is unavailable and `load` says why: callers keep XLA's own ops.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib.metadata
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import time

import jax

FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")
DISABLE = "MESHWORK_CPU_KERNEL"  # set to 0 to keep XLA's own ops (benchmarks compare the two)


def _cpu_features() -> str:
    """The CPU's feature flags: -march=native builds for them, so a library built on one machine is
    never loaded on another with a shared cache folder."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")


def library_path(source: pathlib.Path, compiler: str) -> pathlib.Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(
        "\0".join(
            (source.read_text(), " ".join(FLAGS), version, _cpu_features(), importlib.metadata.version("jaxlib"))
        ).encode()
    ).hexdigest()[:16]
    root = pathlib.Path(os.environ.get("MESHWORK_CACHE", "~/.cache/meshwork")).expanduser()
    return root / "kernels" / f"{source.stem}-{key}.so"


def _build(source: pathlib.Path, compiler: str, path: pathlib.Path) -> None:
    """Compiles into a temporary file beside `path` and renames it: processes building at once each
    write their own, and none loads a half-written library."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(source), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _prune(source, path)


STALE_DAYS = 30


def _prune(source: pathlib.Path, kept: pathlib.Path) -> None:
    """Removes this source's libraries built more than STALE_DAYS ago (older sources, compilers or
    jaxlibs; about 100 KB each); a process that still wants one builds it again."""
    cutoff = time.time() - STALE_DAYS * 86400
    for old in kept.parent.glob(f"{source.stem}-*.so"):
        with contextlib.suppress(OSError):
            if old != kept and old.stat().st_mtime < cutoff:
                old.unlink()


def load(source: pathlib.Path, symbol: str, target: str) -> str | None:
    """Builds `source` (once per machine), registers its handler `symbol` as the FFI target `target`
    on the CPU, and returns None; or returns why it cannot (callers cache the answer)."""
    if os.environ.get(DISABLE, "1") == "0":
        return f"{DISABLE}=0"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        return "no C++ compiler (c++, g++ or clang++ on PATH, or $CXX)"
    try:
        path = library_path(source, compiler)
        if not path.exists():
            _build(source, compiler, path)
        handler = getattr(ctypes.cdll.LoadLibrary(str(path)), symbol)
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
        return f"building {source.name} failed: {e}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    return None


class CpuKernel:
    """One C++ kernel: built and registered on first use, switchable off for a trace.

    KERNEL = CpuKernel(SOURCE, "MeshworkPackedMatmul", "meshwork_cpu_packed_matmul")
    KERNEL.available()             # built (on the first call) and not switched off
    with KERNEL.disabled(): ...    # programs traced inside keep XLA's own ops
    """

    def __init__(self, source: pathlib.Path, symbol: str, target: str):
        self.source, self.symbol, self.target = source, symbol, target
        self._switched_off = 0  # depth of `disabled()` contexts

    @functools.cache  # noqa: B019 (one per kernel, for the process's life)
    def unavailable_reason(self) -> str | None:
        """Why the kernel cannot be used here (building it on the first call), or None."""
        return load(self.source, self.symbol, self.target)

    def available(self) -> bool:
        return not self._switched_off and self.unavailable_reason() is None

    @contextlib.contextmanager
    def disabled(self):
        """Programs traced inside keep XLA's own ops: for measuring the kernel against them in one process."""
        self._switched_off += 1
        try:
            yield
        finally:
            self._switched_off -= 1
