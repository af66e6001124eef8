"""train.on_nan: an injected NaN step is skipped, rolled back past, or stops the run naming the step."""

import math

import jax
import numpy as np
import pytest
from harness import ROOT, TINY

from meshwork.config import load_config
from meshwork.run.metrics import read_metrics
from meshwork.train import cli
from meshwork.train.loop import train
from meshwork.train.stops import NonFiniteLoss

STEPS, BAD = 20, 7
OVERRIDES = [*TINY, f"train.steps={STEPS}", "checkpoint.every=5", f"train.inject_nan_at=[{BAD}]"]


def _train(run_dir, *extra):
    cfg = load_config(ROOT / "configs/lm_tiny.yaml", [f"run.dir={run_dir}", *OVERRIDES, *extra])
    return train(cfg, devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def skipped(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("skip"), "train.on_nan=skip")


def test_skip_drops_the_update_and_goes_on(skipped):
    assert skipped["nonfinite_steps"] == [BAD] and skipped["last_step"] == STEPS
    rows = {r["step"]: r for r in read_metrics(skipped["run_dir"]) if "loss" in r}
    assert math.isnan(rows[BAD]["loss"]) and rows[BAD]["nonfinite"]
    assert not any(r["nonfinite"] for s, r in rows.items() if s != BAD)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(skipped["state"].params))


@pytest.mark.slow
def test_rollback_replays_without_the_bad_batch(skipped, tmp_path):
    rolled = _train(tmp_path, "train.on_nan=rollback")
    assert rolled["nonfinite_steps"] == [BAD] and rolled["last_step"] == STEPS
    rows = [r for r in read_metrics(tmp_path) if "data_index" in r]
    # One row per step after the rollback rewrote 6..; step 7's batch is consumed, never trained on.
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["data_index"] for r in rows] == list(range(STEPS))
    assert rows[BAD - 1].get("skipped_batch") == 1 and "loss" not in rows[BAD - 1]
    # Skipping the update in place and replaying from step 5 without the batch are the same
    # computation, so they end bit for bit equal.
    for a, b in zip(jax.tree.leaves(rolled["state"]), jax.tree.leaves(skipped["state"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    clean = _train(tmp_path / "clean", "train.inject_nan_at=[]", f"train.stop_after={BAD}")
    assert rolled["goodput"]["lost_s"] > 0 and clean["nonfinite_steps"] == []


def test_stop_names_the_step(tmp_path, capsys):
    with pytest.raises(NonFiniteLoss, match=rf"step {BAD} has loss nan .*\(last checkpoint: step 5\)"):
        _train(tmp_path / "api", "train.on_nan=stop")
    status = cli.main(
        [
            "--config",
            str(ROOT / "configs/lm_tiny.yaml"),
            f"run.dir={tmp_path / 'cli'}",
            *OVERRIDES,
            "train.on_nan=stop",
            "mesh.data=8",
        ]
    )
    err = capsys.readouterr().err
    assert status == 3 and f"step {BAD}" in err and "train.on_nan" in err and "Traceback" not in err
