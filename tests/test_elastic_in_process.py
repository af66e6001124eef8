"""In-process elasticity (train.elastic, train/elastic.py): 4 of 8 devices are lost after step 10
and come back after step 20, in one process; the run equals one restarted from checkpoints on the
same device counts, with no batch skipped or repeated, and never reads a lost device's buffer.

(Named test_elastic_in_process.py: tests/reliability/test_elastic.py, the elastic *resume*, owns
the module name test_elastic.)
"""

import time

import jax
import numpy as np
import pytest
from conftest import ROOT, tiny_overrides

from meshwork.config import ConfigError, load_config
from meshwork.run.fast_tier import FastTier
from meshwork.run.metrics import read_metrics
from meshwork.train.elastic import Elastic, layout_for, read_faults
from meshwork.train.loop import train
from meshwork.train.trainer import build_trainer, check_runtime

STEPS, LOSE, BACK = 30, 10, 20
LOST = frozenset({4, 5, 6, 7})
COMMON = [f"train.steps={STEPS}", "checkpoint.every=10", "log.every=1", f"log.eval_every={STEPS}"]
# layout on 8 devices -> the layout the elastic controller picks on the 4 left (same global batch,
# each device's microbatch the same size: twice the microbatches).
LAYOUTS = {
    "fsdp": (
        ["mesh.data=1", "mesh.fsdp=8", "rules.preset=fsdp"],
        ["mesh.data=1", "mesh.fsdp=4", "rules.preset=fsdp", "train.microbatches=2"],
    ),
    "dp_tp": (
        ["mesh.data=4", "mesh.tensor=2", "rules.preset=tp"],
        ["mesh.data=2", "mesh.tensor=2", "rules.preset=tp", "train.microbatches=2"],
    ),
}


def _cfg(run_dir, *extra):
    return load_config(ROOT / "configs/lm_tiny.yaml", [*tiny_overrides(run_dir), *COMMON, *extra])


def _host(state):
    return [np.asarray(x) for x in jax.tree.leaves(state)]


# ---------------------------------------------------------------- quick: the move itself


@pytest.fixture(scope="module")
def fsdp8(tmp_path_factory):
    """A compiled fsdp=8 trainer and a fresh state on it."""
    cfg = _cfg(tmp_path_factory.mktemp("fsdp8"), *LAYOUTS["fsdp"][0], "train.elastic=true")
    trainer = build_trainer(cfg, check_runtime(cfg, jax.devices()), jax.devices()).compile()
    return cfg, trainer


def _make_trainer(c, d, task=None):
    return build_trainer(c, task or check_runtime(c, d), d).compile()


def test_shrink_takes_survivors_and_the_fast_tier_then_grows_back_bit_exact(fsdp8, tmp_path):
    cfg, trainer = fsdp8
    state = trainer.init_state()
    want = _host(state)
    fast = FastTier(5, None, buffered=True)
    fast.save(LOSE, state, {"iterator": {}}, cfg.to_dict())
    elastic = Elastic(cfg, jax.devices(), tmp_path, say=lambda m: None)

    def no_rollback(target):
        raise AssertionError("survivors plus the fast tier hold every shard of this step")

    moved = elastic.change(LOST, trainer, state, LOSE, fast, no_rollback, _make_trainer)
    # The lost devices' buffers were deleted before the move: reading any of them would have raised.
    assert all(s.data.is_deleted() for x in jax.tree.leaves(state) for s in x.addressable_shards if s.device.id in LOST)
    assert moved.rolled_back_to is None and dict(moved.trainer.mesh.shape)["fsdp"] == 4
    assert moved.trainer.cfg.train.microbatches == 2
    assert {s.device.id for x in jax.tree.leaves(moved.state) for s in x.addressable_shards} == {0, 1, 2, 3}
    for a, b in zip(_host(moved.state), want):
        np.testing.assert_array_equal(a, b)

    back = elastic.change(frozenset(), moved.trainer, moved.state, BACK, fast, no_rollback, _make_trainer)
    assert back.trainer is trainer  # the 8-device step compiled once: coming back costs no compile
    assert back.trainer.mesh.size == 8
    for a, b in zip(_host(back.state), want):
        np.testing.assert_array_equal(a, b)


def test_shards_no_tier_holds_send_the_run_back_to_the_newest_tier(fsdp8, tmp_path):
    cfg, trainer = fsdp8
    state = trainer.init_state()
    want = _host(state)
    older = FastTier(5, None, buffered=False)
    older.save(LOSE - 5, state, {"iterator": {"next_index": 5}}, cfg.to_dict())  # not this step's copy
    elastic = Elastic(cfg, jax.devices(), tmp_path, say=lambda m: None)
    asked = []

    def newest(target):
        asked.append(target)
        return LOSE - 5, older.restore(older.latest(), target), older.latest().progress

    moved = elastic.change(LOST, trainer, state, LOSE, older, newest, _make_trainer)
    assert asked and moved.rolled_back_to == LOSE - 5 and moved.progress["iterator"]["next_index"] == 5
    for a, b in zip(_host(moved.state), want):
        np.testing.assert_array_equal(a, b)


def test_replicas_alone_rebuild_a_dp_tp_state(tmp_path):
    cfg = _cfg(tmp_path, *LAYOUTS["dp_tp"][0], "train.elastic=true")
    trainer = _make_trainer(cfg, jax.devices())
    state = trainer.init_state()
    want = _host(state)
    elastic = Elastic(cfg, jax.devices(), tmp_path, say=lambda m: None)
    moved = elastic.change(LOST, trainer, state, LOSE, None, lambda t: pytest.fail("rolled back"), _make_trainer)
    assert dict(moved.trainer.mesh.shape)["data"] == 2 and dict(moved.trainer.mesh.shape)["tensor"] == 2
    for a, b in zip(_host(moved.state), want):
        np.testing.assert_array_equal(a, b)


def test_layouts_keep_the_global_batch_and_the_per_device_microbatch(tmp_path):
    cfg = _cfg(tmp_path, *LAYOUTS["dp_tp"][0])
    small, used = layout_for(cfg, 8, 5)  # 5 left: tensor 2 needs pairs, so 4 are used
    assert used == 4 and (small.mesh.data, small.mesh.tensor, small.train.microbatches) == (2, 2, 2)
    with pytest.raises(ConfigError, match="train.elastic: 1 devices left"):
        layout_for(cfg, 8, 1)


def test_fault_files_and_elastic_configs_that_cannot_work_are_refused(tmp_path):
    faults = tmp_path / "faults"
    faults.write_text("4 5\n6 @ 10-20  # a drill\n")
    read = read_faults(faults, set(range(8)))
    assert [(sorted(f.devices), f.after, f.until) for f in read] == [([4, 5], None, None), ([6], 10, 20)]
    faults.write_text("4 9\n")
    cfg = _cfg(tmp_path / "run", "train.elastic=true", f"train.fault_file={faults}")
    with pytest.raises(ConfigError, match=r"train.fault_file: .* names device 9, which this run does not have"):
        train(cfg, devices=jax.devices())
    assert not (tmp_path / "run").exists()  # refused before anything was written
    faults.write_text("four\n")
    with pytest.raises(ConfigError, match="is not 'DEVICE_IDS'"):
        read_faults(faults, set(range(8)))
    with pytest.raises(ConfigError, match="train.elastic: mesh.stage=2: pipeline stages cannot shrink"):
        _cfg(tmp_path, "train.elastic=true", "mesh.stage=2", "train.pipeline=gpipe")


# ---------------------------------------------------------------- slow: whole runs against restarts


def _losses(run_dir):
    return [r for r in read_metrics(run_dir) if "loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_elastic_run_equals_restarts_on_the_same_device_counts(tmp_path, layout):
    big, small = LAYOUTS[layout]
    faults = tmp_path / "faults"
    faults.write_text(f"4 5 6 7 @ {LOSE}-{BACK}\n")
    # The fsdp layout needs the fast tier (half of every shard dies); dp+tp runs without one (replicas).
    tier = ["checkpoint.fast_every=5"] if layout == "fsdp" else []
    t0 = time.perf_counter()
    elastic = train(
        _cfg(tmp_path / "elastic", *big, "train.elastic=true", f"train.fault_file={faults}", *tier),
        devices=jax.devices(),
    )
    elastic_wall = time.perf_counter() - t0

    restarts, phases = [], []
    for devices, overrides, stop in ((8, big, LOSE), (4, small, BACK), (8, big, STEPS)):
        t0 = time.perf_counter()
        done = train(
            _cfg(tmp_path / "restarted", *overrides, f"train.stop_after={stop}"), devices=jax.devices()[:devices]
        )
        restarts.append(time.perf_counter() - t0)
        phases.append(done["goodput"])
    # What a restart costs in-process (no interpreter start): its compile and restore.
    restart_lost = [
        b["compile_s"] + b["restore_s"] - a["compile_s"] - a["restore_s"] for a, b in zip(phases, phases[1:])
    ]

    changes = elastic["elastic"]
    assert [(c["step"], c["elastic_devices"]) for c in changes] == [(LOSE, 4), (BACK, 8)]
    assert changes[0]["elastic_microbatches"] == 2 and changes[1]["elastic_microbatches"] == 1
    a, b = _losses(tmp_path / "elastic"), _losses(tmp_path / "restarted")
    assert [r["step"] for r in a] == list(range(1, STEPS + 1))
    # No batch skipped or repeated:
    assert [r["data_index"] for r in a] == list(range(STEPS)) == [r["data_index"] for r in b]
    np.testing.assert_allclose([r["loss"] for r in a], [r["loss"] for r in b], rtol=2e-5)
    worst = max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(a, b))
    print(
        f"\n{layout}: max rel loss diff {worst:.2e}; elastic changes lost "
        f"{[round(c['elastic_lost_s'], 2) for c in changes]} s vs in-process restarts "
        f"{[round(x, 2) for x in restart_lost]} s (compile + restore); walls {elastic_wall:.1f} s "
        f"vs {sum(restarts):.1f} s"
    )


@pytest.mark.slow
def test_without_a_copy_of_the_lost_shards_the_run_retrains_from_the_persistent_tier(tmp_path):
    """fsdp without a fast tier: half of every shard dies at step 7, the run goes back to step 5's
    checkpoint on 4 devices and trains 6 and 7 again; the result is a restart's, row for row."""
    big, small = LAYOUTS["fsdp"]
    faults = tmp_path / "faults"
    faults.write_text("4 5 6 7 @ 7\n")
    short = ["train.steps=10", "checkpoint.every=5", "log.eval_every=10"]
    done = train(
        _cfg(tmp_path / "elastic", *big, *short, "train.elastic=true", f"train.fault_file={faults}"),
        devices=jax.devices(),
    )
    train(_cfg(tmp_path / "restarted", *big, *short, "train.stop_after=5"), devices=jax.devices())
    train(_cfg(tmp_path / "restarted", *small, *short), devices=jax.devices()[:4])
    assert [(c["step"], c["elastic_devices"], c["elastic_steps_redone"]) for c in done["elastic"]] == [(5, 4, 2)]
    a, b = _losses(tmp_path / "elastic"), _losses(tmp_path / "restarted")
    assert [r["step"] for r in a] == list(range(1, 11))  # the rows of the steps thrown away are gone
    assert [r["data_index"] for r in a] == list(range(10)) == [r["data_index"] for r in b]
    np.testing.assert_allclose([r["loss"] for r in a], [r["loss"] for r in b], rtol=2e-5)
