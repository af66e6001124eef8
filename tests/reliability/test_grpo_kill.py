"""kill -9 of a GRPO run while it samples a rollout batch, at a weight sync, and while an update runs
on the device: the same command resumes it, and it ends with exactly the parameters, metrics and
rollout batches of a run never killed (train/rollouts.py: rollout batches saved, the source's
position in every checkpoint). The kill is the process's own SIGKILL at the named point
(`MESHWORK_KILL_GRPO`), so it lands in the phase the test names."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from harness import ROOT, TINY, assert_same_final_state

from meshwork.run.metrics import read_metrics

# Two updates per rollout batch and a checkpoint every step: batch 1 is sampled at step 3.
GRPO = [
    "finetune.method=none",
    "finetune.base=null",
    "data.val_fraction=0.25",
    "train.steps=4",
    "checkpoint.every=1",
    "log.eval_every=4",
    "optimizer.warmup_steps=0",
    "optimizer.lr=1e-2",
    "train.grpo.group_size=4",
    "train.grpo.max_new_tokens=6",
    "train.grpo.engine_slots=8",
    "train.grpo.page_size=4",
    "train.grpo.eval_prompts=4",
    "train.grpo.updates_per_rollout=2",
    "train.grpo.rewards=[spread_reward:distinct]",
]
KILLS = {"rollout": "rollout:1", "sync": "sync:1", "update": "update:3"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The prompts, a reward that varies among an untrained model's completions, a straight run."""
    root = tmp_path_factory.mktemp("grpo_kill")
    (root / "p.jsonl").write_text(
        "".join(f'{{"prompt": "Q: {a} plus {b}? A:", "answer": "{a + b}"}}\n' for a in range(6) for b in range(4))
    )
    (root / "spread_reward.py").write_text(
        "def distinct(prompt, completion, fields):\n    return len(set(completion))\n"
    )
    straight = _run(root, root / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    return root


def _run(root, run_dir, kill: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PYTHONPATH": str(root)}
    env.pop("MESHWORK_KILL_GRPO", None)
    if kill:
        env["MESHWORK_KILL_GRPO"] = kill
    cmd = [sys.executable, "-m", "train", "--config", str(ROOT / "configs/grpo_arith.yaml"), f"run.dir={run_dir}"]
    cmd += [*TINY, f"data.text_files=[{root / 'p.jsonl'}]", *GRPO]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("phase", sorted(KILLS))
def test_kill_9_in_a_grpo_phase_resumes_bit_exactly(workdir, tmp_path, phase):
    run_dir = tmp_path / "run"
    killed = _run(workdir, run_dir, KILLS[phase])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = _run(workdir, run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "restoring the checkpoint of step" in resumed.stdout
    assert_same_final_state(run_dir, workdir / "straight")
    keys = ("step", "loss", "ratio", "reward", "val_reward")
    rows = lambda d: {r["step"]: tuple(r.get(k) for k in keys) for r in read_metrics(d)}  # noqa: E731
    assert rows(run_dir) == rows(workdir / "straight")
    for name in ("00000000.npz", "00000001.npz"):
        with np.load(run_dir / "rollouts" / name) as x, np.load(workdir / "straight" / "rollouts" / name) as y:
            assert all(np.array_equal(x[k], y[k]) for k in x.files if k != "host")
