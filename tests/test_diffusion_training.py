"""unet_digits trains through the same loop: equal on 1 and 8 devices (dp, fsdp),
the loss falls, grids are written, and the CLI samples from the run."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT
from flax import nnx

from meshwork.config import load_config
from meshwork.run.metrics import read_metrics
from meshwork.train.trainer import build_trainer, check_runtime

# train.steps is part of every compiled program (the schedule's length): one value for every test here
# lets the 8-device comparison and the 60-step run share one compiled step through the session's cache.
STEPS = 60
SMALL = [
    "train.global_batch=16",
    "log.progress=false",
    "log.tensorboard=false",
    "log.eval_batches=2",
    "optimizer.init_lr_ratio=0.1",
    f"train.steps={STEPS}",
]


def three_steps(tmp_path, overrides, n_devices):
    cfg = load_config(ROOT / "configs/unet_digits.yaml", [f"run.dir={tmp_path}", *SMALL, *overrides])
    devices = jax.devices()[:n_devices]
    trainer = build_trainer(cfg, check_runtime(cfg, devices), devices).compile()
    batches = trainer.task.train_iterator()
    state = trainer.init_state()
    for _ in range(3):
        state, metrics = trainer.step_fn(state, trainer.to_device(next(batches)))
    return jax.device_get(metrics), jax.device_get(state.params), jax.device_get(state.ema)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return three_steps(tmp_path_factory.mktemp("unet1"), ["mesh.data=1"], 1)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(["mesh.data=8"], id="dp 8", marks=pytest.mark.slow),
        pytest.param(
            ["mesh.data=2", "mesh.fsdp=4", "rules.preset=fsdp"],
            id="fsdp 2x4",
            marks=pytest.mark.over_budget(
                "the UNet's train step compiled for 8 devices and for one "
                "(the 1-device one in the module fixture): ~45 s cold",
                seconds=90,
            ),
        ),
    ],
)
def test_unet_sharded_training_equals_one_device(tmp_path, single, overrides):
    metrics, params, ema = three_steps(tmp_path, overrides, 8)
    np.testing.assert_allclose(metrics["loss"], single[0]["loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(single[1])):
        np.testing.assert_allclose(a, b, atol=1e-5)
    for a, b in zip(jax.tree.leaves(ema), jax.tree.leaves(single[2])):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.slow
def test_unet_digits_loss_falls_and_the_cli_samples(tmp_path, unet_digits_run):
    """On conftest's shared unet_digits run (trained through the same loop, 200 steps on one device;
    the sharded loop is test_unet_sharded_training_equals_one_device's)."""
    run, summary = unet_digits_run
    steps = max(summary["val_loss"])
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert np.mean([r["loss"] for r in rows[-2:]]) < 0.6 * rows[0]["loss"], [r["loss"] for r in rows]
    assert summary["val_loss"][steps] < summary["val_loss"][0]
    assert (run / "samples" / f"step_{steps:06d}.png").stat().st_size > 500
    assert "samples_per_s" in rows[-1] and rows[-1]["mfu"] > 0
    check_patch_parallel_on(run)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "inference",
            "diffusion",
            "--checkpoint",
            str(run),
            "--num",
            "10",
            "--steps",
            "5",
            "--out",
            str(tmp_path / "grid.png"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "classifier reads" in proc.stdout and (tmp_path / "grid.png").stat().st_size > 500
    bad = subprocess.run(
        [sys.executable, "-m", "inference", "diffusion", "--checkpoint", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and len(bad.stderr.strip().splitlines()) == 1


# Patch-parallel DDIM (4 patches, 20 steps) on the trained UNet may differ from
# single-device DDIM by at most this much (pixels in [-1, 1]) with 10 warm-up
# steps, and by less than with a single warm-up step: staleness costs accuracy.
PATCH_PARALLEL_BOUND = 0.25


def check_patch_parallel_on(run):
    from meshwork.diffusion.sampling import ddim_sample, patch_parallel_sample
    from meshwork.inference.runs import load_run
    from meshwork.sharding.mesh import make_mesh

    cfg, model, _ = load_run(run)
    mesh = make_mesh({"sequence": 4, "data": 2})
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    fn = jax.tree_util.Partial(_apply, graphdef, state)
    d = cfg.model.diffusion
    shape, key, labels = (2, 16, 16, 1), jax.random.key(1), jnp.array([3, 7])
    kw = dict(steps=20, labels=labels, clip_sample=1.0)
    single = ddim_sample(fn, shape, key, d, **kw)
    errors = {
        w: float(
            jnp.abs(
                patch_parallel_sample(fn, shape, key, d, mesh=mesh, batch_axes=("data",), warmup=w, **kw) - single
            ).max()
        )
        for w in (1, 10, 20)
    }
    assert errors[20] < 1e-5  # all steps synchronous: the single-device computation
    assert errors[10] < PATCH_PARALLEL_BOUND and errors[10] <= errors[1], errors


def _apply(graphdef, state, x, t, y):
    return nnx.merge(graphdef, state)(x, t, y)
