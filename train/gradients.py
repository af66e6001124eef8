"""How one step's gradient is computed and reduced: a strategy per way, chosen once from the config.

Every strategy is a value with one signature,

    metrics, grads, comm = strategy(params, buffers, batch, noise_key, comm)

the gradient of the task's objective over the whole global batch, the step's metrics, and the
strategy's own state (`comm`: per-replica buffers kept in the train state and its checkpoints;
None for strategies that keep none, which hand it back as they got it). `gradient_strategy`
picks one from the config; the step body (train/step.py) calls it without knowing which.

- Plain: one value_and_grad of the whole batch; XLA inserts the data-parallel reduction.
- Microbatched: train.microbatches equal slices, their gradients summed in float32 in a scan.
- Pipelined: the layers pipelined over the mesh axis `stage` (train.pipeline); the schedule
  microbatches by itself and computes the language-model loss at the last stage.
- Reduced: an explicit data-parallel reduction (comm.compression, comm.stale_gradients) of a
  Plain or Microbatched replica's gradient, its buffers in `comm` (train/comm.py).

DiLoCo (comm.local_steps) is not a way to compute a gradient but another update: each replica
steps its own copy with the inner optimizer, and an outer optimizer applies the replicas' mean
change every H steps (train/comm.py's make_diloco_step). It takes a Plain or Microbatched
strategy for each replica's gradient, so it is chosen beside these, in `Trainer.make_step`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from meshwork.config import Config
from meshwork.objectives import Batch, Objective
from meshwork.partitioning import to_device_memory
from meshwork.train.comm import make_comm_gradients
from meshwork.train.pipeline_step import make_pipeline_value_and_grad


class GradientStrategy(Protocol):
    stateful: ClassVar[bool]  # keeps buffers in the train state's "comm" entry

    def __call__(
        self, params: Any, buffers: Any, batch: Batch, noise_key: jax.Array, comm: Any = None
    ) -> tuple[dict, Any, Any]: ...


@dataclasses.dataclass(frozen=True)
class Plain:
    objective: Objective
    stateful: ClassVar[bool] = False

    def __call__(self, params, buffers, batch, noise_key, comm=None):
        (_, metrics), grads = jax.value_and_grad(self.objective, has_aux=True)(params, buffers, batch, noise_key)
        return metrics, grads, comm


@dataclasses.dataclass(frozen=True)
class Microbatched:
    """Gradient accumulation: activation memory of B/M rows, the update of all B.

    Row r of microbatch m is row r*M + m of the batch: each microbatch takes rows from every
    data-parallel shard, so none sits idle. Each microbatch draws its own noise key.
    """

    objective: Objective
    microbatches: int
    stateful: ClassVar[bool] = False

    def __call__(self, params, buffers, batch, noise_key, comm=None):
        M = self.microbatches
        grad_fn = jax.value_and_grad(self.objective, has_aux=True)
        micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // M, M, *x.shape[1:]).swapaxes(0, 1), batch)

        def body(grad_sum, mb_and_key):
            mb, key = mb_and_key
            (_, metrics), grads = grad_fn(params, buffers, mb, key)
            grads = jax.tree.map(to_device_memory, grads)  # offloaded layers' gradients come out on the host
            grad_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
            return grad_sum, metrics

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        grad_sum, metrics = jax.lax.scan(body, zeros, (micro, jax.random.split(noise_key, M)))
        grads = jax.tree.map(lambda g, p: (g / M).astype(p.dtype), grad_sum, params)
        return jax.tree.map(lambda m: m.mean(axis=0), metrics), grads, comm


@dataclasses.dataclass(frozen=True)
class Pipelined:
    """The blocks as a pipeline (`schedule`: a kind of sharding.pipeline_schedules.SCHEDULES).
    The schedule has no training noise: the noise key is not used."""

    value_and_grad: Callable  # (params, buffers, batch) -> (loss, metrics, grads)
    stateful: ClassVar[bool] = False

    def __call__(self, params, buffers, batch, noise_key, comm=None):
        _, metrics, grads = self.value_and_grad(params, buffers, batch)
        return metrics, grads, comm


@dataclasses.dataclass(frozen=True, eq=False)  # compared by identity: the config is not hashable
class Reduced:
    """A replica's gradient (by `replica`) reduced across `data` by hand: compressed, or one step stale."""

    replica: Plain | Microbatched
    cfg: Config  # comm.compression / comm.stale_gradients and their settings
    mesh: Any
    stateful: ClassVar[bool] = True

    def __call__(self, params, buffers, batch, noise_key, comm=None):
        reduce = make_comm_gradients(replica_gradient(self.replica), self.cfg, self.mesh)
        return reduce(params, buffers, batch, noise_key, comm)


def replica_gradient(strategy: Plain | Microbatched) -> Callable:
    """(params, buffers, batch, noise_key) -> (metrics, grads): the form train/comm.py's
    explicit reductions and DiLoCo's local steps call on each replica's rows."""
    return lambda params, buffers, batch, noise_key: strategy(params, buffers, batch, noise_key)[:2]


def local_strategy(cfg: Config, objective: Objective) -> Plain | Microbatched:
    """The gradient of one replica's (or the whole mesh's) batch: plain or accumulated."""
    if cfg.train.microbatches > 1:
        return Microbatched(objective, cfg.train.microbatches)
    return Plain(objective)


def gradient_strategy(cfg: Config, graphdef: nnx.GraphDef, objective: Objective, mesh) -> GradientStrategy:
    """The strategy of `cfg`: the one place that reads train.pipeline, train.microbatches and comm.*."""
    if cfg.train.pipeline != "none":
        return Pipelined(
            make_pipeline_value_and_grad(graphdef, cfg.train.pipeline, cfg.train.microbatches, cfg.train.virtual_stages)
        )
    local = local_strategy(cfg, objective)
    if cfg.comm.compression != "none" or cfg.comm.stale_gradients:
        return Reduced(local, cfg, mesh)
    return local
