"""Every train.remat policy computes the same loss and gradients as none; they differ only in
what the layer scan keeps for the backward pass, read from the traced program's residuals."""

import contextlib
import io
import re

import jax
import numpy as np
import pytest
from conftest import ROOT, tiny_overrides

from meshwork.config import load_config
from meshwork.models.build import build_model, split_model
from meshwork.models.transformer import REMAT_POLICIES
from meshwork.objectives.next_token import next_token_loss
from meshwork.perf import planner_remat
from meshwork.perf.planner import step_flops
from meshwork.perf.planner_layout import make_layout
from meshwork.perf.planner_memory import ITEMSIZE, kept_by_layers, layer_activation_bytes, token_shape

POLICIES = ("none", *REMAT_POLICIES)
BYTES = {"f32": 4, "bf16": 2, "s32": 4, "i32": 4, "bool": 1}


@pytest.fixture(scope="module")
def batch():
    tokens = jax.random.randint(jax.random.key(3), (4, 33), 0, 256)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def objective(tmp_path, batch, config="lm_tiny", *extra):
    cfg = load_config(ROOT / f"configs/{config}.yaml", [*tiny_overrides(tmp_path), *extra])
    graphdef, params, buffers = split_model(build_model(cfg))
    loss_fn = next_token_loss(graphdef)
    return (lambda p: loss_fn(p, buffers, batch)[0]), params


def layer_residual_bytes(f, params) -> int:
    """Bytes of what the layer scans save for the backward pass (`print_saved_residuals`'s lines
    for the outputs of `apply_layers`' and a MoE model's `_moe_layers`' scans), stacked over the
    layers."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(f, params)
    total = 0
    for line in out.getvalue().splitlines():
        if ("apply_layers" in line or "_moe_layers" in line) and (m := re.match(r"(\w+)\[([\d,]*)\]", line)):
            total += BYTES[m[1]] * int(np.prod([int(d) for d in m[2].split(",") if d]))
    return total


@pytest.fixture(scope="module")
def results(tmp_path_factory, batch):
    """policy -> (loss, grads, layer residual bytes, compiled FLOPs). One compile per policy: the
    compiled temp bytes are not asserted (XLA's scheduling of the recomputation moves the peak;
    RESULTS.md)."""
    out = {}
    for policy in POLICIES:
        f, params = objective(tmp_path_factory.mktemp(policy), batch, "lm_tiny", f"train.remat={policy}")
        compiled = jax.jit(jax.value_and_grad(f)).lower(params).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost  # a list of one dict on older jax
        loss, grads = compiled(params)
        out[policy] = (loss, grads, layer_residual_bytes(f, params), cost["flops"])
    return out


def max_rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_policy_changes_no_value_or_gradient(results, policy):
    loss, grads, *_ = results[policy]
    loss0, grads0, *_ = results["none"]
    errs = max_rel(loss, loss0), max(max_rel(a, b) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads0)))
    print(f"{policy}: loss, grads max relative difference vs none {errs}")
    assert max(errs) < 1e-6, errs


def test_policies_differ_in_what_they_save(results):
    saved = {p: r[2] for p, r in results.items()}
    print("layer residual bytes:", saved)
    assert saved["full"] < saved["save_qkv_proj"] < saved["dots_saveable"], saved
    assert saved["full"] < saved["save_out_proj"] < saved["save_qkv_and_out_proj"], saved
    assert saved["save_qkv_proj"] < saved["save_qkv_and_out_proj"] < saved["dots_with_no_batch_dims_saveable"], saved
    # Attention's batched dots (scores, probabilities x values) are what dots_saveable adds.
    assert saved["dots_with_no_batch_dims_saveable"] < saved["dots_saveable"] < saved["none"], saved


def test_named_policy_in_a_moe_model(tmp_path, batch):
    f0, params = objective(tmp_path / "none", batch, "moe_tiny")
    f1, _ = objective(tmp_path / "qkv", batch, "moe_tiny", "train.remat=save_qkv_and_out_proj")
    (l0, g0), (l1, g1) = jax.jit(jax.value_and_grad(f0))(params), jax.jit(jax.value_and_grad(f1))(params)
    errs = max_rel(l1, l0), max(max_rel(a, b) for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)))
    print(f"moe save_qkv_and_out_proj: loss, grads max relative difference vs none {errs}")
    assert max(errs) < 1e-6, errs


def planner_cfg(tmp_path, batch, config="lm_tiny", *extra):
    """A config at the test's batch, as the planner reads it."""
    B, L = batch["inputs"].shape
    return load_config(
        ROOT / f"configs/{config}.yaml",
        [*tiny_overrides(tmp_path), f"train.global_batch={B}", f"data.seq_len={L}", *extra],
    )


def test_the_planner_knows_every_policy():
    assert set(planner_remat.POLICIES) == set(POLICIES)


# Partial policies: those between none and full (offload_dots keeps its products on the host).
PARTIAL = [p for p in POLICIES if p not in ("none", "full", "offload_dots")]


def test_planner_kept_bytes_equal_the_saved_residuals(tmp_path, batch, results):
    """What the planner says each policy keeps beyond full is what jax saves: exactly. (jax also
    keeps a small per-layer tensor under every policy, so the comparison is against full.)"""
    cfg = planner_cfg(tmp_path, batch)
    ts, p = token_shape(cfg, make_layout()), ITEMSIZE[cfg.train.compute_dtype]

    def planned(policy):
        return cfg.model.n_layers * layer_activation_bytes(cfg.model, ts, p, policy)

    for policy in PARTIAL:
        measured = results[policy][2] - results["full"][2]
        print(f"{policy}: kept beyond full, planned {planned(policy) - planned('full'):.0f} B, saved {measured} B")
        assert planned(policy) - planned("full") == measured, policy


# Capacity dispatch (batched expert dots), dropless (ragged_dot) with a gated shared expert.
MOE_VARIANTS = {
    "capacity": (),
    "dropless_gated_shared": (
        "model.moe.capacity_factor=null",
        "model.moe.n_shared_experts=1",
        "model.moe.shared_expert_gate=true",
    ),
}


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_planner_kept_bytes_equal_the_saved_residuals_moe(tmp_path, batch, variant):
    """As above for a MoE model's layers (its dense first layer and its MoE layer), read from the
    traced program alone: the router's float32 logits, the shared experts' products, and under
    capacity dispatch the routed experts' gate, up and down."""
    extra = MOE_VARIANTS[variant]
    cfg = planner_cfg(tmp_path, batch, "moe_tiny", *extra)
    layout = make_layout()

    def saved(policy):
        f, params = objective(tmp_path / policy, batch, "moe_tiny", f"train.remat={policy}", *extra)
        return layer_residual_bytes(f, params)

    full = saved("full")
    for policy in PARTIAL:
        planned, measured = (
            kept_by_layers(cfg, layout, policy) - kept_by_layers(cfg, layout, "full"),
            saved(policy) - full,
        )
        print(f"{variant} {policy}: kept beyond full, planned {planned:.0f} B, saved {measured} B")
        assert planned == measured, policy


def test_planner_recompute_matches_the_compiled_flops(tmp_path, batch, results):
    """The products each policy's backward runs again, against XLA's count of the compiled
    gradient's FLOPs (its scan body counted once: one layer) over none's. XLA's count also
    holds the recomputed elementwise work, a few percent of a layer's forward; full's planned
    recompute also counts the down projection, which the backward never reads."""
    cfg = planner_cfg(tmp_path, batch)

    def planned(policy):
        return step_flops(cfg, make_layout(remat=policy))["recompute"] / cfg.model.n_layers

    layer_forward = planned("full")
    for policy in POLICIES:
        extra = results[policy][3] - results["none"][3]
        print(f"{policy}: recompute per layer planned {planned(policy):.0f}, compiled over none {extra:.0f} FLOPs")
        if policy == "full":
            assert planned(policy) > extra > 0.7 * planned(policy)
        else:
            assert planned(policy) <= extra <= planned(policy) + 0.1 * layer_forward, policy


def test_offload_dots_moves_bytes_to_the_host_not_off_the_books(tmp_path, batch):
    """offload_dots keeps on the device what full keeps; what dots_with_no_batch_dims_saveable
    would add sits on the host, and each microbatch's crosses the link out and back."""
    from meshwork.perf.planner import memory
    from meshwork.perf.planner_memory import offload_memory

    cfg = planner_cfg(tmp_path, batch)
    full, off = memory(cfg, make_layout(remat="full")), memory(cfg, make_layout(remat="offload_dots"))
    layout = make_layout()
    kept = kept_by_layers(cfg, layout, "dots_with_no_batch_dims_saveable") - kept_by_layers(cfg, layout, "full")
    assert off["total"] == pytest.approx(full["total"]) and off["host"] == pytest.approx(kept) and kept > 0
    one, two = (offload_memory(cfg, make_layout(remat="offload_dots", microbatches=mb))["transfer"] for mb in (1, 2))
    assert two == pytest.approx(one)  # half the rows per microbatch, twice the microbatches


MLA = "model.mla={q_lora_rank: 24, kv_lora_rank: 16, qk_nope_head_dim: 8, qk_rope_head_dim: 8, v_head_dim: 12}"


def test_mla_products_are_named_for_the_policies(tmp_path, batch):
    """Multi-head latent attention tags its query, latent, up-projected key/value and output products
    (models/layers/mla.py): each partial policy saves exactly what the planner says it keeps beyond
    full, and changes no value or gradient."""
    cfg = planner_cfg(tmp_path, batch, "lm_tiny", MLA)
    ts, p = token_shape(cfg, make_layout()), ITEMSIZE[cfg.train.compute_dtype]
    f, params = objective(tmp_path / "none", batch, "lm_tiny", MLA)
    loss0, grads0 = jax.jit(jax.value_and_grad(f))(params)
    full = layer_residual_bytes(objective(tmp_path / "full", batch, "lm_tiny", MLA, "train.remat=full")[0], params)
    for policy in ("save_qkv_proj", "save_qkv_and_out_proj"):
        f, _ = objective(tmp_path / policy, batch, "lm_tiny", MLA, f"train.remat={policy}")
        measured = layer_residual_bytes(f, params) - full
        planned = cfg.model.n_layers * (
            layer_activation_bytes(cfg.model, ts, p, policy) - layer_activation_bytes(cfg.model, ts, p, "full")
        )
        print(f"MLA {policy}: kept beyond full, planned {planned:.0f} B, saved {measured} B")
        assert measured > 0 and planned == measured, policy
        loss, grads = jax.jit(jax.value_and_grad(f))(params)
        assert max_rel(loss, loss0) < 1e-6
        assert max(max_rel(a, b) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads0))) < 1e-6
