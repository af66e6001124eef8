"""SIGTERM mid-run: a checkpoint of the current step, status 75, and a resume from exactly there."""

import signal
import time

from harness import launch, train_in_process

from meshwork.run.checkpoint import Checkpointer
from meshwork.run.metrics import read_metrics
from meshwork.train.preemption import PREEMPTED_EXIT_STATUS

LONG = ["train.steps=100000", "checkpoint.every=100000"]  # no checkpoint but the one the signal asks for


def _wait_for_step(run_dir, proc, step: int) -> None:
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        if any(r.get("step", 0) >= step for r in rows):
            return
        time.sleep(0.01)
    raise AssertionError(f"the run did not reach step {step}: {proc.poll()}")


def test_sigterm_saves_the_current_step_and_the_run_resumes_there(compile_cache, tmp_path, capsys):
    proc = launch(tmp_path, compile_cache, *LONG)
    _wait_for_step(tmp_path, proc, 10)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == PREEMPTED_EXIT_STATUS, err[-2000:]
    assert "Traceback" not in err

    rows = [r for r in read_metrics(tmp_path) if "loss" in r]
    stopped = rows[-1]["step"]
    assert stopped >= 10 and f"checkpoint of step {stopped} saved" in out
    assert Checkpointer(tmp_path / "checkpoints", every=1, keep=1, use_async=False).latest_step() == stopped

    # The signal is the process's part; the resume is the same command, here in this process.
    assert train_in_process(tmp_path, *LONG, f"train.stop_after={stopped + 3}") == 0, capsys.readouterr().err[-2000:]
    assert f"resuming from step {stopped}" in capsys.readouterr().out
    rows = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, stopped + 4))
    assert [r["data_index"] for r in rows] == list(range(stopped + 3))


def test_a_second_signal_exits_at_once(compile_cache, tmp_path):
    proc = launch(tmp_path, compile_cache, *LONG, "checkpoint.every=5")
    _wait_for_step(tmp_path, proc, 12)
    proc.send_signal(signal.SIGINT)
    while "saving a checkpoint" not in proc.stdout.readline():  # the first one was handled
        pass
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT
    # Whatever was in flight, the newest verified checkpoint is still whole and loadable.
    ckpt = Checkpointer(tmp_path / "checkpoints", every=1, keep=1, use_async=False)
    assert ckpt.latest_step() is not None and ckpt.latest_step() % 5 == 0
