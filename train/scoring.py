"""Log-probabilities of token rows under given weights, on a trainer's mesh: what GRPO's rollouts
score with the trainer's forward pass (train/rollouts.py: the reference's per-token log p, and the
trainer side of the engine-trainer agreement) and DPO's reference (train/dpo_reference.py: per-pair
sequence log p). Rows come and go as host arrays, in slices of train.global_batch rows, the
trainer's batch layout (the last slice padded)."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from meshwork.objectives.preference import sequence_log_probs, token_log_probs


def log_probs_fn(trainer, *, per_sequence: bool):
    """(params, buffers, rows) -> log p of each target (B, L), or with `per_sequence` each row's sum
    over its `loss_mask` (B,); jitted on `trainer`'s mesh, in its layouts."""
    graphdef = trainer.graphdef
    with trainer.context():

        def logp(params, buffers, batch):
            logits_BLV, _ = nnx.merge(graphdef, params, buffers).apply(batch["inputs"], None)
            if per_sequence:
                return sequence_log_probs(logits_BLV, batch["targets"], batch["loss_mask"])
            return token_log_probs(logits_BLV, batch["targets"])

        s = trainer.shardings
        return jax.jit(logp, in_shardings=(s.params, s.buffers, trainer.batch_sharding))


def score_rows(trainer, fn, params, buffers, rows: dict[str, np.ndarray]) -> np.ndarray:
    """`fn` (a `log_probs_fn`) over every row of `rows`, in slices of global_batch rows."""
    B, n = trainer.cfg.train.global_batch, len(rows["inputs"])
    out = []
    with trainer.context():
        for k in range(0, n, B):
            part = {key: v[k : k + B] for key, v in rows.items()}
            short = B - len(part["inputs"])
            part = {key: np.pad(v, ((0, short), (0, 0))) for key, v in part.items()}
            out.append(np.asarray(fn(params, buffers, trainer.to_device(part)))[: B - short])
    return np.concatenate(out) if out else np.zeros((0,), np.float32)
