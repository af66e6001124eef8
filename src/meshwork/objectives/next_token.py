"""Next-token prediction: the language models' objective (cross-entropy plus the model's auxiliary terms).

One definition for the trainer (`LMTask.objective`, train/task.py) and for the measurements
made outside it (`evaluation.lm_loss.validation_loss`: what quantization or pruning costs), so
the two always agree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from meshwork.objectives import Batch, Objective
from meshwork.objectives.fused_ce import fused_cross_entropy

# `auto` fuses the loss from this vocabulary size up (below it the logits are small and the plain
# loss is as fast), in chunks whose float32 logits take at most AUTO_CHUNK_BYTES. Smaller chunks
# keep a chunk's logits near the cache between the head matmul and the softmax passes: at
# vocabulary 32,000, d 256, 2,048 rows on a 2-core CPU, 512-row chunks (62.5 MiB) made the step
# 12% faster than one 2,048-row chunk (250 MiB), 256-row chunks 8% (benchmarks/RESULTS.md).
AUTO_MIN_VOCAB = 8192
AUTO_CHUNK_BYTES = 64 * 2**20


def auto_loss_chunk(vocab_size: int, rows: int) -> int | None:
    """train.loss_chunk=auto: the chunk (token rows) for a batch of `rows` = B*L tokens, or None
    for the plain loss. Chunks are as large as the byte budget allows (fewer, larger matmuls)
    and split the rows evenly.

    >>> auto_loss_chunk(256, 2048), auto_loss_chunk(32000, 2048), auto_loss_chunk(128256, 8192)
    (None, 512, 128)
    """
    if vocab_size < AUTO_MIN_VOCAB:
        return None
    most = max(1, AUTO_CHUNK_BYTES // (4 * vocab_size))
    chunks = -(-rows // most)
    return -(-rows // chunks)


def next_token_loss(graphdef: nnx.GraphDef, loss_chunk: int | str | None = None) -> Objective:
    """loss_fn(params, buffers, batch, noise_key=None) -> (objective, metrics).

    The objective is the next-token cross-entropy plus the model's auxiliary
    terms (MoE load balancing and router z-loss, with the coefficients of its
    config); metrics["loss"] is the cross-entropy alone, comparable with the
    validation loss, beside the model's statistics (expert load, drops).

    `loss_chunk` (train.loss_chunk): compute the head and the cross-entropy that many token
    rows at a time (objectives/fused_ce.py), from the model's `apply_hidden` and
    `head_weight`, never holding the whole batch's logits; None: the logits of `apply`;
    "auto": `auto_loss_chunk` of the model's vocabulary, where its head weight is a plain array.
    """

    def loss_fn(params, buffers, batch: Batch, noise_key: jax.Array | None = None):
        model = nnx.merge(graphdef, params, buffers)
        kw = dict(noise_key=noise_key, segment_ids_BL=batch.get("segment_ids"))
        if getattr(model, "mtp", None) is not None:  # multi-token prediction reads the targets (models/mtp.py)
            kw |= dict(targets_BL=batch["targets"], loss_mask_BL=batch.get("loss_mask"))
        chunk = _resolve_chunk(model, loss_chunk, batch["targets"].size)
        if chunk is not None:
            h_BLD, stats = model.apply_hidden(batch["inputs"], batch.get("positions"), **kw)
            with jax.named_scope("loss"):  # the scope profiles group by (perf/step_profile.py)
                ce = fused_cross_entropy(
                    h_BLD, model.head_weight(), batch["targets"], batch.get("loss_mask"), chunk=chunk, dtype=model.dtype
                )
        else:
            logits_BLV, stats = model.apply(batch["inputs"], batch.get("positions"), **kw)
            with jax.named_scope("loss"):
                ce = token_cross_entropy(logits_BLV, batch)
        objective = ce + sum(c * stats[k] for k, c in model.aux_coefficients().items() if k in stats)
        return objective, {"loss": ce, **stats}

    return loss_fn


def _resolve_chunk(model: nnx.Module, loss_chunk: int | str | None, rows: int) -> int | None:
    if loss_chunk != "auto":
        return loss_chunk
    if not hasattr(model, "apply_hidden") or not hasattr(model, "cfg"):
        return None
    try:
        model.head_weight()
    except ValueError:  # a quantized or LoRA-wrapped head: the plain loss
        return None
    return auto_loss_chunk(model.cfg.vocab_size, rows)


def token_cross_entropy(logits_BLV: jax.Array, batch: Batch) -> jax.Array:
    """Mean next-token cross-entropy of a batch, over the targets that count: a batch of packed
    documents (data.source: text) carries `loss_mask`, 0 where a target is the first token of the
    next document, which nothing before it in the row can predict."""
    ce_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, batch["targets"])
    if "loss_mask" not in batch:
        return ce_BL.mean()
    mask_BL = batch["loss_mask"].astype(ce_BL.dtype)
    return (ce_BL * mask_BL).sum() / jnp.maximum(mask_BL.sum(), 1.0)
