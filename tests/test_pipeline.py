"""Pipeline parallelism: the schedules are valid and as idle as theory says,
and the pipelined loss and gradients equal plain sequential application."""

import doctest
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import meshwork.sharding.pipeline
import meshwork.sharding.pipeline_schedules
from meshwork.sharding.mesh import make_mesh
from meshwork.sharding.pipeline import pipeline_value_and_grad
from meshwork.sharding.pipeline_schedules import (
    BWD,
    FWD,
    IDLE,
    SCHEDULES,
    Schedule,
    check_schedule,
    cotangent_stash_size,
    idle_fraction,
    schedule_table,
    stash_size,
)

P, M = 4, 8
FUSED = ("gpipe", "1f1b")  # the schedules whose backward is one BWD op
B, L, D, H = 4, 32, 64, 32  # activations (B, L, D): a stash slot is 32 KiB, the weights 16 KiB a stage


def stage_fn(w, x_BLD):
    """A residual MLP: the stage's params are one (D, H) and one (H, D) matrix."""
    return x_BLD + jnp.tanh(x_BLD @ w["w1"]) @ w["w2"]


def loss_fn(head, y_BLD, t_BL):
    return jnp.mean((y_BLD @ head["w"] - t_BL[..., None]) ** 2)


def reference_loss(stage_params, head, x_M, targets_M):
    """No pipeline: every microbatch through the P stages in turn, mean loss."""

    def one(x, t):
        for s in range(P):
            x = stage_fn(jax.tree.map(lambda a: a[s], stage_params), x)
        return loss_fn(head, x, t)

    return jnp.mean(jax.vmap(one)(x_M, targets_M))


@pytest.fixture(scope="module")
def problem():
    k = jax.random.split(jax.random.key(0), 5)
    stage_params = {
        "w1": jax.random.normal(k[0], (P, D, H)) / np.sqrt(D),
        "w2": jax.random.normal(k[1], (P, H, D)) / np.sqrt(H),
    }
    head = {"w": jax.random.normal(k[2], (D, 1)) / np.sqrt(D)}
    x_M = jax.random.normal(k[3], (M, B, L, D))
    targets_M = jax.random.normal(k[4], (M, B, L))
    return stage_params, head, x_M, targets_M


@pytest.fixture(scope="module")
def reference(problem):
    loss, grads = jax.jit(jax.value_and_grad(reference_loss, argnums=(0, 1, 2)))(*problem)
    return jax.device_get((loss, grads))


@pytest.fixture(scope="module")
def stage_mesh():
    return make_mesh({"stage": P}, devices=jax.devices()[:P])


def pipelined(schedule, mesh, problem):
    """The jitted pipeline on `mesh`, the stage params placed over `stage`."""
    stage_params, head, x_M, targets_M = problem
    stage_params = jax.device_put(stage_params, NamedSharding(mesh, PartitionSpec("stage")))
    args = (stage_params, head, x_M, targets_M)
    f = jax.jit(functools.partial(pipeline_value_and_grad, stage_fn, loss_fn, schedule=schedule, mesh=mesh))
    return f, args


@pytest.fixture(scope="module")
def compiled(stage_mesh, problem):
    """One compile per schedule, shared by the equality and memory tests."""
    out = {}
    for kind in (*FUSED, "zb-h1"):
        f, args = pipelined(kind, stage_mesh, problem)
        out[kind] = (f.lower(*args).compile(), args)
    return out


def assert_matches(got, want):
    loss, grads = got
    np.testing.assert_allclose(loss, want[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("kind", [*FUSED, "zb-h1"])
def test_pipeline_equals_sequential(compiled, reference, kind):
    exe, args = compiled[kind]
    loss, (d_stage, d_head, d_x) = exe(*args)
    # Stage grads stay on their stages: each of the 4 devices holds one slice.
    assert d_stage["w1"].sharding.spec == PartitionSpec("stage")
    assert {s.data.shape for s in d_stage["w1"].addressable_shards} == {(1, D, H)}
    assert_matches(jax.device_get((loss, (d_stage, d_head, d_x))), reference)


@pytest.mark.parametrize("kind", [*FUSED, "zb-h1"])
def test_pipeline_equals_sequential_single_microbatch(stage_mesh, problem, kind):
    one = tuple(jax.tree.map(lambda a: a[:1], problem[2:]))
    problem_1 = (*problem[:2], *one)
    want = jax.device_get(jax.jit(jax.value_and_grad(reference_loss, argnums=(0, 1, 2)))(*problem_1))
    f, args = pipelined(kind, stage_mesh, problem_1)
    assert_matches(jax.device_get(f(*args)), want)


def test_hybrid_stage_by_data(problem, reference):
    """stage=4 x data=2: `stage` is manual, `data` is left to GSPMD and splits
    every microbatch's batch dimension."""
    mesh = make_mesh({"stage": P, "data": 2})
    stage_params, head, x_M, targets_M = problem
    x_M = jax.device_put(x_M, NamedSharding(mesh, PartitionSpec(None, "data")))
    targets_M = jax.device_put(targets_M, NamedSharding(mesh, PartitionSpec(None, "data")))
    f, args = pipelined("1f1b", mesh, (stage_params, head, x_M, targets_M))
    exe = f.lower(*args).compile()
    loss, (d_stage, d_head, d_x) = exe(*args)
    assert_matches(jax.device_get((loss, (d_stage, d_head, d_x))), reference)
    # The data axis really split the work: each device's stash and input
    # cotangent hold half of the batch.
    assert {s.data.shape for s in d_x.addressable_shards} == {(M, B // 2, L, D)}
    hlo = exe.as_text()
    assert f"f32[{stash_size(schedule_table('1f1b', P, M))},{B // 2},{L},{D}]" in hlo


def test_hybrid_stage_by_fsdp_keeps_gradients_sharded(problem, reference):
    """stage=4 x fsdp=2: weights and batch split over fsdp inside each stage;
    with the param specs given, the gradients come back split the same way."""
    mesh = make_mesh({"stage": P, "fsdp": 2})
    stage_params, head, x_M, targets_M = problem
    stage_specs = {"w1": PartitionSpec("stage", "fsdp"), "w2": PartitionSpec("stage", None, "fsdp")}
    head_specs = {"w": PartitionSpec("fsdp")}
    stage_params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), stage_params, stage_specs)
    head = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), head, head_specs)
    x_M, targets_M = (jax.device_put(a, NamedSharding(mesh, PartitionSpec(None, "fsdp"))) for a in (x_M, targets_M))
    f = jax.jit(
        functools.partial(
            pipeline_value_and_grad,
            stage_fn,
            loss_fn,
            schedule="gpipe",
            mesh=mesh,
            stage_specs=stage_specs,
            head_specs=head_specs,
        )
    )
    loss, (d_stage, d_head, d_x) = f(stage_params, head, x_M, targets_M)
    assert_matches(jax.device_get((loss, (d_stage, d_head, d_x))), reference)
    assert {s.data.shape for s in d_stage["w1"].addressable_shards} == {(1, D // 2, H)}
    assert {s.data.shape for s in d_stage["w2"].addressable_shards} == {(1, H, D // 2)}
    assert {s.data.shape for s in d_head["w"].addressable_shards} == {(D // 2, 1)}


@pytest.mark.parametrize("kind", FUSED)
@pytest.mark.parametrize("n_micro", [1, 4, 8])
def test_schedule_is_valid_and_idles_as_theory_says(kind, n_micro):
    table = schedule_table(kind, P, n_micro)
    check_schedule(table)
    # Check the same rules again by hand, independent of check_schedule.
    t_of = {}
    for t, s in zip(*np.nonzero(table.op != IDLE)):
        key = (int(table.op[t, s]), int(s), int(table.mb[t, s]))
        assert key not in t_of, f"{key} scheduled twice"
        t_of[key] = t
    assert len(t_of) == 2 * P * n_micro
    for s in range(P):
        for m in range(n_micro):
            assert t_of[(FWD, s, m)] < t_of[(BWD, s, m)]
            if s > 0:
                assert t_of[(FWD, s - 1, m)] < t_of[(FWD, s, m)]
            if s < P - 1:
                assert t_of[(BWD, s + 1, m)] < t_of[(BWD, s, m)]
    assert idle_fraction(table) == pytest.approx((P - 1) / (n_micro + P - 1), abs=1e-12)
    # GPipe keeps every microbatch's stage input; 1F1B at most P of them.
    assert stash_size(table) == (n_micro if kind == "gpipe" else min(P, n_micro))


def test_1f1b_interleaves_after_warmup():
    op = schedule_table("1f1b", P, M).op
    for s in range(P):
        busy = "".join("FB"[o - 1] for o in op[:, s] if o != IDLE)
        warm = P - 1 - s
        assert busy == "F" * warm + "FB" * (M - warm) + "B" * warm


def test_check_schedule_rejects_broken_tables():
    good = schedule_table("gpipe", 2, 2)
    swapped = good.op.copy()
    swapped[[0, -2], 0] = swapped[[-2, 0], 0]  # stage 0's B0 before F0
    with pytest.raises(ValueError, match="before its forward"):
        check_schedule(Schedule("x", 2, 2, swapped, good.mb))
    dropped = good.op.copy()
    dropped[1, 0] = IDLE
    with pytest.raises(ValueError, match="0 times"):
        check_schedule(Schedule("x", 2, 2, dropped, good.mb))
    with pytest.raises(ValueError, match="unknown"):
        schedule_table("zb", 2, 2)


def test_wrong_schedule_shape_is_explained(stage_mesh, problem):
    f, args = pipelined(schedule_table("1f1b", P, M + 1), stage_mesh, problem)
    with pytest.raises(ValueError, match=r"schedule_table\(kind, 4, 8\)"):
        f(*args)


def test_stage_fn_must_keep_shape_and_dtype(stage_mesh, problem):
    widen = lambda w, x: stage_fn(w, x).astype(jnp.float16)  # noqa: E731
    with pytest.raises(ValueError, match="input's shape and dtype"):
        jax.eval_shape(functools.partial(pipeline_value_and_grad, widen, loss_fn, mesh=stage_mesh), *problem)


def test_1f1b_needs_less_temp_memory_than_gpipe(compiled):
    temp = {k: exe.memory_analysis().temp_size_in_bytes for k, (exe, _) in compiled.items()}
    slot = B * L * D * 4
    saved = (stash_size(schedule_table("gpipe", P, M)) - stash_size(schedule_table("1f1b", P, M))) * slot
    # 1F1B keeps 4 stage inputs instead of 8; nearly all of that shows up.
    assert temp["1f1b"] < temp["gpipe"]
    assert temp["gpipe"] - temp["1f1b"] >= 0.75 * saved, temp


def test_zb_h1_needs_1f1b_memory_plus_waiting_cotangents(compiled):
    """ZB-H1 stashes as many stage inputs as 1F1B; its deferred W's also keep
    their output cotangents (P-1 here instead of 1F1B's 1)."""
    temp = {k: exe.memory_analysis().temp_size_in_bytes for k, (exe, _) in compiled.items()}
    slot = B * L * D * 4
    zb, one = schedule_table("zb-h1", P, M), schedule_table("1f1b", P, M)
    assert stash_size(zb) == stash_size(one)
    extra = cotangent_stash_size(zb) - cotangent_stash_size(one)
    # Measured: exactly one more slot-sized temporary besides, and 64 bytes.
    assert temp["zb-h1"] - temp["1f1b"] <= (extra + 1) * slot + 4096, (temp, extra)
    assert temp["zb-h1"] < temp["gpipe"]


def test_docstring_examples():
    assert doctest.testmod(meshwork.sharding.pipeline, optionflags=doctest.ELLIPSIS).failed == 0
    assert doctest.testmod(meshwork.sharding.pipeline_schedules, optionflags=doctest.ELLIPSIS).failed == 0


# ---- every schedule, data axes manual, a tied embedding ------------------------------------------
# An 8-layer residual MLP between a tied embedding E (K, D): x = u @ E in front of the pipeline,
# logits y @ E.T on the last stage, so E's gradient is the head's plus the input cotangent's.
V_LAYERS, K, D8, H8, B8, L8 = 2 * P, 16, 32, 16, 4, 8
VIRTUAL = {"interleaved": 2}  # chunks per stage; the others run 2 layers per stage


def layer_fn(w, x_BLD):
    return x_BLD + jnp.tanh(x_BLD @ w["w1"]) @ w["w2"]


def tied_loss_fn(head, y_BLD, t_BLK):
    return jnp.mean((y_BLD @ head["E"].T - t_BLK) ** 2)


def tied_reference(layers, E, u_M, t_M):
    def one(u, t):
        x = u @ E
        for i in range(V_LAYERS):
            x = layer_fn(jax.tree.map(lambda a, i=i: a[i], layers), x)
        return tied_loss_fn({"E": E}, x, t)

    return jnp.mean(jax.vmap(one)(u_M, t_M))


def tied_pipelined(kind, mesh, data_axes, layers, E, u_M, t_M):
    """The same loss through the pipeline: layers laid out (P, 2, ...) either way, stage s holding
    layers 2s and 2s+1 (v = 1) or chunks s and s+P (interleaved, v = 2)."""
    v = VIRTUAL.get(kind, 1)
    x_M, embed_vjp = jax.vjp(lambda e: u_M @ e, E)
    if v == 1:
        stages = jax.tree.map(lambda a: a.reshape(P, 2, *a.shape[1:]), layers)

        def stage_fn_(w, x):
            return layer_fn(
                jax.tree.map(lambda a: a[1], w),  # noqa: E731
                layer_fn(jax.tree.map(lambda a: a[0], w), x),
            )
    else:
        stages = jax.tree.map(lambda a: a.reshape(v, P, *a.shape[1:]).swapaxes(0, 1), layers)
        stage_fn_ = layer_fn
    loss, (d_stages, d_head, d_x) = pipeline_value_and_grad(
        stage_fn_,
        tied_loss_fn,
        stages,
        {"E": E},
        x_M,
        t_M,
        schedule=kind,
        virtual_stages=v,
        mesh=mesh,
        data_axes=data_axes,
    )
    (d_E,) = embed_vjp(d_x)
    if v == 1:
        d_layers = jax.tree.map(lambda g: g.reshape(V_LAYERS, *g.shape[2:]), d_stages)
    else:
        d_layers = jax.tree.map(lambda g: g.swapaxes(0, 1).reshape(V_LAYERS, *g.shape[2:]), d_stages)
    return loss, (d_layers, d_E + d_head["E"])


@pytest.fixture(scope="module")
def tied_problem():
    k = jax.random.split(jax.random.key(1), 5)
    layers = {
        "w1": jax.random.normal(k[0], (V_LAYERS, D8, H8)) / np.sqrt(D8),
        "w2": jax.random.normal(k[1], (V_LAYERS, H8, D8)) / np.sqrt(H8),
    }
    E = jax.random.normal(k[2], (K, D8)) / np.sqrt(K)
    u_M = jax.random.normal(k[3], (M, B8, L8, K))
    t_M = jax.random.normal(k[4], (M, B8, L8, K))
    want = jax.device_get(jax.jit(jax.value_and_grad(tied_reference, argnums=(0, 1)))(layers, E, u_M, t_M))
    return (layers, E, u_M, t_M), want


def assert_close(got, want, rtol=1e-5):
    np.testing.assert_allclose(got[0], want[0], rtol=rtol)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max())


def _run_tied(kind, data_axes, tied_problem):
    (layers, E, u_M, t_M), want = tied_problem
    mesh = make_mesh({"stage": P, "data": 2})
    u_M, t_M = (jax.device_put(a, NamedSharding(mesh, PartitionSpec(None, "data"))) for a in (u_M, t_M))
    f = jax.jit(functools.partial(tied_pipelined, kind, mesh, data_axes))
    assert_close(jax.device_get(f(layers, E, u_M, t_M)), want)


@pytest.mark.parametrize("kind", SCHEDULES)
def test_every_schedule_equals_unpipelined_stage_by_data(kind, tied_problem):
    """stage=4 x data=2, `data` manual too: loss and every gradient (the tied
    embedding's included) equal the unpipelined model's."""
    _run_tied(kind, ("data",), tied_problem)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["interleaved", "zb-h1"])
def test_new_schedules_equal_unpipelined_with_data_left_to_gspmd(kind, tied_problem):
    _run_tied(kind, (), tied_problem)


def _all_reduces(hlo: str) -> tuple[int, int]:
    """(all-reduce ops, arrays they reduce) in optimized HLO text: the combiner tuples arrays up."""
    ops = re.findall(r" all-reduce(?:-start)?\(([^)]*)\)", hlo)
    return len(ops), sum(args.count("%") for args in ops)


def _all_reduces_in_loops(hlo: str) -> int:
    """All-reduce ops in the while loops' bodies (and what they call): run every step."""
    comps, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?%?([\w.-]+) .*\{$", line)
        if head and not line.startswith(" "):
            name = head.group(1)
            comps[name] = []
        elif name is not None:
            comps[name].append(line)
    calls = {
        n: set(
            re.findall(
                r"%([\w.-]+)",
                " ".join(
                    re.findall(
                        r"(?:body|branch_computations|calls|to_apply|true_computation|false_computation)=(\{[^}]*\}|%[\w.-]+)",
                        "\n".join(body),
                    )
                ),
            )
        )
        for n, body in comps.items()
    }
    todo = {b for body in comps.values() for b in re.findall(r"body=%([\w.-]+)", "\n".join(body))}
    seen = set()
    while todo:
        n = todo.pop()
        if n in comps and n not in seen:
            seen.add(n)
            todo |= calls[n]
    return sum(len(re.findall(r" all-reduce(?:-start)?\(", "\n".join(comps[n]))) for n in seen)


def test_data_axes_reduce_gradients_once():
    """stage=2 x data=2, 1F1B: with `data` left to GSPMD, the compiler all-reduces the
    gradients over `data` inside the scan's backward steps; with data_axes=("data",) the
    program all-reduces each gradient leaf (and the loss) once, after the schedule."""
    mesh = make_mesh({"stage": 2, "data": 2}, devices=jax.devices()[:4])
    k = jax.random.split(jax.random.key(2), 5)
    stage_params = jax.device_put(
        {"w1": jax.random.normal(k[0], (2, 16, 8)), "w2": jax.random.normal(k[1], (2, 8, 16))},
        NamedSharding(mesh, PartitionSpec("stage")),
    )
    head = {"w": jax.random.normal(k[2], (16, 1))}
    x_M, t_M = (
        jax.device_put(jax.random.normal(kk, shape), NamedSharding(mesh, PartitionSpec(None, "data")))
        for kk, shape in ((k[3], (4, 4, 8, 16)), (k[4], (4, 4, 8)))
    )
    args = (stage_params, head, x_M, t_M)
    counts, outs = {}, {}
    for data_axes in ((), ("data",)):
        f = jax.jit(
            functools.partial(
                pipeline_value_and_grad, stage_fn, loss_fn, schedule="1f1b", mesh=mesh, data_axes=data_axes
            )
        )
        exe = f.lower(*args).compile()
        counts[data_axes] = (*_all_reduces(exe.as_text()), _all_reduces_in_loops(exe.as_text()))
        outs[data_axes] = jax.device_get(exe(*args))
    n_grads = len(jax.tree.leaves((stage_params, head, x_M)))  # w1, w2, the head, x_M
    assert counts[("data",)][0] <= counts[("data",)][1] <= n_grads + 1, counts
    assert counts[()][1] > n_grads + 1 and counts[()][0] > counts[("data",)][0], counts
    assert counts[()][2] > 0 and counts[("data",)][2] == 0, counts  # none left inside the scan
    assert_close(outs[("data",)], (outs[()][0], outs[()][1]))


def test_data_axes_refuse_params_sharded_over_them(problem):
    mesh = make_mesh({"stage": P, "data": 2})
    specs = {"w1": PartitionSpec("stage", "data"), "w2": PartitionSpec("stage")}
    with pytest.raises(ValueError, match="one of data_axes"):
        jax.eval_shape(
            functools.partial(
                pipeline_value_and_grad, stage_fn, loss_fn, mesh=mesh, stage_specs=specs, data_axes=("data",)
            ),
            *problem,
        )


def test_interleaved_wants_chunked_params(stage_mesh, problem):
    with pytest.raises(ValueError, match=r"leading axes \(4, 2\).*swapaxes"):
        jax.eval_shape(
            functools.partial(
                pipeline_value_and_grad, stage_fn, loss_fn, mesh=stage_mesh, schedule="interleaved", virtual_stages=2
            ),
            *problem,
        )
