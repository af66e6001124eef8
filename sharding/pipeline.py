"""Pipeline parallelism over the mesh axis `stage`: the executor of a schedule table.

The model is cut into P stages that run the same `stage_fn` on their own
slice of the stage parameters (leaves with a leading axis of size P, sharded
over `stage`). The batch is cut into M microbatches. A *schedule table* says,
for every time step and every stage, which operation that stage runs on which
microbatch (and, for interleaved schedules, which of its model chunks). The
executor walks the table in a `lax.scan` inside `jax.shard_map`; after every
step each stage hands its forward output to the next stage and its input
cotangent to the previous one with `lax.ppermute`.

Every backward recomputes its stage's forward from the stashed stage input
(`jax.vjp` of `stage_fn`): only stage inputs (and, for zb-h1, the deferred
W's output cotangents) are kept, never the activations inside a stage. B and
W each recompute the forward (B: `vjp` w.r.t. the input only; W: w.r.t. the
weights only), so zb-h1 runs one forward more per microbatch and stage
than 1F1B (three instead of two).

Data parallelism: by default only `stage` is manual inside the executor and
the compiler (GSPMD) splits each microbatch's rows over the data axes, which
makes it all-reduce the weight gradients over them inside every backward step
of the scan. With `data_axes=("data",)` those axes are manual too: each
device accumulates the float32 gradients of its own rows through the whole
schedule and the executor all-reduces each gradient leaf (and the loss) once,
after it. The params must be replicated over `data_axes` (an fsdp axis that
splits them stays with the compiler: leave it out).

Parameter layout: for `virtual_stages=1` every `stage_params` leaf is
(P, ...), slice s being stage s. For `virtual_stages=v > 1` it is
(P, v, ...), `[s, c]` being model chunk c*P + s: blocks stacked (L, ...) in
model order become `a.reshape(v, P, L // (v*P), ...).swapaxes(0, 1)`.

The tables (gpipe, 1f1b, interleaved, zb-h1), their idle fractions and stash sizes are in
`sharding/pipeline_schedules.py`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from meshwork.sharding.pipeline_schedules import FWD, IDLE, Schedule, buffer_plan, check_schedule, schedule_table
from meshwork.sharding.shard_map_util import vary_over


def _set(buf: jax.Array, i: jax.Array, value: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(buf, value.astype(buf.dtype), i, 0)


def _get(buf: jax.Array, i: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)


def _inner_specs(
    specs: Any, params: Any, axis_name: str, what: str, *, leading: bool, manual: tuple[str, ...] = ()
) -> Any:
    """PartitionSpecs over the non-pipeline axes, as seen inside the shard_map (None: no constraint)."""
    if specs is None:
        return None
    is_spec = lambda s: isinstance(s, PartitionSpec)  # noqa: E731
    flat, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    if treedef != jax.tree.structure(params) or not all(map(is_spec, flat)):
        raise ValueError(f"pipeline: {what} must be a PartitionSpec per leaf of the params, with their tree structure")
    inner = []
    for spec in flat:
        if leading and (len(spec) == 0 or spec[0] not in (axis_name, (axis_name,))):
            raise ValueError(
                f"pipeline: {what} entry {spec} must start with {axis_name!r}, the axis the stages live on"
            )
        rest = tuple(spec)[1:] if leading else tuple(spec)
        if any(axis_name in ((a,) if isinstance(a, str) else tuple(a or ())) for a in rest):
            raise ValueError(f"pipeline: {what} entry {spec} uses {axis_name!r} beyond the leading stage dimension")
        for a in manual:
            if any(a in ((b,) if isinstance(b, str) else tuple(b or ())) for b in rest):
                raise ValueError(
                    f"pipeline: {what} entry {spec} shards over {a!r}, one of data_axes; params "
                    f"sharded over a data axis keep it with the compiler: leave {a!r} out of data_axes"
                )
        inner.append(PartitionSpec(*rest))
    return jax.tree.unflatten(treedef, inner)


def _constrain(tree: Any, specs: Any) -> Any:
    if specs is None:
        return tree
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, specs)


def pipeline_value_and_grad(
    stage_fn: Callable[[Any, jax.Array], jax.Array],
    loss_fn: Callable[[Any, jax.Array, Any], jax.Array],
    stage_params: Any,
    head_params: Any,
    x_M: jax.Array,
    targets_M: Any,
    *,
    schedule: str | Schedule = "1f1b",
    mesh: Mesh | None = None,
    axis_name: str = "stage",
    stage_specs: Any = None,
    head_specs: Any = None,
    virtual_stages: int = 1,
    data_axes: tuple[str, ...] = (),
    seq_axes: tuple[str, ...] = (),
    context_M: Any = None,
    has_aux: bool = False,
) -> tuple[Any, tuple[Any, Any, jax.Array]]:
    """Mean microbatch loss of a pipelined model, and its gradients.

    The model is `loss_fn(head_params, stage_fn(p[V-1], ... stage_fn(p[0],
    x_M[m])), targets_M[m])` averaged over the M microbatches, where p[k] is
    the k-th model chunk of the stage parameters (V = P * virtual_stages; with
    one chunk per stage, the k-th slice of every leaf). Call it inside
    `jax.jit`.

    Args:
      stage_fn: (one chunk's params, x) -> y of x's shape and dtype.
      loss_fn: (head_params, y, one microbatch's targets) -> scalar, the mean
        over the microbatch's rows; runs on the last stage.
      stage_params: pytree, leaves (P, ...) with P = mesh.shape[axis_name], or
        (P, v, ...) with `[s, c]` model chunk c*P + s when the schedule has
        v = virtual_stages > 1; their leading axis is (or becomes) sharded
        over `axis_name`.
      head_params: pytree, replicated over `axis_name`.
      x_M: (M, ...) activations entering stage 0, replicated over
        `axis_name`; other mesh axes may shard the inner dimensions.
      targets_M: pytree with leaves (M, ...), replicated over `axis_name`.
      schedule: one of SCHEDULES or a `Schedule` for (P, M).
      mesh: defaults to the mesh set with `jax.set_mesh`.
      stage_specs, head_specs: optional pytrees of PartitionSpecs, the mesh
        shardings of `stage_params` (leading entry `axis_name`) and
        `head_params`. The float32 gradient accumulators, carried through
        the whole schedule, are kept sharded the same way over the other
        axes (e.g. `fsdp`); without them the compiler is free to replicate
        the accumulators there, and does.
      virtual_stages: model chunks per stage for `schedule="interleaved"`.
      context_M: optional pytree of leaves (M, ...) split like x_M (e.g. the
        tokens' positions): stage_fn is then called as stage_fn(params, x,
        context_m) with microbatch m's slice.
      has_aux: stage_fn returns (y, (stage_loss, stats)): a scalar that
        joins the objective (e.g. a MoE layer's load-balancing loss; the mean
        of the loss_fn's loss is the objective's other part) and a pytree of
        arrays recorded per microbatch without gradient (routing statistics).
      data_axes: mesh axes that split dimension 1 of x_M and of every
        targets_M leaf (a microbatch's rows) and over which the params are
        replicated. They become manual inside the pipeline too: every stage
        accumulates the gradients of its own rows in float32 and the
        gradients are summed over `data_axes` once, after the schedule (one
        all-reduce per gradient leaf), instead of the compiler's all-reduce
        in every backward step. Params sharded over one of them (fsdp on the
        data axis) are refused: leave that axis out (today's path).
      seq_axes: mesh axes that split dimension 2 of x_M and of every
        targets_M and context_M leaf (a row's tokens: context parallelism),
        manual inside the pipeline as data_axes are, so the stages see their
        tokens only (attention over the whole row is then the stage's own
        business: ring attention over these axes). loss_fn and the stage
        losses must be means over the local tokens, equal shards.

    Returns:
      (loss, (d_stage_params, d_head_params, d_x_M)): gradients of the mean
      loss with the shapes of the inputs; with has_aux the first entry is
      (loss, stage_loss, stats): loss_fn's mean, the stage losses' (summed
      over stages, averaged over microbatches; the gradients are those of
      loss + stage_loss) and each stage's stats with leading axes (P, M)
      ((P, v, M) with chunks, [s, c] being chunk c*P + s); d_stage_params stays sharded over
      `axis_name`, the others are replicated over it (d_x_M keeps the
      `data_axes` split). Axes other than `axis_name` and `data_axes` stay
      with the compiler (GSPMD).

    >>> mesh = jax.make_mesh((1,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> stage_fn = lambda w, x: jnp.tanh(x @ w)
    >>> loss_fn = lambda h, y, t: jnp.mean((y @ h - t) ** 2)
    >>> w, h = jnp.ones((1, 3, 3)) / 3, jnp.ones((3, 1))
    >>> x_M, t_M = jnp.ones((2, 5, 3)), jnp.zeros((2, 5, 1))
    >>> f = jax.jit(functools.partial(pipeline_value_and_grad, stage_fn, loss_fn, schedule="gpipe", mesh=mesh))
    >>> loss, (dw, dh, dx_M) = f(w, h, x_M, t_M)
    >>> dw.shape, dh.shape, dx_M.shape
    ((1, 3, 3), (3, 1), (2, 5, 3))
    """
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if mesh.empty or axis_name not in mesh.shape:
        raise ValueError(f"pipeline: no mesh axis {axis_name!r}; pass mesh= or call inside jax.set_mesh(mesh)")
    P, M = mesh.shape[axis_name], x_M.shape[0]
    table = schedule_table(schedule, P, M, virtual_stages) if isinstance(schedule, str) else schedule
    if virtual_stages not in (1, table.virtual_stages):
        raise ValueError(
            f"pipeline: virtual_stages={virtual_stages} but the schedule has "
            f"{table.virtual_stages}; pass one or the other"
        )
    if (table.n_stages, table.n_microbatches) != (P, M):
        raise ValueError(
            f"pipeline: schedule is for P={table.n_stages}, M={table.n_microbatches} but the mesh "
            f"has {axis_name}={P} and x_M has {M} microbatches; "
            f"build it with schedule_table(kind, {P}, {M})"
        )
    check_schedule(table)
    v = table.virtual_stages
    lead = (P,) if v == 1 else (P, v)
    for path, leaf in jax.tree_util.tree_leaves_with_path(stage_params):
        if leaf.shape[: len(lead)] != lead:
            layout = (
                "e.g. blocks reshaped to (P, L/P, ...)"
                if v == 1
                else "chunk c*P+s at [s, c], e.g. blocks (L, ...) reshaped to (v, P, L/(v*P), ...) then swapaxes(0, 1)"
            )
            raise ValueError(
                f"pipeline: stage_params{jax.tree_util.keystr(path)} has shape {leaf.shape}; every "
                f"leaf needs leading axes {lead} ({axis_name}={P}, virtual_stages={v}), {layout}"
            )
    data_axes, seq_axes = tuple(data_axes), tuple(seq_axes)
    for a in (*data_axes, *seq_axes):
        if a not in mesh.shape or a == axis_name:
            raise ValueError(
                f"pipeline: data_axes/seq_axes entry {a!r} is not a mesh axis other than {axis_name!r}; "
                f"the mesh has {tuple(mesh.shape)}"
            )
    n_data = math.prod(mesh.shape[a] for a in data_axes)
    n_seq = math.prod(mesh.shape[a] for a in seq_axes)
    split = (*data_axes, *seq_axes)  # manual axes besides the stages: each holds a share of the tokens
    one_stage = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[len(lead) :], a.dtype), stage_params)
    x_in = jax.ShapeDtypeStruct(x_M.shape[1:], x_M.dtype)
    context_in = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), context_M)
    y_out = jax.eval_shape(stage_fn, one_stage, x_in, *(() if context_M is None else (context_in,)))
    if has_aux:
        if not (
            isinstance(y_out, tuple)
            and len(y_out) == 2
            and isinstance(y_out[1], tuple)
            and len(y_out[1]) == 2
            and getattr(y_out[1][0], "shape", None) == ()
        ):
            raise ValueError(
                f"pipeline: has_aux=True needs stage_fn to return (y, (stage_loss, stats)) with a "
                f"scalar stage_loss; it returns {y_out}"
            )
        y_out = y_out[0]
    if (getattr(y_out, "shape", None), getattr(y_out, "dtype", None)) != (x_in.shape, x_in.dtype):
        raise ValueError(
            f"pipeline: stage_fn maps {x_in.dtype}{list(x_in.shape)} to {y_out}; a stage must return "
            "an array of its input's shape and dtype (cast its output, e.g. y.astype(x.dtype))"
        )
    for path, leaf in jax.tree_util.tree_leaves_with_path(context_M):
        if leaf.shape[:2] != x_M.shape[:2]:
            raise ValueError(
                f"pipeline: context_M{jax.tree_util.keystr(path)} has shape {leaf.shape}; every leaf "
                f"needs the leading (microbatch, row) axes {x_M.shape[:2]} of x_M"
            )
    if data_axes and (x_M.ndim < 2 or x_M.shape[1] % n_data):
        raise ValueError(
            f"pipeline: x_M {x_M.shape} needs a dimension 1 divisible by {n_data}, the size of data_axes={data_axes}"
        )
    if seq_axes and (x_M.ndim < 3 or x_M.shape[2] % n_seq):
        raise ValueError(
            f"pipeline: x_M {x_M.shape} needs a dimension 2 divisible by {n_seq}, the size of seq_axes={seq_axes}"
        )
    inner_stage_specs = _inner_specs(stage_specs, stage_params, axis_name, "stage_specs", leading=True, manual=split)
    inner_head_specs = _inner_specs(head_specs, head_params, axis_name, "head_specs", leading=False, manual=split)
    plan = buffer_plan(table)
    # Per-step columns of the plan; each stage picks its own entry by axis_index.
    steps = {
        k: jnp.asarray(v)
        for k, v in dict(
            op=table.op,
            mb=table.mb,
            chunk=table.chunk,
            slot=plan.slot,
            gslot=plan.gslot,
            recv_x=plan.recv_x,
            recv_g=plan.recv_g,
        ).items()
    }
    # With chunks, device P-1 feeds device 0 (and back): a ring.
    to_next = [(s, (s + 1) % P) for s in range(P if v > 1 else P - 1)]
    to_prev = [((s + 1) % P, s) for s in range(P if v > 1 else P - 1)]
    manual = (axis_name, *split)
    # The loss is the mean over microbatches and over the shards' rows and tokens.
    n_shards = n_data * n_seq
    loss_ct = 1.0 / (M * n_shards)

    def per_stage(stage_params, head_params, x_M, targets_M, context_M):
        stage = jax.lax.axis_index(axis_name)
        first, last_stage = stage == 0, stage == P - 1
        params = jax.tree.map(lambda a: a[0], stage_params)
        # Carried values differ between stages (and data shards): declare them
        # varying up front so the scan carry keeps one type. The params and
        # head too: a vjp w.r.t. a replicated input would psum its cotangent
        # over the replicas in every step, a collective that, over the
        # stages, only the last one would reach.
        vary = functools.partial(vary_over, axes=manual)
        head_params = jax.tree.map(vary, head_params)
        if split:
            params = jax.tree.map(functools.partial(jax.lax.pcast, axis_name=split, to="varying"), params)
        zeros_x = lambda n: vary(jnp.zeros((n, *x_M.shape[1:]), x_M.dtype))  # noqa: E731
        f32_zeros = lambda tree: jax.tree.map(lambda a: vary(jnp.zeros(a.shape, jnp.float32)), tree)  # noqa: E731
        pin_params = functools.partial(_constrain, specs=inner_stage_specs)
        pin_head = functools.partial(_constrain, specs=inner_head_specs)

        def chunk_params(ch):
            return params if v == 1 else jax.tree.map(lambda a: _get(a, ch), params)

        def run(p, x, m):
            """The stage on microbatch m: (y, stage_loss, stats), the last two zero without has_aux."""
            out = stage_fn(p, x) if context_M is None else stage_fn(p, x, jax.tree.map(lambda a: _get(a, m), context_M))
            y, (stage_loss, stats) = out if has_aux else (out, (jnp.zeros((), jnp.float32), ()))
            # Varying like the cotangent it gets: its gradient then reaches every data shard's
            # copy once (a stage loss computed from whole-batch means is the same on each).
            return y, (vary(stage_loss.astype(jnp.float32)), stats)

        stats_shape = jax.eval_shape(lambda: run(chunk_params(0), vary(x_M[0]), 0)[1][1])
        per_mb = (M,) if v == 1 else (v, M)
        carry = dict(
            stash=zeros_x(plan.n_stash),
            grad_in=zeros_x(plan.n_grad),
            dx=zeros_x(M),
            d_params=pin_params(f32_zeros(params)),
            d_head=pin_head(f32_zeros(head_params)),
            loss=vary(jnp.zeros((), jnp.float32)),
            stage_loss=vary(jnp.zeros((), jnp.float32)),
            stats=jax.tree.map(lambda a: vary(jnp.zeros((*per_mb, *a.shape), a.dtype)), stats_shape),
        )
        no_send = vary(jnp.zeros(x_M.shape[1:], x_M.dtype))
        ones = lambda: vary(jnp.asarray(loss_ct, jnp.float32))  # noqa: E731  (d objective / d each loss)

        def add_params(c, ch, d_params):
            def add(acc, g):
                if v == 1:
                    return acc + g.astype(jnp.float32)
                return _set(acc, ch, _get(acc, ch) + g.astype(jnp.float32))

            return dict(c, d_params=pin_params(jax.tree.map(add, c["d_params"], d_params)))

        def add_head(c, loss, d_head):
            c = dict(c, loss=c["loss"] + loss.astype(jnp.float32))
            c["d_head"] = pin_head(jax.tree.map(lambda a, g: a + g.astype(jnp.float32), c["d_head"], d_head))
            return c

        def record(c, m, ch, aux):
            """A microbatch's stage loss and statistics, kept by the step that computes its input
            gradient (once per microbatch and chunk, whatever the schedule)."""
            stage_loss, stats = aux

            def put(buf, a):
                if v == 1:
                    return _set(buf, m, a)
                return _set(buf, ch, _set(_get(buf, ch), m, a))

            return dict(c, stage_loss=c["stage_loss"] + stage_loss, stats=jax.tree.map(put, c["stats"], stats))

        def set_dx(c, m, dx):
            # Kept only on stage 0, see below. With chunks, stage 0's chunk 0
            # backward of m comes after its other chunks' and overwrites them.
            return dict(c, dx=_set(c["dx"], m, dx))

        def target(m):
            return jax.tree.map(lambda a: _get(a, m), targets_M)

        def idle(c, m, ch, slot, gslot):
            return c, no_send, no_send

        def forward(c, m, ch, slot, gslot):
            return c, run(chunk_params(ch), _get(c["stash"], slot), m)[0], no_send

        # A stage's backward: the vjp of (y, stage_loss) w.r.t. the params and/or the input, fed
        # the next stage's input gradient and d objective / d stage_loss.
        def backward(c, m, ch, slot, gslot):
            (_, _), vjp, aux = jax.vjp(
                lambda p, x: _split(run(p, x, m)), chunk_params(ch), _get(c["stash"], slot), has_aux=True
            )
            d_params, dx = vjp((_get(c["grad_in"], gslot), ones()))
            return set_dx(record(add_params(c, ch, d_params), m, ch, aux), m, dx), no_send, dx

        def backward_input(c, m, ch, slot, gslot):
            p = chunk_params(ch)
            (_, _), vjp, aux = jax.vjp(lambda x: _split(run(p, x, m)), _get(c["stash"], slot), has_aux=True)
            (dx,) = vjp((_get(c["grad_in"], gslot), ones()))
            return set_dx(record(c, m, ch, aux), m, dx), no_send, dx

        def backward_weight(c, m, ch, slot, gslot):
            x = _get(c["stash"], slot)
            (_, _), vjp, _ = jax.vjp(lambda p: _split(run(p, x, m)), chunk_params(ch), has_aux=True)
            (d_params,) = vjp((_get(c["grad_in"], gslot), ones()))
            return add_params(c, ch, d_params), no_send, no_send

        def forward_last(c, m, ch, slot, gslot):
            # The last stage's forward only stashes (done before the switch):
            # its backward reruns stage and loss under jax.vjp anyway.
            return c, no_send, no_send

        def last(p, h, x, m):
            """The last chunk and the loss: ((loss_fn's loss, stage loss), stats)."""
            y, (stage_loss, stats) = run(p, x, m)
            return (loss_fn(h, y, target(m)).astype(jnp.float32), stage_loss), (stage_loss, stats)

        def backward_last(c, m, ch, slot, gslot):
            (loss, _), vjp, aux = jax.vjp(
                lambda p, h, x: last(p, h, x, m), chunk_params(ch), head_params, _get(c["stash"], slot), has_aux=True
            )
            d_params, d_head, dx = vjp((ones(), ones()))
            c = record(add_head(add_params(c, ch, d_params), loss, d_head), m, ch, aux)
            return set_dx(c, m, dx), no_send, dx

        def backward_input_last(c, m, ch, slot, gslot):
            p = chunk_params(ch)
            (loss, _), vjp, aux = jax.vjp(
                lambda h, x: last(p, h, x, m), head_params, _get(c["stash"], slot), has_aux=True
            )
            d_head, dx = vjp((ones(), ones()))
            return set_dx(record(add_head(c, loss, d_head), m, ch, aux), m, dx), no_send, dx

        def backward_weight_last(c, m, ch, slot, gslot):
            x = _get(c["stash"], slot)
            _, vjp, _ = jax.vjp(lambda p: last(p, head_params, x, m), chunk_params(ch), has_aux=True)
            (d_params,) = vjp((ones(), ones()))
            return add_params(c, ch, d_params), no_send, no_send

        # Indexed by op, plus 4 on the last virtual stage (stage P-1, chunk v-1).
        branches = [
            idle,
            forward,
            backward,
            backward_input,
            backward_weight,
            forward_last,
            backward_last,
            backward_input_last,
            backward_weight_last,
        ]

        def step(c, row):
            op, m, ch, slot, gslot, recv_x, recv_g = (
                row[k][stage] for k in ("op", "mb", "chunk", "slot", "gslot", "recv_x", "recv_g")
            )
            m, ch, slot, gslot = (jnp.maximum(i, 0) for i in (m, ch, slot, gslot))  # idle cells hold -1
            # Virtual stage 0's input comes from x_M; stash it where later
            # stages' inputs arrive, so forward and backward read one buffer.
            take_x = (op == FWD) & first & (ch == 0)
            c = dict(c, stash=_set(c["stash"], slot, jnp.where(take_x, _get(x_M, m), _get(c["stash"], slot))))
            last = last_stage & (ch == v - 1)
            branch = jnp.where(op == IDLE, 0, op + 4 * last.astype(op.dtype))
            c, y, dx = jax.lax.switch(branch, branches, c, m, ch, slot, gslot)
            # Every stage sends every step (zeros when it has nothing) so that
            # the collectives line up; the receiver knows from the table
            # whether the message is real and which slot it fills.
            y_in = jax.lax.ppermute(y, axis_name, to_next)
            dy_in = jax.lax.ppermute(dx, axis_name, to_prev)
            for buf, msg, at in (("stash", y_in, recv_x), ("grad_in", dy_in, recv_g)):
                i = jnp.maximum(at, 0)
                c[buf] = _set(c[buf], i, jnp.where(at >= 0, msg, _get(c[buf], i)))
            return c, None

        c, _ = jax.lax.scan(step, carry, steps)
        # The only reductions over the data axes: once per gradient leaf, after the schedule.
        loss = jax.lax.psum(c["loss"], manual) / (M * n_shards)
        stage_loss = jax.lax.psum(c["stage_loss"], manual) / (M * n_shards)
        # Statistics are the whole microbatch's on every data shard already (or averaged here).
        stats = jax.tree.map(lambda a: (jax.lax.pmean(a, split) if split else a)[None], c["stats"])
        d_head = pin_head(jax.tree.map(lambda g, p: jax.lax.psum(g, manual).astype(p.dtype), c["d_head"], head_params))
        d_x = jax.lax.psum(jnp.where(first, c["dx"], 0), axis_name)
        d_params = c["d_params"]
        if split:
            d_params = jax.tree.map(lambda g: jax.lax.psum(g, split), d_params)
        d_params = pin_params(jax.tree.map(lambda g, p: g.astype(p.dtype), d_params, params))
        d_params = jax.tree.map(lambda g: g[None], d_params)
        return (loss, stage_loss, stats), d_params, d_head, d_x

    stage_spec = PartitionSpec(axis_name)
    entry = lambda axes: None if not axes else axes[0] if len(axes) == 1 else axes  # noqa: E731
    rows_spec = PartitionSpec(*[None, entry(data_axes), entry(seq_axes)][: 3 if seq_axes else 2 if data_axes else 0])
    values, d_params, d_head, d_x = jax.shard_map(
        per_stage,
        mesh=mesh,
        axis_names=set(manual),
        in_specs=(stage_spec, PartitionSpec(), rows_spec, rows_spec, rows_spec),
        out_specs=((PartitionSpec(), PartitionSpec(), stage_spec), stage_spec, PartitionSpec(), rows_spec),
    )(stage_params, head_params, x_M, targets_M, context_M)
    return (values if has_aux else values[0]), (d_params, d_head, d_x)


def _split(out):
    """run's (y, (stage_loss, stats)) as jax.vjp(has_aux=True) takes it: the differentiated
    (y, stage_loss), and (stage_loss, stats) as the aux to record."""
    y, aux = out
    return (y, aux[0]), aux
