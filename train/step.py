"""The training and evaluation steps: pure functions of (state, batch).

The step computes the gradient with the strategy it is given (train/gradients.py), then applies
the optimizer, unless the loss or the gradient is not finite. What the loss is belongs to the
task (train/task.py, meshwork.objectives).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from meshwork.objectives import Batch, Objective
from meshwork.partitioning import to_device_memory
from meshwork.train.gradients import GradientStrategy
from meshwork.train.state import TrainState


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    gradients: GradientStrategy,
    *,
    seed: int = 0,
    grad_shardings: Any = None,
    ema_decay: float | None = None,
    inject_nan_at: tuple[int, ...] = (),
) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    """Returns step(state, batch) -> (state, metrics); jit it with shardings and donation.

    `gradients` (train/gradients.py: plain, microbatched, pipelined, or reduced by hand with
    its buffers in state.comm) gives the batch's metrics and gradient.

    `grad_shardings`, when given, pins the gradients' layout (ZeRO-2 splits
    them over the data-parallel axes, so XLA reduce-scatters instead of
    all-reducing); otherwise XLA lays them out like the parameters.

    A step whose loss or gradient norm is not finite changes nothing but the
    step counter (metrics["nonfinite"] says so); the host decides what follows
    (train.on_nan). `inject_nan_at` makes the loss and gradients of those
    steps (1-based, as logged) NaN, to test that handling.
    """

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        # Noise (e.g. noisy top-k routing) is a pure function of the step, so a
        # resumed run draws exactly what an uninterrupted one would.
        noise_key = jax.random.fold_in(jax.random.key(seed), state.step)
        metrics, grads, comm = gradients(state.params, state.buffers, batch, noise_key, state.comm)
        grads = jax.tree.map(to_device_memory, grads)  # offloaded layers' gradients leave the scan on the host
        if inject_nan_at:
            poison = jnp.where(jnp.isin(state.step + 1, jnp.asarray(inject_nan_at)), jnp.nan, 1.0)
            grads = jax.tree.map(lambda g: g * poison.astype(g.dtype), grads)
            metrics = {**metrics, "loss": metrics["loss"] * poison}
        if grad_shardings is not None:
            grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        # Host offload (train.offload): state that lives in pinned host memory is streamed to the
        # device for the update (the forward pass streams offloaded layers itself, one at a time);
        # the jit's host out_shardings stream the new values back out.
        state = state.replace(
            params=jax.tree.map(to_device_memory, state.params),
            opt_state=jax.tree.map(to_device_memory, state.opt_state),
        )
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)

        # What a step may change besides its counter: `update` computes these, `keep` returns them as they were.
        changed = (
            "params",
            "buffers",
            "opt_state",
            *(("comm",) if gradients.stateful else ()),
            *(("ema",) if ema_decay else ()),
        )

        def update(_):
            new = _updated(graphdef, tx, ema_decay, state, grads, metrics).replace(comm=comm)
            return {k: getattr(new, k) for k in changed}

        def keep(_):
            return {k: getattr(state, k) for k in changed}

        # A step whose loss or gradient is not finite leaves the state as it was. A branch on the
        # device, not a select of new and old: with the old state still needed after the update,
        # XLA would copy every donated buffer (params and both Adam moments) to keep it, which
        # cost 15% of a step at vocabulary 32,000 on a CPU. No host sync either way.
        with jax.named_scope("nan_guard"):
            new_state = jax.lax.cond(finite, update, keep, None)
        metrics = {**metrics, "grad_norm": grad_norm, "lr": schedule(state.step), "nonfinite": ~finite}
        return state.replace(**new_state, step=state.step + 1), metrics

    return train_step


def make_eval_step(objective: Objective, metrics: tuple[str, ...] = ()) -> Callable[[Any, Any, Batch], dict]:
    """(params, buffers, batch) -> {"loss": the task's loss (for an LM the cross-entropy alone), and
    the objective's `metrics` named (DPO's accuracy and reward margin)}, without training noise:
    fixed timesteps and noise for diffusion, no router noise."""

    def evaluate(params, buffers, batch):
        m = objective(params, buffers, batch)[1]
        return {k: m[k] for k in ("loss", *metrics)}

    return evaluate


def _updated(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    ema_decay: float | None,
    state: TrainState,
    grads: Any,
    metrics: dict,
) -> TrainState:
    """The optimizer's update of `state`: new params and opt_state, the buffers models update from
    the step's statistics (MoE routers' biases), and the EMA of the weights if there is one."""
    with jax.named_scope("optimizer"):  # the scope profiles group by (perf/step_profile.py)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
    model = nnx.merge(graphdef, params, state.buffers)
    buffers = model.updated_buffers(state.buffers, metrics) if hasattr(model, "updated_buffers") else state.buffers
    new = state.replace(params=params, buffers=buffers, opt_state=opt_state)
    if ema_decay:  # weights averaged over steps: what diffusion samples with
        new = new.replace(ema=jax.tree.map(lambda e, p: ema_decay * e + (1 - ema_decay) * p, state.ema, params))
    return new
