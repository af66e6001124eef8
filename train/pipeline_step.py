"""The language models' training step as a pipeline over the mesh axis `stage`.

The embedding runs before the pipeline (its gradient flows back through the
pipeline's input cotangent), the stacked layers are cut into P stages (P x v
chunks under `interleaved`), and the final norm, logits and loss run on the
last stage for each microbatch, so 1F1B can start a microbatch's backward pass
as soon as its forward pass ends. The executor and its schedules are
`meshwork.sharding.pipeline`; this file lays the model out for it.

The dense Transformer has one stack of layers (`blocks`). The MoE model has
runs of dense and MoE layers (`MoEConfig.layer_runs`); it pipelines when every
chunk has the same pattern of runs (all-MoE, or e.g. dense/MoE alternating
with an even period), since every stage runs one program. Each stage then
returns its MoE layers' routing statistics beside its output: their auxiliary
losses join the objective through the executor's `has_aux`, and the
statistics come back per microbatch and layer, reassembled in model order
(the load per layer feeds the router-bias update as without a pipeline).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from meshwork.config_sections import LayerRun, chunk_runs
from meshwork.models.transformer import apply_layers
from meshwork.objectives.next_token import token_cross_entropy
from meshwork.sharding.parallel import current_rules
from meshwork.sharding.pipeline import pipeline_value_and_grad
from meshwork.sharding.rules import Rules, logical_to_spec, split_axes

Batch = dict[str, jax.Array]


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
    mesh = jax.sharding.get_abstract_mesh()
    reshard = not mesh.empty and "stage" in mesh.axis_names

    def chunks(a):
        a = a.reshape(v, P, a.shape[0] // (P * v), *a.shape[1:]).swapaxes(0, 1)
        if reshard:
            # Named as two shardings of one array (model order: stage splits v; then stage
            # order), the move is an all-to-all both ways; left to the transpose, jax 0.12's
            # partitioner replicated the gradients on the way back (all-gathers) instead.
            rest = [PartitionSpec.UNCONSTRAINED] * (a.ndim - 2)
            a = jax.lax.with_sharding_constraint(a, PartitionSpec(None, "stage", *rest))
            a = jax.lax.with_sharding_constraint(a, PartitionSpec("stage", None, *rest))
        return a

    return jax.tree.map(chunks, blocks)


def stage_specs(blocks: nnx.State, rules: Rules, axis_name: str = "stage", virtual_stages: int = 1) -> nnx.State:
    """PartitionSpecs of `stage_layout(blocks, ...)`: `axis_name` on the new leading stage
    dimension, the inner dimensions split as the rules split the block's own (e.g. `embed`
    over `fsdp`), so the executor keeps its float32 gradient accumulators sharded that way."""

    def spec(var):
        inner = [
            None if a == axis_name or (isinstance(a, tuple) and axis_name in a) else a
            for a in _mesh_spec(var, rules)[1:]
        ]  # [0] is `layers`, now cut into stages
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
    used = {
        a
        for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        if isinstance(spec, PartitionSpec)
        for entry in spec
        for a in ((entry,) if isinstance(entry, str) else tuple(entry or ()))
    }
    return tuple(a for a in split_axes("act_batch", rules, mesh_shape) if a not in used)


def model_runs(model: nnx.Module) -> tuple[LayerRun, ...]:
    """The model's stacked layer groups in order: the dense Transformer's one `blocks`, or the
    MoE model's runs."""
    return getattr(model, "runs", None) or (LayerRun("blocks", False, 0, model.cfg.n_layers),)


def _gather_chunk_run(
    states: dict[str, nnx.State], runs: tuple[LayerRun, ...], piece: LayerRun, n_chunks: int, per_chunk: int
) -> nnx.State:
    """Chunk-run `piece` of every chunk, stacked (n_chunks * piece.count, ...) in model order,
    sliced from the model's runs (a chunk's run lies inside one model run)."""
    if len(runs) == 1:  # one stack of layers (the dense model, an all-MoE one): already in this form
        return states[runs[0].name]
    slices = []
    for c in range(n_chunks):
        first = c * per_chunk + piece.start
        run = _run_at(runs, first)
        lo = first - run.start
        slices.append(jax.tree.map(lambda a, lo=lo: a[lo : lo + piece.count], states[run.name]))
    if len(slices) == 1:
        return slices[0]
    return jax.tree.map(lambda *parts: jnp.concatenate(parts), *slices)


def make_pipeline_value_and_grad(
    graphdef: nnx.GraphDef, kind: str, microbatches: int, virtual_stages: int = 1
) -> Callable:
    """(params, buffers, batch) -> (loss, metrics, grads) with the layers pipelined over the mesh axis `stage`.

    The parameters' PartitionSpecs under the rules being traced with (`use_rules`) go to the
    executor, so its gradient accumulators are split over `fsdp` (or whatever splits the
    weights) as the weights are, and the batch axes that split no weight are summed once,
    after the schedule. `positions` (context parallelism's zigzag order) reach every stage.
    """
    return functools.partial(_pipelined_value_and_grad, graphdef, kind, microbatches, virtual_stages)


def _pipelined_value_and_grad(
    graphdef: nnx.GraphDef, kind: str, microbatches: int, v: int, params, buffers, batch: Batch
):
    model = nnx.merge(graphdef, params, buffers)
    emb_g, emb_s = nnx.split(model.embed)
    head_g, head_s = nnx.split(model.head)
    tied = model.cfg.tie_embeddings
    mesh_shape = dict(jax.sharding.get_abstract_mesh().shape)
    P = mesh_shape["stage"]
    runs = model_runs(model)
    pieces = chunk_runs(runs, P * v)
    if pieces is None:
        raise ValueError(
            f"pipeline: the layers {[(r.name, r.count) for r in runs]} do not cut into "
            f"{P * v} chunks of one dense/MoE pattern; every stage runs one program"
        )
    per_chunk = model.cfg.n_layers // (P * v)
    graphdefs, states = {}, {}
    for run in runs:
        graphdefs[run.moe], states[run.name] = nnx.split(getattr(model, run.name))

    def to_stages(states):
        return {p.name: stage_layout(_gather_chunk_run(states, runs, p, P * v, per_chunk), P, v) for p in pieces}

    stages, stages_vjp = jax.vjp(to_stages, states)
    n_moe = sum(r.count for r in runs if r.moe)

    def micro(x):  # rows r*M + m form microbatch m, as in gradient accumulation: each spans every data shard
        return x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)

    tokens_M, targets_M = micro(batch["inputs"]), micro(batch["targets"])
    context_M = {"positions": micro(batch["positions"])} if "positions" in batch else None
    x_M, embed_vjp = jax.vjp(lambda e: nnx.merge(emb_g, e)(tokens_M), emb_s)

    stage_fn = _stage_fn(model, pieces, graphdefs, n_moe)

    def loss_fn(head, y_BLD, targets_BL):
        embed = nnx.merge(emb_g, head["embed"]) if tied else None
        return token_cross_entropy(nnx.merge(head_g, head["head"])(y_BLD, embed), {"targets": targets_BL})

    head_params = {"head": head_s, "embed": emb_s if tied else None}
    layout = _executor_layout(states, runs, pieces, head_params, mesh_shape, v)
    values, (d_stages, d_head, d_x_M) = pipeline_value_and_grad(
        stage_fn,
        loss_fn,
        stages,
        head_params,
        x_M,
        targets_M,
        schedule=kind,
        virtual_stages=v,
        context_M=context_M,
        has_aux=bool(n_moe),
        **layout,
    )
    (d_embed,) = embed_vjp(d_x_M)
    if tied:  # the table is both the input embedding and the output projection
        d_embed = jax.tree.map(jnp.add, d_embed, d_head["embed"])
    (d_runs,) = stages_vjp(d_stages)
    grads = _params_tree(params, d_embed, d_head["head"], d_runs)
    if not n_moe:
        return values, {"loss": values}, grads
    ce, stage_loss, stats = values
    return ce + stage_loss, {"loss": ce, **_routing_metrics(stats, v)}, grads


def _stage_fn(model, pieces, graphdefs: dict[bool, nnx.GraphDef], n_moe: int) -> Callable:
    """What one stage runs on its chunk of layers: (chunk, x, context) -> x, or, with MoE layers,
    (x, (the stage's share of the auxiliary loss, its routing statistics))."""
    remat, coefficients = model.remat, model.aux_coefficients()

    def stage_fn(chunk, x_BLD, context=None):
        positions = None if context is None else context["positions"]
        stats = []
        for p in pieces:
            if not p.moe:
                x_BLD = apply_layers(graphdefs[False], chunk[p.name], x_BLD, positions, remat, first_layer=None)
                continue
            x_BLD, layer_stats = model._moe_layers(graphdefs[True], chunk[p.name], x_BLD, positions, None, None, None)
            stats.append(layer_stats)
        if not n_moe:
            return x_BLD
        stats = jax.tree.map(lambda *xs: jnp.concatenate(xs), *stats)  # (MoE layers of the chunk, ...)
        # The model's auxiliary terms are averaged over all its MoE layers: each stage adds its share.
        stage_loss = sum(c * stats[k].sum() for k, c in coefficients.items()) / n_moe
        return x_BLD, (jnp.asarray(stage_loss, jnp.float32), stats)

    return stage_fn


def _executor_layout(states, runs, pieces, head_params, mesh_shape: dict[str, int], v: int) -> dict:
    """The weights' layout under the rules being traced with: the executor keeps its float32
    accumulators split like them, and sums gradients over the data axes once, after the schedule."""
    rules, layout = current_rules(), {}
    if rules is None:
        return layout
    layout = dict(
        stage_specs={p.name: stage_specs(states[_run_at(runs, p.start).name], rules, "stage", v) for p in pieces},
        head_specs=head_specs(head_params, rules),
    )
    layout["data_axes"] = data_axes(rules, mesh_shape, tuple(layout.values()))
    # Context parallelism: each stage holds its share of every row's tokens (ring attention).
    layout["seq_axes"] = split_axes("act_seq", rules, mesh_shape)
    return layout


def _params_tree(params, d_embed, d_head, d_runs):
    """The pieces' gradients reassembled into the parameters' own tree (same Variables, same
    metadata); the routers' biases are not trained, their gradients (zero) are dropped."""
    grads = jax.tree.map(jnp.zeros_like, params)
    nnx.replace_by_pure_dict(
        grads,
        {
            "embed": nnx.to_pure_dict(d_embed),
            "head": nnx.to_pure_dict(d_head),
            **{k: nnx.to_pure_dict(d.filter(nnx.Param)) for k, d in d_runs.items()},
        },
    )
    return grads


def _run_at(runs: tuple[LayerRun, ...], layer: int) -> LayerRun:
    """The model run holding `layer` (a chunk's run lies inside one; its Variables give its layout)."""
    return next(r for r in runs if r.start <= layer < r.start + r.count)


def _routing_metrics(stats_stages: dict[str, jax.Array], virtual_stages: int) -> dict[str, jax.Array]:
    """The executor's per-stage statistics ((P, M, n, ...), or (P, v, M, n, ...) with chunks
    [s, c] = chunk c*P + s) as the model reports them, averaged over the microbatches as
    gradient accumulation averages a step's metrics."""
    from meshwork.models.moe import routing_summary

    def model_order(a):
        if virtual_stages == 1:  # (P, M, n, ...) -> (M, P*n, ...)
            a = a.swapaxes(0, 1)
            return a.reshape(a.shape[0], a.shape[1] * a.shape[2], *a.shape[3:])
        a = jnp.moveaxis(a, 2, 0).swapaxes(1, 2)  # (P, v, M, n, ...) -> (M, v, P, n, ...)
        return a.reshape(a.shape[0], a.shape[1] * a.shape[2] * a.shape[3], *a.shape[4:])

    per_mb = jax.vmap(routing_summary)(jax.tree.map(model_order, stats_stages))
    return jax.tree.map(lambda m: m.mean(axis=0), per_mb)
