"""The language models' validation loss: a measurement, computed exactly as the trainer's val_loss is."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from meshwork.objectives.next_token import next_token_loss


def validation_loss(model: nnx.Module, batches: list[dict[str, np.ndarray]]) -> float:
    """Mean next-token cross-entropy over `batches`, computed as the trainer's val_loss is
    (`next_token_loss`'s cross-entropy, without auxiliary terms): e.g. what a
    quantization or pruning costs.

    `batches`: e.g. `meshwork.train.task.make_task(cfg).eval_batches()`, the trainer's own set.
    """
    graphdef, params, buffers = nnx.split(model, nnx.Param, ...)
    loss_fn = jax.jit(next_token_loss(graphdef))
    return float(np.mean([loss_fn(params, buffers, b)[1]["loss"] for b in batches]))
