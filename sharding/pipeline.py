"""Pipeline parallelism over the mesh axis `stage`: schedules and an executor.

The model is cut into P stages that run the same `stage_fn` on their own
slice of the stage parameters (leaves with a leading axis of size P, sharded
over `stage`). The batch is cut into M microbatches. A *schedule table* says,
for every time step and every stage, whether that stage runs the forward of
microbatch m, the backward of microbatch m, or nothing. The executor walks the
table in a `lax.scan` inside `jax.shard_map`; after every step each stage
hands its forward output to the next stage and its input cotangent to the
previous one with `lax.ppermute`.

Two schedules, with the same bubble (P-1)/(M+P-1) when a forward and a
backward each take one time step:

- `gpipe`: all M forwards, then all M backwards; every stage keeps M stage
  inputs for its backward.
- `1f1b` (PipeDream-Flush): stage s runs P-1-s warm-up forwards, then
  alternates one forward and one backward, then drains the backwards; a stage
  keeps at most P stage inputs, whatever M.

A backward recomputes its stage's forward from the stashed stage input
(`jax.vjp` of `stage_fn`): only stage inputs are kept, never the activations
inside a stage.

    >>> table = schedule_table("1f1b", n_stages=4, n_microbatches=8)
    >>> table.op.shape, idle_fraction(table) == 3 / 11, stash_size(table)
    ((22, 4), True, 4)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

IDLE, FWD, BWD = 0, 1, 2
SCHEDULES = ("gpipe", "1f1b")


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """A static pipeline schedule: what every stage does at every time step.

    `op[t, s]` is IDLE, FWD or BWD; `mb[t, s]` is the microbatch it works on
    (-1 when idle). Both are numpy int32 arrays of shape (T, P).
    """

    kind: str
    n_stages: int
    n_microbatches: int
    op: np.ndarray
    mb: np.ndarray

    @property
    def n_steps(self) -> int:
        return self.op.shape[0]

    def __str__(self) -> str:
        cell = lambda o, m: ("." if o == IDLE else "FB"[o - 1] + str(m)).rjust(3)  # noqa: E731
        rows = [" ".join(cell(o, m) for o, m in zip(self.op[:, s], self.mb[:, s])) for s in range(self.n_stages)]
        return "\n".join(f"stage {s}: {r}" for s, r in enumerate(rows))


def _stage_order(kind: str, stage: int, n_stages: int, n_microbatches: int) -> list[tuple[int, int]]:
    """The order in which one stage runs its 2M operations."""
    M = n_microbatches
    if kind == "gpipe":
        return [(FWD, m) for m in range(M)] + [(BWD, m) for m in range(M)]
    # 1F1B: enough warm-up forwards that the first backward reaches this stage
    # just as its last warm-up forward is done; after that each backward frees
    # the stash slot the next forward takes, so at most P inputs are live.
    warm = min(n_stages - 1 - stage, M)
    order = [(FWD, m) for m in range(warm)]
    for i in range(M - warm):
        order += [(FWD, warm + i), (BWD, i)]
    return order + [(BWD, m) for m in range(M - warm, M)]


def schedule_table(kind: str, n_stages: int, n_microbatches: int) -> Schedule:
    """Builds the `gpipe` or `1f1b` table for P stages and M microbatches.

    Every stage runs its operations in the schedule's order, each as early as
    its inputs allow: the forward of m on stage s needs stage s-1's forward of
    m from an earlier step; the backward needs this stage's forward of m and
    stage s+1's backward of m (the loss, on the last stage).

    >>> print(schedule_table("gpipe", 2, 2))
    stage 0:  F0  F1   .   .  B0  B1
    stage 1:   .  F0  F1  B0  B1   .
    """
    if kind not in SCHEDULES:
        raise ValueError(f"pipeline schedule {kind!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError(f"pipeline needs n_stages >= 1 and n_microbatches >= 1, got {n_stages} and {n_microbatches}")
    P, M = n_stages, n_microbatches
    orders = [_stage_order(kind, s, P, M) for s in range(P)]
    done: dict[tuple[int, int, int], int] = {}  # (op, stage, microbatch) -> step
    nxt = [0] * P
    ops, mbs = [], []
    t = 0
    while any(n < 2 * M for n in nxt):
        if t > 4 * (M + P):
            raise RuntimeError(f"pipeline schedule {kind!r} deadlocked for P={P}, M={M}")
        op_row, mb_row = [IDLE] * P, [-1] * P
        for s in range(P):
            if nxt[s] == 2 * M:
                continue
            op, m = orders[s][nxt[s]]
            if op == FWD:
                ready = s == 0 or done.get((FWD, s - 1, m), t) < t
            else:
                ready = done.get((FWD, s, m), t) < t and (s == P - 1 or done.get((BWD, s + 1, m), t) < t)
            if ready:
                op_row[s], mb_row[s] = op, m
        for s in range(P):  # record after the row: a result is usable from the next step on
            if op_row[s] != IDLE:
                done[(op_row[s], s, mb_row[s])] = t
                nxt[s] += 1
        ops.append(op_row)
        mbs.append(mb_row)
        t += 1
    return Schedule(kind, P, M, np.asarray(ops, np.int32), np.asarray(mbs, np.int32))


def idle_fraction(table: Schedule) -> float:
    """The share of (time step, stage) cells in which a stage does nothing.

    >>> idle_fraction(schedule_table("gpipe", n_stages=4, n_microbatches=4)) == 3 / 7
    True
    """
    return float(np.mean(table.op == IDLE))


def _op_times(table: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """Step of every forward and backward, as (P, M) arrays (-1 if missing)."""
    t_fwd = np.full((table.n_stages, table.n_microbatches), -1)
    t_bwd = np.full_like(t_fwd, -1)
    for t, s in zip(*np.nonzero(table.op != IDLE)):
        (t_fwd if table.op[t, s] == FWD else t_bwd)[s, table.mb[t, s]] = t
    return t_fwd, t_bwd


def check_schedule(table: Schedule) -> None:
    """Raises ValueError unless `table` is a schedule the executor can run.

    Every stage runs exactly one forward and one backward of each microbatch;
    a forward comes after the previous stage's forward of that microbatch, a
    backward after this stage's forward and the next stage's backward.

    >>> check_schedule(schedule_table("1f1b", 4, 8))
    """
    P, M = table.n_stages, table.n_microbatches
    if table.op.shape != table.mb.shape or table.op.ndim != 2 or table.op.shape[1] != P:
        raise ValueError(f"schedule: op {table.op.shape} and mb {table.mb.shape} must both be (steps, {P})")
    if not np.isin(table.op, (IDLE, FWD, BWD)).all():
        raise ValueError("schedule: op holds values other than IDLE, FWD, BWD")
    busy = table.op != IDLE
    if ((table.mb[busy] < 0) | (table.mb[busy] >= M)).any():
        raise ValueError(f"schedule: a busy cell names a microbatch outside [0, {M})")
    for code, name in ((FWD, "forward"), (BWD, "backward")):
        for s in range(P):
            count = np.bincount(table.mb[:, s][table.op[:, s] == code], minlength=M)
            if (count != 1).any():
                m = int(np.argmax(count != 1))
                raise ValueError(f"schedule: stage {s} runs the {name} of microbatch {m} {count[m]} times, not once")
    t_fwd, t_bwd = _op_times(table)
    for s in range(P):
        for m in range(M):
            if s > 0 and t_fwd[s, m] <= t_fwd[s - 1, m]:
                raise ValueError(f"schedule: forward of microbatch {m} on stage {s} runs before stage {s - 1}'s")
            if t_bwd[s, m] <= t_fwd[s, m]:
                raise ValueError(f"schedule: backward of microbatch {m} on stage {s} runs before its forward")
            if s < P - 1 and t_bwd[s, m] <= t_bwd[s + 1, m]:
                raise ValueError(f"schedule: backward of microbatch {m} on stage {s} runs before stage {s + 1}'s")


def _slots_needed(write: np.ndarray, read: np.ndarray) -> int:
    """Fewest ring-buffer slots (slot = m % n) such that no live entry is overwritten.

    Entry (s, m) is written at step write[s, m] (at the end of that step, or
    in a forward step, never in its own read step) and last read at step
    read[s, m]; the write of a later entry may share the step of the read.
    """
    M = write.shape[1]
    for n in range(1, M + 1):
        if all(write[s, m2] >= read[s, m1] or write[s, m1] >= read[s, m2]
               for s in range(write.shape[0]) for m1 in range(M) for m2 in range(m1 + n, M, n)):
            return n
    return M


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Per (step, stage) buffer slots derived from a table; -1 = nothing."""

    n_stash: int  # slots for stage inputs
    n_grad: int  # slots for cotangents received from the next stage
    slot: np.ndarray  # stash slot of this step's microbatch
    gslot: np.ndarray  # cotangent slot read by this step's backward
    recv_x: np.ndarray  # stash slot the activation arriving after this step goes to
    recv_g: np.ndarray  # cotangent slot the cotangent arriving after this step goes to


def _plan(table: Schedule) -> _Plan:
    P = table.n_stages
    t_fwd, t_bwd = _op_times(table)
    # A stage input lands when the previous stage's forward sends it (stage 0
    # reads it from x_M in its own forward) and is last used by the backward.
    x_written = np.concatenate([t_fwd[:1], t_fwd[:-1]])
    n_stash = _slots_needed(x_written, t_bwd)
    n_grad = _slots_needed(t_bwd[1:], t_bwd[:-1]) if P > 1 else 1
    busy = table.op != IDLE
    slot = np.where(busy, table.mb % n_stash, -1)
    gslot = np.where(table.op == BWD, table.mb % n_grad, -1)
    recv_x = np.full_like(table.op, -1)
    recv_g = np.full_like(table.op, -1)
    recv_x[:, 1:] = np.where(table.op[:, :-1] == FWD, table.mb[:, :-1] % n_stash, -1)
    recv_g[:, :-1] = np.where(table.op[:, 1:] == BWD, table.mb[:, 1:] % n_grad, -1)
    return _Plan(n_stash, n_grad, slot, gslot, recv_x, recv_g)


def stash_size(table: Schedule) -> int:
    """How many stage inputs each stage keeps for its backward under `table`.

    >>> stash_size(schedule_table("gpipe", 4, 8)), stash_size(schedule_table("1f1b", 4, 8))
    (8, 4)
    """
    return _plan(table).n_stash


def _set(buf: jax.Array, i: jax.Array, value: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(buf, value.astype(buf.dtype), i, 0)


def _get(buf: jax.Array, i: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)


def _inner_specs(specs: Any, params: Any, axis_name: str, what: str, *, leading: bool) -> Any:
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
            raise ValueError(f"pipeline: {what} entry {spec} must start with {axis_name!r}, "
                             "the axis the stages live on")
        rest = tuple(spec)[1:] if leading else tuple(spec)
        if any(axis_name in ((a,) if isinstance(a, str) else tuple(a or ())) for a in rest):
            raise ValueError(f"pipeline: {what} entry {spec} uses {axis_name!r} beyond the leading stage dimension")
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
) -> tuple[jax.Array, tuple[Any, Any, jax.Array]]:
    """Mean microbatch loss of a pipelined model, and its gradients.

    The model is `loss_fn(head_params, stage_fn(p[P-1], ... stage_fn(p[0],
    x_M[m])), targets_M[m])` averaged over the M microbatches, where p[s] is
    the s-th slice of every `stage_params` leaf. Call it inside `jax.jit`.

    Args:
      stage_fn: (one stage's params, x) -> y of x's shape and dtype.
      loss_fn: (head_params, y, one microbatch's targets) -> scalar; runs on
        the last stage.
      stage_params: pytree, leaves (P, ...) with P = mesh.shape[axis_name];
        their leading axis is (or becomes) sharded over `axis_name`.
      head_params: pytree, replicated over `axis_name`.
      x_M: (M, ...) activations entering stage 0, replicated over
        `axis_name`; other mesh axes may shard the inner dimensions.
      targets_M: pytree with leaves (M, ...), replicated over `axis_name`.
      schedule: "gpipe", "1f1b" or a `Schedule` for (P, M).
      mesh: defaults to the mesh set with `jax.set_mesh`.
      stage_specs, head_specs: optional pytrees of PartitionSpecs, the mesh
        shardings of `stage_params` (leading entry `axis_name`) and
        `head_params`. The float32 gradient accumulators, carried through
        the whole schedule, are kept sharded the same way over the other
        axes (e.g. `fsdp`); without them the compiler is free to replicate
        the accumulators there, and does.

    Returns:
      (loss, (d_stage_params, d_head_params, d_x_M)): gradients of the mean
      loss with the shapes of the inputs; d_stage_params stays sharded over
      `axis_name`, the others are replicated over it. Only `axis_name` is
      manual inside: the other mesh axes stay with the compiler (GSPMD), so
      a microbatch's batch dimension may be sharded over `data`.

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
    table = schedule_table(schedule, P, M) if isinstance(schedule, str) else schedule
    if (table.n_stages, table.n_microbatches) != (P, M):
        raise ValueError(f"pipeline: schedule is for P={table.n_stages}, M={table.n_microbatches} but the mesh "
                         f"has {axis_name}={P} and x_M has {M} microbatches; "
                         f"build it with schedule_table(kind, {P}, {M})")
    check_schedule(table)
    for path, leaf in jax.tree_util.tree_leaves_with_path(stage_params):
        if leaf.ndim == 0 or leaf.shape[0] != P:
            raise ValueError(f"pipeline: stage_params{jax.tree_util.keystr(path)} has shape {leaf.shape}; every "
                             f"leaf needs a leading axis of size {axis_name}={P}, "
                             "e.g. blocks reshaped to (P, L/P, ...)")
    one_stage = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stage_params)
    x_in = jax.ShapeDtypeStruct(x_M.shape[1:], x_M.dtype)
    y_out = jax.eval_shape(stage_fn, one_stage, x_in)
    if (getattr(y_out, "shape", None), getattr(y_out, "dtype", None)) != (x_in.shape, x_in.dtype):
        raise ValueError(f"pipeline: stage_fn maps {x_in.dtype}{list(x_in.shape)} to {y_out}; a stage must return "
                         "an array of its input's shape and dtype (cast its output, e.g. y.astype(x.dtype))")
    inner_stage_specs = _inner_specs(stage_specs, stage_params, axis_name, "stage_specs", leading=True)
    inner_head_specs = _inner_specs(head_specs, head_params, axis_name, "head_specs", leading=False)
    plan = _plan(table)
    # Per-step columns of the plan; each stage picks its own entry by axis_index.
    steps = {k: jnp.asarray(v) for k, v in dict(op=table.op, mb=table.mb, slot=plan.slot, gslot=plan.gslot,
                                                recv_x=plan.recv_x, recv_g=plan.recv_g).items()}
    to_next = [(s, s + 1) for s in range(P - 1)]
    to_prev = [(s + 1, s) for s in range(P - 1)]
    inv_M = 1.0 / M

    def per_stage(stage_params, head_params, x_M, targets_M):
        stage = jax.lax.axis_index(axis_name)
        first, last = stage == 0, stage == P - 1
        params = jax.tree.map(lambda a: a[0], stage_params)
        # Carried values differ between stages: declare them varying over the
        # stage axis up front so the scan carry keeps one type. The head too:
        # a vjp w.r.t. a replicated input would psum its cotangent over the
        # stages, a collective that only the last stage would reach.
        vary = functools.partial(jax.lax.pcast, axis_name=(axis_name,), to="varying")
        head_params = jax.tree.map(vary, head_params)
        zeros_x = lambda n: vary(jnp.zeros((n, *x_M.shape[1:]), x_M.dtype))  # noqa: E731
        f32_zeros = lambda tree: jax.tree.map(lambda a: vary(jnp.zeros(a.shape, jnp.float32)), tree)  # noqa: E731
        pin_params = functools.partial(_constrain, specs=inner_stage_specs)
        pin_head = functools.partial(_constrain, specs=inner_head_specs)
        carry = dict(stash=zeros_x(plan.n_stash), grad_in=zeros_x(plan.n_grad), dx=zeros_x(M),
                     d_params=pin_params(f32_zeros(params)), d_head=pin_head(f32_zeros(head_params)),
                     loss=vary(jnp.zeros((), jnp.float32)))
        no_send = vary(jnp.zeros(x_M.shape[1:], x_M.dtype))

        def idle(c, m, slot, gslot):
            return c, no_send, no_send

        def forward(c, m, slot, gslot):
            return c, stage_fn(params, _get(c["stash"], slot)), no_send

        def backward(c, m, slot, gslot):
            _, vjp = jax.vjp(stage_fn, params, _get(c["stash"], slot))
            d_params, dx = vjp(_get(c["grad_in"], gslot))
            return _accumulate(c, m, dx, d_params), no_send, dx

        def forward_last(c, m, slot, gslot):
            # The last stage's forward only stashes (done before the switch):
            # its backward reruns stage and loss under jax.vjp anyway.
            return c, no_send, no_send

        def backward_last(c, m, slot, gslot):
            target = jax.tree.map(lambda a: _get(a, m), targets_M)
            loss, vjp = jax.vjp(lambda p, h, x: loss_fn(h, stage_fn(p, x), target),
                                params, head_params, _get(c["stash"], slot))
            d_params, d_head, dx = vjp(vary(jnp.asarray(inv_M, loss.dtype)))
            c = _accumulate(c, m, dx, d_params)
            c["d_head"] = pin_head(jax.tree.map(lambda a, g: a + g.astype(jnp.float32), c["d_head"], d_head))
            c["loss"] = c["loss"] + loss.astype(jnp.float32)
            return c, no_send, dx

        def _accumulate(c, m, dx, d_params):
            c = dict(c)
            c["d_params"] = pin_params(jax.tree.map(lambda a, g: a + g.astype(jnp.float32), c["d_params"], d_params))
            c["dx"] = _set(c["dx"], m, dx)  # kept only on stage 0, see below
            return c

        branches = [idle, forward, backward, forward_last, backward_last]

        def step(c, row):
            op, m, slot, gslot, recv_x, recv_g = (row[k][stage] for k in
                                                  ("op", "mb", "slot", "gslot", "recv_x", "recv_g"))
            m, slot, gslot = (jnp.maximum(i, 0) for i in (m, slot, gslot))  # idle cells hold -1
            # Stage 0's input comes from x_M; stash it where later stages'
            # inputs arrive, so forward and backward read one buffer.
            take_x = (op == FWD) & first
            c = dict(c, stash=_set(c["stash"], slot, jnp.where(take_x, _get(x_M, m), _get(c["stash"], slot))))
            branch = jnp.where(op == IDLE, 0, op + 2 * last.astype(op.dtype))
            c, y, dx = jax.lax.switch(branch, branches, c, m, slot, gslot)
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
        loss = jax.lax.psum(c["loss"], axis_name) * inv_M
        d_head = pin_head(jax.tree.map(lambda g, p: jax.lax.psum(g, axis_name).astype(p.dtype),
                                       c["d_head"], head_params))
        d_x = jax.lax.psum(jnp.where(first, c["dx"], 0), axis_name)
        d_params = pin_params(jax.tree.map(lambda g, p: g.astype(p.dtype), c["d_params"], params))
        d_params = jax.tree.map(lambda g: g[None], d_params)
        return loss, d_params, d_head, d_x

    stage_spec = PartitionSpec(axis_name)
    loss, d_params, d_head, d_x = jax.shard_map(
        per_stage, mesh=mesh, axis_names={axis_name},
        in_specs=(stage_spec, PartitionSpec(), PartitionSpec(), PartitionSpec()),
        out_specs=(PartitionSpec(), stage_spec, PartitionSpec(), PartitionSpec()),
    )(stage_params, head_params, x_M, targets_M)
    return loss, (d_params, d_head, d_x)
