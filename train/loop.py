"""The training loop: validate, build the mesh, init or resume, step, log, save.

    from meshwork.config import load_config
    from meshwork.train.loop import train
    summary = train(load_config("configs/lm_tiny.yaml", ["train.steps=50"]))
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from meshwork.config import Config, ConfigError
from meshwork.models.build import ema_decay
from meshwork.partitioning import indivisible, logical_specs
from meshwork.perf.flops import param_counts
from meshwork.run.checkpoint import Checkpointer, CheckpointSchedule, abstract_with_shardings, storage_full_message
from meshwork.run.durable import StorageFull, storage_problem
from meshwork.run.goodput_clock import GoodputClock
from meshwork.run.metrics import MetricsWriter
from meshwork.sharding.mesh import MESH_AXES, MeshSizeError, make_mesh, resolve_mesh_shape
from meshwork.sharding.overlap import compiler_options
from meshwork.sharding.report import compiled_report, format_report, state_bytes
from meshwork.sharding.ring_attention import zigzag_permutation
from meshwork.sharding.parallel import ParallelContext, use_parallel
from meshwork.sharding.rules import ROLES, logical_to_sharding, rules_for, split_axes, tree_shardings
from meshwork.train.comm import (
    check_comm,
    comm_shardings,
    init_comm_state,
    make_comm_gradients,
    make_diloco_step,
    outer_optimizer,
    uses_comm,
)
from meshwork.train.elastic import Elastic
from meshwork.train.finetune import base_data_config, check_base, describe, load_base_params, with_base_model
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
    restore_newest,
    take_run_dir,
)
from meshwork.train.state import abstract_state, init_state, param_count, state_shardings
from meshwork.train.step import make_accumulate, make_eval_step, make_objective, make_train_step
from meshwork.train.stops import NonFiniteLoss
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
            self.eval_fn = jax.jit(make_eval_step(self.graphdef, make_objective(self.graphdef, cfg)), in_shardings=(
                self.shardings["params"], self.shardings["buffers"], self.batch_sharding), out_shardings=replicated)

    def make_step(self, grad_shardings: Any) -> Callable:
        cfg, objective = self.cfg, make_objective(self.graphdef, self.cfg)
        if cfg.comm.local_steps > 1:
            accumulate = make_accumulate(self.graphdef, objective, cfg.train.microbatches)
            return make_diloco_step(self.graphdef, accumulate, self.inner_tx, self.tx, self.schedule, cfg,
                                    self.mesh, cfg.run.seed)
        comm_grads = (make_comm_gradients(make_accumulate(self.graphdef, objective, cfg.train.microbatches),
                                          cfg, self.mesh) if uses_comm(cfg) else None)
        return make_train_step(self.graphdef, self.tx, self.schedule, cfg.train.microbatches, grad_shardings,
                               cfg.train.pipeline, cfg.run.seed, loss_fn=objective, ema_decay=ema_decay(cfg),
                               inject_nan_at=tuple(cfg.train.inject_nan_at), comm_grads=comm_grads,
                               virtual_stages=cfg.train.virtual_stages)

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


def _restore(trainer: Trainer, ckpt: Checkpointer, step: int | None, data_iter, first_position: dict,
             fast=None, snapshot=None):
    """(state, progress) at checkpoint `step`, the data iterator moved there; a fresh state when None.
    With `snapshot` (the fast tier's, of `step`) the state comes from it instead of the persistent tier."""
    if step is None:
        data_iter.set_state(first_position)
        return trainer.init_state(), {}
    target = abstract_with_shardings(trainer.abstract, trainer.shardings)
    if snapshot is not None and snapshot.step == step:
        state, progress = fast.restore(snapshot, target), snapshot.progress
    else:
        state, progress = ckpt.restore(step, target)
    data_iter.set_state(progress["iterator"])
    return state, progress


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
            return {"run_dir": str(run_dir), "resumed_from": start, "val_loss": {}, "preempted": False,
                    "nonfinite_steps": [], "goodput": clock.breakdown(), "last_step": start, "state": None}
    # A fault file that names devices this run lacks is refused before the compile.
    elastic = Elastic(cfg, devices or jax.devices(), run_dir, say) if cfg.train.elastic and not dry_run else None

    def announce(trainer: Trainer) -> None:  # the start-up block, before the compile's silence
        if dry_run == "json":
            return
        total = param_count(trainer.abstract)
        active = f", {param_counts(cfg.model)['activated']:,} activated per token" if trainer.task.name == "lm" else ""
        model = (f"{cfg.model.kind} model: {total:,} parameters{active}" if cfg.finetune.method == "none"
                 else describe(cfg, trainer.abstract))
        for line in startup_lines(trainer, model, start=start, run_dir=run_dir) if not dry_run else [model]:
            say(line)
        say("compiling the train step...")

    with clock.phase("compile"):
        trainer = Trainer(cfg, task, devices, before_compile=announce)
    if dry_run:  # True: human-readable; "json": one JSON object
        print(json.dumps(trainer.report_dict()) if dry_run == "json" else trainer.report())
        return {"dry_run": True}
    check_fits(trainer)
    if guard.signal is not None:  # asked to stop while starting: nothing new exists yet, so nothing to save
        say("preempted during start-up: nothing was written; run the same command to start")
        return {"run_dir": str(run_dir), "resumed_from": start, "val_loss": {}, "preempted": True,
                "nonfinite_steps": [], "goodput": clock.breakdown(), "last_step": start or 0, "state": None}

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
    ckpt = open_checkpoints(cfg, run_dir, say)
    fast = open_fast_tier(cfg)
    start, snapshot = newest_tier(cfg, ckpt, fast, say)
    data_iter = trainer.task.train_iterator()
    first_position = data_iter.get_state()
    val_set = trainer.task.eval_batches()
    # Fine-tuning on new data: also track the loss on the base run's data (what may be forgotten).
    base_data = base_data_config(cfg)
    base_val_set = make_task(base_data).eval_batches() if base_data is not None else None
    if start is not None:
        say(f"restoring the checkpoint of step {start}...")
    with clock.phase("restore" if start is not None else "compile"):
        state, progress = _restore(trainer, ckpt, start, data_iter, first_position, fast, snapshot)
    clock.resume(progress.get("goodput"))
    skipped = set(progress.get("skipped_steps", []))  # batches a rollback threw out, for good
    writer = MetricsWriter(run_dir, tensorboard=cfg.log.tensorboard, resume_step=start, enabled=is_main)
    summary: dict[str, Any] = {"run_dir": str(run_dir), "resumed_from": start, "val_loss": {}, "preempted": False,
                               "nonfinite_steps": [], "restored_tier": "fast" if snapshot is not None else
                               ("persistent" if start is not None else None), "elastic": []}
    schedule = CheckpointSchedule(cfg.checkpoint.every, cfg.run.mttf_hours, start or 0, clock.totals["productive"])

    def progress() -> dict[str, Any]:  # what a checkpoint of the current step keeps beside the state
        return {"iterator": data_iter.get_state(), "skipped_steps": sorted(skipped), "goodput": clock.snapshot()}

    def evaluate(step: int) -> dict[str, float]:
        with clock.phase("eval"):
            row = {"val_loss": trainer.evaluate(state, val_set)}
            if base_val_set is not None:
                row["val_loss_base_data"] = trainer.evaluate(state, base_val_set)
        for k, v in row.items():
            summary.setdefault(k, {})[step] = v
        return row

    if start is None:
        say(f"evaluating step 0 ({len(val_set)} validation batches)...")
        writer.write(0, evaluate(0))
    steps = cfg.train.steps
    last = min(steps, cfg.train.stop_after or steps)
    n_devices = trainer.mesh.size
    logger = StepLogger(cfg, writer, trainer.task.flops_per_step(trainer.step_fn, n_devices),
                        trainer.task.items_per_step(), trainer.task.unit, start=start or 0, last=last,
                        enabled=is_main, n_devices=n_devices,
                        live=lambda: {"goodput": clock.goodput()})

    def nonfinite(done: tuple[int, dict] | None) -> int | None:
        """The step just read back, if its loss or gradient norm was not finite (skip: only counted)."""
        if done is None or not done[1].get("nonfinite"):
            return None
        summary["nonfinite_steps"].append(done[0])
        if cfg.train.on_nan == "stop":
            ckpt.close()  # the write in flight commits: it is where a rerun resumes
            raise NonFiniteLoss(
                f"train.on_nan=stop: step {done[0]} has loss {done[1]['loss']} and gradient norm "
                f"{done[1]['grad_norm']}; its update was not applied and the run stopped (last checkpoint: "
                f"step {ckpt.latest_step()}); lower optimizer.lr, or set train.on_nan=skip or rollback")
        return done[0] if cfg.train.on_nan == "rollback" else None

    def roll_back(bad: int) -> int:
        """on_nan=rollback: state and data back to the last checkpoint; the bad batch is skipped from now on."""
        nonlocal state
        logger.discard()
        ckpt.wait()
        good = ckpt.latest_step()
        say(f"warning: step {bad} is not finite; rolling back to step {good or 0} and skipping its batch")
        with clock.phase("restore"):
            state, _ = _restore(trainer, ckpt, good, data_iter, first_position)
        skipped.add(bad)
        clock.rollback()
        writer.truncate(good or 0)
        logger.restart_timer()
        return good or 0

    step = start or 0
    while step < last:
        step += 1
        ckpt.poll()
        position = data_iter.get_state().get("next_index")
        with clock.phase("productive"):
            batch = next(data_iter)
            if step in skipped:  # a rollback threw this batch out: never train on it
                state = trainer.skip_fn(state)
                logger.add(step, skipped_batch=1)
                done = logger.step_dispatched(step, {}, data_index=position)
            else:
                state, metrics = trainer.step_fn(state, trainer.to_device(batch))
                done = logger.step_dispatched(step, metrics, data_index=position)
        if (bad := nonfinite(done)) is not None:
            step = roll_back(bad)
            continue
        if step % cfg.log.eval_every == 0 or step == steps:
            logger.add(step, **evaluate(step))
        if trainer.task.name == "diffusion" and cfg.log.sample_every and step % cfg.log.sample_every == 0 \
                and is_main:
            trainer.write_samples(state, run_dir / "samples" / f"step_{step:06d}.png")
        preempted = guard.should_stop(step)
        if step == last or preempted:  # the invocation's time account joins its last row
            logger.add(step, **{f"time_{k}" if k.endswith("_s") else k: v for k, v in clock.breakdown().items()})
        if schedule.due(step) or step == last or preempted:
            # The step's own row and finiteness are settled before its checkpoint exists.
            if (bad := nonfinite(logger.flush())) is not None:
                step = roll_back(bad)
                continue
            if step == last or preempted:  # the run's last write: the summary waits for it
                say(f"saving the checkpoint of step {step}...")
            with clock.phase("checkpoint"):
                ckpt.save(step, state, progress(), cfg.to_dict(), force=True)
            clock.checkpointed()
            if row := schedule.measured(step, ckpt.stalls, clock.totals["productive"]):
                say(schedule.describe(row))
                writer.write(step, row)
        if fast is not None and fast.due(step) and step != last:
            with clock.phase("checkpoint"):
                fast.save(step, state, progress(), cfg.to_dict())
        if elastic is not None and (lost := elastic.poll(step)) is not None:
            logger.flush()  # the last step's metrics, read while its devices are still there
            with clock.phase("lost"):
                moved = elastic.change(lost, trainer, state, step, fast, lambda t: restore_newest(ckpt, fast, t),
                                       trainer_on)
            trainer, state, logger.n_devices = moved.trainer, moved.state, moved.trainer.mesh.size
            if moved.rolled_back_to is not None:  # shards were lost for good: train the steps since again
                step = moved.rolled_back_to
                data_iter.set_state((moved.progress or {}).get("iterator", first_position))
                writer.truncate(step)
                clock.rollback()
            summary["elastic"].append({"step": step, **moved.row})
            writer.write(step, moved.row)
            logger.restart_timer()
        if preempted:
            summary["preempted"] = True
            say(f"preempted: checkpoint of step {step} saved; run the same command to resume")
            break
    logger.close()
    with clock.phase("checkpoint"):
        ckpt.close()
        if fast is not None:
            fast.close()
    summary["checkpoint_stalls"] = {"persistent": ckpt.stalls, "fast": fast.stalls if fast is not None else []}
    summary["goodput"] = clock.breakdown()
    writer.close()
    summary.update(state=state, last_step=step)
    return summary
