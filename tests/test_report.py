"""The report's claims, read from compiled programs on 8 fake CPU devices.

What the collectives of each preset should be (Megatron for tp/sp, ZeRO for
dp/zero/fsdp) and what each device should hold, checked against what XLA
actually compiled, with the byte counts of `sharding/report.py`.
"""

import functools
import json

import jax
import jax.numpy as jnp
import pytest
from conftest import ROOT, tiny_overrides
from flax import nnx

from meshwork.config import load_config
from meshwork.models.layers.mlp import SwiGLU
from meshwork.partitioning import logical_specs
from meshwork.sharding.mesh import make_mesh
from meshwork.sharding.parallel import use_rules, with_logical_constraint
from meshwork.sharding.report import COLLECTIVES, compiled_report, format_report, list_collectives, state_bytes
from meshwork.sharding.rules import ROLES, rules_for, tree_shardings
from meshwork.train.optim import make_optimizer
from meshwork.train.state import abstract_state, param_count, state_shardings
from meshwork.train.trainer import build_trainer, check_runtime

N = 8
# 16 scanned layers compile as fast as 2 (one loop body) and make the layer
# stack dominate the embedding and LM head as it does in real models; at 2
# layers those two are 31% of the parameters and XLA moves neither like a
# ZeRO weight (see test_fsdp_sends_one_and_a_half_times_dp).
LAYERS = 16
MESHES = {
    "dp": dict(data=8),
    "zero1": dict(data=8),
    "zero2": dict(data=8),
    "fsdp": dict(data=1, fsdp=8),
    "hsdp": dict(data=2, fsdp=4),
}


def make_cfg(tmp_path, name):
    preset = "fsdp" if name == "hsdp" else name
    sizes = [f"mesh.{k}={v}" for k, v in MESHES[name].items()]
    return load_config(
        ROOT / "configs/lm_tiny.yaml",
        [*tiny_overrides(tmp_path), f"model.n_layers={LAYERS}", f"rules.preset={preset}", *sizes],
    )


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    """One compiled train step per layout, built on first use and shared."""
    cache = {}

    def get(name):
        if name not in cache:
            cfg = make_cfg(tmp_path_factory.mktemp(name), name)
            cache[name] = build_trainer(cfg, check_runtime(cfg)).compile()
        return cache[name]

    return get


def grad_shardings(trainer):
    return tree_shardings(logical_specs(trainer.abstract.params), trainer.mesh, trainer.rules_by_role["grads"])


def summary(collectives, in_loop=None):
    """{kind: (count, payload bytes, bytes sent)} per step; `in_loop` keeps only
    the scanned layers' collectives (True) or only the rest (False)."""
    out = {k: [0, 0, 0.0] for k in COLLECTIVES}
    for c in collectives:
        if in_loop is None or (c.multiplier == LAYERS) == in_loop:
            out[c.kind][0] += c.multiplier
            out[c.kind][1] += c.payload_bytes * c.multiplier
            out[c.kind][2] += c.sent_bytes * c.multiplier
    return out


def block_bytes(trainer):
    """fp32 bytes of the scanned layers' parameters (what ZeRO's formulas count)."""
    return 4 * sum(x.size for x in jax.tree.leaves(trainer.abstract.params["blocks"]))


# --- Megatron: one MLP block's forward --------------------------------------------


@functools.cache
def mlp_forward_collectives(preset):
    mesh = make_mesh({"data": 4, "tensor": 2})
    rules = rules_for(preset)
    act = ("act_batch", "act_norm_seq", "act_embed")
    with jax.set_mesh(mesh), use_rules(rules), nnx.logical_axis_rules(rules):
        mlp = nnx.eval_shape(
            lambda: SwiGLU(
                64, 128, init_std=0.02, out_std=0.02, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0)
            )
        )
        graphdef, params = nnx.split(mlp)

        def forward(params, x_BLD):
            y_BLD = nnx.merge(graphdef, params)(with_logical_constraint(x_BLD, act))
            return with_logical_constraint(y_BLD, act)

        compiled = (
            jax.jit(forward, in_shardings=(nnx.get_named_sharding(params, mesh), None))
            .lower(params, jax.ShapeDtypeStruct((8, 32, 64), jnp.float32))
            .compile()
        )
    return list_collectives(compiled.as_text())


def test_tp_mlp_forward_is_one_all_reduce_over_tensor():
    (c,) = mlp_forward_collectives("tp")
    assert (c.kind, c.group_size, c.matched_as) == ("all-reduce", 2, "all-reduce")
    assert c.payload_bytes == 2 * 32 * 64 * 4  # this device's (B/4, L, D) partial sums


def test_sp_mlp_forward_is_all_gather_then_reduce_scatter():
    collectives = mlp_forward_collectives("sp")
    got = sorted((c.kind, c.group_size) for c in collectives)
    assert got == [("all-gather", 2), ("reduce-scatter", 2)]
    rs = next(c for c in collectives if c.kind == "reduce-scatter")
    assert rs.matched_as == "all-reduce + dynamic-slice"  # XLA:CPU has no reduce-scatter pass


# --- ZeRO: what a train step sends --------------------------------------------------


def test_dp_all_reduces_the_gradients_and_gathers_nothing(trainers):
    t = trainers("dp")
    s = summary(list_collectives(t.step_fn.as_text()))
    four_p = 4 * param_count(t.abstract)
    assert s["all-reduce"][2] == pytest.approx(2 * (N - 1) / N * four_p, rel=0.02)
    assert s["all-gather"][0] == s["reduce-scatter"][0] == 0
    # Each layer's gradients: reduced inside the backward loop, once per layer.
    assert summary(list_collectives(t.step_fn.as_text()), in_loop=True)["all-reduce"][1] == block_bytes(t)


def test_zero2_reduce_scatters_the_gradients(trainers):
    t = trainers("zero2")
    s = summary(list_collectives(t.step_fn.as_text()))
    four_p = 4 * param_count(t.abstract)
    # All but the embedding table's gradient (2.6% of P here): XLA builds its
    # 1/N columns from an all-to-all of the lookup's activation gradients.
    assert s["reduce-scatter"][1] == pytest.approx(four_p, rel=0.05)
    assert s["all-reduce"][1] < 0.001 * four_p  # only the loss and norm scalars
    # The replicated parameters are rebuilt from the updated 1/N shards.
    assert s["all-gather"][1] == pytest.approx(four_p, rel=0.05)


def test_fsdp_gathers_weights_twice_and_reduce_scatters_gradients(trainers):
    t = trainers("fsdp")
    layers = summary(list_collectives(t.step_fn.as_text()), in_loop=True)
    # remat=none, yet every layer's weights are gathered in the forward loop and
    # again in the backward loop: inside a scan the residual is the sharded weight.
    assert layers["all-gather"][1] == pytest.approx(2 * block_bytes(t), rel=0.01)
    assert layers["reduce-scatter"][1] == block_bytes(t)
    assert layers["all-reduce"][0] == 0
    assert all(c.group_size == N for c in list_collectives(t.step_fn.as_text()) if c.kind == "reduce-scatter")


def test_hsdp_reduce_scatters_over_fsdp_then_all_reduces_over_data(trainers):
    t = trainers("hsdp")  # data=2 x fsdp=4
    layer_cs = [c for c in list_collectives(t.step_fn.as_text()) if c.multiplier == LAYERS]
    rs = [c for c in layer_cs if c.kind == "reduce-scatter"]
    ar = [c for c in layer_cs if c.kind == "all-reduce"]
    assert {c.group_size for c in rs} == {4} and {c.group_size for c in ar} == {2}
    assert sum(c.payload_bytes for c in rs) * LAYERS == block_bytes(t)
    assert sum(c.payload_bytes for c in ar) * LAYERS == block_bytes(t) // 4  # the 1/fsdp shards


def test_fsdp_sends_one_and_a_half_times_dp(trainers):
    """ZeRO-3 moves 3 Psi per step (gather forward, gather backward, reduce-scatter),
    data parallelism 2 Psi (one all-reduce = reduce-scatter + all-gather).

    Exact for the scanned layers under remat=none: the backward re-gathers
    anyway (see above), so remat=full adds only 0.1% (a few norm-scale
    gathers). The whole step is
    lower: the embedding is looked up by an all-to-all of activations and
    never gathered or reduced, and the LM head, outside the scan, is gathered
    once and kept for the backward. Measured: 1.45 at 16 layers, 1.21 at 2.
    """
    dp, fsdp = (list_collectives(trainers(n).step_fn.as_text()) for n in ("dp", "fsdp"))
    sent = lambda cs, in_loop=None: sum(v[2] for v in summary(cs, in_loop).values())  # noqa: E731
    assert sent(fsdp, True) / sent(dp, True) == pytest.approx(1.5, rel=0.01)
    assert sent(fsdp) / sent(dp) == pytest.approx(1.5, rel=0.10)


# --- ZeRO: what each device holds ---------------------------------------------------


def layout(tmp_path, name):
    """(abstract state, state shardings, grad shardings) as the Trainer builds them, uncompiled."""
    cfg = make_cfg(tmp_path, name)
    mesh = make_mesh(cfg.mesh.sizes())
    rules = {role: rules_for(cfg.rules.preset, cfg.rules.overrides, role) for role in ROLES}
    _, abstract = abstract_state(cfg, make_optimizer(cfg.optimizer, cfg.train.steps)[0])
    grads = tree_shardings(logical_specs(abstract.params), mesh, rules["grads"])
    return abstract, state_shardings(abstract, mesh, rules), grads


@pytest.mark.parametrize(
    "name, formula",
    [
        ("dp", lambda P: 16 * P),
        ("zero1", lambda P: 8 * P + 8 * P / N),
        ("zero2", lambda P: 4 * P + 12 * P / N),
        ("fsdp", lambda P: 16 * P / N),
    ],
)
def test_state_bytes_follow_zero_formulas(tmp_path, name, formula):
    abstract, shardings, grads = layout(tmp_path, name)
    got = state_bytes(abstract.parts(), shardings.parts(), grads)
    assert got["total"] == pytest.approx(formula(param_count(abstract)), rel=0.02)
    assert got["total"] == got["params"] + got["grads"] + got["opt_state"]


def test_state_bytes_read_the_trainers_shardings(trainers, tmp_path):
    t = trainers("zero2")
    got = state_bytes(t.abstract.parts(), t.shardings.parts(), grad_shardings(t))
    P = param_count(t.abstract)
    assert got["params"] == 4 * P
    assert got["grads"] == pytest.approx(4 * P / N, rel=0.01)
    abstract, shardings, grads = layout(tmp_path, "zero2")
    assert got == state_bytes(abstract.parts(), shardings.parts(), grads)


# --- the report itself ---------------------------------------------------------------


def test_report_is_json_and_prints_every_figure(trainers):
    t = trainers("fsdp")
    report = compiled_report(t.step_fn, state_bytes(t.abstract.parts(), t.shardings.parts(), grad_shardings(t)))
    assert json.loads(json.dumps(report)) == report
    assert set(report["collectives"]) == set(COLLECTIVES)
    assert report["temp_bytes"] > 0 and report["flops"] > 0
    text = format_report(report, t.cfg, t.mesh)
    for phrase in (
        "per-device params",
        "per-device grads",
        "per-device opt state",
        "per-device temp",
        "FLOPs",
        *COLLECTIVES,
    ):
        assert phrase in text, text
    assert "per-device params" not in format_report(compiled_report(t.step_fn))  # state is optional


# --- the HLO reader on hand-written programs -----------------------------------------

LOOP_HLO = """HloModule m, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%slice (p0: f32[8,4], p1: s32[]) -> f32[1,4] {
  %p0 = f32[8,4]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds = f32[1,4]{1,0} dynamic-slice(%p0, %p1, %zero), dynamic_slice_sizes={1,4}
}

%body (t: (s32[], f32[8,4], s32[])) -> (s32[], f32[8,4], s32[]) {
  %t = (s32[], f32[8,4], s32[]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %g = f32[8,4]{1,0} get-tuple-element(%t), index=1
  %off = s32[] get-tuple-element(%t), index=2
  %g16 = f32[16]{0} broadcast(%i), dimensions={}
  %ar = (f32[8,4]{1,0}, f32[16]{0}) all-reduce(%g, %g16), replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0','axis_1'}, to_apply=%add
  %a0 = f32[8,4]{1,0} get-tuple-element(%ar), index=0
  %a1 = f32[16]{0} get-tuple-element(%ar), index=1
  %kept = f32[1,4]{1,0} fusion(%a0, %off), kind=kLoop, calls=%slice
  %ag = f32[16,4]{1,0} all-gather(%g), replica_groups=[4,2]<=[8], dimensions={0}
  %cp = f32[8,4]{1,0} collective-permute(%g), source_target_pairs={{0,1},{1,0}}
  %a2a = f32[8,4]{1,0} all-to-all(%g), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  ROOT %out = (s32[], f32[8,4], s32[]) tuple(%i, %g, %off)
}

%cond (t: (s32[], f32[8,4], s32[])) -> pred[] {
  %t = (s32[], f32[8,4], s32[]) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (w: f32[8,4]) -> f32[8,4] {
  %w = f32[8,4]{1,0} parameter(0)
  %z = s32[] constant(0)
  %pid = u32[] partition-id()
  %off = s32[] convert(%pid)
  %init = (s32[], f32[8,4], s32[]) tuple(%z, %w, %off)
  %loop = (s32[], f32[8,4], s32[]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %res = f32[8,4]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_reader_on_a_hand_written_loop():
    """Three replica-group formats, a trip count, and one combined all-reduce
    whose first part is partition-sliced to 1/8 (a reduce-scatter) while its
    second is read whole (an all-reduce)."""
    got = {(c.kind, c.matched_as): c for c in list_collectives(LOOP_HLO)}
    assert {c.multiplier for c in got.values()} == {3}
    rs = got["reduce-scatter", "all-reduce + dynamic-slice"]
    assert (rs.group_size, rs.payload_bytes, rs.sent_bytes) == (8, 128, 7 / 8 * 128)
    ar = got["all-reduce", "all-reduce"]
    assert (ar.group_size, ar.payload_bytes, ar.sent_bytes) == (8, 64, 2 * 7 / 8 * 64)
    ag = got["all-gather", "all-gather"]
    assert (ag.group_size, ag.payload_bytes, ag.sent_bytes) == (2, 256, 128)  # output: 2 x 128 bytes
    assert got["collective-permute", "collective-permute"].sent_bytes == 128
    assert got["all-to-all", "all-to-all"].group_size == 4


def test_a_loop_index_slice_is_not_a_reduce_scatter():
    """The same program with the slice offset taken from the loop counter
    (as a scan's own indexing is): nothing is partition-sliced."""
    hlo = LOOP_HLO.replace("fusion(%a0, %off)", "fusion(%a0, %i)")
    kinds = sorted(c.kind for c in list_collectives(hlo))
    assert kinds == ["all-gather", "all-reduce", "all-to-all", "collective-permute"]
    (ar,) = (c for c in list_collectives(hlo) if c.kind == "all-reduce")
    assert ar.payload_bytes == 128 + 64  # both parts of the combined all-reduce, read whole
