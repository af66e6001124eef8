"""The training and evaluation steps: pure functions of (state, batch)."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from meshwork.config import Config
from meshwork.evaluation.lm_loss import make_loss_fn
from meshwork.models.transformer import to_device_memory
from meshwork.train.pipeline_step import make_pipeline_value_and_grad

Batch = dict[str, jax.Array]


def make_diffusion_loss_fn(graphdef: nnx.GraphDef, cfg: Config) -> Callable[..., tuple[jax.Array, dict]]:
    """loss_fn(params, buffers, batch, noise_key=None) -> (objective, metrics) for a denoiser.

    The noise and timesteps come from `noise_key` (a pure function of the step
    in training, fixed in evaluation). For classifier-free guidance a share
    `label_dropout` of the labels becomes the null class, the last one.
    """
    from meshwork.diffusion.schedule import diffusion_loss

    dcfg, n_classes = cfg.model.diffusion, cfg.model.unet.num_class_embeds

    def loss_fn(params, buffers, batch: Batch, noise_key: jax.Array | None = None):
        model = nnx.merge(graphdef, params, buffers)
        key = noise_key if noise_key is not None else jax.random.key(0)
        key, drop_key = jax.random.split(key)
        labels = None
        if n_classes is not None:
            drop = jax.random.bernoulli(drop_key, dcfg.label_dropout, batch["labels"].shape)
            labels = jnp.where(drop & (noise_key is not None), n_classes - 1, batch["labels"])
        loss, metrics = diffusion_loss(model, batch["images"], key, labels, dcfg)
        return loss, {**metrics, "loss": loss}
    return loss_fn


def make_objective(graphdef: nnx.GraphDef, cfg: Config) -> Callable[..., tuple[jax.Array, dict]]:
    """The training objective of `cfg`'s task."""
    if cfg.model.kind == "unet":
        return make_diffusion_loss_fn(graphdef, cfg)
    return make_loss_fn(graphdef, cfg.train.loss_chunk)


def make_accumulate(graphdef: nnx.GraphDef, loss_fn: Callable | None, microbatches: int = 1,
                    pipeline: str = "none", virtual_stages: int = 1) -> Callable:
    """accumulate(params, buffers, batch, noise_key) -> (metrics, grads) of the whole batch.

    With `microbatches` = M > 1, gradients of M equal slices of the batch are
    summed in float32 inside a scan (gradient accumulation); a pipeline
    schedule does its own microbatching.
    """
    grad_fn = jax.value_and_grad(loss_fn or make_loss_fn(graphdef), has_aux=True)
    pipelined = (make_pipeline_value_and_grad(graphdef, pipeline, microbatches, virtual_stages)
                 if pipeline != "none" else None)

    def accumulate(params, buffers, batch: Batch, noise_key):
        if pipelined is not None:
            _, metrics, grads = pipelined(params, buffers, batch)
            return metrics, grads
        if microbatches == 1:
            (_, metrics), grads = grad_fn(params, buffers, batch, noise_key)
            return metrics, grads
        # Row r of microbatch m is row r*M + m of the batch: each microbatch
        # takes rows from every data-parallel shard, so none sits idle.
        micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:])
                             .swapaxes(0, 1), batch)

        def body(grad_sum, mb_and_key):
            mb, key = mb_and_key
            (_, metrics), grads = grad_fn(params, buffers, mb, key)
            grads = jax.tree.map(to_device_memory, grads)  # offloaded layers' gradients come out on the host
            grad_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
            return grad_sum, metrics

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        keys = jax.random.split(noise_key, microbatches)
        grad_sum, metrics = jax.lax.scan(body, zeros, (micro, keys))
        grads = jax.tree.map(lambda g, p: (g / microbatches).astype(p.dtype), grad_sum, params)
        return jax.tree.map(lambda m: m.mean(axis=0), metrics), grads

    return accumulate


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    microbatches: int = 1, grad_shardings: Any = None,
                    pipeline: str = "none", seed: int = 0, loss_fn: Callable | None = None,
                    ema_decay: float | None = None, inject_nan_at: tuple[int, ...] = (),
                    comm_grads: Callable | None = None,
                    virtual_stages: int = 1) -> Callable[[dict, Batch], tuple[dict, dict]]:
    """Returns step(state, batch) -> (state, metrics); jit it with shardings and donation.

    `pipeline` (a kind of `sharding.pipeline_schedules.SCHEDULES`: "gpipe", "1f1b", ...)
    runs the blocks as a pipeline over the mesh axis `stage` with
    `microbatches` microbatches; `virtual_stages` chunks per stage under
    "interleaved".

    `grad_shardings`, when given, pins the gradients' layout (ZeRO-2 splits
    them over the data-parallel axes, so XLA reduce-scatters instead of
    all-reducing); otherwise XLA lays them out like the parameters.

    With `microbatches` = M > 1, gradients of M equal slices of the batch are
    summed in float32 inside a scan (gradient accumulation), so activation
    memory is that of B/M sequences while the update equals the full batch's.

    A step whose loss or gradient norm is not finite changes nothing but the
    step counter (metrics["nonfinite"] says so); the host decides what follows
    (train.on_nan). `inject_nan_at` makes the loss and gradients of those
    steps (1-based, as logged) NaN, to test that handling.

    `comm_grads` (train/comm.py) replaces the implicit data-parallel gradient
    all-reduce with an explicit one (compressed, or one step stale) whose
    buffers live in state["comm"].
    """
    accumulate = make_accumulate(graphdef, loss_fn, microbatches, pipeline, virtual_stages)

    def train_step(state: dict, batch: Batch) -> tuple[dict, dict]:
        # Noise (e.g. noisy top-k routing) is a pure function of the step, so a
        # resumed run draws exactly what an uninterrupted one would.
        noise_key = jax.random.fold_in(jax.random.key(seed), state["step"])
        if comm_grads is not None:
            metrics, grads, comm = comm_grads(state["params"], state["buffers"], batch, noise_key, state["comm"])
        else:
            metrics, grads = accumulate(state["params"], state["buffers"], batch, noise_key)
        grads = jax.tree.map(to_device_memory, grads)  # offloaded layers' gradients leave the scan on the host
        if inject_nan_at:
            poison = jnp.where(jnp.isin(state["step"] + 1, jnp.asarray(inject_nan_at)), jnp.nan, 1.0)
            grads = jax.tree.map(lambda g: g * poison.astype(g.dtype), grads)
            metrics = {**metrics, "loss": metrics["loss"] * poison}
        if grad_shardings is not None:
            grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        # Host offload (train.offload): state that lives in pinned host memory is streamed to the
        # device for the update (the forward pass streams offloaded layers itself, one at a time);
        # the jit's host out_shardings stream the new values back out.
        state = {**state, **{k: jax.tree.map(to_device_memory, state[k]) for k in ("params", "opt_state")}}
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)

        # What a step may change besides its counter: `update` computes these, `keep` returns them as they were.
        changed = ("params", "buffers", "opt_state", *(("comm",) if comm_grads is not None else ()),
                   *(("ema",) if ema_decay else ()))

        def update(_):
            with jax.named_scope("optimizer"):  # the scope profiles group by (perf/step_profile.py)
                updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
                params = optax.apply_updates(state["params"], updates)
            model = nnx.merge(graphdef, params, state["buffers"])
            # Models with non-trained variables (MoE routers' biases) update them from the step's statistics.
            buffers = model.updated_buffers(state["buffers"], metrics) if hasattr(model, "updated_buffers") \
                else state["buffers"]
            new = {"params": params, "buffers": buffers, "opt_state": opt_state}
            if comm_grads is not None:
                new["comm"] = comm
            if ema_decay:  # weights averaged over steps: what diffusion samples with
                new["ema"] = jax.tree.map(lambda e, p: ema_decay * e + (1 - ema_decay) * p, state["ema"], params)
            return {k: new[k] for k in changed}

        def keep(_):
            return {k: state[k] for k in changed}

        # A step whose loss or gradient is not finite leaves the state as it was. A branch on the
        # device, not a select of new and old: with the old state still needed after the update,
        # XLA would copy every donated buffer (params and both Adam moments) to keep it, which
        # cost 15% of a step at vocabulary 32,000 on a CPU. No host sync either way.
        with jax.named_scope("nan_guard"):
            new_state = jax.lax.cond(finite, update, keep, None)
        metrics = {**metrics, "grad_norm": grad_norm, "lr": schedule(state["step"]), "nonfinite": ~finite}
        return {**state, **new_state, "step": state["step"] + 1}, metrics

    return train_step


def make_eval_step(graphdef: nnx.GraphDef, loss_fn: Callable | None = None) -> Callable[[Any, Any, Batch], jax.Array]:
    """(params, buffers, batch) -> the task's loss (for an LM the cross-entropy alone),
    without training noise: fixed timesteps and noise for diffusion, no router noise."""
    loss_fn = loss_fn or make_loss_fn(graphdef)
    return lambda params, buffers, batch: loss_fn(params, buffers, batch)[1]["loss"]
