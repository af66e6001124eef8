"""MoE layer: routers, GShard capacity, dropless grouped matmul and expert parallelism.

References are written plainly in NumPy (float64) per token; expert parallelism is checked on
8 fake CPU devices (tests/conftest.py) against the single-device layer.
"""

import doctest
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshwork.models.layers.moe
import meshwork.models.layers.moe_dispatch
import meshwork.models.layers.moe_routing
from meshwork.config_sections import MoEConfig
from meshwork.models.layers.moe import MoE
from meshwork.models.layers.moe_dispatch import capacity_per_group
from meshwork.models.layers.moe_routing import RouterBias, select_experts, updated_router_bias
from meshwork.sharding.mesh import make_mesh
from meshwork.sharding.parallel import use_rules
from meshwork.sharding.rules import logical_to_sharding, rules_for

B, L, D, E, F, K = 8, 16, 16, 8, 24, 2
TOL = dict(atol=2e-5, rtol=2e-5)


def make_moe(seed=0, **cfg) -> MoE:
    cfg = MoEConfig(**{"n_experts": E, "top_k": K, "d_expert": F, **cfg})
    # Large init so outputs are O(1) and tolerances mean something.
    return MoE(D, cfg, init_std=0.3, out_std=0.3, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(seed))


def apply(moe: MoE, x: jax.Array, noise_key: jax.Array | None = None):
    """moe(x) compiled (op-by-op dispatch of the routing is slow on CPU)."""
    return jax.jit(lambda x, key: moe(x, noise_key=key))(x, noise_key)


def skew_router(moe: MoE, amount: float = 2.0) -> None:
    """Bias routing toward expert 0 (x[..., 0] is a constant 1 in `inputs`)."""
    moe.router[...] = moe.router[...].at[0, 0].add(amount)


def inputs(seed=1, batch=B) -> jax.Array:
    x = jax.random.normal(jax.random.key(seed), (batch, L, D), jnp.float32)
    return x.at[..., 0].set(1.0)


def np_params(moe: MoE) -> dict:
    """The top-level weights (router, noise, w_gate, ...) as float64 arrays."""
    return {
        path[0]: np.asarray(v[...], np.float64)
        for path, v in nnx.to_flat_state(nnx.state(moe, nnx.Param))
        if len(path) == 1
    }


def np_swiglu(x_D, w_gate_DF, w_up_DF, w_down_FD):
    g = x_D @ w_gate_DF
    return (g / (1 + np.exp(-g)) * (x_D @ w_up_DF)) @ w_down_FD


def np_softmax_route(logits_E, k, norm=True):
    p = np.exp(logits_E - logits_E.max())
    p /= p.sum()
    chosen = np.argsort(-p, kind="stable")[:k]
    w = p[chosen] / (p[chosen].sum() if norm else 1.0)
    return chosen, w


def np_gshard_keep(chosen_BLX, n_experts, capacity):
    """The rule as stated: per batch row, 1st choices in sequence order, then 2nd choices, ...;
    an expert admits its first `capacity` assignments."""
    keep = np.zeros(chosen_BLX.shape, bool)
    for b in range(chosen_BLX.shape[0]):
        taken = np.zeros(n_experts, int)
        for k in range(chosen_BLX.shape[2]):
            for t in range(chosen_BLX.shape[1]):
                e = chosen_BLX[b, t, k]
                if taken[e] < capacity:
                    keep[b, t, k] = True
                    taken[e] += 1
    return keep


def np_moe(x_BLD, p, chosen_BLX, w_BLX, keep_BLX=None, scale=1.0):
    """Per-token loop over the kept chosen experts."""
    y = np.zeros(x_BLD.shape)
    for b, t, k in np.ndindex(*chosen_BLX.shape):
        if keep_BLX is None or keep_BLX[b, t, k]:
            e = chosen_BLX[b, t, k]
            y[b, t] += w_BLX[b, t, k] * np_swiglu(x_BLD[b, t], p["w_gate"][e], p["w_up"][e], p["w_down"][e])
    return scale * y


def np_softmax_routing(logits_BLE, k, norm=True):
    chosen = np.zeros(logits_BLE.shape[:2] + (k,), int)
    w = np.zeros(chosen.shape)
    for b, t in np.ndindex(*logits_BLE.shape[:2]):
        chosen[b, t], w[b, t] = np_softmax_route(logits_BLE[b, t], k, norm)
    return chosen, w


# ---------------------------------------------------------------- routing and capacity


def test_capacity_drops_follow_the_gshard_rule():
    moe = make_moe(capacity_factor=1.0)
    skew_router(moe)
    x = inputs()
    y, stats = apply(moe, x)
    p, x64 = np_params(moe), np.asarray(x, np.float64)
    chosen, w = np_softmax_routing(x64 @ p["router"], K)
    C = capacity_per_group(1.0, L, K, E)
    keep = np_gshard_keep(chosen, E, C)
    dropped = int((~keep).sum())
    assert dropped > 0.2 * chosen.size  # the skew overflows expert 0
    assert round(float(stats["dropped_fraction"]) * chosen.size) == dropped
    np.testing.assert_allclose(stats["load"], np.bincount(chosen.ravel(), minlength=E) / chosen.size, atol=1e-7)
    np.testing.assert_allclose(y, np_moe(x64, p, chosen, w, keep), **TOL)


def test_ample_capacity_drops_nothing_and_equals_dropless():
    x = inputs()
    y_cap, s_cap = apply(make_moe(capacity_factor=E / K), x)  # C = L: room for every token
    y_free, s_free = apply(make_moe(), x)
    assert float(s_cap["dropped_fraction"]) == 0.0
    np.testing.assert_allclose(y_cap, y_free, **TOL)


def _dense_reference(params, x_BLD):
    """All experts on all tokens, gated by the softmax top-k weights (jnp, differentiable)."""
    probs = jax.nn.softmax(x_BLD @ params["router"], axis=-1)
    w, idx = jax.lax.top_k(probs, K)
    gate_BLE = jnp.einsum("BLKE,BLK->BLE", jax.nn.one_hot(idx, E), w / w.sum(-1, keepdims=True))
    h = jax.nn.silu(jnp.einsum("BLD,EDF->BLEF", x_BLD, params["w_gate"])) * jnp.einsum(
        "BLD,EDF->BLEF", x_BLD, params["w_up"]
    )
    return jnp.einsum("BLE,BLEF,EFD->BLD", gate_BLE, h, params["w_down"])


def test_dropless_equals_per_token_loop_and_dense_gradients():
    moe = make_moe()
    skew_router(moe)  # unbalanced groups exercise the grouped matmul's ragged sizes
    x = inputs()
    y, stats = apply(moe, x)
    p, x64 = np_params(moe), np.asarray(x, np.float64)
    chosen, w = np_softmax_routing(x64 @ p["router"], K)
    assert float(stats["dropped_fraction"]) == 0.0
    np.testing.assert_allclose(y, np_moe(x64, p, chosen, w), **TOL)

    graphdef, params = nnx.split(moe, nnx.Param)
    readout = jnp.sin(jnp.arange(D, dtype=jnp.float32))  # distinct cotangent per output feature

    def loss_layer(params, x):
        return jnp.sum(nnx.merge(graphdef, params)(x)[0] * readout)

    def loss_dense(params, x):
        return jnp.sum(_dense_reference({k: v[...] for k, v in params.items()}, x) * readout)

    got = jax.jit(jax.grad(loss_layer, argnums=(0, 1)))(params, x)
    want = jax.jit(jax.grad(loss_dense, argnums=(0, 1)))(params, x)
    np.testing.assert_allclose(got[1], want[1], **TOL)
    for name in ("router", "w_gate", "w_up", "w_down"):
        np.testing.assert_allclose(got[0][name][...], want[0][name][...], err_msg=name, **TOL)


def test_softmax_weights_are_the_softmax_over_the_chosen_logits():
    logits = jax.random.normal(jax.random.key(3), (2, 5, E))
    e, w, probs = select_experts(logits, router="softmax", k=3)
    np.testing.assert_allclose(w, jax.nn.softmax(jnp.take_along_axis(logits, e, -1), -1), atol=1e-6)
    np.testing.assert_array_equal(e, jax.lax.top_k(logits, 3)[1])
    _, w_raw, _ = select_experts(logits, router="softmax", k=3, norm_topk_prob=False)
    np.testing.assert_allclose(w_raw, jnp.take_along_axis(probs, e, -1), atol=1e-7)


def test_noisy_router_adds_learned_noise_only_with_a_key():
    moe = make_moe(router="noisy", noise_std=0.7)
    moe.noise[...] = jax.random.normal(jax.random.key(4), (D, E)) * 0.3
    x, key = inputs(), jax.random.key(5)
    p, x64 = np_params(moe), np.asarray(x, np.float64)
    clean = x64 @ p["router"]

    y_eval, _ = apply(moe, x)
    np.testing.assert_allclose(y_eval, np_moe(x64, p, *np_softmax_routing(clean, K)), **TOL)

    y_train, _ = apply(moe, x, key)
    noise = np.asarray(jax.random.normal(key, (B, L, E), jnp.float32), np.float64)
    noisy = clean + noise * np.log1p(np.exp(x64 @ p["noise"])) * 0.7
    chosen, w = np_softmax_routing(noisy, K)
    assert (chosen != np_softmax_routing(clean, K)[0]).any()
    np.testing.assert_allclose(y_train, np_moe(x64, p, chosen, w), **TOL)
    np.testing.assert_array_equal(y_train, apply(moe, x, key)[0])


def np_sigmoid_route(logits_E, bias_E, k, n_groups, topk_groups):
    scores = 1 / (1 + np.exp(-logits_E))
    choice = (scores + bias_E).reshape(n_groups, -1)
    group_score = np.sort(choice, axis=1)[:, -2:].sum(1)
    groups = np.argsort(-group_score, kind="stable")[:topk_groups]
    masked = np.full_like(choice, -np.inf)
    masked[groups] = choice[groups]
    chosen = np.argsort(-masked.ravel(), kind="stable")[:k]
    return chosen, scores[chosen] / scores[chosen].sum()


def test_sigmoid_router_groups_bias_and_scaling():
    moe = make_moe(router="sigmoid", n_groups=4, topk_groups=2, top_k=3, routed_scaling_factor=2.5)
    bias = jnp.array([0.3, -0.2, 0.0, 0.25, -0.3, 0.1, 0.0, 0.2])
    moe.router_bias[...] = bias
    x = inputs()
    y, stats = apply(moe, x)
    p, x64 = np_params(moe), np.asarray(x, np.float64)
    logits = x64 @ p["router"]
    chosen = np.zeros((B, L, 3), int)
    w = np.zeros((B, L, 3))
    for b, t in np.ndindex(B, L):
        chosen[b, t], w[b, t] = np_sigmoid_route(logits[b, t], np.asarray(bias), 3, 4, 2)
    np.testing.assert_allclose(y, np_moe(x64, p, chosen, w, scale=2.5), **TOL)
    # The groups limit the choice: at most two groups of two experts per token.
    assert all(len(set(c // 2)) <= 2 for c in chosen.reshape(-1, 3))
    # The bias is state, not a parameter the optimizer would see.
    assert isinstance(moe.router_bias, RouterBias) and "router_bias" not in nnx.state(moe, nnx.Param)

    # Bias moves the selection; where the selection is unchanged, the weights are too.
    e_b, w_b, _ = select_experts(jnp.asarray(logits), router="sigmoid", k=3, bias_E=bias, n_groups=4, topk_groups=2)
    e_0, w_0, _ = select_experts(jnp.asarray(logits), router="sigmoid", k=3, n_groups=4, topk_groups=2)
    same = (jnp.sort(e_b, -1) == jnp.sort(e_0, -1)).all(-1)
    assert not bool(same.all()) and bool(same.any())
    order = lambda e, w: jnp.take_along_axis(w, jnp.argsort(e, -1), -1)  # noqa: E731
    np.testing.assert_allclose(order(e_b, w_b)[same], order(e_0, w_0)[same], atol=1e-6)


def test_shared_experts_and_qwen2_gate():
    x = inputs()
    routed = make_moe(seed=7)
    shared = make_moe(seed=7, n_shared_experts=2)
    gated = make_moe(seed=7, n_shared_experts=2, shared_expert_gate=True, routed_scaling_factor=1.5)
    assert shared.shared.w_gate.shape == (D, 2 * F)
    for m in (shared, gated):  # same routed weights as `routed` (same seed, same init order)
        np.testing.assert_array_equal(m.w_gate[...], routed.w_gate[...])
    y_routed = apply(routed, x)[0]
    s_BLD = shared.shared(x)
    np.testing.assert_allclose(apply(shared, x)[0], y_routed + s_BLD, **TOL)
    gate_BL1 = jax.nn.sigmoid(x @ gated.shared_gate[...])
    np.testing.assert_allclose(apply(gated, x)[0], 1.5 * y_routed + gated.shared(x) * gate_BL1, **TOL)


def test_aux_loss_is_one_when_balanced_and_z_loss_formula():
    moe = make_moe()
    x = inputs()
    moe.router[...] = jnp.zeros((D, E))  # uniform probabilities: P_e = 1/E
    assert float(apply(moe, x)[1]["aux_loss"]) == pytest.approx(1.0, abs=1e-6)

    # Perfectly balanced assignments (f_e = 1/E) give 1 whatever P is; all on one expert gives ~E.
    logits = jax.random.normal(jax.random.key(0), (1, 2 * E, E))
    experts = jnp.stack([jnp.arange(2 * E) % E, (jnp.arange(2 * E) + 1) % E], -1)[None]
    probs = jax.nn.softmax(logits, -1)
    assert float(meshwork.models.layers.moe_routing.load_balancing_loss(probs, experts)) == pytest.approx(1.0, abs=1e-6)
    onehot = jnp.full((1, 4, E), 1e-9).at[..., 0].set(1.0)
    assert float(
        meshwork.models.layers.moe_routing.load_balancing_loss(onehot, jnp.zeros((1, 4, 2), jnp.int32))
    ) == pytest.approx(E, rel=1e-6)

    moe = make_moe()
    logits = np.asarray(x, np.float64) @ np_params(moe)["router"]
    lse = np.log(np.exp(logits).sum(-1))
    assert float(apply(moe, x)[1]["z_loss"]) == pytest.approx(float(np.mean(lse**2)), rel=1e-5)


def test_router_bias_update_moves_toward_underloaded_experts():
    bias = jnp.zeros((2, 4))  # two stacked layers
    load = jnp.array([[0.4, 0.1, 0.25, 0.25], [0.25] * 4])
    new = updated_router_bias(bias, load, 0.1)
    np.testing.assert_allclose(new, [[-0.1, 0.1, 0.0, 0.0], [0.0] * 4], atol=1e-7)


def test_parameter_names_shapes_and_logical_axes():
    moe = make_moe(router="noisy", n_shared_experts=1, shared_expert_gate=True)
    got = {
        ".".join(map(str, k)): (v.shape, v.get_metadata()["out_sharding"])
        for k, v in nnx.to_flat_state(nnx.state(moe, nnx.Param))
    }
    assert got == {
        "router": ((D, E), ("embed", "router")),
        "noise": ((D, E), ("embed", "router")),
        "w_gate": ((E, D, F), ("expert", "embed", "mlp")),
        "w_up": ((E, D, F), ("expert", "embed", "mlp")),
        "w_down": ((E, F, D), ("expert", "mlp", "embed")),
        "shared.w_gate": ((D, F), ("embed", "mlp")),
        "shared.w_up": ((D, F), ("embed", "mlp")),
        "shared.w_down": ((F, D), ("mlp", "embed")),
        "shared_gate": ((D, 1), ("embed", None)),
    }
    bias = make_moe(router="sigmoid").router_bias
    assert bias.shape == (E,) and bias.get_metadata()["out_sharding"] == ("router",)


def test_bfloat16_compute_keeps_router_in_float32():
    cfg = MoEConfig(n_experts=E, top_k=K, d_expert=F, capacity_factor=1.25)
    moe = MoE(D, cfg, init_std=0.3, out_std=0.3, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    y, stats = apply(moe, inputs().astype(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16 and stats["aux_loss"].dtype == jnp.float32
    np.testing.assert_allclose(y.astype(jnp.float32), apply(make_moe(capacity_factor=1.25), inputs())[0], atol=0.1)


def test_docstring_examples():
    for module in (meshwork.models.layers.moe, meshwork.models.layers.moe_routing, meshwork.models.layers.moe_dispatch):
        assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0


# ---------------------------------------------------------------- expert parallelism


def _loss_and_grads(graphdef, rest):
    readout = jnp.cos(jnp.arange(D, dtype=jnp.float32))

    def loss(params, x):
        y, stats = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(y * readout) + stats["aux_loss"] + stats["z_loss"], (y, stats)

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


def _place(state, mesh, rules):
    def put(v):
        return v.replace(jax.device_put(v[...], logical_to_sharding(v.get_metadata()["out_sharding"], mesh, rules)))

    return jax.tree.map(put, state, is_leaf=lambda v: isinstance(v, nnx.Variable))


@pytest.fixture(scope="module", params=["capacity", "dropless"])
def ep_case(request):
    """A model, its inputs and the single-device loss, outputs and gradients."""
    moe = make_moe(seed=11, capacity_factor=1.0 if request.param == "capacity" else None)
    skew_router(moe, 1.0)
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
    x = inputs(seed=12)
    expected = jax.jit(_loss_and_grads(graphdef, rest))(params, x)
    if request.param == "capacity":
        assert 0 < float(expected[0][1][1]["dropped_fraction"]) < 0.5
    return graphdef, params, rest, x, expected


def _all_gather_results(hlo: str) -> list[str]:
    """The result-type text (left of the op name) of every all-gather in optimized HLO."""
    return [line.split(" all-gather")[0] for line in hlo.splitlines() if re.search(r" all-gather(-start)?\(", line)]


def _gathers_expert_weights(hlo: str) -> bool:
    return any(f"[{E},{D},{F}]" in r or f"[{E},{F},{D}]" in r for r in _all_gather_results(hlo))


def test_hlo_check_sees_a_gathered_expert_weight():
    mesh = make_mesh({"expert": 8})
    w = jax.device_put(jnp.ones((E, D, F)), logical_to_sharding(("expert", "embed", "mlp"), mesh, rules_for("ep")))
    replicated = logical_to_sharding((), mesh, rules_for("ep"))
    assert _gathers_expert_weights(jax.jit(lambda w: w * 2, out_shardings=replicated).lower(w).compile().as_text())


@pytest.mark.parametrize(
    "mesh_sizes, preset, overrides, impl, exchange",
    [
        ({"expert": 4, "data": 2}, "ep", {}, "lax", "all-to-all"),
        # the same all-to-all on a mesh of one axis: a layout repeat, in the slow tier
        pytest.param({"expert": 8}, "ep", {}, "lax", "all-to-all", marks=pytest.mark.slow),
        ({"data": 2, "expert": 4}, "ep", {"expert": ["data", "expert"]}, "hierarchical", "collective-permute"),
        ({"data": 8}, "dp", {}, "lax", None),  # no expert parallelism: local dispatch, no exchange
    ],
    ids=["expert4xdata2", "expert8", "data2xexpert4-hierarchical", "dp8"],
)
def test_sharded_layer_equals_single_device(ep_case, mesh_sizes, preset, overrides, impl, exchange):
    graphdef, params, rest, x, ((loss_ref, (y_ref, stats_ref)), (g_params_ref, g_x_ref)) = ep_case
    mesh, rules = make_mesh(mesh_sizes), rules_for(preset, overrides)
    if impl != "lax":
        moe = nnx.merge(graphdef, params, rest)
        moe.all_to_all = impl
        graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
    with jax.set_mesh(mesh), use_rules(rules):
        sharded_params = _place(params, mesh, rules)
        n_owners = mesh_sizes.get("expert", 1) * (mesh_sizes["data"] if overrides else 1)
        assert sharded_params["w_gate"][...].addressable_shards[0].data.shape[0] == E // n_owners
        x_sharded = jax.device_put(x, logical_to_sharding(("act_batch", "act_seq", "act_embed"), mesh, rules))
        compiled = jax.jit(_loss_and_grads(graphdef, rest)).lower(sharded_params, x_sharded).compile()
        (loss, (y, stats)), (g_params, g_x) = compiled(sharded_params, x_sharded)

    np.testing.assert_allclose(y, y_ref, **TOL)
    np.testing.assert_allclose(loss, loss_ref, **TOL)
    for k in stats_ref:
        np.testing.assert_allclose(stats[k], stats_ref[k], err_msg=k, **TOL)
    np.testing.assert_allclose(g_x, g_x_ref, **TOL)
    for name in ("router", "w_gate", "w_up", "w_down"):
        np.testing.assert_allclose(g_params[name][...], g_params_ref[name][...], err_msg=name, **TOL)

    hlo = compiled.as_text()
    for op in ("all-to-all", "collective-permute"):
        assert (op in hlo) == (op == exchange), op
    assert not _gathers_expert_weights(hlo), "expert weights were all-gathered"
    # Routing (top-k, capacity positions) stays on each device's own rows: nothing is gathered.
    assert not _all_gather_results(hlo)
