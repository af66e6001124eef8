"""DPO's reference log-probabilities when the reference is not the policy's own weights with LoRA's
adapters off: for full fine-tuning, computed once before training and cached beside the data
(`train.dpo.reference: precomputed`, no second copy of the weights during the run), or computed
for each batch from a frozen copy of the base's weights held beside the policy
(`train.dpo.reference: frozen_copy`, no pass over the data before the first step, no cache).

The reference is the policy at step 0, the fine-tuning base (`Trainer.init_state()`, built once
here and dropped). Its sequence log-probability of every pair's chosen and rejected reply, train
and validation splits, is computed on the trainer's mesh in batches of train.global_batch pairs
and added to the pairs as `chosen_ref_logp` and `rejected_ref_logp` (each pair's value repeated
along its row, so every batch key shares the (batch, seq) layout); `dpo_objective` then reads them
instead of running the reference's forward pass.

`frozen_copy`: `FrozenReference` keeps the base (`Trainer.init_state()`'s weights, the policy at step
0) on the trainer's mesh, and `WithReference` wraps the pairs' iterator and evaluation batches so
each batch gets the same two keys, computed on the devices just before the step takes it.

The cache is one `.npz` per (pairs, base, model) in `data.cache_dir`, else in a
`.meshwork-dpo-reference` folder beside the first pairs file: a second run on the same pairs and
base reads it instead of computing.
"""

from __future__ import annotations

import hashlib
import io
import json
import pathlib

import jax
import numpy as np

from meshwork.data.user_text import find_text_files
from meshwork.run.durable import replace_file
from meshwork.train.scoring import log_probs_fn, score_rows

SIDES = ("chosen", "rejected")


def cache_path(cfg, pairs) -> pathlib.Path:
    """Where the reference of these pairs under this base and model is cached."""
    h = hashlib.sha256()
    for split in (pairs.train, pairs.val):
        for key in sorted(split.arrays):
            if not key.endswith("ref_logp"):
                h.update(key.encode() + np.ascontiguousarray(split.arrays[key]).tobytes())
    base = pathlib.Path(cfg.finetune.base).expanduser().resolve()
    # The base's checkpoints (a run) or weight files (a Hugging Face folder), with their sizes and times.
    files = (
        sorted((base / "checkpoints").glob("*"))
        if (base / "checkpoints").is_dir()
        else sorted(base.glob("*.safetensors*"))
    )
    identity = {
        "base": str(base),
        "weights": [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files],
        "model": cfg.model.model_dump(mode="json"),
        "dtypes": (cfg.train.compute_dtype, cfg.train.param_dtype),
    }
    h.update(json.dumps(identity, sort_keys=True).encode())
    folder = (
        pathlib.Path(cfg.data.cache_dir).expanduser()
        if cfg.data.cache_dir
        else find_text_files(cfg.data.text_files)[0].parent / ".meshwork-dpo-reference"
    )
    return folder / f"dpo-reference-{h.hexdigest()[:16]}.npz"


def attach_reference(cfg, trainer, pairs, say=print) -> None:
    """Adds `chosen_ref_logp` and `rejected_ref_logp` to both splits of `pairs`, from the cache or computed."""
    path = cache_path(cfg, pairs)
    if path.is_file():
        with np.load(path) as f:
            found = {k: f[k] for k in f.files}
        say(f"DPO reference log-probabilities: read from {path}")
    else:
        say("DPO reference log-probabilities: computing them once with the base model...")
        found = _compute(trainer, pairs)
        if jax.process_index() == 0:  # every process computed them; one writes
            path.parent.mkdir(parents=True, exist_ok=True)
            data = io.BytesIO()
            np.savez(data, **found)
            replace_file(path, data.getvalue())
    L = cfg.data.seq_len
    for name, split in (("train", pairs.train), ("val", pairs.val)):
        for side in SIDES:
            split.arrays[f"{side}_ref_logp"] = np.repeat(found[f"{name}_{side}"][:, None], L, axis=1)


class FrozenReference:
    """The base's weights (the policy's at step 0), frozen, on the trainer's mesh; `__call__` adds a
    batch's reference keys."""

    def __init__(self, trainer):
        state = trainer.init_state()
        self.trainer, self.params, self.buffers = trainer, state.params, state.buffers  # not the optimizer's state
        self.fn = log_probs_fn(trainer, per_sequence=True)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        L, out = batch["chosen_inputs"].shape[1], dict(batch)
        for side in SIDES:
            rows = {k: batch[f"{side}_{k}"] for k in ("inputs", "targets", "loss_mask")}
            logp = score_rows(self.trainer, self.fn, self.params, self.buffers, rows)
            out[f"{side}_ref_logp"] = np.repeat(logp[:, None], L, axis=1)
        return out


class WithReference:
    """`iterator`'s batches with the reference keys added (checkpointable as `iterator` is)."""

    def __init__(self, iterator, reference: FrozenReference):
        self.iterator, self.reference = iterator, reference

    def __iter__(self):
        return self

    def __next__(self):
        return self.reference(next(self.iterator))

    def get_state(self):
        return self.iterator.get_state()

    def set_state(self, state) -> None:
        self.iterator.set_state(state)


def _compute(trainer, pairs) -> dict[str, np.ndarray]:
    state = trainer.init_state()  # the policy at step 0: the reference
    fn = log_probs_fn(trainer, per_sequence=True)
    out = {}
    for name, split in (("train", pairs.train), ("val", pairs.val)):
        for side in SIDES:
            rows = {k: split.arrays[f"{side}_{k}"] for k in ("inputs", "targets", "loss_mask")}
            out[f"{name}_{side}"] = score_rows(trainer, fn, state.params, state.buffers, rows)
    return out
