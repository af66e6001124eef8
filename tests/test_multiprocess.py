"""Two processes x 4 CPU devices on 127.0.0.1 (jax.distributed, gloo) train exactly
like one process with 8 devices: same batches, same losses."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT, tiny_overrides
from processes import free_port, wait_all

from meshwork.run.metrics import read_metrics

STEPS = 20
ARGS = [
    "train.steps=20",
    "log.every=1",
    "log.eval_every=20",
    "checkpoint.every=10",
    "mesh.data=1",
    "mesh.fsdp=8",
    "rules.preset=fsdp",
]


def _launch(run_dir, n_local_devices, extra_args=(), process_id=None):
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={n_local_devices}",
    }
    cmd = [
        sys.executable,
        "-m",
        "train",
        "--config",
        str(ROOT / "configs/lm_tiny.yaml"),
        *tiny_overrides(run_dir),
        *ARGS,
        *extra_args,
    ]
    log = open(run_dir.parent / f"{run_dir.name}.{process_id}.log", "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), log


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    port = free_port()
    multi = tmp_path / "multi"
    procs = [
        _launch(
            multi,
            4,
            ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
            process_id=i,
        )
        for i in range(2)
    ]
    codes = wait_all(procs, 420)
    logs = "\n".join((tmp_path / f"multi.{i}.log").read_text()[-3000:] for i in range(2))
    assert codes == [0, 0], logs

    single = tmp_path / "single"
    assert wait_all([_launch(single, 8, process_id=0)], 420) == [0], (tmp_path / "single.0.log").read_text()[-3000:]

    loss = lambda d: [(r["step"], r["loss"]) for r in read_metrics(d) if "loss" in r]  # noqa: E731
    multi_losses, single_losses = loss(multi), loss(single)
    assert [s for s, _ in multi_losses] == list(range(1, STEPS + 1))
    assert [s for s, _ in single_losses] == list(range(1, STEPS + 1))
    # Same data and math; only the collectives' implementation (gloo across
    # processes) may reassociate sums.
    for (_, a), (_, b) in zip(multi_losses, single_losses):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)
    assert multi_losses[-1][1] < multi_losses[0][1] - 1.0
    # Both processes took part in the sharded checkpoint.
    assert (multi / "checkpoints" / "20").is_dir()
