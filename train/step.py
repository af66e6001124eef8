"""The training and evaluation steps: pure functions of (state, batch)."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models.transformer import apply_layers
from sharding.pipeline import pipeline_value_and_grad

Batch = dict[str, jax.Array]


def make_loss_fn(graphdef: nnx.GraphDef) -> Callable[[Any, Batch], jax.Array]:
    def loss_fn(params, batch: Batch) -> jax.Array:
        logits_BLV = nnx.merge(graphdef, params)(batch["inputs"], batch.get("positions"))
        return optax.softmax_cross_entropy_with_integer_labels(logits_BLV, batch["targets"]).mean()
    return loss_fn


def make_pipeline_value_and_grad(graphdef: nnx.GraphDef, kind: str, microbatches: int) -> Callable:
    """(params, batch) -> (loss, grads) with the blocks pipelined over the mesh axis `stage`.

    The embedding runs before the pipeline (its gradient flows back through
    the pipeline's input cotangent), the stacked blocks are cut into P stages
    of L/P layers, and the final norm, logits and loss run on the last stage
    for each microbatch, so 1F1B can start a microbatch's backward pass as
    soon as its forward pass ends.
    """
    def ce(logits_BLV, targets_BL):
        return optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL).mean()

    def value_and_grad(params, batch: Batch):
        model = nnx.merge(graphdef, params)
        emb_g, emb_s = nnx.split(model.embed)
        blk_g, blk_s = nnx.split(model.blocks)
        head_g, head_s = nnx.split(model.head)
        remat, tied = model.remat, model.cfg.tie_embeddings
        P = jax.sharding.get_abstract_mesh().shape["stage"]
        # Interleaved rows, as in gradient accumulation: each microbatch spans all data shards.
        tokens_M, targets_M = (x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)
                               for x in (batch["inputs"], batch["targets"]))
        x_M, embed_vjp = jax.vjp(lambda e: nnx.merge(emb_g, e)(tokens_M), emb_s)
        stages = jax.tree.map(lambda a: a.reshape(P, a.shape[0] // P, *a.shape[1:]), blk_s)

        def stage_fn(layers, x_BLD):
            return apply_layers(blk_g, layers, x_BLD, None, remat)

        def loss_fn(head, y_BLD, targets_BL):
            embed = nnx.merge(emb_g, head["embed"]) if tied else None
            return ce(nnx.merge(head_g, head["head"])(y_BLD, embed), targets_BL)

        head_params = {"head": head_s, "embed": emb_s if tied else None}
        loss, (d_stages, d_head, d_x_M) = pipeline_value_and_grad(
            stage_fn, loss_fn, stages, head_params, x_M, targets_M, schedule=kind)
        (d_embed,) = embed_vjp(d_x_M)
        if tied:  # the table is both the input embedding and the output projection
            d_embed = jax.tree.map(jnp.add, d_embed, d_head["embed"])
        d_blocks = jax.tree.map(lambda g, a: g.reshape(a.shape), d_stages, blk_s)
        # Reassemble the pieces into the parameters' own tree (same Variables, same metadata).
        grads = jax.tree.map(jnp.zeros_like, params)
        nnx.replace_by_pure_dict(grads, {"blocks": nnx.to_pure_dict(d_blocks), "embed": nnx.to_pure_dict(d_embed),
                                         "head": nnx.to_pure_dict(d_head["head"])})
        return loss, grads

    return value_and_grad


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    microbatches: int = 1, grad_shardings: Any = None,
                    pipeline: str = "none") -> Callable[[dict, Batch], tuple[dict, dict]]:
    """Returns step(state, batch) -> (state, metrics); jit it with shardings and donation.

    `pipeline` ("gpipe" or "1f1b") runs the blocks as a pipeline over the mesh
    axis `stage` with `microbatches` microbatches.

    `grad_shardings`, when given, pins the gradients' layout (ZeRO-2 splits
    them over the data-parallel axes, so XLA reduce-scatters instead of
    all-reducing); otherwise XLA lays them out like the parameters.

    With `microbatches` = M > 1, gradients of M equal slices of the batch are
    summed in float32 inside a scan (gradient accumulation), so activation
    memory is that of B/M sequences while the update equals the full batch's.
    """
    grad_fn = jax.value_and_grad(make_loss_fn(graphdef))
    pipelined = make_pipeline_value_and_grad(graphdef, pipeline, microbatches) if pipeline != "none" else None

    def accumulate(params, batch: Batch):
        if pipelined is not None:  # the pipeline schedule does the microbatching
            return pipelined(params, batch)
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
