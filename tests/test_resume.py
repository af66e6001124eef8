"""Stopping and resuming changes nothing: 40 straight steps equal 20 + 20 resumed, bit for bit."""

import jax
import numpy as np
import pytest
from conftest import ROOT, tiny_overrides

from meshwork.config import load_config
from meshwork.run.metrics import read_metrics
from meshwork.train.loop import train

COMMON = [
    "train.steps=40",
    "checkpoint.every=20",
    "log.every=1",
    "log.eval_every=20",
    "mesh.data=2",
    "mesh.fsdp=4",
    "rules.preset=fsdp",
]


@pytest.mark.over_budget("three runs (straight, stopped, resumed) of an fsdp step: ~15 s cold", seconds=40)
def test_resume_is_bitwise_exact(tmp_path):
    def cfg(d, *extra):
        return load_config(
            ROOT / "configs/lm_tiny.yaml",
            [*tiny_overrides(tmp_path / d), *COMMON, *extra],
        )

    straight = train(cfg("straight"))
    first = train(cfg("resumed", "train.stop_after=20"))
    assert first["resumed_from"] is None and set(first["val_loss"]) == {0, 20}
    second = train(cfg("resumed"))
    assert second["resumed_from"] == 20

    rows_a = read_metrics(tmp_path / "straight")
    rows_b = read_metrics(tmp_path / "resumed")
    losses = lambda rows: [(r["step"], r["loss"]) for r in rows if "loss" in r]  # noqa: E731
    assert losses(rows_a) == losses(rows_b) and len(losses(rows_a)) == 40
    assert [r.get("val_loss") for r in rows_a] == [r.get("val_loss") for r in rows_b]

    for a, b in zip(jax.tree.leaves(straight["state"]), jax.tree.leaves(second["state"])):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
