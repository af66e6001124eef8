"""Pipeline parallelism: the schedules are valid and as idle as theory says,
and the pipelined loss and gradients equal plain sequential application."""

import doctest
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import meshwork.sharding.pipeline
from meshwork.sharding.mesh import make_mesh
from meshwork.sharding.pipeline import (BWD, FWD, IDLE, SCHEDULES, Schedule, check_schedule, idle_fraction,
                               pipeline_value_and_grad, schedule_table, stash_size)

P, M = 4, 8
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
    stage_params = {"w1": jax.random.normal(k[0], (P, D, H)) / np.sqrt(D),
                    "w2": jax.random.normal(k[1], (P, H, D)) / np.sqrt(H)}
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
    for kind in SCHEDULES:
        f, args = pipelined(kind, stage_mesh, problem)
        out[kind] = (f.lower(*args).compile(), args)
    return out


def assert_matches(got, want):
    loss, grads = got
    np.testing.assert_allclose(loss, want[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("kind", SCHEDULES)
def test_pipeline_equals_sequential(compiled, reference, kind):
    exe, args = compiled[kind]
    loss, (d_stage, d_head, d_x) = exe(*args)
    # Stage grads stay on their stages: each of the 4 devices holds one slice.
    assert d_stage["w1"].sharding.spec == PartitionSpec("stage")
    assert {s.data.shape for s in d_stage["w1"].addressable_shards} == {(1, D, H)}
    assert_matches(jax.device_get((loss, (d_stage, d_head, d_x))), reference)


@pytest.mark.parametrize("kind", SCHEDULES)
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
    f = jax.jit(functools.partial(pipeline_value_and_grad, stage_fn, loss_fn, schedule="gpipe", mesh=mesh,
                                  stage_specs=stage_specs, head_specs=head_specs))
    loss, (d_stage, d_head, d_x) = f(stage_params, head, x_M, targets_M)
    assert_matches(jax.device_get((loss, (d_stage, d_head, d_x))), reference)
    assert {s.data.shape for s in d_stage["w1"].addressable_shards} == {(1, D // 2, H)}
    assert {s.data.shape for s in d_stage["w2"].addressable_shards} == {(1, H, D // 2)}
    assert {s.data.shape for s in d_head["w"].addressable_shards} == {(D // 2, 1)}


@pytest.mark.parametrize("kind", SCHEDULES)
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


def test_docstring_examples():
    assert doctest.testmod(meshwork.sharding.pipeline, optionflags=doctest.ELLIPSIS).failed == 0
