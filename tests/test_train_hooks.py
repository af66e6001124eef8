"""Each hook of train/hooks/ alone, on a `Run` of real parts (metrics writer, step logger, Orbax
checkpointer, fast tier, goodput clock) and a stand-in trainer holding only what the hook reads.

Nothing here compiles a train step: the claims are the hooks' own decisions (when to evaluate,
save, roll back, move), which a compiled Trainer would only make slower to check. The loop that
calls them in order is exercised by the training, resume and reliability tests.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from conftest import ROOT

from meshwork.config import load_config
from meshwork.run.checkpoint import CheckpointSchedule
from meshwork.run.fast_tier import FastTier
from meshwork.run.goodput_clock import PHASES, GoodputClock
from meshwork.run.metrics import MetricsWriter, read_metrics
from meshwork.train.elastic import Change
from meshwork.train.hooks import Moved, RollBack, StepEnd
from meshwork.train.hooks.elastic import ElasticChange
from meshwork.train.hooks.evaluation import Evaluation
from meshwork.train.hooks.fast_tier import FastCheckpoint
from meshwork.train.hooks.goodput import GoodputRow
from meshwork.train.hooks.nonfinite import NonFiniteGuard
from meshwork.train.hooks.persistent import PersistentCheckpoint
from meshwork.train.hooks.preemption import Preemption
from meshwork.train.hooks.run import Run
from meshwork.train.hooks.samples import Samples
from meshwork.train.logger import StepLogger
from meshwork.train.run_dir.resume import open_checkpoints
from meshwork.train.stops import NonFiniteLoss

DEVICE = jax.devices()[0]


def state_at(step: int) -> dict:
    """A tiny train state whose values name the step it belongs to (device_put only: nothing compiles)."""
    return {
        "params": {"w": jax.device_put(np.full((2, 3), float(step), np.float32), DEVICE)},
        "step": jax.device_put(np.int32(step), DEVICE),
    }


def step_of(state: dict) -> int:
    return int(np.asarray(state["step"]))


def finite(loss: float = 1.0) -> dict:
    """A step's metrics as the compiled step returns them: device scalars."""
    return {
        "loss": jax.device_put(np.float32(loss), DEVICE),
        "grad_norm": jax.device_put(np.float32(0.5), DEVICE),
        "nonfinite": jax.device_put(np.bool_(not math.isfinite(loss)), DEVICE),
    }


class Positions:
    """The data iterator's checkpointable position (what Run keeps and restores)."""

    def __init__(self):
        self.index = 0

    def get_state(self) -> dict:
        return {"next_index": self.index}

    def set_state(self, state: dict) -> None:
        self.index = state["next_index"]


class StandInTrainer:
    """What the hooks and Run.restore read of a Trainer: the task's name, evaluate, write_samples,
    and the abstract state with its shardings; `mesh.size` for the elastic row."""

    def __init__(self, task: str = "lm", devices: int = 8):
        template = state_at(0)
        self.abstract = jax.eval_shape(lambda: template)
        self.shardings = jax.tree.map(lambda x: x.sharding, template)
        self.task = SimpleNamespace(name=task)
        self.mesh = SimpleNamespace(size=devices)
        self.evaluated: list[tuple[int, int]] = []  # (state's step, batches)

    def init_state(self) -> dict:
        return state_at(0)

    def evaluate(self, state, batches) -> dict:
        self.evaluated.append((step_of(state), len(batches)))
        return {"loss": 2.0 + len(batches)}  # which set was evaluated shows in the value

    def write_samples(self, state, path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\x89PNG\r\n\x1a\n")


def make_run(
    tmp_path, *overrides: str, fast: FastTier | None = None, is_main: bool = True, logger_last: int | None = None
) -> Run:
    """A Run as train/loop.py's _run builds it, on lm_tiny's config with `overrides`."""
    cfg = load_config(
        ROOT / "configs/lm_tiny.yaml",
        [f"run.dir={tmp_path}", "log.progress=false", "log.tensorboard=false", *overrides],
    )
    tmp_path.mkdir(parents=True, exist_ok=True)
    said: list[str] = []
    data = Positions()
    run = Run(
        cfg,
        tmp_path,
        said.append,
        is_main,
        GoodputClock(),
        open_checkpoints(cfg, tmp_path, said.append),
        fast,
        data,
        data.get_state(),
        set(),
        {"val_loss": {}, "preempted": False, "nonfinite_steps": [], "elastic": []},
    )
    run.writer = MetricsWriter(tmp_path, tensorboard=False)
    last = logger_last or cfg.train.steps
    run.logger = StepLogger(cfg, run.writer, 1e9, 256, "tokens", start=0, last=last, enabled=is_main, n_devices=8)
    run.said = said  # for the assertions on what the run printed
    return run


def close(run: Run) -> None:
    run.ckpt.close()
    run.writer.close()


def test_nonfinite_guard_skip_counts_the_step(tmp_path):
    run = make_run(tmp_path, "train.on_nan=skip")
    guard, trainer = NonFiniteGuard(run), StandInTrainer()
    assert guard.check(None, trainer) is None
    assert guard.check((3, {"loss": 1.0, "grad_norm": 0.5, "nonfinite": False}), trainer) is None
    assert guard.check((4, {"loss": float("nan"), "grad_norm": float("nan"), "nonfinite": True}), trainer) is None
    assert run.summary["nonfinite_steps"] == [4]
    assert run.skipped == set() and run.ckpt.latest_step() is None  # nothing rolled back or thrown out
    close(run)


def test_nonfinite_guard_stop_names_the_step_and_the_last_checkpoint(tmp_path):
    run = make_run(tmp_path, "train.on_nan=stop")
    run.ckpt.save(2, state_at(2), run.progress(), run.cfg.to_dict(), force=True)  # in flight when the NaN comes
    with pytest.raises(NonFiniteLoss, match=r"step 5 has loss nan .*last checkpoint: step 2"):
        NonFiniteGuard(run).check((5, {"loss": float("nan"), "grad_norm": 1.0, "nonfinite": True}), StandInTrainer())
    assert run.summary["nonfinite_steps"] == [5]
    assert run.ckpt.latest_step() == 2  # the write in flight committed before the error
    run.writer.close()


def test_nonfinite_guard_rollback_restores_the_last_checkpoint(tmp_path):
    run = make_run(tmp_path, "train.on_nan=rollback", "log.every=1")
    run.data_iter.index = 7
    run.ckpt.save(2, state_at(2), run.progress(), run.cfg.to_dict(), force=True)
    for step in range(1, 6):
        run.writer.write(step, {"loss": 1.0})
    run.data_iter.index = 20
    run.logger.step_dispatched(6, finite())  # read back after the bad step: thrown away with it
    back = NonFiniteGuard(run).check((5, {"loss": float("nan"), "grad_norm": 1.0, "nonfinite": True}), StandInTrainer())
    assert isinstance(back, RollBack) and back.step == 2
    np.testing.assert_array_equal(np.asarray(back.state["params"]["w"]), np.full((2, 3), 2.0))
    assert run.skipped == {5} and run.summary["nonfinite_steps"] == [5]
    assert run.data_iter.index == 7  # the data goes back with the state
    assert run.logger.pending is None
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]  # the rows past the checkpoint go
    assert any("rolling back to step 2" in s for s in run.said)
    close(run)


def test_evaluation_at_multiples_of_eval_every_and_at_the_last_step(tmp_path):
    run = make_run(tmp_path, "log.eval_every=5", "train.steps=12")
    trainer = StandInTrainer()
    evaluation = Evaluation(run, val_set=[{}, {}], base_val_set=[{}])
    for step in range(1, 13):  # the loop: dispatch the step, then the observers
        run.logger.step_dispatched(step, finite())
        assert evaluation.after_step(StepEnd(step, state_at(step), trainer)) is None
    run.logger.close()
    assert trainer.evaluated == [(5, 2), (5, 1), (10, 2), (10, 1), (12, 2), (12, 1)]
    assert run.summary["val_loss"] == {5: 4.0, 10: 4.0, 12: 4.0}
    assert run.summary["val_loss_base_data"] == {5: 3.0, 10: 3.0, 12: 3.0}
    rows = {r["step"]: r for r in read_metrics(tmp_path)}
    assert sorted(s for s, r in rows.items() if "val_loss" in r) == [5, 10, 12]
    assert rows[12]["val_loss_base_data"] == 3.0
    close(run)


def test_samples_only_for_diffusion_at_sample_every_on_the_main_process(tmp_path):
    def pngs(task, *overrides, is_main=True):
        run_dir = tmp_path / f"{task}{len(overrides)}{is_main}"
        run, trainer = make_run(run_dir, *overrides, is_main=is_main), StandInTrainer(task)
        hook = Samples(run)
        for step in range(1, 8):
            hook.after_step(StepEnd(step, state_at(step), trainer))
        close(run)
        return sorted(p.name for p in (run_dir / "samples").glob("*.png"))

    assert pngs("diffusion", "log.sample_every=3") == ["step_000003.png", "step_000006.png"]
    assert pngs("lm", "log.sample_every=3") == []
    assert pngs("diffusion", "log.sample_every=3", is_main=False) == []
    assert pngs("diffusion") == []  # log.sample_every unset


def test_goodput_row_only_on_the_last_step(tmp_path):
    run = make_run(tmp_path, "log.every=1", logger_last=3)
    trainer, hook = StandInTrainer(), GoodputRow(run)
    for step in (1, 2, 3):
        run.logger.step_dispatched(step, finite())
        hook.after_step(StepEnd(step, state_at(step), trainer, ending=step == 3))
    run.logger.close()
    rows = read_metrics(tmp_path)
    times = {f"time_{p}_s" for p in PHASES} | {"time_other_s", "time_wall_s"}
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert not any(k.startswith("time_") for r in rows[:2] for k in r)
    assert times <= rows[2].keys() and 0.0 <= rows[2]["goodput"] <= 1.0
    close(run)


def test_persistent_checkpoint_when_due_and_when_ending(tmp_path):
    run = make_run(tmp_path, "checkpoint.every=4", "checkpoint.keep=5")
    schedule = CheckpointSchedule(run.cfg.checkpoint.every, None, 0, 0.0)
    hook, trainer = PersistentCheckpoint(run, schedule, NonFiniteGuard(run)), StandInTrainer()
    for step in range(1, 7):
        run.data_iter.index = 10 * step
        run.logger.step_dispatched(step, finite())
        assert hook.after_step(StepEnd(step, state_at(step), trainer, ending=step == 6)) is None
    run.ckpt.wait()
    assert run.ckpt.verified_steps() == [4, 6]
    state, progress = run.restore(trainer, 6)
    assert step_of(state) == 6 and progress["iterator"] == {"next_index": 60}
    assert run.data_iter.index == 60 and progress["skipped_steps"] == []
    assert len(run.ckpt.stalls) == 2
    close(run)


def test_persistent_checkpoint_rolls_back_instead_of_saving_a_nonfinite_step(tmp_path):
    run = make_run(tmp_path, "checkpoint.every=2", "train.on_nan=rollback")
    schedule = CheckpointSchedule(run.cfg.checkpoint.every, None, 0, 0.0)
    hook, trainer = PersistentCheckpoint(run, schedule, NonFiniteGuard(run)), StandInTrainer()
    actions = {}
    for step in range(1, 5):  # step 4's metrics, flushed before its save, are NaN
        run.logger.step_dispatched(step, finite(float("nan") if step == 4 else 1.0))
        actions[step] = hook.after_step(StepEnd(step, state_at(step), trainer))
    assert actions[1] is None and actions[2] is None and actions[3] is None
    back = actions[4]
    assert isinstance(back, RollBack) and back.step == 2 and step_of(back.state) == 2
    assert run.skipped == {4} and run.summary["nonfinite_steps"] == [4]
    run.ckpt.wait()
    assert run.ckpt.verified_steps() == [2]  # the NaN step was never saved
    close(run)


def test_fast_checkpoint_when_due_but_never_at_the_last_step(tmp_path):
    fast = FastTier(every=2, path=None, buffered=False)
    run = make_run(tmp_path, fast=fast)
    hook, trainer = FastCheckpoint(run, last=6), StandInTrainer()
    newest = []
    for step in range(1, 7):
        run.data_iter.index = step
        hook.after_step(StepEnd(step, state_at(step), trainer, ending=step == 6))
        newest.append(fast.in_ram.step if fast.in_ram is not None else None)
    assert newest == [None, 2, 2, 4, 4, 4]  # step 6 is the persistent tier's
    assert len(fast.stalls) == 2 and fast.in_ram.progress["iterator"] == {"next_index": 4}
    restored, _ = run.restore(trainer, 4, fast.latest())
    assert step_of(restored) == 4
    close(run)
    # Without a fast tier the hook does nothing.
    no_fast = make_run(tmp_path / "none")
    FastCheckpoint(no_fast, last=6).after_step(StepEnd(2, state_at(2), trainer))
    close(no_fast)


class StandInElastic:
    """train/elastic.py's Elastic as the hook sees it: poll says which devices are lost after a step,
    change moves the run. The real change, in process on fake devices, is tested in
    tests/test_elastic_in_process.py; here only the hook's bookkeeping around it."""

    def __init__(self, lost_after: dict[int, frozenset], roll_back: bool = False):
        self.lost_after, self.roll_back, self.calls = lost_after, roll_back, []

    def poll(self, step):
        return self.lost_after.get(step)

    def change(self, lost, trainer, state, step, fast, restore_newest, make_trainer):
        self.calls.append((lost, step))
        new = StandInTrainer(devices=8 - len(lost))
        row = {"elastic_reason": f"lost devices {sorted(lost)}", "elastic_devices": new.mesh.size}
        if not self.roll_back:
            return Change(new, state, row=row)
        back, restored, progress = restore_newest(
            jax.tree.map(  # the newest tier, as the real change reads it
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), new.abstract, new.shardings
            )
        )
        return Change(new, restored, row=row, rolled_back_to=back, progress=progress)


def test_elastic_change_moves_the_run_when_devices_are_lost(tmp_path):
    run = make_run(tmp_path)
    elastic = StandInElastic({3: frozenset({6, 7})})
    hook, trainer = ElasticChange(run, elastic, trainer_on=None), StandInTrainer()
    assert hook.after_step(StepEnd(2, state_at(2), trainer)) is None  # poll: nothing changed
    moved = hook.after_step(StepEnd(3, state_at(3), trainer))
    assert isinstance(moved, Moved) and moved.step == 3 and moved.trainer.mesh.size == 6
    assert step_of(moved.state) == 3 and elastic.calls == [(frozenset({6, 7}), 3)]
    assert run.logger.n_devices == 6
    assert run.summary["elastic"] == [{"step": 3, "elastic_reason": "lost devices [6, 7]", "elastic_devices": 6}]
    assert read_metrics(tmp_path) == [{"step": 3, "elastic_reason": "lost devices [6, 7]", "elastic_devices": 6}]
    close(run)


def test_elastic_change_with_lost_shards_goes_back_to_the_newest_checkpoint(tmp_path):
    run = make_run(tmp_path)
    run.data_iter.index = 40
    run.ckpt.save(4, state_at(4), run.progress(), run.cfg.to_dict(), force=True)
    for step in range(1, 7):
        run.writer.write(step, {"loss": 1.0})
    run.data_iter.index = 99
    hook = ElasticChange(run, StandInElastic({6: frozenset({0})}, roll_back=True), trainer_on=None)
    moved = hook.after_step(StepEnd(6, state_at(6), StandInTrainer()))
    assert isinstance(moved, Moved) and moved.step == 4 and step_of(moved.state) == 4
    assert run.data_iter.index == 40
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 4]  # steps 5, 6 go; the change's row
    assert run.summary["elastic"][0]["step"] == 4
    close(run)


def test_preemption_says_so_only_when_preempted(tmp_path):
    run = make_run(tmp_path)
    hook, trainer = Preemption(run), StandInTrainer()
    hook.after_step(StepEnd(9, state_at(9), trainer, ending=True))  # the last step, not a signal
    assert run.summary["preempted"] is False and run.said == []
    hook.after_step(StepEnd(7, state_at(7), trainer, ending=True, preempted=True))
    assert run.summary["preempted"] is True
    assert run.said == ["preempted: checkpoint of step 7 saved; run the same command to resume"]
    close(run)
