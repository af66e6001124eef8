"""The training and evaluation steps: pure functions of (state, batch)."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

Batch = dict[str, jax.Array]


def make_loss_fn(graphdef: nnx.GraphDef) -> Callable[[Any, Batch], jax.Array]:
    def loss_fn(params, batch: Batch) -> jax.Array:
        logits_BLV = nnx.merge(graphdef, params)(batch["inputs"], batch.get("positions"))
        return optax.softmax_cross_entropy_with_integer_labels(logits_BLV, batch["targets"]).mean()
    return loss_fn


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    microbatches: int = 1, grad_shardings: Any = None) -> Callable[[dict, Batch], tuple[dict, dict]]:
    """Returns step(state, batch) -> (state, metrics); jit it with shardings and donation.

    `grad_shardings`, when given, pins the gradients' layout (ZeRO-2 splits
    them over the data-parallel axes, so XLA reduce-scatters instead of
    all-reducing); otherwise XLA lays them out like the parameters.

    With `microbatches` = M > 1, gradients of M equal slices of the batch are
    summed in float32 inside a scan (gradient accumulation), so activation
    memory is that of B/M sequences while the update equals the full batch's.
    """
    grad_fn = jax.value_and_grad(make_loss_fn(graphdef))

    def accumulate(params, batch: Batch):
        if microbatches == 1:
            return grad_fn(params, batch)
        # Row r of microbatch m is row r*M + m of the batch: each microbatch
        # takes rows from every data-parallel shard, so none sits idle.
        micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:])
                             .swapaxes(0, 1), batch)

        def body(carry, mb):
            loss_sum, grad_sum = carry
            loss, grads = grad_fn(params, mb)
            grad_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
            return (loss_sum + loss, grad_sum), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        (loss_sum, grad_sum), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), micro)
        grads = jax.tree.map(lambda g, p: (g / microbatches).astype(p.dtype), grad_sum, params)
        return loss_sum / microbatches, grads

    def train_step(state: dict, batch: Batch) -> tuple[dict, dict]:
        loss, grads = accumulate(state["params"], batch)
        if grad_shardings is not None:
            grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(state["step"])}
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    return train_step


def make_eval_step(graphdef: nnx.GraphDef) -> Callable[[Any, Batch], jax.Array]:
    return make_loss_fn(graphdef)
