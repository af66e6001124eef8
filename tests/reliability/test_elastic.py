"""Elastic resume: a run checkpointed on 8 devices (fsdp) continues on 4 (dp, two microbatches)
with the same global batch, the data stream picking up where it stopped."""

import jax
import numpy as np
import pytest
from harness import ROOT, TINY

from meshwork.config import load_config
from meshwork.run.metrics import read_metrics
from meshwork.train.loop import train

STEPS, STOP = 20, 10
COMMON = [*TINY, f"train.steps={STEPS}", "checkpoint.every=5"]
FSDP8 = ["mesh.data=1", "mesh.fsdp=8", "rules.preset=fsdp"]
DP4 = ["mesh.data=4", "mesh.fsdp=1", "rules.preset=dp", "train.microbatches=2"]


def _train(run_dir, layout, devices, *extra):
    cfg = load_config(ROOT / "configs/lm_tiny.yaml", [f"run.dir={run_dir}", *COMMON, *layout, *extra])
    return train(cfg, devices=jax.devices()[:devices])


@pytest.mark.over_budget("two runs, on 8 devices and resumed on 4, each compiled: ~15 s cold", seconds=40)
def test_resume_on_4_devices_follows_the_8_device_run(tmp_path):
    straight = _train(tmp_path / "straight", FSDP8, 8)
    _train(tmp_path / "elastic", FSDP8, 8, f"train.stop_after={STOP}")
    elastic = _train(tmp_path / "elastic", DP4, 4)
    assert elastic["resumed_from"] == STOP
    assert {s.device for x in jax.tree.leaves(elastic["state"]) for s in x.addressable_shards} == set(jax.devices()[:4])

    rows = lambda d: [r for r in read_metrics(d) if "loss" in r]  # noqa: E731
    a, b = rows(tmp_path / "straight"), rows(tmp_path / "elastic")
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    assert [r["data_index"] for r in b] == list(range(STEPS))  # the stream went on at batch 10
    assert [r["loss"] for r in a[:STOP]] == [r["loss"] for r in b[:STOP]]  # same run until the move
    # After it only the reduction order differs (4 devices, two accumulated halves): float noise.
    np.testing.assert_allclose([r["loss"] for r in b[STOP:]], [r["loss"] for r in a[STOP:]], rtol=2e-5)
    np.testing.assert_allclose(elastic["val_loss"][STEPS], straight["val_loss"][STEPS], rtol=2e-5)
    for x, y in zip(jax.tree.leaves(elastic["state"].params), jax.tree.leaves(straight["state"].params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-3, atol=1e-5)
