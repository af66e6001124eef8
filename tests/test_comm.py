"""Communication options on 8 fake devices: bytes on the wire read from the compiled step, and
what each costs in validation loss against exact data parallelism after the same steps."""

import jax
import numpy as np
import pytest
from conftest import ROOT, tiny_overrides

from meshwork.config import ConfigError, load_config
from meshwork.sharding.hlo import collective_summary
from meshwork.train.comm import compressed, matrix_view
from meshwork.train.loop import train
from meshwork.train.trainer import build_trainer, check_runtime

STEPS = 40
DP = ["mesh.data=8", "rules.preset=dp", "checkpoint.every=1000", f"log.eval_every={STEPS}"]
OPTIONS = {
    "dp": [],
    "bf16": ["comm.compression=bf16"],
    "int8": ["comm.compression=int8"],
    "powersgd": ["comm.compression=powersgd", "comm.rank=1"],
    "powersgd_r2": ["comm.compression=powersgd", "comm.rank=2"],
    "powersgd_r4": ["comm.compression=powersgd", "comm.rank=4"],
    "stale": ["comm.stale_gradients=true"],
    "diloco": ["comm.local_steps=4"],
    "overlap": ["comm.overlap=true", "comm.combine_threshold_bytes=1048576"],
}


def _cfg(run_dir, name):
    return load_config(
        ROOT / "configs/lm_tiny.yaml", [*tiny_overrides(run_dir), f"train.steps={STEPS}", *DP, *OPTIONS[name]]
    )


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    out = {}
    for name in ("dp", "bf16", "int8", "powersgd", "powersgd_r4", "diloco"):
        cfg = _cfg(tmp_path_factory.mktemp(name), name)
        out[name] = build_trainer(cfg, check_runtime(cfg)).compile()
    return out


def _wire(trainer) -> dict:
    return collective_summary(trainer.step_fn.as_text())


def _grad_bytes(trainer) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.abstract.params))


@pytest.mark.over_budget("one compiled step per compression option (module fixture): ~17 s cold", seconds=40)
def test_bytes_on_the_wire_fall_by_the_expected_factor(trainers):
    n = 8
    ring = 2 * (n - 1) / n
    dp = _wire(trainers["dp"])
    grads = _grad_bytes(trainers["dp"])
    # Exact data parallelism: one ring all-reduce of every gradient (plus a few scalars).
    assert dp["all-reduce"]["bytes"] == pytest.approx(ring * grads, rel=0.01)

    # bf16 / int8: all-to-all of the encoded blocks, then all-gather of the reduced share (a ring
    # all-reduce done by hand): 1/2 or 1/4 of f32; int8 adds a float32 scale per 256 values.
    for name, factor in (("bf16", 1 / 2), ("int8", 1 / 4 + 1 / 256)):
        wire = _wire(trainers[name])
        sent = wire["all-to-all"]["bytes"] + wire["all-gather"]["bytes"]
        assert sent / (ring * grads) == pytest.approx(factor, rel=0.02), name
        assert wire["all-reduce"]["bytes"] < 0.001 * ring * grads  # only the metrics' scalars

    # PowerSGD rank r: r (rows + cols) per compressed matrix, the other leaves exactly.
    shapes = [x.shape for x in jax.tree.leaves(trainers["dp"].abstract.params)]
    for name, r in (("powersgd", 1), ("powersgd_r4", 4)):
        expect = sum(
            4 * (b * r * (rows + cols) if compressed(s, r) else int(np.prod(s)))
            for s in shapes
            for b, rows, cols in [matrix_view(s) or (1, 1, int(np.prod(s)))]
        )
        psgd = _wire(trainers[name])
        assert psgd["all-reduce"]["bytes"] == pytest.approx(ring * expect, rel=0.02), name
    assert _wire(trainers["powersgd"])["all-reduce"]["bytes"] < ring * grads / 30  # 1/35.5 on this model
    assert _wire(trainers["powersgd_r4"])["all-reduce"]["bytes"] < ring * grads / 9  # 1/9.6

    # DiLoCo, H = 4: the parameter all-reduce happens only in the sync branch, once per 4 steps.
    diloco = _wire(trainers["diloco"])
    assert diloco["all-reduce"]["bytes"] == pytest.approx(ring * grads, rel=0.01)  # counted once, per H steps
    per_step = diloco["all-reduce"]["bytes"] / 4
    assert per_step == pytest.approx(dp["all-reduce"]["bytes"] / 4, rel=0.01)
    assert "conditional" in trainers["diloco"].step_fn.as_text()


@pytest.fixture(scope="module")
def losses(tmp_path_factory):
    """Validation loss after STEPS steps under each option (lm_tiny, 8 devices)."""
    return {name: train(_cfg(tmp_path_factory.mktemp(f"run_{name}"), name))["val_loss"][STEPS] for name in MARGINS}


# Relative margins over exact DP's validation loss after 40 steps (docs/communication.md; benchmarks/RESULTS.md holds the measured table).
MARGINS = {
    "dp": 0.0,
    "bf16": 0.002,
    "int8": 0.01,
    "powersgd_r2": 0.05,
    "stale": 0.05,
    "diloco": 0.08,
    "overlap": 1e-5,
}  # scheduling options change when things run, not what is computed


@pytest.mark.slow
def test_compressed_and_local_runs_stay_close_to_exact_dp(losses):
    print({name: round(v, 4) for name, v in losses.items()})  # RESULTS.md's table: pytest -n 0 -s --tier slow
    dp = losses["dp"]
    for name, margin in MARGINS.items():
        assert losses[name] <= dp * (1 + margin), (name, losses)
    assert losses["dp"] < 3.2  # and exact DP itself learned (5.54 at step 0)


@pytest.mark.parametrize("compression", ["powersgd", "int8"])
def test_error_feedback_keeps_the_sum_of_sent_gradients_on_track(compression, tmp_path):
    """Error feedback's promise: over T steps, what was applied sums to the true gradients' sum
    minus one step's error, instead of drifting away step after step."""
    from meshwork.sharding.mesh import make_mesh
    from meshwork.train.comm_drift import sum_drift

    cfg = load_config(ROOT / "configs/lm_tiny.yaml", [f"comm.compression={compression}", "comm.rank=1"])
    drift = sum_drift(cfg, make_mesh({"data": 8}))
    assert drift[True] * 3 < drift[False], drift


def test_bad_combinations_are_refused(tmp_path):
    for extra, culprit in (
        (["comm.compression=int8", "rules.preset=fsdp", "mesh.fsdp=8", "mesh.data=1"], "comm.compression"),
        (["comm.compression=int8", "comm.local_steps=2"], "comm.local_steps"),
    ):
        cfg = load_config(ROOT / "configs/lm_tiny.yaml", [*tiny_overrides(tmp_path), *DP, *extra])
        with pytest.raises(ConfigError, match=culprit):
            check_runtime(cfg)
