"""The training loop: validate, build the mesh, init or resume, step, log, save.

    from meshwork.config import load_config
    from train.loop import train
    summary = train(load_config("configs/lm_tiny.yaml", ["train.steps=50"]))
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from meshwork.checkpoint import Checkpointer, abstract_with_shardings
from meshwork.config import Config, ConfigError, dump_config
from meshwork.flops import param_counts
from meshwork.hardware import peak_flops_per_device
from meshwork.metrics import MetricsWriter
from sharding.mesh import MESH_AXES, MeshSizeError, make_mesh, resolve_mesh_shape
from sharding.report import compiled_report, format_report, state_bytes
from sharding.ring_attention import zigzag_permutation
from sharding.rules import ROLES, logical_to_sharding, rules_for, split_axes, tree_shardings, use_rules
from train.optim import make_optimizer
from train.finetune import base_data_config, check_base, describe, load_base_params
from train.state import abstract_state, ema_decay, init_state, logical_specs, param_count, state_shardings
from train.step import make_eval_step, make_objective, make_train_step
from train.task import DiffusionTask, LMTask, make_task

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
    seq_axes = split_axes("act_seq", rules, mesh_shape)
    if seq_axes and cfg.train.pipeline != "none":
        raise ConfigError("train.pipeline: context parallelism (cp) inside a pipeline is not supported; "
                          "drop cp from rules.preset or set train.pipeline=none")
    if len(seq_axes) > 1:
        raise ConfigError(f"rules.preset: the sequence is split over {seq_axes}; context parallelism uses one axis")
    if seq_axes and cfg.data.seq_len % (2 * mesh_shape[seq_axes[0]]):
        raise ConfigError(f"data.seq_len: {cfg.data.seq_len} must be a multiple of 2 x {seq_axes[0]}="
                          f"{mesh_shape[seq_axes[0]]} for context parallelism's zigzag layout")
    check_base(cfg)
    return make_task(cfg)


def process_rows(sharding: NamedSharding, global_shape: tuple[int, ...]) -> slice:
    """The contiguous block of rows (dimension 0) that this process's devices hold."""
    index_map = sharding.addressable_devices_indices_map(global_shape)
    starts = {idx[0].start or 0 for idx in index_map.values()}
    stops = {global_shape[0] if idx[0].stop is None else idx[0].stop for idx in index_map.values()}
    return slice(min(starts), max(stops))


def to_host(x: jax.Array) -> np.ndarray:
    """A replicated value as numpy, also when other processes hold copies of it."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_shards[0].data)


class Trainer:
    """Everything compiled for one config on one mesh; `train()` drives it."""

    def __init__(self, cfg: Config, task: LMTask | DiffusionTask, devices: list | None = None):
        self.cfg, self.task = cfg, task
        self.mesh = make_mesh(cfg.mesh.sizes(), devices)
        preset = cfg.rules.preset + ("+pp" if cfg.train.pipeline != "none" else "")
        self.rules_by_role = {role: rules_for(preset, cfg.rules.overrides, role) for role in ROLES}
        self.rules = self.rules_by_role["params"]  # also the activations' table
        # Context parallelism: tokens are laid out in zigzag order so every
        # device on the ring gets the same share of causal attention work;
        # the model reads each token's true position from `positions`.
        seq_axes = split_axes("act_seq", self.rules, dict(self.mesh.shape))
        self.seq_perm = (zigzag_permutation(cfg.data.seq_len, self.mesh.shape[seq_axes[0]])
                         if len(seq_axes) == 1 else None)
        self.tx, self.schedule = make_optimizer(cfg.optimizer, cfg.train.steps)
        # Shapes first, outside the mesh: nnx.eval_shape would otherwise try to
        # place the logical names on the mesh itself.
        self.graphdef, self.abstract = abstract_state(cfg, self.tx)
        with self.context():
            self.shardings = state_shardings(self.abstract, self.mesh, self.rules_by_role)
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
            # The step owns the state: donating it lets XLA update parameters
            # and moments in place instead of holding two copies.
            step = jax.jit(make_train_step(self.graphdef, self.tx, self.schedule, cfg.train.microbatches,
                                           grad_shardings, cfg.train.pipeline, cfg.run.seed,
                                           loss_fn=make_objective(self.graphdef, cfg), ema_decay=ema_decay(cfg)),
                           in_shardings=(self.shardings, self.batch_sharding),
                           out_shardings=(self.shardings, replicated), donate_argnums=0)
            self.step_fn = step.lower(abstract_with_shardings(self.abstract, self.shardings), batch_abstract).compile()
            self.eval_fn = jax.jit(make_eval_step(self.graphdef, make_objective(self.graphdef, cfg)), in_shardings=(
                self.shardings["params"], self.shardings["buffers"], self.batch_sharding), out_shardings=replicated)

    def context(self):
        """Mesh and rules must both be current while tracing, so activation constraints apply."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(use_rules(self.rules))
        return stack

    def init_state(self) -> dict[str, Any]:
        """A fresh state; a fine-tuning run starts from its base run's trained weights."""
        # Outside the mesh context, like the trainer's own abstract state (nnx.eval_shape).
        base = (load_base_params(self.cfg, self.mesh, self.rules_by_role)
                if self.cfg.finetune.method != "none" else None)
        with self.context():
            return init_state(self.cfg, self.tx, self.shardings, base)

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

    def write_samples(self, state: dict[str, Any], path: pathlib.Path, num: int = 16, steps: int = 25) -> None:
        """A grid of DDIM samples from the EMA weights (the raw ones if there is no EMA)."""
        from flax import nnx

        from inference.diffusion_sampling import save_grid
        from inference.generate_images import sample_images

        model = nnx.merge(self.graphdef, state.get("ema", state["params"]), state["buffers"])
        with self.context():
            images, _ = sample_images(model, self.cfg, num=num, steps=steps)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_grid(images, path, nrow=4)

    def report_dict(self) -> dict[str, Any]:
        """Per-device state bytes, temp memory, FLOPs and collectives of the compiled step."""
        return compiled_report(self.step_fn, state_bytes(self.abstract, self.shardings, self.grad_shardings))

    def report(self) -> str:
        return format_report(self.report_dict(), self.cfg, self.mesh)


def _check_same_model(cfg: Config, saved: dict, run_dir: pathlib.Path) -> None:
    """Resuming a different model would fail deep inside Orbax; say so plainly instead."""
    for section in ("model", "data"):
        now = cfg.to_dict()[section]
        if saved.get(section) != now:
            key = next((k for k in now if saved.get(section, {}).get(k) != now[k]), "")
            raise ConfigError(f"{section}.{key}: {run_dir} holds a checkpoint of a run with {section}.{key}="
                              f"{saved.get(section, {}).get(key)!r}, not {now[key]!r}; use a new run.dir "
                              f"or the original value")


class StepLogger:
    """Reads each step's metrics one step late (the next step is already queued,
    so the host never stalls the device) and writes every `log.every`-th
    step, every evaluated step and the last one, with throughput and MFU."""

    def __init__(self, cfg: Config, writer: MetricsWriter, trainer: Trainer, *, start: int, last: int,
                 enabled: bool):
        self.cfg, self.writer, self.last = cfg, writer, last
        self.unit, self.items_per_step = trainer.task.unit, trainer.task.items_per_step()
        self.flops_per_step = trainer.task.flops_per_step(trainer.step_fn)
        self.peak, _ = peak_flops_per_device(cfg.train.compute_dtype)
        self.pbar = tqdm(total=cfg.train.steps, initial=start, disable=not (cfg.log.progress and enabled),
                         desc=cfg.run.name, dynamic_ncols=True)
        self.pending: tuple[int, Any] | None = None
        self.extra: dict[int, dict[str, float]] = {}
        self.t_last, self.steps_since = time.perf_counter(), 0

    def add(self, step: int, **values: float) -> None:
        self.extra.setdefault(step, {}).update(values)

    def step_dispatched(self, step: int, metrics: Any) -> None:
        if self.pending is not None:
            self._finish(*self.pending)
        self.pending = (step, metrics)

    def close(self) -> None:
        if self.pending is not None:
            self._finish(*self.pending)
        self.pbar.close()

    def _finish(self, step: int, metrics: Any) -> None:
        m = {k: to_host(v).tolist() for k, v in metrics.items()}  # scalars, or per-expert lists
        self.steps_since += 1
        self.pbar.update(1)
        self.pbar.set_postfix(loss=f"{m['loss']:.3f}")
        if step % self.cfg.log.every and step not in self.extra and step != self.last:
            return
        now = time.perf_counter()
        step_time = (now - self.t_last) / self.steps_since
        self.t_last, self.steps_since = now, 0
        tflops = self.flops_per_step / step_time / jax.device_count() / 1e12
        self.writer.write(step, {**m, "step_time_s": step_time, f"{self.unit}_per_s": self.items_per_step / step_time,
                                 "tflops_per_device": tflops, "mfu": tflops * 1e12 / self.peak,
                                 **self.extra.pop(step, {})})


def train(cfg: Config, *, devices: list | None = None, dry_run: bool | str = False) -> dict[str, Any]:
    """Trains `cfg` to `cfg.train.steps`, resuming from `run.dir` if it holds a checkpoint.

    Returns a summary: first and last validation loss, steps run, run dir.
    """
    trainer = Trainer(cfg, check_runtime(cfg, devices), devices)
    if jax.process_index() == 0 and not dry_run == "json":
        total = param_count(trainer.abstract)
        active = f", {param_counts(cfg.model)['activated']:,} activated per token" if trainer.task.name == "lm" else ""
        print(f"{cfg.model.kind} model: {total:,} parameters{active}" if cfg.finetune.method == "none"
              else describe(cfg, trainer.abstract))
    if dry_run:  # True: human-readable; "json": one JSON object
        print(json.dumps(trainer.report_dict()) if dry_run == "json" else trainer.report())
        return {"dry_run": True}

    run_dir = pathlib.Path(cfg.run.dir)
    ckpt = Checkpointer(run_dir / "checkpoints", every=cfg.checkpoint.every, keep=cfg.checkpoint.keep,
                        use_async=cfg.checkpoint.async_)
    start = ckpt.latest_step()
    if start is not None:
        _check_same_model(cfg, ckpt.saved_config(start), run_dir)
    is_main = jax.process_index() == 0
    if is_main:
        (run_dir / "config.yaml").write_text(dump_config(cfg))

    data_iter = trainer.task.train_iterator()
    val_set = trainer.task.eval_batches()
    # Fine-tuning on new data: also track the loss on the base run's data (what may be forgotten).
    base_data = base_data_config(cfg)
    base_val_set = make_task(base_data).eval_batches() if base_data is not None else None
    if start is None:
        state = trainer.init_state()
    else:
        state, iter_state = ckpt.restore(start, abstract_with_shardings(trainer.abstract, trainer.shardings))
        data_iter.set_state(iter_state)
    writer = MetricsWriter(run_dir, tensorboard=cfg.log.tensorboard, resume_step=start, enabled=is_main)
    summary: dict[str, Any] = {"run_dir": str(run_dir), "resumed_from": start, "val_loss": {}}
    if start is None:
        start = 0
        summary["val_loss"][0] = trainer.evaluate(state, val_set)
        row = {"val_loss": summary["val_loss"][0]}
        if base_val_set is not None:
            row["val_loss_base_data"] = summary.setdefault("val_loss_base_data", {})[0] = \
                trainer.evaluate(state, base_val_set)
        writer.write(0, row)

    steps = cfg.train.steps
    last = min(steps, cfg.train.stop_after or steps)
    logger = StepLogger(cfg, writer, trainer, start=start, last=last, enabled=is_main)
    for step in range(start + 1, last + 1):
        batch = trainer.to_device(next(data_iter))
        state, metrics = trainer.step_fn(state, batch)
        logger.step_dispatched(step, metrics)
        if step % cfg.log.eval_every == 0 or step == steps:
            summary["val_loss"][step] = trainer.evaluate(state, val_set)
            logger.add(step, val_loss=summary["val_loss"][step])
            if base_val_set is not None:
                loss = summary.setdefault("val_loss_base_data", {})[step] = trainer.evaluate(state, base_val_set)
                logger.add(step, val_loss_base_data=loss)
        if trainer.task.name == "diffusion" and cfg.log.sample_every and step % cfg.log.sample_every == 0 and is_main:
            trainer.write_samples(state, run_dir / "samples" / f"step_{step:06d}.png")
        ckpt.save(step, state, data_iter.get_state(), cfg.to_dict(), force=step == last)
    logger.close()
    ckpt.close()
    writer.close()
    summary.update(state=state, last_step=max(last, start))
    return summary
