"""kill -9 at random moments, including mid-write of an async checkpoint; damaged checkpoints.

After every crash the same command resumes from the newest verified
checkpoint; the run must end with exactly the parameters of an uninterrupted
run and with every step trained on its own batch exactly once.
"""

import json
import os
import random
import signal
import time

import numpy as np
import pytest
from harness import STEPS, final_state, launch, run, stopped_run

from meshwork.run.metrics import read_metrics

KILLS = 10


_LAST: dict = {}  # path -> ((size, mtime), step): `_kill_at` polls every 0.5 ms, on the trainer's cores


def _logged_step(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    try:
        st = path.stat()
    except FileNotFoundError:
        return -1
    seen, step = _LAST.get(path, (None, -1))
    if seen == (st.st_size, st.st_mtime_ns):  # unchanged since the last read
        return step
    step = -1
    for ln in reversed(path.read_text().splitlines()):
        try:
            step = json.loads(ln)["step"]
            break
        except ValueError:
            continue
    _LAST[path] = ((st.st_size, st.st_mtime_ns), step)
    return step


def _writing(run_dir) -> bool:
    ckpts = run_dir / "checkpoints"
    return ckpts.is_dir() and any("tmp" in p.name for p in ckpts.iterdir())


def _kill_at(run_dir, cache, target: int, mid_write: bool) -> dict:
    """Starts the run, kills it with SIGKILL once it has logged `target` (and, if asked, while a
    checkpoint is being written); returns what the kill hit."""
    proc = launch(run_dir, cache)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if _logged_step(run_dir) >= target and (not mid_write or _writing(run_dir)):
            break
        time.sleep(0.0005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    return {
        "target": target,
        "killed": proc.returncode == -signal.SIGKILL,
        "mid_write": _writing(run_dir),
        "at_step": _logged_step(run_dir),
    }


@pytest.mark.slow
def test_kill_9_at_random_moments_changes_nothing(reference_run, compile_cache, tmp_path):
    rng = random.Random(0)
    targets = sorted(rng.sample(range(2, STEPS - 3), KILLS))
    mid_write = set(rng.sample(range(KILLS), 3))  # three kills wait for a checkpoint write in flight
    kills = [_kill_at(tmp_path, compile_cache, t, i in mid_write) for i, t in enumerate(targets)]
    assert all(k["killed"] for k in kills), kills
    assert any(k["mid_write"] for k in kills), kills  # at least one left an uncommitted write behind

    done = run(tmp_path, compile_cache)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr

    step, leaves = final_state(tmp_path)
    ref_step, ref_leaves = final_state(reference_run)
    assert step == ref_step == STEPS
    for a, b in zip(leaves, ref_leaves, strict=True):
        np.testing.assert_array_equal(a, b)

    # Every step's batch exactly once, in order: batch i of the shuffled stream at step i + 1.
    rows = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["data_index"] for r in rows] == list(range(STEPS))
    ref_rows = [r for r in read_metrics(reference_run) if "loss" in r]
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref_rows]

    # The crashes show up as lost time in the run's goodput account.
    account = read_metrics(tmp_path)[-1]
    assert account["time_lost_s"] > 0 and 0 < account["goodput"] < 1
    parts = [v for k, v in account.items() if k.startswith("time_") and k != "time_wall_s"]
    assert sum(parts) == pytest.approx(account["time_wall_s"], rel=0.01)
    assert not (tmp_path / "checkpoints_rejected").exists() or all(
        p.name.split("-")[0].isdigit() for p in (tmp_path / "checkpoints_rejected").iterdir()
    )


def _damage(step_dir, how: str) -> str:
    """Flips one byte in, or truncates, the largest file of a checkpoint (the array data)."""
    target = max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[: len(data) // 2]
    target.write_bytes(bytes(data))
    return str(target.relative_to(step_dir))


@pytest.mark.parametrize("how", ["flip", pytest.param("truncate", marks=pytest.mark.slow)])
def test_damaged_checkpoint_is_skipped_and_the_previous_one_used(how, reference_run, compile_cache, tmp_path):
    stopped_run(compile_cache, tmp_path)  # a run stopped at step 30
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [25, 30]
    damaged = _damage(tmp_path / "checkpoints" / "30", how)

    done = run(tmp_path, compile_cache)
    assert done.returncode == 0, done.stderr[-2000:]
    # Named in the warning, moved aside (not deleted), and the run went on from step 25.
    assert f"checkpoint 30 skipped ({damaged}" in done.stdout
    (kept,) = (tmp_path / "checkpoints_rejected").iterdir()
    assert kept.name.startswith("30-") and (kept / damaged).is_file()
    rows = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["data_index"] for r in rows] == list(range(STEPS))

    step, leaves = final_state(tmp_path)
    _, ref_leaves = final_state(reference_run)
    assert step == STEPS
    for a, b in zip(leaves, ref_leaves, strict=True):
        np.testing.assert_array_equal(a, b)
