"""Recovery fine-tuning of a pruned model: train with the sparsity pattern held fixed.

params, masks = prune_model(model, "2:4")               # meshwork.models.sparsity
params, losses = recover(cfg, params, masks)            # the kept weights retrain, the zeros stay
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from meshwork.models.sparsity import apply_masks
from meshwork.train.trainer import build_trainer, check_runtime


def recover(
    cfg, params: nnx.State, masks: dict, *, devices: list | None = None, log=None
) -> tuple[nnx.State, list[float]]:
    """Fine-tunes pruned `params` for `cfg.train.steps` steps of `cfg`'s training (its data,
    optimizer and schedule: set a small `optimizer.lr`), with the masks re-applied after every
    optimizer step so the pruned weights stay zero. Returns (params, the training losses).

    Built on the public trainer (`Trainer`): a fresh optimizer state, the pruned
    weights put in place of the initial ones, the data from the start of the training stream.
    `log(step, loss)` is called every step if given.
    """
    trainer = build_trainer(cfg, check_runtime(cfg, devices), devices).compile()
    state = trainer.init_state()
    # A copy (may_alias=False): the step donates the state, which must not delete the caller's params.
    state = state.replace(
        params=jax.tree.map(
            lambda new, old: jax.device_put(new.astype(old.dtype), old.sharding, may_alias=False), params, state.params
        )
    )
    masks = jax.device_put(masks, NamedSharding(trainer.mesh, PartitionSpec()))
    mask_fn = jax.jit(apply_masks, donate_argnums=0)
    state = state.replace(params=mask_fn(state.params, masks))
    data = trainer.task.train_iterator()
    losses = []
    for i in range(cfg.train.steps):
        state, metrics = trainer.step_fn(state, trainer.to_device(next(data)))
        state = state.replace(params=mask_fn(state.params, masks))
        losses.append(float(metrics["loss"]))
        if log is not None:
            log(i + 1, losses[-1])
    return jax.device_get(state.params), losses
