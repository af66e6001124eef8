"""Resuming with a config that differs from the stored run: shapes never, optimizer settings only
when named in run.allow_changes (then recorded), and a run at its last step is left alone."""

import json

import pytest
from harness import STEPS, run, stopped_run, train_in_process, tree_digest

from meshwork.run.metrics import read_metrics


def test_shape_change_is_refused_before_compiling(compile_cache, tmp_path, capsys):
    stopped_run(compile_cache, tmp_path)
    before = tree_digest(tmp_path)
    capsys.readouterr()
    code = train_in_process(tmp_path, "model.d_ff=256")
    out, err = capsys.readouterr()
    assert code == 2 and "parameters" not in out  # nothing built or compiled
    (line,) = err.strip().splitlines()
    assert line.startswith("error: model.d_ff: ") and "d_ff=128, not 256" in line
    assert tree_digest(tmp_path) == before


@pytest.mark.slow
def test_lr_change_is_refused_then_accepted_when_named_and_recorded(compile_cache, tmp_path):
    first = run(tmp_path, compile_cache, "train.stop_after=10")
    assert first.returncode == 0, first.stderr[-2000:]
    before = tree_digest(tmp_path)
    refused = run(tmp_path, compile_cache, "optimizer.lr=0.01")
    assert refused.returncode == 2 and "run.allow_changes=[optimizer.lr]" in refused.stderr
    assert tree_digest(tmp_path) == before

    done = run(tmp_path, compile_cache, "optimizer.lr=0.01", "run.allow_changes=[optimizer.lr]")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "changed from step 10: optimizer.lr 0.003 -> 0.01" in done.stdout
    (row,) = [json.loads(ln) for ln in (tmp_path / "config_history.jsonl").read_text().splitlines()]
    assert row["step"] == 10 and row["changes"] == {"optimizer.lr": [0.003, 0.01]}
    rows = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # From step 11 on the schedule follows the new peak (still in warmup: 11/20 of it).
    assert rows[9]["lr"] < 0.003 < rows[10]["lr"] <= 0.01
