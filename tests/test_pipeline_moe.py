"""The Mixture-of-Experts LM in a pipeline: on 4 stages x data 2, every schedule, tied and
untied, trains as one device does (gradient accumulation over the same microbatches): the
loss of 3 steps, every gradient leaf and the routing statistics after them, and (slow tier)
a 20-step loss curve. The auxiliary losses ride through the schedule as stage losses; the
statistics come back per layer in model order. What stays refused says why in one line."""

import re

import jax
import numpy as np
import pytest
from conftest import ROOT, tiny_overrides

from meshwork.config import ConfigError, load_config
from meshwork.data.text import train_iterator
from meshwork.train.gradients import gradient_strategy
from meshwork.train.trainer import build_trainer, check_runtime

# 8 MoE layers: 2 a stage, or 2 chunks of 1 under interleaved.
MOE = [
    "model.kind=moe",
    "model.n_layers=8",
    "model.moe.n_experts=4",
    "model.moe.top_k=2",
    "model.moe.d_expert=64",
    "model.moe.capacity_factor=1.25",
    "model.moe.aux_loss_coef=0.01",
    "model.moe.z_loss_coef=0.001",
    "optimizer.init_lr_ratio=0.1",
    "optimizer.warmup_steps=5",
    "train.microbatches=4",
]
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb-h1": 1}
PIPELINE = ["mesh.stage=4", "mesh.data=2"]
STATS = ("aux_loss", "z_loss", "dropped_fraction", "load_per_layer", "load_cv")


def _trainer(tmp_path, overrides, n_devices):
    cfg = load_config(ROOT / "configs/lm_tiny.yaml", [*tiny_overrides(tmp_path), *MOE, *overrides])
    devices = jax.devices()[:n_devices]
    task = check_runtime(cfg, devices)
    return cfg, task, build_trainer(cfg, task, devices).compile()


def train_then_grads(tmp_path, overrides, n_devices, steps=3, curve_steps=None):
    """Losses of `steps` steps, then the next batch's metrics and gradients at the trained weights;
    with `curve_steps`, training then goes on over that same next batch and the ones after it, and
    the losses of all `curve_steps` steps come back first (one run, one compile, for both checks)."""
    cfg, task, trainer = _trainer(tmp_path, overrides, n_devices)
    batches = train_iterator(str(task.train), cfg.data.seq_len, cfg.train.global_batch, seed=0)
    state, losses = trainer.init_state(), []
    for _ in range(steps):
        state, metrics = trainer.step_fn(state, trainer.to_device(next(batches)))
        losses.append(float(metrics["loss"]))
    gradients = gradient_strategy(cfg, trainer.graphdef, task.objective(trainer.graphdef), trainer.mesh)
    batch = trainer.to_device(next(batches))
    with trainer.context():
        metrics, grads, _ = jax.jit(gradients)(state.params, state.buffers, batch, jax.random.key(0))
    result = np.asarray(losses), jax.device_get(metrics), jax.device_get(grads)
    if curve_steps is None:
        return result
    for _ in range(steps, curve_steps):
        state, step_metrics = trainer.step_fn(state, batch)
        losses.append(float(step_metrics["loss"]))
        batch = trainer.to_device(next(batches))
    return np.asarray(losses), result


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    cache = {}

    def get(tied, *more):
        if (tied, *more) not in cache:
            cache[tied, *more] = train_then_grads(
                tmp_path_factory.mktemp("one"), ["mesh.data=1", f"model.tie_embeddings={tied}", *more], 1
            )
        return cache[tied, *more]

    return get


def assert_same_training(got, want, what):
    (got_losses, got_metrics, got_grads), (want_losses, want_metrics, want_grads) = got, want
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    np.testing.assert_allclose(got_metrics["loss"], want_metrics["loss"], rtol=1e-5)
    for k in STATS:  # routing statistics of every MoE layer, in model order
        np.testing.assert_allclose(got_metrics[k], want_metrics[k], rtol=1e-5, atol=1e-7, err_msg=k)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(want_grads)]
    assert [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(got_grads)] == paths
    worst = 0.0
    for path, g, w in zip(paths, jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        scale = float(np.max(np.abs(w)))
        assert scale > 0, path  # every leaf, the routers included, gets a gradient
        worst = max(worst, float(np.max(np.abs(g - w))) / scale)
        # 1e-4 of the leaf's scale: the weight products' backward (models/layers/mixed_matmul.py)
        # contracts in its own order, measured at 1.13e-5 on an AVX-512 host and 3.3e-5 on an
        # AVX2-only one (its float32 kernels sum in another order); a wrong stage, chunk or tie
        # is off by the order of the scale itself.
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4 * scale, err_msg=path)
    print(
        f"{what}: {len(paths)} gradient leaves, worst |diff|/max|g| {worst:.2e}, "
        f"aux_loss {float(got_metrics['aux_loss']):.6f}"
    )


CURVE_STEPS = 20


@pytest.fixture(scope="module")
def one_device_curve(tmp_path_factory):
    """tied -> (20-step loss curve, the 3-step losses, metrics and gradients) on one device."""
    cache = {}

    def get(tied):
        if tied not in cache:
            cache[tied] = train_then_grads(
                tmp_path_factory.mktemp("one"),
                ["mesh.data=1", f"model.tie_embeddings={tied}"],
                1,
                curve_steps=CURVE_STEPS,
            )
        return cache[tied]

    return get


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    """(kind, tied) -> what one_device_curve gives, on 4 stages x data 2: one run of each schedule
    and tie serves both tests below (the 3-step gradients and the 20-step curve), where each test
    trained its own before."""
    cache = {}

    def get(kind, tied):
        if (kind, tied) not in cache:
            cache[kind, tied] = train_then_grads(
                tmp_path_factory.mktemp("pp"),
                [
                    *PIPELINE,
                    f"train.pipeline={kind}",
                    f"train.virtual_stages={SCHEDULES[kind]}",
                    f"model.tie_embeddings={tied}",
                ],
                8,
                curve_steps=CURVE_STEPS,
            )
        return cache[kind, tied]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, tied",
    [
        pytest.param(kind, tied, id=f"{kind}-{'tied' if tied else 'untied'}")
        for kind in SCHEDULES
        for tied in (False, True)
    ],
)
def test_every_schedule_trains_the_moe_lm_as_one_device(pipelined, one_device_curve, kind, tied):
    assert_same_training(pipelined(kind, tied)[1], one_device_curve(tied)[1], f"{kind} tied={tied}")


@pytest.mark.over_budget(
    "the quick tier's one MoE pipeline: a pipelined MoE step and its accumulation compiled "
    "for 8 devices and for one, ~40 s cold",
    seconds=80,
)
def test_a_small_interleaved_tied_moe_pipeline_trains_as_one_device(tmp_path, one_device):
    """The quick tier's case: 4 MoE layers as 2 stages x 2 chunks of one layer, data 4, tied."""
    small = ("model.n_layers=4", "train.microbatches=2")
    got = train_then_grads(
        tmp_path,
        [
            "mesh.stage=2",
            "mesh.data=4",
            "train.pipeline=interleaved",
            "train.virtual_stages=2",
            "model.tie_embeddings=true",
            *small,
        ],
        8,
    )
    assert_same_training(got, one_device(True, *small), "interleaved tied, 2 stages x 2 chunks")


@pytest.mark.slow
def test_dense_and_moe_runs_repeating_per_stage_pipeline(tmp_path, one_device):
    """Layers D D M M D D M M on 2 stages x data 2 x fsdp 2: each stage runs D D M M, gathered from
    the model's four runs."""
    pattern = ("model.moe.dense_layers=[0,1,4,5]", "train.microbatches=2")
    got = train_then_grads(
        tmp_path,
        [
            "mesh.stage=2",
            "mesh.data=2",
            "mesh.fsdp=2",
            "rules.preset=fsdp",
            "train.pipeline=1f1b",
            "model.tie_embeddings=false",
            *pattern,
        ],
        8,
    )
    assert_same_training(got, one_device(False, *pattern), "1f1b D D M M x 2")


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("kind", list(SCHEDULES))
def test_moe_loss_curve_equals_one_devices(pipelined, one_device_curve, kind, tied):
    got, one = pipelined(kind, tied)[0], one_device_curve(tied)[0]
    print(
        f"{kind} tied={tied}: loss {one[0]:.4f} -> {one[-1]:.4f}, max relative difference "
        f"{np.max(np.abs(got - one) / one):.2e}"
    )
    assert one[-1] < one[0] - 0.3
    if not tied:
        np.testing.assert_allclose(got, one, rtol=1e-5)
        return
    # Tied, the table's two gradients are summed in another order than on one device (1e-7
    # apart); after 14 steps that flips one token's top-k or capacity slot, a discrete change
    # that moves the loss by ~1e-4 from step 15 on, the same under all four schedules.
    np.testing.assert_allclose(got[:14], one[:14], rtol=1e-5)
    np.testing.assert_allclose(got, one, rtol=3e-4)


@pytest.mark.parametrize(
    "overrides, says",
    [
        (
            [
                "rules.preset=ep",
                "model.kind=moe",
                "mesh.stage=2",
                "mesh.expert=4",
                "mesh.data=1",
                "train.pipeline=1f1b",
            ],
            "expert parallelism (ep) inside a pipeline stage is not supported",
        ),
    ],
)
def test_what_stays_refused_says_why_in_one_line(tmp_path, overrides, says):
    cfg = load_config(ROOT / "configs/lm_tiny.yaml", [*tiny_overrides(tmp_path), "model.n_layers=4", *overrides])
    with pytest.raises(ConfigError, match=re.escape(says)) as e:
        check_runtime(cfg, jax.devices())
    assert "\n" not in str(e.value)
