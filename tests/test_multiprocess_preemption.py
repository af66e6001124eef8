"""SIGTERM to one of two processes under jax.distributed: JAX's preemption sync point has both
stop at the same step, checkpoint it and exit 75; the relaunch finishes the run bit for bit like
two processes that were never interrupted."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import FAST_COMPILE_FLAGS, ROOT, tiny_overrides
from processes import free_port, wait_all

from meshwork.run.checkpoint import manifest_problem
from meshwork.run.metrics import read_metrics
from meshwork.train.preemption import PREEMPTED_EXIT_STATUS

# JAX's SIGTERM listener polls once a second, so the run must have more than a second of steps left
# when the signal comes: steps take 0.1-0.5 s here (2 cores, gloo between the processes). The 27
# steps after SIGNAL_AFTER last 2.7 s at the fastest, over twice that second (on a loaded machine
# the stop came at step 5); each step past that costs two runs, the relaunch and the straight one.
STEPS = 30
SIGNAL_AFTER = 2  # metrics.jsonl shows this step: both processes are in the step loop
ARGS = [
    f"train.steps={STEPS}",
    "log.every=1",
    f"log.eval_every={STEPS}",
    f"checkpoint.every={STEPS}",
    "mesh.data=1",
    "mesh.fsdp=8",
    "rules.preset=fsdp",
]


def _launch_pair(run_dir, tag):
    """Two processes x 4 CPU devices on 127.0.0.1, each logging to run_dir.parent/<tag>.<i>.log."""
    port = free_port()
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": " ".join(["--xla_force_host_platform_device_count=4", *FAST_COMPILE_FLAGS]),
    }
    procs = []
    for i in range(2):
        cmd = [
            sys.executable,
            "-m",
            "train",
            "--config",
            str(ROOT / "configs/lm_tiny.yaml"),
            *tiny_overrides(run_dir),
            *ARGS,
            "--coordinator-address",
            f"127.0.0.1:{port}",
            "--num-processes",
            "2",
            "--process-id",
            str(i),
        ]
        log = open(run_dir.parent / f"{tag}.{i}.log", "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), log))
    return procs


def _logs(tmp_path, tag):
    return "\n".join(f"--- {tag}.{i}:\n" + (tmp_path / f"{tag}.{i}.log").read_text()[-3000:] for i in range(2))


def _wait_until(ready, procs, tmp_path, tag, timeout=180):
    """Polls `ready()` while both processes run (a process that ends first fails the test)."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert all(p.poll() is None for p, _ in procs), _logs(tmp_path, tag)
        assert time.monotonic() < deadline, _logs(tmp_path, tag)
        time.sleep(0.02)


def _stopped_at(tmp_path, tag) -> list[list[str]]:
    """The step each process's summary says it was preempted at (as the lines found)."""
    return [re.findall(r"preempted at step (\d+) of", (tmp_path / f"{tag}.{i}.log").read_text()) for i in range(2)]


def _last_logged_step(run_dir) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [json.loads(line)["step"] for line in lines if line.endswith("}")]
    return max(steps, default=0)


def _final_state(step_dir):
    """The checkpoint's state (parameters, optimizer moments, step) as host numpy arrays."""
    path = step_dir / "state"
    with ocp.PyTreeCheckpointer() as ckptr:
        tree = ckptr.metadata(path).item_metadata.tree
        return ckptr.restore(path, restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree))


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_one_step(tmp_path):
    # Mid-run, SIGTERM to process 1: process 0 hears of it through JAX's coordination service.
    run = tmp_path / "preempted"
    procs = _launch_pair(run, "first")
    _wait_until(lambda: _last_logged_step(run) >= SIGNAL_AFTER, procs, tmp_path, "first")
    procs[1][0].send_signal(signal.SIGTERM)
    codes = wait_all(procs, 300)
    logs = _logs(tmp_path, "first")
    assert codes != [0, 0], f"the run ended before JAX's notice (steps this fast want a larger STEPS)\n{logs}"
    assert codes == [PREEMPTED_EXIT_STATUS] * 2, logs
    named = _stopped_at(tmp_path, "first")
    assert len(named[0]) == 1 and named[0] == named[1], logs
    stop = int(named[0][0])
    assert SIGNAL_AFTER <= stop < STEPS, logs
    assert f"preempted: checkpoint of step {stop} saved" in logs
    assert sorted(int(d.name) for d in (run / "checkpoints").iterdir() if d.name.isdigit()) == [stop], logs
    assert manifest_problem(run / "checkpoints" / str(stop)) is None
    assert _last_logged_step(run) == stop

    # SIGTERM to process 0 while the resumed run compiles: no step has asked JAX yet, and the
    # guard counts its own calls (1, 2, ...), so the sync point is this invocation's first step.
    procs = _launch_pair(run, "second")
    _wait_until(
        lambda: "compiling the train step" in (tmp_path / "second.0.log").read_text(), procs, tmp_path, "second"
    )
    procs[0][0].send_signal(signal.SIGTERM)
    codes = wait_all(procs, 300)
    logs = _logs(tmp_path, "second")
    assert codes == [PREEMPTED_EXIT_STATUS] * 2, logs
    assert _stopped_at(tmp_path, "second") == [[str(stop + 1)]] * 2, logs
    assert manifest_problem(run / "checkpoints" / str(stop + 1)) is None

    codes = wait_all(_launch_pair(run, "third"), 300)
    assert codes == [0, 0], _logs(tmp_path, "third")

    straight = tmp_path / "straight"
    codes = wait_all(_launch_pair(straight, "straight"), 300)
    assert codes == [0, 0], _logs(tmp_path, "straight")

    # Bit for bit: every step's loss, the validation losses and the final state (parameters,
    # optimizer moments, step).
    losses = lambda d: [(r["step"], r["loss"]) for r in read_metrics(d) if "loss" in r]  # noqa: E731
    assert losses(run) == losses(straight)
    assert [s for s, _ in losses(run)] == list(range(1, STEPS + 1))
    vals = lambda d: [(r["step"], r["val_loss"]) for r in read_metrics(d) if "val_loss" in r]  # noqa: E731
    assert vals(run) == vals(straight)
    a = _final_state(run / "checkpoints" / str(STEPS))
    b = _final_state(straight / "checkpoints" / str(STEPS))
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
