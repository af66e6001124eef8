"""A Trainer: everything one config needs on one mesh, as a frozen value.

    task = check_runtime(cfg, devices)             # raises ConfigError before anything compiles
    trainer = build_trainer(cfg, task, devices)    # mesh, rules, optimizer, abstract state, shardings
    trainer = trainer.compile()                    # the same value with its step compiled
    state = trainer.init_state()
    state, metrics = trainer.step_fn(state, trainer.to_device(batch))

Building is cheap (shapes only, no parameter memory) and says what the run will be: the
start-up lines and `--dry-run`'s layout come from it before the long compile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshwork.config import Config, ConfigError
from meshwork.models.build import ema_decay
from meshwork.partitioning import abstract_with_shardings, indivisible, logical_specs
from meshwork.perf.hardware import device_memory_bytes
from meshwork.sharding.context_parallel import check_heads
from meshwork.sharding.mesh import MESH_AXES, MeshSizeError, make_mesh, resolve_mesh_shape
from meshwork.sharding.overlap import compiler_options
from meshwork.sharding.parallel import ParallelContext, use_parallel
from meshwork.sharding.report import compiled_report, format_report, state_bytes
from meshwork.sharding.ring_attention import zigzag_permutation
from meshwork.sharding.rules import ROLES, Rules, logical_to_sharding, rules_for, split_axes, tree_shardings
from meshwork.train.comm import (
    check_comm,
    comm_shardings,
    init_comm_state,
    make_diloco_step,
    outer_optimizer,
    uses_comm,
)
from meshwork.train.finetune import check_base, load_base_params
from meshwork.train.gradients import gradient_strategy, local_strategy, replica_gradient
from meshwork.train.logger import to_host
from meshwork.train.optim import make_optimizer
from meshwork.train.state import TrainState, abstract_state, init_state, state_shardings
from meshwork.train.step import make_eval_step, make_train_step
from meshwork.train.task import DiffusionTask, LMTask, make_task


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
            f"cannot be split over the data-parallel size data*fsdp={dp}; use a multiple of {dp * cfg.train.microbatches}"
        )
    try:
        rules = rules_for(cfg.rules.preset, cfg.rules.overrides)
    except KeyError as e:
        raise ConfigError(str(e.args[0])) from None
    for name, axes in cfg.rules.overrides.items():
        unknown = [a for a in ((axes,) if isinstance(axes, str) else axes or ()) if a not in MESH_AXES]
        if unknown:
            raise ConfigError(
                f"rules.overrides: {name}: {unknown[0]!r} is not a mesh axis; use one of "
                f"{', '.join(MESH_AXES)} (or null for replicated)"
            )
    seq_axes = split_axes("act_seq", rules, mesh_shape)
    if split_axes("expert", rules, mesh_shape) and cfg.train.pipeline != "none":
        raise ConfigError(
            "train.pipeline: expert parallelism (ep) inside a pipeline stage is not supported; "
            "drop ep from rules.preset (the experts stay whole on each stage) or set train.pipeline=none"
        )
    if seq_axes:
        _check_context_parallel(cfg, seq_axes, mesh_shape, split_axes("act_heads", rules, mesh_shape))
    check_comm(cfg, mesh_shape)
    check_base(cfg)
    return make_task(cfg)


def _check_context_parallel(cfg: Config, seq_axes: tuple[str, ...], mesh_shape: dict, head_axes: tuple) -> None:
    """train.context_parallel against the sequence split, the model's heads and the attention impl."""
    cp, m, L = cfg.train.context_parallel, cfg.model, cfg.data.seq_len
    want = 2 if cp == "usp" else 1
    if len(seq_axes) != want:
        raise ConfigError(
            f"train.context_parallel: {cp} needs act_seq split over {want} mesh axis(es), the rules split it over "
            f"{list(seq_axes)}; "
            + (
                "split it over two, the ring's then Ulysses', e.g. rules.overrides act_seq=[sequence, tensor] "
                "(and act_norm_seq alike), or use ring"
                if cp == "usp"
                else "use train.context_parallel=usp (a ring over the first, Ulysses within the second)"
            )
        )
    ring = mesh_shape[seq_axes[0]]
    if cp != "ulysses" and L % (2 * ring):
        raise ConfigError(
            f"data.seq_len: {L} must be a multiple of 2 x {seq_axes[0]}={ring} for context parallelism's zigzag layout"
        )
    if cp == "ulysses" and L % ring:
        raise ConfigError(f"data.seq_len: {L} must be a multiple of {seq_axes[0]}={ring} for Ulysses")
    if cp in ("ulysses", "usp") and m.kind != "unet":
        heads, kv_heads = (m.n_heads, m.n_heads) if m.mla is not None else (m.n_heads, m.n_kv_heads)
        tensor = math.prod(mesh_shape[a] for a in head_axes)
        try:
            check_heads(cp, heads, kv_heads, mesh_shape[seq_axes[-1]], tensor)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if (cp == "all_gather" or cfg.train.pipeline != "none") and m.attention != "xla":
        raise ConfigError(
            f"model.attention: {m.attention} masks keys by index, and context parallelism by all-gathered keys "
            f"(train.context_parallel=all_gather, and any inside a pipeline) masks them by position; "
            "use model.attention=xla, or train.context_parallel=ulysses or ring without a pipeline"
        )
    if cp == "usp" and cfg.train.pipeline != "none":
        raise ConfigError(
            "train.context_parallel: usp inside a pipeline is not built; use all_gather or ulysses with train.pipeline"
        )


def process_rows(sharding: NamedSharding, global_shape: tuple[int, ...]) -> slice:
    """The contiguous block of rows (dimension 0) that this process's devices hold."""
    index_map = sharding.addressable_devices_indices_map(global_shape)
    starts = {idx[0].start or 0 for idx in index_map.values()}
    stops = {global_shape[0] if idx[0].stop is None else idx[0].stop for idx in index_map.values()}
    return slice(min(starts), max(stops))


@dataclasses.dataclass(frozen=True)
class Trainer:
    """One config on one mesh: layout (from `build_trainer`) and, after `compile()`, the programs."""

    cfg: Config
    task: LMTask | DiffusionTask
    mesh: Mesh
    rules_by_role: dict[str, Rules]  # a table per role (sharding.rules.ROLES): params, opt_state, grads
    parallel: ParallelContext  # how the layers run on the mesh (sharding/parallel.py)
    seq_perm: np.ndarray | None  # context parallelism's zigzag token order (None without it)
    tx: optax.GradientTransformation  # the state's optimizer (DiLoCo: the outer one)
    inner_tx: optax.GradientTransformation | None  # DiLoCo's per-replica optimizer
    schedule: optax.Schedule
    graphdef: nnx.GraphDef
    abstract: TrainState  # the train state as ShapeDtypeStructs
    shardings: TrainState  # a NamedSharding prefix tree of the state
    grad_shardings: Any  # the gradients' own layout (ZeRO-2), or None: the parameters'
    batch_sharding: NamedSharding
    step_fn: Callable | None = None  # (state, batch) -> (state, metrics), donating the state
    skip_fn: Callable | None = None  # state -> state with only the step counter moved
    eval_fn: Callable | None = None  # (params, buffers, batch) -> {"loss": the task's loss, its eval_metrics}

    @property
    def rules(self) -> Rules:
        return self.rules_by_role["params"]  # also the activations' table

    def compile(self) -> Trainer:
        """This trainer with its train, skip and eval steps compiled (the long part of start-up)."""
        replicated = NamedSharding(self.mesh, PartitionSpec())
        with self.context():
            # The step owns the state: donating it lets XLA update parameters
            # and moments in place instead of holding two copies.
            step = jax.jit(
                self.make_step(self.grad_shardings),
                in_shardings=(self.shardings, self.batch_sharding),
                out_shardings=(self.shardings, replicated),
                donate_argnums=0,
            )
            lowered = step.lower(abstract_with_shardings(self.abstract, self.shardings), self.batch_abstract())
            try:
                step_fn = lowered.compile(
                    compiler_options=compiler_options(self.cfg.comm, self.mesh.devices.flat[0].platform)
                )
            except jax.errors.JaxRuntimeError as e:  # the installed jaxlib decides which options exist
                if "No such compile option" not in str(e):
                    raise
                raise ConfigError(
                    f"comm.xla_options: {str(e).split(': ', 1)[-1]} in this jaxlib "
                    f"({jax.__version__}); remove it or check its spelling"
                ) from None
            # A batch thrown out by a rollback: only the step counter moves (the schedule and noise follow it).
            skip_fn = jax.jit(
                lambda state: state.replace(step=state.step + 1), out_shardings=self.shardings, donate_argnums=0
            )
            eval_fn = jax.jit(
                make_eval_step(self.task.objective(self.graphdef), getattr(self.task, "eval_metrics", ())),
                in_shardings=(self.shardings.params, self.shardings.buffers, self.batch_sharding),
                out_shardings=replicated,
            )
        return dataclasses.replace(self, step_fn=step_fn, skip_fn=skip_fn, eval_fn=eval_fn)

    def batch_abstract(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The global batch as ShapeDtypeStructs (with `positions` under context parallelism)."""
        shapes = self.task.batch_shapes()
        if self.seq_perm is not None:
            shapes = {**shapes, "positions": shapes["inputs"]}
        return {
            k: jax.ShapeDtypeStruct((self.cfg.train.global_batch, *shape), dtype, sharding=self.batch_sharding)
            for k, (shape, dtype) in shapes.items()
        }

    def make_step(self, grad_shardings: Any) -> Callable:
        """step(state, batch) -> (state, metrics): the task's objective, the config's gradient
        strategy, and the optimizer's update (DiLoCo's local and outer steps under comm.local_steps)."""
        cfg, objective = self.cfg, self.task.objective(self.graphdef)
        if cfg.comm.local_steps > 1:
            return make_diloco_step(
                self.graphdef,
                replica_gradient(local_strategy(cfg, objective)),
                self.inner_tx,
                self.tx,
                self.schedule,
                cfg,
                self.mesh,
                cfg.run.seed,
            )
        return make_train_step(
            self.graphdef,
            self.tx,
            self.schedule,
            gradient_strategy(cfg, self.graphdef, objective, self.mesh),
            seed=cfg.run.seed,
            grad_shardings=grad_shardings,
            ema_decay=ema_decay(cfg),
            inject_nan_at=tuple(cfg.train.inject_nan_at),
        )

    def context(self):
        """The mesh and the run's ParallelContext, current while tracing: activation constraints
        and the layers' parallel implementations read them."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(use_parallel(self.parallel))
        return stack

    def init_state(self) -> TrainState:
        """A fresh state; a fine-tuning run starts from its base run's trained weights."""
        # Outside the mesh context, like the trainer's own abstract state (nnx.eval_shape).
        base = load_base_params(self.cfg, self.mesh, self.rules_by_role) if self.cfg.finetune.method != "none" else None
        with self.context():
            if not uses_comm(self.cfg):
                return init_state(self.cfg, self.tx, self.shardings, base)
            state = init_state(self.cfg, self.tx, self.shardings.replace(comm=None), base)
            init_comm = _comm_initializer(self.cfg, self.mesh, self.inner_tx)
            return state.replace(comm=jax.jit(init_comm, out_shardings=self.shardings.comm)(state.params))

    def to_device(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Global host batch -> sharded global arrays; each process puts only the rows its devices hold."""
        if self.seq_perm is not None:  # a language model's tokens under context parallelism
            B = batch["inputs"].shape[0]
            batch = {
                **{k: v[:, self.seq_perm] for k, v in batch.items()},
                "positions": np.broadcast_to(self.seq_perm.astype(np.int32), (B, len(self.seq_perm))),
            }
        rows = process_rows(self.batch_sharding, next(iter(batch.values())).shape)
        return {
            k: jax.make_array_from_process_local_data(self.batch_sharding, v[rows], v.shape) for k, v in batch.items()
        }

    def evaluate(self, state: TrainState, batches: list[dict[str, np.ndarray]]) -> dict[str, float]:
        """The means over `batches` of the eval step's loss and the task's `eval_metrics`."""
        with self.context():
            rows = [self.eval_fn(state.params, state.buffers, self.to_device(b)) for b in batches]
        return {k: float(np.mean([to_host(r[k]) for r in rows])) for k in rows[0]}

    def write_samples(self, state: TrainState, path: pathlib.Path, num: int | None = None, steps: int = 25) -> None:
        """A grid of DDIM samples from the EMA weights (the raw ones if there is no EMA): one row per
        class, 2 samples each (16 samples without classes), tiles scaled up to 48 px."""
        from flax import nnx

        from meshwork.diffusion.images import sample_images, save_class_grid

        classes = self.cfg.model.unet.num_class_embeds
        num = num or (2 * (classes - 1) if classes is not None else 16)  # the last class is guidance's null one
        model = nnx.merge(self.graphdef, state.ema if state.ema is not None else state.params, state.buffers)
        with self.context():
            images, labels = sample_images(model, self.cfg, num=num, steps=steps)
        save_class_grid(images, labels, path)

    def report_dict(self) -> dict[str, Any]:
        """Per-device state bytes, temp memory, FLOPs and collectives of the compiled step."""
        return compiled_report(
            self.step_fn, state_bytes(self.abstract.parts(), self.shardings.parts(), self.grad_shardings)
        )

    def report(self) -> str:
        return format_report(self.report_dict(), self.cfg, self.mesh)


def build_trainer(cfg: Config, task: LMTask | DiffusionTask, devices: list | None = None) -> Trainer:
    """The trainer of `cfg` on `devices` (default: all), not compiled yet. Raises ConfigError for a
    model the mesh cannot split."""
    mesh = make_mesh(cfg.mesh.sizes(), devices)
    preset = cfg.rules.preset + ("+pp" if cfg.train.pipeline != "none" else "")
    rules_by_role = {role: rules_for(preset, cfg.rules.overrides, role) for role in ROLES}
    rules = rules_by_role["params"]
    # Context parallelism: tokens are laid out in zigzag order so every
    # device on the ring (or all-gathering) gets the same share of causal attention work
    # (usp: zigzag over its ring axis); the model reads each token's true position from
    # `positions`. Ulysses gives every device whole rows: the tokens stay in order (with
    # positions all the same inside a pipeline, whose stages see only their shard of each row).
    seq_axes = split_axes("act_seq", rules, dict(mesh.shape))
    seq_perm = None
    if seq_axes and cfg.train.context_parallel != "ulysses":
        seq_perm = zigzag_permutation(cfg.data.seq_len, mesh.shape[seq_axes[0]])
    elif seq_axes and cfg.train.pipeline != "none":
        seq_perm = np.arange(cfg.data.seq_len)
    tx, schedule = make_optimizer(cfg.optimizer, cfg.train.steps, rules_by_role["opt_state"])
    inner_tx = None
    if cfg.comm.local_steps > 1:  # DiLoCo: AdamW runs inside each replica, the state's optimizer is the outer one
        inner_tx, tx = tx, outer_optimizer(cfg)
    # Shapes first, outside the mesh: nnx.eval_shape would otherwise try to
    # place the logical names on the mesh itself.
    graphdef, abstract = abstract_state(cfg, tx)
    if uses_comm(cfg):
        abstract = abstract.replace(comm=jax.eval_shape(_comm_initializer(cfg, mesh, inner_tx), abstract.params))
    parallel = ParallelContext(
        rules, collective_matmul=cfg.comm.collective_matmul, context_parallel=cfg.train.context_parallel
    )
    with jax.set_mesh(mesh), use_parallel(parallel):
        shardings = state_shardings(abstract, mesh, rules_by_role, cfg.train.offload)
        if uses_comm(cfg):
            shardings = shardings.replace(comm=comm_shardings(abstract.comm, mesh))
        _check_divisible(cfg, abstract_with_shardings(abstract, shardings))
        # Gradients get their own layout only when it differs from the
        # parameters' (ZeRO-2: reduce-scattered instead of all-reduced).
        grad_shardings = None
        if rules_by_role["grads"] != rules:
            grad_shardings = tree_shardings(logical_specs(abstract.params), mesh, rules_by_role["grads"])
        batch_sharding = logical_to_sharding(task.batch_axes, mesh, rules)
    return Trainer(
        cfg,
        task,
        mesh,
        rules_by_role,
        parallel,
        seq_perm,
        tx,
        inner_tx,
        schedule,
        graphdef,
        abstract,
        shardings,
        grad_shardings,
        batch_sharding,
    )


def _comm_initializer(cfg: Config, mesh: Mesh, inner_tx: optax.GradientTransformation | None) -> Callable:
    """params -> the comm part of the state (per-replica buffers, one replica per `data` device)."""
    return functools.partial(init_comm_state, cfg, n_replicas=mesh.shape["data"], inner_tx=inner_tx)


def _check_divisible(cfg: Config, placed: TrainState) -> None:
    # Parameters first: the message should name a weight, not one of its Adam moments.
    parts = placed.parts()
    for part in sorted(parts, key=lambda k: (k != "params", k != "buffers", k)):
        if problem := indivisible(parts[part]):
            raise ConfigError(
                f"{part}.{problem} (rules.preset={cfg.rules.preset}); choose model sizes "
                f"the mesh divides, a smaller mesh axis, or another rules.preset"
            )


def trainer_on(cfg: Config, devices: list, task: LMTask | DiffusionTask) -> Trainer:
    """A compiled Trainer for `cfg` on `devices` (an elastic change's new device set; the task is the run's)."""
    return build_trainer(cfg, task, devices).compile()


def check_fits(trainer) -> None:
    """Refuses, before anything is written, a step whose compiled program (a `Trainer`'s) cannot fit one device."""
    mem = trainer.step_fn.memory_analysis()
    if mem is None:
        return
    need = mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
    from meshwork.train.rollouts import engine_plan_of

    engine = engine_plan_of(trainer)  # grpo colocated: the serving engine shares the devices
    beside = (
        engine.kv_bytes_per_device + engine.weight_bytes_per_device if engine and engine.placement == "colocated" else 0
    )
    have = device_memory_bytes(trainer.mesh.local_devices[0])  # another process's devices do not answer
    if need + beside > have:
        also = f" and the serving engine beside it {beside / 2**30:,.1f} GiB" if beside else ""
        raise ConfigError(
            f"the compiled step needs {need / 2**30:,.1f} GiB per device{also}, more than the "
            f"{have / 2**30:,.1f} GiB one device has; lower train.global_batch or data.seq_len, "
            f"raise train.microbatches, set train.remat=full, or shard more (rules.preset=fsdp)"
            + ("; or lower train.grpo.engine_slots or use placement split" if beside else "")
        )
