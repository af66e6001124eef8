"""Shared pieces of the reliability tests (their fixtures are in tests/conftest.py): a tiny lm_tiny run started as a real process.

Runs that are killed, signalled or compared bit for bit all start as
`python -m train` subprocesses on one CPU device with the same settings, so
the compiled program is the same in every process (a persistent compilation
cache shared by the session makes each start cost ~4 s instead of ~8 s).
"""

import hashlib
import os
import pathlib
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS = 40  # the tests stop at 10 and 30 and kill before step 37: 40 is enough
TINY = [
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=128",
    "data.seq_len=32",
    "train.global_batch=8",
    "log.progress=false",
    "log.tensorboard=false",
    "log.eval_batches=1",
    "log.every=1",
    "log.eval_every=1000",
    "mesh.data=1",
    f"train.steps={STEPS}",
    "checkpoint.every=5",
    "checkpoint.keep=2",
]


def train_args(run_dir: pathlib.Path, *extra: str) -> list[str]:
    """The arguments of `python -m train` for the tiny lm_tiny run into `run_dir`."""
    return ["--config", str(ROOT / "configs/lm_tiny.yaml"), f"run.dir={run_dir}", *TINY, *extra]


def launch(run_dir: pathlib.Path, cache: pathlib.Path, *extra: str, **popen) -> subprocess.Popen:
    """`python -m train` of the tiny lm_tiny run into `run_dir`, on one CPU device."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "",
        "PYTHONUNBUFFERED": "1",
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    cmd = [sys.executable, "-m", "train", *train_args(run_dir, *extra)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def train_in_process(run_dir: pathlib.Path, *extra: str) -> int:
    """The command `launch` starts, called in this process (for claims about the trainer's checks, not
    about a process): its exit status; the caller reads the output with capsys. The session has 8
    devices, so the mesh takes them all (`mesh.data=-1`); a resumed run's mesh may differ."""
    from meshwork.train.cli import main

    return main(train_args(run_dir, "mesh.data=-1", *extra))


def run(run_dir: pathlib.Path, cache: pathlib.Path, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = launch(run_dir, cache, *extra)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


STOP = 30  # where `stopped_run` stops: checkpoints 25 and 30 committed, 10 steps left


def stopped_run(cache: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    """A copy at `dest` of the tiny run stopped by `train.stop_after=STOP` (a real trainer's clean
    stop), for the tests that resume, damage or interrupt such a run. The run itself is trained once
    per machine and code version (`cache_dirs.shared_run`, like the reference run), not once per
    test: each test gets its own copy (mtimes kept), so the shared one is never written to."""
    import shutil

    import cache_dirs

    def make(run_dir):
        done = run(run_dir, cache, f"train.stop_after={STOP}")
        assert done.returncode == 0, done.stderr[-2000:]
        return {}

    shared, _ = cache_dirs.shared_run(ROOT, "reliability_stopped", repr((TINY, f"train.stop_after={STOP}")), make)
    return pathlib.Path(shutil.copytree(shared, dest, dirs_exist_ok=True))


def final_state(run_dir: pathlib.Path) -> tuple[int, list[np.ndarray]]:
    """(step, leaves) of the newest verified checkpoint, read back as numpy."""
    import jax
    import orbax.checkpoint as ocp

    from meshwork.run.checkpoint import Checkpointer

    ckpt = Checkpointer(run_dir / "checkpoints", every=1, keep=1, use_async=False)
    step = ckpt.latest_step()
    restored = ckpt.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    ckpt.close()
    return step, [np.asarray(x) for x in jax.tree.leaves(restored["state"])]


def tree_digest(root: pathlib.Path) -> str:
    """sha256 over the sorted relative paths (directories too), the bytes and the mtime of every file."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        if p.is_file() and not p.is_symlink():
            h.update(p.read_bytes())
            h.update(str(p.stat().st_mtime_ns).encode())
    return h.hexdigest()


def assert_same_final_state(run_dir: pathlib.Path, reference: pathlib.Path) -> None:
    """`run_dir` ended at the reference run's step with bit-identical state."""
    step, leaves = final_state(run_dir)
    ref_step, ref_leaves = final_state(reference)
    assert step == ref_step
    for a, b in zip(leaves, ref_leaves, strict=True):
        np.testing.assert_array_equal(a, b)


# The line the trainer prints as it enters each phase of a start: a signal test waits for it and
# signals then, so the signal lands in the phase the test names. "imports" has no line: the signal
# is sent as soon as the process runs, and the test checks nothing had been printed yet.
PHASE_LINES = {
    "imports": None,
    "compile": "compiling the train step...",
    "restore": "restoring the checkpoint of step",
    "steps": f"/{STEPS}: loss ",
}  # the first progress line: "step N/40: loss ..."


def launch_until(
    phase: str, run_dir: pathlib.Path, cache: pathlib.Path, *extra: str, timeout: float = 180
) -> tuple[subprocess.Popen, str]:
    """Starts the tiny run and returns once it has printed `phase`'s line, with what it printed so far
    (the signal the caller sends next lands in that phase: the trainer's output is unbuffered)."""
    import time

    proc = launch(run_dir, cache, *extra)
    line, seen, deadline = PHASE_LINES[phase], [], time.time() + timeout
    if line is None:
        time.sleep(0.3)  # past the interpreter's start, well inside the seconds of imports
        return proc, ""
    while time.time() < deadline:
        text = proc.stdout.readline()
        if not text:
            break
        seen.append(text)
        if line in text:
            return proc, "".join(seen)
    proc.kill()
    out, err = proc.communicate()
    raise AssertionError(f"the trainer never printed {line!r}: {''.join(seen) + out}{err[-2000:]}")
