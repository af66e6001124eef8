"""A run dir has one owner: a second trainer is refused naming the first, a kill during the first
compile leaves nothing the same command refuses, leftovers of interrupted writes are cleaned, and a
run already at its last step is not touched."""

import os
import signal
import time

import pytest
from harness import (
    PHASE_LINES,
    STEPS,
    STOP,
    assert_same_final_state,
    launch,
    launch_until,
    run,
    stopped_run,
    train_in_process,
    tree_digest,
)

from meshwork.run.metrics import read_metrics


@pytest.mark.over_budget("two trainer processes, one paused while the other is refused: 12-14 s", seconds=40)
def test_second_trainer_is_refused_and_the_first_loses_nothing(reference_run, compile_cache, tmp_path):
    first = launch(tmp_path, compile_cache)
    deadline = time.time() + 120
    while not (tmp_path / "owner.json").exists() and first.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert first.poll() is None, first.communicate()[1][-2000:]
    # Paused while it holds the run dir, so the tiny run cannot finish before the second one arrives.
    os.kill(first.pid, signal.SIGSTOP)
    t0 = time.perf_counter()
    second = run(tmp_path, compile_cache)
    refused_after_s = time.perf_counter() - t0
    os.kill(first.pid, signal.SIGCONT)
    out, err = first.communicate(timeout=180)
    assert second.returncode == 2, second.stderr[-2000:]
    (line,) = second.stderr.strip().splitlines()
    assert f"is in use by pid {first.pid} on " in line and "Traceback" not in second.stderr
    assert "parameters" not in second.stdout  # refused before its compile
    print(f"second trainer refused after {refused_after_s:.1f} s")
    assert first.returncode == 0, err[-2000:]
    rows = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # every row of the first trainer
    assert not (tmp_path / "owner.json").exists()  # released at the end
    assert_same_final_state(tmp_path, reference_run)


def _assert_landed(phase: str, sig: signal.Signals, before: str, proc, out: str) -> None:
    """The signal arrived in `phase`: what was printed before it shows the phase had begun, and the
    trainer's answer shows it had not moved past it."""
    if phase == "imports":
        # Sent before the start-up block: a Ctrl-C then is held until the trainer's guard acts on it
        # (train/interrupts.py), so the block may still be printed after it.
        assert before == "", before
    else:
        assert PHASE_LINES[phase] in before
    if sig == signal.SIGKILL:
        return
    # Once the trainer has started (its handler prints the signal's name) the status is the
    # documented 75; before that (the interpreter's own start) the default action ends the process.
    assert proc.returncode == (75 if f"{sig.name}:" in out else -sig), (proc.returncode, out[-500:])
    if phase in ("imports", "compile") and proc.returncode == 75:
        assert "preempted during start-up: nothing was written" in out, out[-500:]
    if phase == "steps":
        assert "checkpoint of step" in out and "saved" in out, out[-500:]


# The slow tier signals in each of these phases (the quick tier's signal test is the one while resuming).
@pytest.mark.slow
@pytest.mark.parametrize(
    "sig, phase, cached",
    [
        (signal.SIGKILL, "compile", True),
        (signal.SIGINT, "imports", True),  # Ctrl-C inside a gc callback during the imports used to be lost (exit 0)
        (signal.SIGTERM, "compile", False),  # an empty compilation cache: the compile takes seconds
        (signal.SIGINT, "compile", False),
        (signal.SIGTERM, "steps", True),
    ],
    ids=["kill-compile", "int-imports", "term-compile", "int-compile", "term-early-steps"],
)
def test_signal_during_the_first_start_leaves_a_run_the_same_command_starts(
    sig, phase, cached, reference_run, compile_cache, tmp_path
):
    """Imports, data, compile, first steps: a signal there used to leave checkpoints/ without config.yaml."""
    run_dir = tmp_path / "run"
    proc, before = launch_until(phase, run_dir, compile_cache if cached else tmp_path / "empty_cache")
    assert proc.poll() is None
    os.kill(proc.pid, sig)
    out, _ = proc.communicate(timeout=120)
    out = before + out
    print(f"signal {sig.name} in {phase}: exit status {proc.returncode}")
    _assert_landed(phase, sig, before, proc, out)
    done = run(run_dir, compile_cache)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_same_final_state(run_dir, reference_run)


@pytest.mark.parametrize(
    "sig",
    [
        pytest.param(
            signal.SIGKILL,
            id="kill",
            marks=pytest.mark.over_budget(
                "two trainer processes (killed while restoring, resumed) beside the shared stopped run: 14-18 s",
                seconds=40,
            ),
        ),
        pytest.param(signal.SIGTERM, id="term", marks=pytest.mark.slow),
        pytest.param(signal.SIGINT, id="int", marks=pytest.mark.slow),
    ],
)
def test_signal_while_resuming_leaves_a_run_the_same_command_resumes(sig, reference_run, compile_cache, tmp_path):
    """A second start interrupted by each signal while it restores step 30."""
    stopped_run(compile_cache, tmp_path)  # a run stopped at step 30
    proc, before = launch_until("restore", tmp_path, compile_cache)
    os.kill(proc.pid, sig)
    out, _ = proc.communicate(timeout=120)
    out = before + out
    _assert_landed("restore", sig, before, proc, out)
    assert f"step {STOP + 1}/" not in before  # it had not trained on yet
    done = run(tmp_path, compile_cache)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_same_final_state(tmp_path, reference_run)


@pytest.mark.slow
def test_leftovers_of_interrupted_writes_are_removed(reference_run, compile_cache, tmp_path):
    stopped_run(compile_cache, tmp_path)  # a run stopped at step 30
    ckpts = tmp_path / "checkpoints"
    for name in (".20.deleting", "35.orbax-checkpoint-tmp-1234567"):  # a kill while pruning, while writing
        (ckpts / name / "state").mkdir(parents=True)
        (ckpts / name / "state" / "data").write_bytes(b"\0" * 4096)
    done = run(tmp_path, compile_cache)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in ckpts.iterdir()) == [str(STEPS - 5), str(STEPS)]
    for name in (".20.deleting", "35.orbax-checkpoint-tmp-1234567"):
        assert f"warning: removed {ckpts / name}" in done.stdout
    assert_same_final_state(tmp_path, reference_run)


def test_a_finished_run_is_not_touched_again(reference_run, tmp_path, capsys):
    import shutil

    run_dir = shutil.copytree(reference_run, tmp_path / "run")
    before = tree_digest(run_dir)
    for steps in (STEPS, STEPS - 10):
        capsys.readouterr()
        code = train_in_process(run_dir, f"train.steps={steps}")
        out, err = capsys.readouterr()
        assert code == 0, err[-2000:]
        assert f"already at step {STEPS} of train.steps={steps}" in out
        assert "parameters" not in out  # nothing compiled
    assert tree_digest(run_dir) == before


def test_a_dead_trainers_lock_never_blocks_and_is_reported(reference_run, compile_cache, tmp_path):
    import json
    import shutil

    run_dir = shutil.copytree(reference_run, tmp_path / "run")
    (run_dir / "owner.json").write_text(json.dumps({"host": "gone", "pid": 999999, "started": "yesterday"}))
    done = run(run_dir, compile_cache)  # the kernel dropped that trainer's flock when it died
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(pid 999999 on gone (started yesterday)) ended without releasing it; taking the run over" in done.stdout


@pytest.mark.slow
def test_a_run_dir_without_a_committed_checkpoint_is_fresh(reference_run, compile_cache, tmp_path):
    """What a run killed before its first checkpoint leaves (a config of other sizes, metrics, an empty
    checkpoints/) does not stop a new start."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "config.yaml").write_text("model: {d_model: 999}\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "val_loss": 9.0}\n')
    done = run(tmp_path, compile_cache)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == list(range(1, STEPS + 1))
    assert_same_final_state(tmp_path, reference_run)
