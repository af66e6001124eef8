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
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from meshwork.config import Config, ConfigError
from meshwork.models.build import ema_decay
from meshwork.partitioning import abstract_with_shardings, indivisible, logical_specs
from meshwork.perf.flops import param_counts
from meshwork.run.checkpoint import CheckpointSchedule, storage_full_message
from meshwork.run.durable import StorageFull, storage_problem
from meshwork.run.goodput_clock import GoodputClock
from meshwork.run.metrics import MetricsWriter
from meshwork.sharding.mesh import MESH_AXES, MeshSizeError, make_mesh, resolve_mesh_shape
from meshwork.sharding.overlap import compiler_options
from meshwork.sharding.report import compiled_report, format_report, state_bytes
from meshwork.sharding.ring_attention import zigzag_permutation
from meshwork.sharding.parallel import ParallelContext, use_parallel
from meshwork.sharding.rules import ROLES, logical_to_sharding, rules_for, split_axes, tree_shardings
from meshwork.train.comm import check_comm, comm_shardings, init_comm_state, make_diloco_step, outer_optimizer, uses_comm
from meshwork.train.elastic import Elastic
from meshwork.train.finetune import base_data_config, check_base, describe, load_base_params, with_base_model
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
from meshwork.train.logger import StepLogger, to_host
from meshwork.train.optim import make_optimizer
from meshwork.train.preemption import PreemptionGuard
from meshwork.train.run_dir import record_changes, write_config
from meshwork.train.run_lock import RunDirLock
from meshwork.train.startup import (
    check_checkpoints,
    check_fits,
    newest_tier,
    open_checkpoints,
    open_fast_tier,
    take_run_dir,
)
from meshwork.train.state import abstract_state, init_state, param_count, state_shardings
from meshwork.train.gradients import gradient_strategy, local_strategy, replica_gradient
from meshwork.train.step import make_eval_step, make_train_step
from meshwork.train.task import DiffusionTask, LMTask, make_task
from meshwork.train.terminal import say as say_through_bar
from meshwork.train.terminal import startup_lines


def check_runtime(cfg: Config, devices: list | None = None) -> LMTask | DiffusionTask:
    """The checks that need jax or the file system; raises ConfigError before anything is compiled or written."""
    n_devices = len(devices) if devices is not None else jax.device_count()
    try:
        mesh_shape = dict(zip(MESH_AXES, resolve_mesh_shape(cfg.mesh.sizes(), n_devices)))
    except MeshSizeError as e:
        raise ConfigError(f"{e} (devices: {n_devices}, {jax.default_backend()})") from None
    dp = mesh_shape["data"] * mesh_shape["fsdp"]
    per_micro = cfg.train.global_batch // cfg.train.microbatches
    if per_micro % dp:
        raise ConfigError(
            f"train.global_batch: {cfg.train.global_batch} sequences in {cfg.train.microbatches} microbatch(es) "
            f"cannot be split over the data-parallel size data*fsdp={dp}; use a multiple of {dp * cfg.train.microbatches}")
    try:
        rules = rules_for(cfg.rules.preset, cfg.rules.overrides)
    except KeyError as e:
        raise ConfigError(str(e.args[0])) from None
    for name, axes in cfg.rules.overrides.items():
        unknown = [a for a in ((axes,) if isinstance(axes, str) else axes or ()) if a not in MESH_AXES]
        if unknown:
            raise ConfigError(f"rules.overrides: {name}: {unknown[0]!r} is not a mesh axis; use one of "
                              f"{', '.join(MESH_AXES)} (or null for replicated)")
    seq_axes = split_axes("act_seq", rules, mesh_shape)
    if split_axes("expert", rules, mesh_shape) and cfg.train.pipeline != "none":
        raise ConfigError("train.pipeline: expert parallelism (ep) inside a pipeline stage is not supported; "
                          "drop ep from rules.preset (the experts stay whole on each stage) or set train.pipeline=none")
    if len(seq_axes) > 1:
        raise ConfigError(f"rules.preset: the sequence is split over {seq_axes}; context parallelism uses one axis")
    if seq_axes and cfg.data.source == "text":
        raise ConfigError(f"rules.preset: context parallelism (ring attention over {seq_axes[0]}) takes no packed "
                          "documents, which data.source=text makes; drop cp from rules.preset")
    if seq_axes and cfg.data.seq_len % (2 * mesh_shape[seq_axes[0]]):
        raise ConfigError(f"data.seq_len: {cfg.data.seq_len} must be a multiple of 2 x {seq_axes[0]}="
                          f"{mesh_shape[seq_axes[0]]} for context parallelism's zigzag layout")
    check_comm(cfg, mesh_shape)
    check_base(cfg)
    return make_task(cfg)


def process_rows(sharding: NamedSharding, global_shape: tuple[int, ...]) -> slice:
    """The contiguous block of rows (dimension 0) that this process's devices hold."""
    index_map = sharding.addressable_devices_indices_map(global_shape)
    starts = {idx[0].start or 0 for idx in index_map.values()}
    stops = {global_shape[0] if idx[0].stop is None else idx[0].stop for idx in index_map.values()}
    return slice(min(starts), max(stops))


class Trainer:
    """Everything compiled for one config on one mesh; `train()` drives it."""

    def __init__(self, cfg: Config, task: LMTask | DiffusionTask, devices: list | None = None,
                 before_compile: Callable[["Trainer"], None] | None = None):
        """`before_compile(self)` runs once shapes, mesh and shardings are known, before the (long) compile."""
        self.cfg, self.task = cfg, task
        self.mesh = make_mesh(cfg.mesh.sizes(), devices)
        preset = cfg.rules.preset + ("+pp" if cfg.train.pipeline != "none" else "")
        self.rules_by_role = {role: rules_for(preset, cfg.rules.overrides, role) for role in ROLES}
        self.rules = self.rules_by_role["params"]  # also the activations' table
        # How the layers run on the mesh, chosen once for the run (sharding/parallel.py).
        self.parallel = ParallelContext(self.rules, collective_matmul=cfg.comm.collective_matmul)
        # Context parallelism: tokens are laid out in zigzag order so every
        # device on the ring gets the same share of causal attention work;
        # the model reads each token's true position from `positions`.
        seq_axes = split_axes("act_seq", self.rules, dict(self.mesh.shape))
        self.seq_perm = (zigzag_permutation(cfg.data.seq_len, self.mesh.shape[seq_axes[0]])
                         if len(seq_axes) == 1 else None)
        self.tx, self.schedule = make_optimizer(cfg.optimizer, cfg.train.steps)
        self.inner_tx = None
        if cfg.comm.local_steps > 1:  # DiLoCo: AdamW runs inside each replica, the state's optimizer is the outer one
            self.inner_tx, self.tx = self.tx, outer_optimizer(cfg)
        # Shapes first, outside the mesh: nnx.eval_shape would otherwise try to
        # place the logical names on the mesh itself.
        self.graphdef, self.abstract = abstract_state(cfg, self.tx)
        if uses_comm(cfg):
            self.abstract["comm"] = jax.eval_shape(self.init_comm, self.abstract["params"])
        with self.context():
            self.shardings = state_shardings(self.abstract, self.mesh, self.rules_by_role, cfg.train.offload)
            if uses_comm(cfg):
                self.shardings["comm"] = comm_shardings(self.abstract["comm"], self.mesh)
            # Parameters first: the message should name a weight, not one of its Adam moments.
            placed = abstract_with_shardings(self.abstract, self.shardings)
            for part in sorted(placed, key=lambda k: (k != "params", k != "buffers", k)):
                if problem := indivisible(placed[part]):
                    raise ConfigError(f"{part}.{problem} (rules.preset={cfg.rules.preset}); choose model sizes "
                                      f"the mesh divides, a smaller mesh axis, or another rules.preset")
            # Gradients get their own layout only when it differs from the
            # parameters' (ZeRO-2: reduce-scattered instead of all-reduced).
            grad_shardings = tree_shardings(logical_specs(self.abstract["params"]), self.mesh,
                                            self.rules_by_role["grads"])
            if self.rules_by_role["grads"] == self.rules:
                grad_shardings = None
            self.grad_shardings = grad_shardings
            self.batch_sharding = logical_to_sharding(task.batch_axes, self.mesh, self.rules)
            replicated = NamedSharding(self.mesh, PartitionSpec())
            shapes = {**task.batch_shapes(), **({"positions": task.batch_shapes()["inputs"]}
                                                 if self.seq_perm is not None else {})}
            batch_abstract = {k: jax.ShapeDtypeStruct((cfg.train.global_batch, *shape), dtype,
                                                      sharding=self.batch_sharding)
                              for k, (shape, dtype) in shapes.items()}
            if before_compile is not None:
                before_compile(self)
            # The step owns the state: donating it lets XLA update parameters
            # and moments in place instead of holding two copies.
            step = jax.jit(self.make_step(grad_shardings), in_shardings=(self.shardings, self.batch_sharding),
                           out_shardings=(self.shardings, replicated), donate_argnums=0)
            lowered = step.lower(abstract_with_shardings(self.abstract, self.shardings), batch_abstract)
            try:
                self.step_fn = lowered.compile(
                    compiler_options=compiler_options(cfg.comm, self.mesh.devices.flat[0].platform))
            except jax.errors.JaxRuntimeError as e:  # the installed jaxlib decides which options exist
                if "No such compile option" not in str(e):
                    raise
                raise ConfigError(f"comm.xla_options: {str(e).split(': ', 1)[-1]} in this jaxlib "
                                  f"({jax.__version__}); remove it or check its spelling") from None
            # A batch thrown out by a rollback: only the step counter moves (the schedule and noise follow it).
            self.skip_fn = jax.jit(lambda state: {**state, "step": state["step"] + 1},
                                   out_shardings=self.shardings, donate_argnums=0)
            self.eval_fn = jax.jit(make_eval_step(task.objective(self.graphdef)), in_shardings=(
                self.shardings["params"], self.shardings["buffers"], self.batch_sharding), out_shardings=replicated)

    def make_step(self, grad_shardings: Any) -> Callable:
        """step(state, batch) -> (state, metrics): the task's objective, the config's gradient
        strategy, and the optimizer's update (DiLoCo's local and outer steps under comm.local_steps)."""
        cfg, objective = self.cfg, self.task.objective(self.graphdef)
        if cfg.comm.local_steps > 1:
            return make_diloco_step(self.graphdef, replica_gradient(local_strategy(cfg, objective)), self.inner_tx,
                                    self.tx, self.schedule, cfg, self.mesh, cfg.run.seed)
        return make_train_step(self.graphdef, self.tx, self.schedule,
                               gradient_strategy(cfg, self.graphdef, objective, self.mesh), seed=cfg.run.seed,
                               grad_shardings=grad_shardings, ema_decay=ema_decay(cfg),
                               inject_nan_at=tuple(cfg.train.inject_nan_at))

    def init_comm(self, params: Any) -> dict[str, Any]:
        return init_comm_state(self.cfg, params, self.mesh.shape["data"], self.inner_tx)

    def context(self):
        """The mesh and the run's ParallelContext, current while tracing: activation constraints
        and the layers' parallel implementations read them."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(use_parallel(self.parallel))
        return stack

    def init_state(self) -> dict[str, Any]:
        """A fresh state; a fine-tuning run starts from its base run's trained weights."""
        # Outside the mesh context, like the trainer's own abstract state (nnx.eval_shape).
        base = (load_base_params(self.cfg, self.mesh, self.rules_by_role)
                if self.cfg.finetune.method != "none" else None)
        with self.context():
            if not uses_comm(self.cfg):
                return init_state(self.cfg, self.tx, self.shardings, base)
            plain = {k: v for k, v in self.shardings.items() if k != "comm"}
            state = init_state(self.cfg, self.tx, plain, base)
            return {**state, "comm": jax.jit(self.init_comm, out_shardings=self.shardings["comm"])(state["params"])}

    def to_device(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Global host batch -> sharded global arrays; each process puts only the rows its devices hold."""
        if self.seq_perm is not None:  # a language model's tokens under context parallelism
            B = batch["inputs"].shape[0]
            batch = {**{k: v[:, self.seq_perm] for k, v in batch.items()},
                     "positions": np.broadcast_to(self.seq_perm.astype(np.int32), (B, len(self.seq_perm)))}
        rows = process_rows(self.batch_sharding, next(iter(batch.values())).shape)
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, v[rows], v.shape)
                for k, v in batch.items()}

    def evaluate(self, state: dict[str, Any], batches: list[dict[str, np.ndarray]]) -> float:
        with self.context():
            losses = [self.eval_fn(state["params"], state["buffers"], self.to_device(b)) for b in batches]
        return float(np.mean([to_host(x) for x in losses]))

    def write_samples(self, state: dict[str, Any], path: pathlib.Path, num: int | None = None,
                      steps: int = 25) -> None:
        """A grid of DDIM samples from the EMA weights (the raw ones if there is no EMA): one row per
        class, 2 samples each (16 samples without classes), tiles scaled up to 48 px."""
        from flax import nnx

        from meshwork.diffusion.images import sample_images, save_class_grid

        classes = self.cfg.model.unet.num_class_embeds
        num = num or (2 * (classes - 1) if classes is not None else 16)  # the last class is guidance's null one
        model = nnx.merge(self.graphdef, state.get("ema", state["params"]), state["buffers"])
        with self.context():
            images, labels = sample_images(model, self.cfg, num=num, steps=steps)
        save_class_grid(images, labels, path)

    def report_dict(self) -> dict[str, Any]:
        """Per-device state bytes, temp memory, FLOPs and collectives of the compiled step."""
        return compiled_report(self.step_fn, state_bytes(self.abstract, self.shardings, self.grad_shardings))

    def report(self) -> str:
        return format_report(self.report_dict(), self.cfg, self.mesh)


def trainer_on(cfg: Config, devices: list, task: LMTask | DiffusionTask) -> Trainer:
    """A Trainer for `cfg` compiled on `devices` (an elastic change's new device set; the task is the run's)."""
    return Trainer(cfg, task, devices)


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
    task = check_runtime(cfg, devices)
    is_main = jax.process_index() == 0
    say = say_through_bar if is_main else (lambda msg: None)
    run_dir = pathlib.Path(cfg.run.dir)
    lock = RunDirLock(run_dir)
    # Signals are caught from here on, so SIGTERM or Ctrl-C during the compile or the restore ends
    # with the documented status too (a dry run writes nothing and is simply interrupted).
    with (contextlib.nullcontext() if dry_run else PreemptionGuard()) as guard:
        try:
            return _train(cfg, task, devices, dry_run, clock, run_dir, lock, is_main, say, guard)
        except OSError as e:  # metrics, manifests, samples: the run dir's storage gave out
            if (problem := storage_problem(e)) is None:
                raise
            raise StorageFull(storage_full_message(run_dir / "checkpoints", problem,
                                                   f"writing {e.filename or 'to the run dir'}")) from None
        finally:
            lock.release()


def _train(cfg: Config, task, devices, dry_run, clock: GoodputClock, run_dir: pathlib.Path, lock: RunDirLock,
           is_main: bool, say, guard: PreemptionGuard | None) -> dict[str, Any]:
    start, changes = None, {}
    taken = False  # take_run_dir has run: the same on every process, where lock.held is process 0's alone
    if not dry_run:
        # Every refusal (another trainer, another run, unreadable checkpoints) comes before the compile,
        # and nothing in the run dir changes until the compile is done: a kill during it leaves the
        # run dir as it was, and a new run dir does not exist yet.
        if run_dir.is_dir():
            take_run_dir(lock, is_main, say)
            taken = True
        start, changes = check_checkpoints(cfg, run_dir)
        if start is not None and start >= cfg.train.steps:
            say(f"already at step {start} of train.steps={cfg.train.steps}; nothing to train (raise train.steps "
                f"to train further)")
            return _nothing_run(run_dir, start, clock, preempted=False)
    # A fault file that names devices this run lacks is refused before the compile.
    elastic = Elastic(cfg, devices or jax.devices(), run_dir, say) if cfg.train.elastic and not dry_run else None
    with clock.phase("compile"):
        trainer = Trainer(cfg, task, devices,
                          before_compile=lambda t: _announce(t, cfg, dry_run, start, run_dir, say))
    if dry_run:  # True: human-readable; "json": one JSON object
        print(json.dumps(trainer.report_dict()) if dry_run == "json" else trainer.report())
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


def _nothing_run(run_dir: pathlib.Path, start: int | None, clock: GoodputClock, preempted: bool) -> dict[str, Any]:
    """The summary of an invocation that trained no step."""
    return {"run_dir": str(run_dir), "resumed_from": start, "val_loss": {}, "preempted": preempted,
            "nonfinite_steps": [], "goodput": clock.breakdown(), "last_step": start or 0, "state": None}


def _announce(trainer: Trainer, cfg: Config, dry_run, start: int | None, run_dir: pathlib.Path, say) -> None:
    """The start-up block, before the compile's silence."""
    if dry_run == "json":
        return
    total = param_count(trainer.abstract)
    active = f", {param_counts(cfg.model)['activated']:,} activated per token" if trainer.task.name == "lm" else ""
    model = (f"{cfg.model.kind} model: {total:,} parameters{active}" if cfg.finetune.method == "none"
             else describe(cfg, trainer.abstract))
    for line in startup_lines(trainer, model, start=start, run_dir=run_dir) if not dry_run else [model]:
        say(line)
    say("compiling the train step...")


def _run(cfg: Config, trainer: Trainer, elastic: Elastic | None, clock: GoodputClock, run_dir: pathlib.Path,
         is_main: bool, say, guard: PreemptionGuard) -> dict[str, Any]:
    """Opens the checkpoint tiers and the data, restores or initializes, trains, closes."""
    ckpt = open_checkpoints(cfg, run_dir, say)
    fast = open_fast_tier(cfg)
    start, snapshot = newest_tier(cfg, ckpt, fast, say)
    data_iter = trainer.task.train_iterator()
    summary: dict[str, Any] = {"run_dir": str(run_dir), "resumed_from": start, "val_loss": {}, "preempted": False,
                               "nonfinite_steps": [], "restored_tier": "fast" if snapshot is not None else
                               ("persistent" if start is not None else None), "elastic": []}
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
        say(f"evaluating step 0 ({len(val_set)} validation batches)...")
        run.writer.write(0, evaluation.evaluate(trainer, state, 0))
    last = min(cfg.train.steps, cfg.train.stop_after or cfg.train.steps)
    run.logger = StepLogger(cfg, run.writer, trainer.task.flops_per_step(trainer.step_fn, trainer.mesh.size),
                            trainer.task.items_per_step(), trainer.task.unit, start=start or 0, last=last,
                            enabled=is_main, n_devices=trainer.mesh.size, live=lambda: {"goodput": clock.goodput()})
    nonfinite = NonFiniteGuard(run)
    # Hooks that look at the new state come before the loop asks whether a signal ended the run;
    # those that keep it or move it come after, and see whether this step is the last.
    observers = [evaluation, Samples(run)]
    keepers = [GoodputRow(run), PersistentCheckpoint(run, schedule, nonfinite), FastCheckpoint(run, last),
               *([ElasticChange(run, elastic, trainer_on)] if elastic else []), Preemption(run)]
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


def _loop(run: Run, trainer: Trainer, state: Any, step: int, last: int, nonfinite: NonFiniteGuard,
          observers: list[Hook], keepers: list[Hook], guard: PreemptionGuard) -> tuple[Any, int]:
    """Steps until `last` or a preemption signal; after each, the hooks in order (train/hooks/)."""
    while step < last:
        step += 1
        state, done = _step(run, trainer, state, step)
        if (back := nonfinite.check(done, trainer)) is not None:
            step, state = back.step, back.state
            continue
        for hook in observers:
            hook.after_step(StepEnd(step, state, trainer))
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
        batch = next(run.data_iter)
        if step in run.skipped:  # a rollback threw this batch out: never train on it
            state = trainer.skip_fn(state)
            run.logger.add(step, skipped_batch=1)
            return state, run.logger.step_dispatched(step, {}, data_index=position)
        state, metrics = trainer.step_fn(state, trainer.to_device(batch))
        return state, run.logger.step_dispatched(step, metrics, data_index=position)
