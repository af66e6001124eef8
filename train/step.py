"""The training and evaluation steps: pure functions of (state, batch)."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec

from meshwork.config import Config
from meshwork.evaluation.lm_loss import make_loss_fn
from meshwork.models.transformer import apply_layers, to_device_memory
from meshwork.sharding.pipeline import pipeline_value_and_grad
from meshwork.sharding.rules import Rules, current_rules, logical_to_spec, split_axes

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
    return make_diffusion_loss_fn(graphdef, cfg) if cfg.model.kind == "unet" else make_loss_fn(graphdef)


def _mesh_spec(var: nnx.Variable, rules: Rules) -> PartitionSpec:
    """The mesh PartitionSpec the rules give a variable's array (replicated without logical names)."""
    names = var.get_metadata().get("out_sharding")
    return logical_to_spec(tuple(names), rules) if names else PartitionSpec()


def stage_layout(blocks: nnx.State, n_stages: int, virtual_stages: int = 1) -> nnx.State:
    """The stacked blocks (L, ...) as the pipeline's stage parameters.

    v = 1: (P, L/P, ...); stage s holds layers s L/P .. (s+1) L/P - 1, the
    block of the `layers` axis the `pp` rules already keep on it.
    v > 1 (interleaved): (P, v, L/(P v), ...); stage s holds the model chunks
    s, s+P, s+2P, ... of L/(P v) layers each, so chunk c = j P + s is
    `out[s, j]` (a reshape to (v, P, ...) and a swap; the stored parameters
    stay in model order, so this is an all-to-all over `stage` every step).

    >>> import numpy as np
    >>> stage_layout({"w": np.arange(8)}, 2, 2)["w"].tolist()
    [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    """
    P, v = n_stages, virtual_stages
    if v == 1:
        return jax.tree.map(lambda a: a.reshape(P, a.shape[0] // P, *a.shape[1:]), blocks)
    return jax.tree.map(lambda a: a.reshape(v, P, a.shape[0] // (P * v), *a.shape[1:]).swapaxes(0, 1), blocks)


def from_stage_layout(stages: nnx.State, blocks: nnx.State, virtual_stages: int = 1) -> nnx.State:
    """Inverse of `stage_layout`: stage-shaped arrays (gradients) back to the blocks' (L, ...)."""
    if virtual_stages == 1:
        return jax.tree.map(lambda g, a: g.reshape(a.shape), stages, blocks)
    return jax.tree.map(lambda g, a: g.swapaxes(0, 1).reshape(a.shape), stages, blocks)


def stage_specs(blocks: nnx.State, rules: Rules, axis_name: str = "stage", virtual_stages: int = 1) -> nnx.State:
    """PartitionSpecs of `stage_layout(blocks, ...)`: `axis_name` on the new leading stage
    dimension, the inner dimensions split as the rules split the block's own (e.g. `embed`
    over `fsdp`), so the executor keeps its float32 gradient accumulators sharded that way."""
    def spec(var):
        inner = [None if a == axis_name or (isinstance(a, tuple) and axis_name in a) else a
                 for a in _mesh_spec(var, rules)[1:]]  # [0] is `layers`, now cut into stages
        # (P, L/P, ...) or (P, v, L/(P v), ...): the layers within a stage (and its chunks) unsplit.
        return var.replace(PartitionSpec(axis_name, *([None] * (1 if virtual_stages == 1 else 2)), *inner))
    return jax.tree.map(spec, blocks, is_leaf=lambda x: isinstance(x, nnx.Variable))


def head_specs(tree: Any, rules: Rules, axis_name: str = "stage") -> Any:
    """PartitionSpecs of replicated-over-stages params (embedding, final norm, LM head) under `rules`."""
    def spec(var):
        axes = [None if a == axis_name else a for a in _mesh_spec(var, rules)]
        return var.replace(PartitionSpec(*axes))
    return jax.tree.map(spec, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def data_axes(rules: Rules, mesh_shape: dict[str, int], specs: Any) -> tuple[str, ...]:
    """The batch's mesh axes (`act_batch`, size > 1) that split no weight in `specs`: the
    executor sums the gradients over them once, after the schedule, instead of in every
    backward step. An axis that splits weights (fsdp) stays with the compiler.

    >>> from meshwork.sharding.rules import rules_for
    >>> data_axes(rules_for("fsdp+pp"), {"stage": 2, "data": 2, "fsdp": 2}, [PartitionSpec("stage", "fsdp")])
    ('data',)
    """
    used = {a for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
            if isinstance(spec, PartitionSpec) for entry in spec
            for a in ((entry,) if isinstance(entry, str) else tuple(entry or ()))}
    return tuple(a for a in split_axes("act_batch", rules, mesh_shape) if a not in used)


def make_pipeline_value_and_grad(graphdef: nnx.GraphDef, kind: str, microbatches: int,
                                 virtual_stages: int = 1) -> Callable:
    """(params, buffers, batch) -> (loss, metrics, grads) with the blocks pipelined over the mesh axis `stage`.

    The embedding runs before the pipeline (its gradient flows back through
    the pipeline's input cotangent), the stacked blocks are cut into P stages
    of L/P layers (`stage_layout`; P x v chunks under `interleaved`), and the
    final norm, logits and loss run on the last stage for each microbatch, so
    1F1B can start a microbatch's backward pass as soon as its forward pass
    ends. The parameters' PartitionSpecs under the rules being traced with
    (`use_rules`) go to the executor, so its gradient accumulators are split
    over `fsdp` (or whatever splits the weights) as the weights are.
    """
    def ce(logits_BLV, targets_BL):
        return optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL).mean()

    def value_and_grad(params, buffers, batch: Batch):
        model = nnx.merge(graphdef, params, buffers)
        emb_g, emb_s = nnx.split(model.embed)
        blk_g, blk_s = nnx.split(model.blocks)
        head_g, head_s = nnx.split(model.head)
        remat, tied = model.remat, model.cfg.tie_embeddings
        P = jax.sharding.get_abstract_mesh().shape["stage"]
        # Interleaved rows, as in gradient accumulation: each microbatch spans all data shards.
        tokens_M, targets_M = (x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)
                               for x in (batch["inputs"], batch["targets"]))
        x_M, embed_vjp = jax.vjp(lambda e: nnx.merge(emb_g, e)(tokens_M), emb_s)
        stages = stage_layout(blk_s, P, virtual_stages)

        def stage_fn(layers, x_BLD):
            return apply_layers(blk_g, layers, x_BLD, None, remat)

        def loss_fn(head, y_BLD, targets_BL):
            embed = nnx.merge(emb_g, head["embed"]) if tied else None
            return ce(nnx.merge(head_g, head["head"])(y_BLD, embed), targets_BL)

        head_params = {"head": head_s, "embed": emb_s if tied else None}
        # The weights' layout under the rules being traced with: the executor keeps its float32
        # accumulators split like them, and sums gradients over the data axes once, after the schedule.
        rules, layout = current_rules(), {}
        if rules is not None:
            layout = dict(stage_specs=stage_specs(blk_s, rules, "stage", virtual_stages),
                          head_specs=head_specs(head_params, rules))
            layout["data_axes"] = data_axes(rules, dict(jax.sharding.get_abstract_mesh().shape),
                                            tuple(layout.values()))
        loss, (d_stages, d_head, d_x_M) = pipeline_value_and_grad(
            stage_fn, loss_fn, stages, head_params, x_M, targets_M, schedule=kind,
            virtual_stages=virtual_stages, **layout)
        (d_embed,) = embed_vjp(d_x_M)
        if tied:  # the table is both the input embedding and the output projection
            d_embed = jax.tree.map(jnp.add, d_embed, d_head["embed"])
        d_blocks = from_stage_layout(d_stages, blk_s, virtual_stages)
        # Reassemble the pieces into the parameters' own tree (same Variables, same metadata).
        grads = jax.tree.map(jnp.zeros_like, params)
        nnx.replace_by_pure_dict(grads, {"blocks": nnx.to_pure_dict(d_blocks), "embed": nnx.to_pure_dict(d_embed),
                                         "head": nnx.to_pure_dict(d_head["head"])})
        return loss, {"loss": loss}, grads

    return value_and_grad


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
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        model = nnx.merge(graphdef, params, state["buffers"])
        # Models with non-trained variables (MoE routers' biases) update them from the step's statistics.
        buffers = model.updated_buffers(state["buffers"], metrics) if hasattr(model, "updated_buffers") \
            else state["buffers"]
        metrics = {**metrics, "grad_norm": grad_norm, "lr": schedule(state["step"]), "nonfinite": ~finite}
        new_state = {"step": state["step"] + 1, "params": params, "buffers": buffers, "opt_state": opt_state}
        if comm_grads is not None:
            new_state["comm"] = comm
        if ema_decay:  # weights averaged over steps: what diffusion samples with
            new_state["ema"] = jax.tree.map(lambda e, p: ema_decay * e + (1 - ema_decay) * p, state["ema"], params)
        # Selecting (not branching) keeps one program and no host sync: a NaN
        # update is computed and thrown away, so the weights stay finite.
        kept = {**state, "step": new_state["step"]}
        return jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, kept), metrics

    return train_step


def make_eval_step(graphdef: nnx.GraphDef, loss_fn: Callable | None = None) -> Callable[[Any, Any, Batch], jax.Array]:
    """(params, buffers, batch) -> the task's loss (for an LM the cross-entropy alone),
    without training noise: fixed timesteps and noise for diffusion, no router noise."""
    loss_fn = loss_fn or make_loss_fn(graphdef)
    return lambda params, buffers, batch: loss_fn(params, buffers, batch)[1]["loss"]
