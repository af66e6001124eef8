"""Next-token cross-entropy: the language models' training objective and their validation loss.

One definition for the trainer (meshwork.train.step) and for inference-side
measurements (what quantization or pruning costs), so the two always agree.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from meshwork.evaluation.fused_ce import fused_cross_entropy

Batch = dict[str, jax.Array]


def make_loss_fn(graphdef: nnx.GraphDef, loss_chunk: int | None = None) -> Callable[..., tuple[jax.Array, dict]]:
    """loss_fn(params, buffers, batch, noise_key=None) -> (objective, metrics).

    The objective is the next-token cross-entropy plus the model's auxiliary
    terms (MoE load balancing and router z-loss, with the coefficients of its
    config); metrics["loss"] is the cross-entropy alone, comparable with the
    validation loss, beside the model's statistics (expert load, drops).

    `loss_chunk` (train.loss_chunk): compute the head and the cross-entropy that many token
    rows at a time (evaluation/fused_ce.py), from the model's `apply_hidden` and
    `head_weight`, never holding the whole batch's logits; None: the logits of `apply`.
    """
    def loss_fn(params, buffers, batch: Batch, noise_key: jax.Array | None = None):
        model = nnx.merge(graphdef, params, buffers)
        kw = dict(noise_key=noise_key, segment_ids_BL=batch.get("segment_ids"))
        if loss_chunk is not None:
            h_BLD, stats = model.apply_hidden(batch["inputs"], batch.get("positions"), **kw)
            with jax.named_scope("loss"):  # the scope profiles group by (perf/step_profile.py)
                ce = fused_cross_entropy(h_BLD, model.head_weight(), batch["targets"], batch.get("loss_mask"),
                                         chunk=loss_chunk, dtype=model.dtype)
        else:
            logits_BLV, stats = model.apply(batch["inputs"], batch.get("positions"), **kw)
            with jax.named_scope("loss"):
                ce = token_cross_entropy(logits_BLV, batch)
        objective = ce + sum(c * stats[k] for k, c in model.aux_coefficients().items() if k in stats)
        return objective, {"loss": ce, **stats}
    return loss_fn


def token_cross_entropy(logits_BLV: jax.Array, batch: Batch) -> jax.Array:
    """Mean next-token cross-entropy of a batch, over the targets that count: a batch of packed
    documents (data.source: text) carries `loss_mask`, 0 where a target is the first token of the
    next document, which nothing before it in the row can predict."""
    ce_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, batch["targets"])
    if "loss_mask" not in batch:
        return ce_BL.mean()
    mask_BL = batch["loss_mask"].astype(ce_BL.dtype)
    return (ce_BL * mask_BL).sum() / jnp.maximum(mask_BL.sum(), 1.0)


def validation_loss(model: nnx.Module, batches: list[dict[str, np.ndarray]]) -> float:
    """Mean next-token cross-entropy over `batches`, computed as the trainer's val_loss is
    (`make_loss_fn`'s cross-entropy, without auxiliary terms): e.g. what a
    quantization or pruning costs.

    `batches`: e.g. `meshwork.train.task.make_task(cfg).eval_batches()`, the trainer's own set.
    """
    graphdef, params, buffers = nnx.split(model, nnx.Param, ...)
    loss_fn = jax.jit(make_loss_fn(graphdef))
    return float(np.mean([loss_fn(params, buffers, b)[1]["loss"] for b in batches]))
