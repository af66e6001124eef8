"""Every pipeline schedule trains as one device does: on 4 stages x data 2, tied and untied,
the loss of each of 20 steps equals the single-device run's (slow tier: ten 20-step runs)."""

import jax
import numpy as np
import pytest
from conftest import ROOT, tiny_overrides

from meshwork.config import load_config
from meshwork.data.text import train_iterator
from meshwork.train.trainer import build_trainer, check_runtime

STEPS = 20
# 8 layers: 2 a stage, or 2 chunks of 1 a stage under interleaved; nonzero lr at step 0.
COMMON = ["model.n_layers=8", "optimizer.init_lr_ratio=0.1", "optimizer.warmup_steps=5"]
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb-h1": 1}


def loss_curve(tmp_path, overrides, n_devices):
    cfg = load_config(ROOT / "configs/lm_tiny.yaml", [*tiny_overrides(tmp_path), *COMMON, *overrides])
    devices = jax.devices()[:n_devices]
    task = check_runtime(cfg, devices)
    trainer = build_trainer(cfg, task, devices).compile()
    batches = train_iterator(str(task.train), cfg.data.seq_len, cfg.train.global_batch, seed=0)
    state, losses = trainer.init_state(), []
    for _ in range(STEPS):
        state, metrics = trainer.step_fn(state, trainer.to_device(next(batches)))
        losses.append(float(metrics["loss"]))
    return np.asarray(losses)


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    return {
        tied: loss_curve(tmp_path_factory.mktemp(f"one_{tied}"), ["mesh.data=1", f"model.tie_embeddings={tied}"], 1)
        for tied in (False, True)
    }


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("kind", list(SCHEDULES))
def test_the_loss_curve_equals_one_devices(tmp_path, single_device, kind, tied):
    got = loss_curve(
        tmp_path,
        [
            "mesh.stage=4",
            "mesh.data=2",
            f"train.pipeline={kind}",
            f"train.virtual_stages={SCHEDULES[kind]}",
            "train.microbatches=4",
            f"model.tie_embeddings={tied}",
        ],
        8,
    )
    want = single_device[tied]
    print(
        f"{kind} tied={tied}: loss {want[0]:.4f} -> {want[-1]:.4f}, "
        f"max relative difference {np.max(np.abs(got - want) / want):.2e}"
    )
    assert want[-1] < want[0] - 0.3  # the curve is a learning curve, not a flat line
    np.testing.assert_allclose(got, want, rtol=1e-5)
