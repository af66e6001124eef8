"""The training loop: validate, build the mesh, init or resume, step, log, save.

from meshwork.config import load_config
from meshwork.train.loop import train
summary = train(load_config("configs/lm_tiny.yaml", ["train.steps=50"]))
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import sys
from typing import Any

import jax

from meshwork.config import Config
from meshwork.perf.flops import param_counts
from meshwork.run.checkpoint import CheckpointSchedule, storage_full_message
from meshwork.run.durable import StorageFull, storage_problem
from meshwork.run.goodput_clock import GoodputClock
from meshwork.run.metrics import MetricsWriter
from meshwork.train.elastic import Elastic
from meshwork.train.finetune import base_data_config, describe, with_base_model
from meshwork.train.hooks import Hook, Moved, RollBack, StepEnd
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
from meshwork.train.optimizer_report import optimizer_lines, optimizer_report
from meshwork.train.preemption import PreemptionGuard
from meshwork.train.rollouts import engine_plan_of, split_placement
from meshwork.train.run_dir import (
    RunDirLock,
    check_checkpoints,
    newest_tier,
    open_checkpoints,
    open_fast_tier,
    record_changes,
    take_run_dir,
    write_config,
)
from meshwork.train.state import param_count
from meshwork.train.task import make_task
from meshwork.train.terminal import say as say_through_bar
from meshwork.train.terminal import startup_lines
from meshwork.train.trainer import Trainer, build_trainer, check_fits, check_runtime, trainer_on


def train(cfg: Config, *, devices: list | None = None, dry_run: bool | str = False) -> dict[str, Any]:
    """Trains `cfg` to `cfg.train.steps`, resuming from `run.dir`'s newest verified checkpoint.

    Returns a summary: validation losses, the steps run, the run dir, the
    final state, `goodput` (the time breakdown) and `preempted` (True when a
    SIGTERM/SIGINT ended it early, after saving). Raises ConfigError for bad
    input before anything in run.dir changes, NonFiniteLoss under on_nan=stop,
    StorageFull when the run dir's storage gives out (the last checkpoint kept).
    """
    clock = GoodputClock()
    cfg = with_base_model(cfg)  # a Hugging Face finetune.base decides the model
    devices, engine_devices = split_placement(cfg, devices)  # grpo split: the serving engine takes the other half
    task = check_runtime(cfg, devices)
    if engine_devices is not None:
        task.engine_devices = engine_devices
    is_main = jax.process_index() == 0
    say = say_through_bar if is_main else (lambda msg: None)
    run_dir = pathlib.Path(cfg.run.dir)
    lock = RunDirLock(run_dir)
    # Signals are caught from here on, so SIGTERM or Ctrl-C during the compile or the restore ends
    # with the documented status too (a dry run writes nothing and is simply interrupted).
    with contextlib.nullcontext() if dry_run else PreemptionGuard() as guard:
        try:
            return _train(cfg, task, devices, dry_run, clock, run_dir, lock, is_main, say, guard)
        except OSError as e:  # metrics, manifests, samples: the run dir's storage gave out
            if (problem := storage_problem(e)) is None:
                raise
            raise StorageFull(
                storage_full_message(run_dir / "checkpoints", problem, f"writing {e.filename or 'to the run dir'}")
            ) from None
        finally:
            lock.release()


def _train(
    cfg: Config,
    task,
    devices,
    dry_run,
    clock: GoodputClock,
    run_dir: pathlib.Path,
    lock: RunDirLock,
    is_main: bool,
    say,
    guard: PreemptionGuard | None,
) -> dict[str, Any]:
    start, changes = None, {}
    taken = False  # take_run_dir has run: the same on every process, where lock.held is process 0's alone
    if not dry_run:
        # Every refusal (another trainer, another run, unreadable checkpoints) comes before the compile,
        # and nothing in the run dir changes until the compile is done: a kill during it leaves the
        # run dir as it was, and a new run dir does not exist yet.
        if run_dir.is_dir():
            take_run_dir(lock, is_main, say)
            taken = True
        start, changes = check_checkpoints(cfg, run_dir, _warn if is_main else lambda msg: None)
        if start is not None and start >= cfg.train.steps:
            say(
                f"already at step {start} of train.steps={cfg.train.steps}; nothing to train (raise train.steps "
                f"to train further)"
            )
            return _nothing_run(run_dir, start, clock, preempted=False)
    # A fault file that names devices this run lacks is refused before the compile.
    elastic = Elastic(cfg, devices or jax.devices(), run_dir, say) if cfg.train.elastic and not dry_run else None
    with clock.phase("compile"):
        trainer = build_trainer(cfg, task, devices)
        _announce(trainer, cfg, dry_run, start, run_dir, say)  # the start-up block, before the compile's silence
        trainer = trainer.compile()
    if dry_run:  # True: human-readable; "json": one JSON object
        engine = engine_plan_of(trainer)  # grpo: the serving engine's pages and sync traffic beside it
        optimizer = optimizer_report(trainer)  # its state and Newton-Schulz traffic beside the planner's
        if dry_run == "json":
            engine_part = {"engine": engine.to_dict()} if engine else {}
            print(json.dumps({**trainer.report_dict(), "optimizer": optimizer, **engine_part}))
        else:
            lines = [trainer.report(), *optimizer_lines(optimizer), *(engine.lines() if engine else [])]
            print("\n".join(lines))
        return {"dry_run": True}
    check_fits(trainer)
    if guard.signal is not None:  # asked to stop while starting: nothing new exists yet, so nothing to save
        say("preempted during start-up: nothing was written; run the same command to start")
        return _nothing_run(run_dir, start, clock, preempted=True)
    if not taken:  # a new run dir: create it and own it before writing into it
        if is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
        take_run_dir(lock, is_main, say)
    if is_main:  # the run's identity first: config.yaml is a new run dir's first file
        write_config(cfg, run_dir)
        lock.record()
        if changes:
            record_changes(run_dir, start or 0, changes)
            say(f"changed from step {start}: " + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items()))
    return _run(cfg, trainer, elastic, clock, run_dir, is_main, say, guard)


def _warn(msg: str) -> None:
    """A line on stderr before the compile (no progress bar yet): what the user should know but
    what does not stop the run, such as an edited config.yaml that the checkpoint overrules."""
    print(msg, file=sys.stderr, flush=True)


def _nothing_run(run_dir: pathlib.Path, start: int | None, clock: GoodputClock, preempted: bool) -> dict[str, Any]:
    """The summary of an invocation that trained no step."""
    return {
        "run_dir": str(run_dir),
        "resumed_from": start,
        "val_loss": {},
        "preempted": preempted,
        "nonfinite_steps": [],
        "goodput": clock.breakdown(),
        "last_step": start or 0,
        "state": None,
    }


def _announce(trainer: Trainer, cfg: Config, dry_run, start: int | None, run_dir: pathlib.Path, say) -> None:
    """What the run is (model, mesh, layout, run dir), and that the compile begins."""
    if dry_run == "json":
        return
    total = param_count(trainer.abstract)
    active = f", {param_counts(cfg.model)['activated']:,} activated per token" if trainer.task.name == "lm" else ""
    model = (
        f"{cfg.model.kind} model: {total:,} parameters{active}"
        if cfg.finetune.method == "none"
        else describe(cfg, trainer.abstract)
    )
    for line in startup_lines(trainer, model, start=start, run_dir=run_dir) if not dry_run else [model]:
        say(line)
    say("compiling the train step...")


def _run(
    cfg: Config,
    trainer: Trainer,
    elastic: Elastic | None,
    clock: GoodputClock,
    run_dir: pathlib.Path,
    is_main: bool,
    say,
    guard: PreemptionGuard,
) -> dict[str, Any]:
    """Opens the checkpoint tiers and the data, restores or initializes, trains, closes."""
    ckpt = open_checkpoints(cfg, run_dir, say)
    fast = open_fast_tier(cfg)
    start, snapshot = newest_tier(cfg, ckpt, fast, say)
    if (prepare := getattr(trainer.task, "prepare", None)) is not None:
        prepare(trainer, say)  # dpo's reference, precomputed (or read) or a frozen copy, before any batch
    data_iter = trainer.task.train_iterator()
    summary: dict[str, Any] = {
        "run_dir": str(run_dir),
        "resumed_from": start,
        "val_loss": {},
        "preempted": False,
        "nonfinite_steps": [],
        "restored_tier": "fast" if snapshot is not None else ("persistent" if start is not None else None),
        "elastic": [],
    }
    run = Run(cfg, run_dir, say, is_main, clock, ckpt, fast, data_iter, data_iter.get_state(), set(), summary)
    val_set = trainer.task.eval_batches()
    base_data = base_data_config(cfg)
    evaluation = Evaluation(run, val_set, make_task(base_data).eval_batches() if base_data is not None else None)
    if start is not None:
        say(f"restoring the checkpoint of step {start}...")
    with clock.phase("restore" if start is not None else "compile"):
        state, progress = run.restore(trainer, start, snapshot)
    clock.resume(progress.get("goodput"))
    run.skipped.update(progress.get("skipped_steps", []))
    run.writer = MetricsWriter(run_dir, tensorboard=cfg.log.tensorboard, resume_step=start, enabled=is_main)
    schedule = CheckpointSchedule(cfg.checkpoint.every, cfg.run.mttf_hours, start or 0, clock.totals["productive"])
    if start is None:
        say(
            f"evaluating step 0 (greedy answers to {cfg.train.grpo.eval_prompts} held-out prompts)..."
            if trainer.task.on_policy
            else f"evaluating step 0 ({len(val_set)} validation batches)..."
        )
        run.writer.write(0, evaluation.evaluate(trainer, state, 0))
    last = min(cfg.train.steps, cfg.train.stop_after or cfg.train.steps)
    run.logger = StepLogger(
        cfg,
        run.writer,
        trainer.task.flops_per_step(trainer.step_fn, trainer.mesh.size),
        trainer.task.items_per_step(),
        trainer.task.unit,
        start=start or 0,
        last=last,
        enabled=is_main,
        n_devices=trainer.mesh.size,
        live=lambda: {"goodput": clock.goodput()},
    )
    nonfinite = NonFiniteGuard(run)
    # Hooks that look at the new state come before the loop asks whether a signal ended the run;
    # those that keep it or move it come after, and see whether this step is the last.
    observers = [evaluation, Samples(run)]
    keepers = [
        GoodputRow(run),
        PersistentCheckpoint(run, schedule, nonfinite),
        FastCheckpoint(run, last),
        *([ElasticChange(run, elastic, trainer_on)] if elastic else []),
        Preemption(run),
    ]
    state, step = _loop(run, trainer, state, start or 0, last, nonfinite, observers, keepers, guard)
    run.logger.close()
    with clock.phase("checkpoint"):
        ckpt.close()
        if fast is not None:
            fast.close()
    summary["checkpoint_stalls"] = {"persistent": ckpt.stalls, "fast": fast.stalls if fast is not None else []}
    summary["goodput"] = clock.breakdown()
    run.writer.close()
    summary.update(state=state, last_step=step)
    return summary


def _loop(
    run: Run,
    trainer: Trainer,
    state: Any,
    step: int,
    last: int,
    nonfinite: NonFiniteGuard,
    observers: list[Hook],
    keepers: list[Hook],
    guard: PreemptionGuard,
) -> tuple[Any, int]:
    """Steps until `last` or a preemption signal; after each, the hooks in order (train/hooks/)."""
    while step < last:
        step += 1
        state, done = _step(run, trainer, state, step)
        if (back := nonfinite.check(done, trainer)) is not None:
            step, state = back.step, back.state
            continue
        seen = StepEnd(step, state, trainer)
        for hook in observers:
            hook.after_step(seen)
        preempted = guard.should_stop(step)
        end = StepEnd(step, state, trainer, ending=step == last or preempted, preempted=preempted)
        for hook in keepers:
            action = hook.after_step(end)
            if isinstance(action, RollBack):
                step, state = action.step, action.state
                break
            if isinstance(action, Moved):
                trainer, state, step = action.trainer, action.state, action.step
                end = dataclasses.replace(end, step=step, state=state, trainer=trainer)
        else:
            if preempted:
                break
    return state, step


def _step(run: Run, trainer: Trainer, state: Any, step: int) -> tuple[Any, tuple[int, dict] | None]:
    """One training step (or, for a batch a rollback threw out, only the counter), dispatched;
    returns the new state and the metrics of an earlier step read back meanwhile, if any."""
    run.ckpt.poll()
    position = run.data_iter.get_state().get("next_index")
    with run.clock.phase("productive"):
        batch = _next_batch(run, trainer, state, step)
        if step in run.skipped:  # a rollback threw this batch out: never train on it
            state, metrics = trainer.skip_fn(state), {}
            run.logger.add(step, skipped_batch=1)
        else:
            state, metrics = trainer.step_fn(state, trainer.to_device(batch))
        if trainer.task.on_policy:
            run.data_iter.after_dispatch(trainer, state)  # off-policy: the next batch samples meanwhile
        return state, run.logger.step_dispatched(step, metrics, data_index=position)


def _next_batch(run: Run, trainer: Trainer, state: Any, step: int) -> dict:
    """The step's batch: the next of the data, or for an on-policy task (grpo) the source's next,
    made from the current weights; what making it measured goes into the step's row."""
    if not trainer.task.on_policy:
        return next(run.data_iter)
    batch = run.data_iter.next_from(trainer, state)
    if run.data_iter.host:
        run.logger.add(step, **run.data_iter.host)
    return batch
