"""gpt-oss's Mixture of Experts in meshwork's MoE layer: router and expert biases, softmax over the
top-k logits, the clamped SwiGLU.

Parity with transformers' `GptOssMLP` reads tests/fixtures/gpt_oss_moe/golden.npz (written by
tests/fixtures/make_gpt_oss_moe_golden.py; no torch here): random nonzero weights and biases,
pre-activations large enough that the clamp acts, output and gradients. Expert parallelism is
checked on 8 fake CPU devices against one device with the helpers of tests/test_moe_layer.py.
"""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, tiny_overrides
from flax import nnx
from ml_dtypes import bfloat16
from test_moe_layer import E, F, _all_gather_results, _loss_and_grads, _place, inputs, make_moe, skew_router

import meshwork.models.hf.gpt_oss_experts
from meshwork.config import load_config
from meshwork.config_sections import MoEConfig
from meshwork.models.build import build_model
from meshwork.models.hf.gpt_oss_experts import HF_NAMES, moe_params_from_hf, moe_params_to_hf
from meshwork.models.layers.moe import MoE
from meshwork.models.layers.moe_routing import select_experts
from meshwork.perf.flops import param_counts
from meshwork.perf.planner_weights import model_weights
from meshwork.sharding.mesh import make_mesh
from meshwork.sharding.parallel import use_rules
from meshwork.sharding.rules import logical_to_sharding, rules_for

GOLDEN = dict(np.load(ROOT / "tests/fixtures/gpt_oss_moe/golden.npz"))
HF = {n: GOLDEN[f"hf.{n}"] for n in HF_NAMES}
GPT_OSS = dict(router="softmax", norm_topk_prob=True, router_bias=True, expert_bias=True, activation="clamped_swiglu")
BIASES = ("b_router", "b_gate", "b_up", "b_down")
REL = 1e-5


def rel_err(got, want) -> float:
    """max |got - want| / max |want|: the error relative to the array's scale."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


def params_of(moe: MoE) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in nnx.to_pure_dict(nnx.state(moe, nnx.Param)).items()}


def load(moe: MoE, params: dict) -> None:
    state = nnx.state(moe, nnx.Param)
    nnx.replace_by_pure_dict(state, {k: jnp.asarray(v) for k, v in params.items()})
    nnx.update(moe, state)


def golden_moe(capacity_factor: float | None) -> MoE:
    hidden, inter, experts, k, limit, alpha = GOLDEN["config"]
    cfg = MoEConfig(
        n_experts=int(experts),
        top_k=int(k),
        d_expert=int(inter),
        swiglu_limit=float(limit),
        swiglu_alpha=float(alpha),
        capacity_factor=capacity_factor,
        **GPT_OSS,
    )
    moe = MoE(int(hidden), cfg, init_std=0.1, out_std=0.1, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    params = moe_params_from_hf(HF)
    assert set(params) == set(params_of(moe))  # the mapping names every parameter
    load(moe, params)
    return moe


def test_hf_mapping_round_trips_bit_exactly():
    params = moe_params_from_hf(HF, prefix="")
    back = moe_params_to_hf(params)
    for n in HF_NAMES:
        assert back[n].dtype == HF[n].dtype and np.array_equal(back[n], HF[n]), n
    # gate at even columns, up at odd, as GptOssExperts._apply_gate slices them
    np.testing.assert_array_equal(params["w_up"][2, :, 1], HF["experts.gate_up_proj"][2, :, 3])
    np.testing.assert_array_equal(params["b_gate"][1, 2], HF["experts.gate_up_proj_bias"][1, 4])
    # any dtype, to the bit, under a checkpoint prefix; and meshwork -> HF -> meshwork
    pre = "model.layers.3.mlp."
    hf16 = {pre + n: v.astype(bfloat16) for n, v in HF.items()}
    p16 = moe_params_from_hf(hf16, prefix=pre)
    for n, v in moe_params_to_hf(p16, prefix=pre).items():
        assert v.dtype == bfloat16 and v.tobytes() == hf16[n].tobytes(), n
    for n, v in moe_params_from_hf(moe_params_to_hf(p16)).items():
        assert v.tobytes() == p16[n].tobytes(), n
    with pytest.raises(KeyError, match="router.bias"):
        moe_params_from_hf({n: v for n, v in HF.items() if n != "router.bias"})


def test_docstring_examples():
    assert doctest.testmod(meshwork.models.hf.gpt_oss_experts).failed == 0


def test_golden_exercises_the_clamp_and_the_biases():
    gate_clamped, up_clamped, n = GOLDEN["clamped"]
    assert gate_clamped > 0.1 * n and up_clamped > 0.1 * n
    for n in ("router.bias", "experts.gate_up_proj_bias", "experts.down_proj_bias"):
        assert np.abs(HF[n]).min() > 0, n


def test_routing_is_gpt_oss_softmax_over_the_top_k_logits():
    moe = golden_moe(None)
    x = jnp.asarray(GOLDEN["x_BLD"])
    logits = jax.jit(moe.router_logits)(x)
    np.testing.assert_allclose(logits, x @ HF["router.weight"].T + HF["router.bias"], rtol=1e-5, atol=1e-5)
    expert, weight, _ = select_experts(logits, router="softmax", k=moe.cfg.top_k, norm_topk_prob=True)
    np.testing.assert_array_equal(expert.reshape(-1, moe.cfg.top_k), GOLDEN["router_indices_TX"])
    assert rel_err(weight.reshape(-1, moe.cfg.top_k), GOLDEN["router_scores_TX"]) < REL


@pytest.mark.parametrize("path", ["dropless", "capacity"])
def test_layer_equals_transformers_gpt_oss_mlp(path):
    """Output and gradients (input, every weight and bias) of loss = sum(y * readout)."""
    E_, k = int(GOLDEN["config"][2]), int(GOLDEN["config"][3])
    moe = golden_moe(E_ / k if path == "capacity" else None)  # capacity L per expert and row: no drop
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
    readout = jnp.asarray(GOLDEN["readout_BLD"])

    def loss(params, x):
        y, stats = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(y * readout), (y, stats)

    (_, (y, stats)), (g_params, g_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        params, jnp.asarray(GOLDEN["x_BLD"])
    )
    assert float(stats["dropped_fraction"]) == 0.0
    errors = {"y": rel_err(y, GOLDEN["y_BLD"]), "grad x": rel_err(g_x, GOLDEN["grad_x_BLD"])}
    g_hf = moe_params_to_hf({k: np.asarray(v) for k, v in nnx.to_pure_dict(g_params).items()})
    errors |= {f"grad {n}": rel_err(g_hf[n], GOLDEN[f"grad.{n}"]) for n in HF_NAMES}
    assert max(errors.values()) < REL, errors


def test_biases_and_activation_are_options_off_by_default():
    default = MoEConfig()
    assert (default.router_bias, default.expert_bias, default.activation) == (False, False, "swiglu")
    assert not set(BIASES) & set(params_of(make_moe()))
    got = {
        ".".join(map(str, k)): (v.shape, v.get_metadata()["out_sharding"])
        for k, v in nnx.to_flat_state(nnx.state(make_moe(**GPT_OSS), nnx.Param))
        if k[0] in BIASES
    }
    D = inputs().shape[-1]
    assert got == {
        "b_router": ((E,), ("router",)),
        "b_gate": ((E, F), ("expert", "mlp")),
        "b_up": ((E, F), ("expert", "mlp")),
        "b_down": ((E, D), ("expert", "embed")),
    }
    with pytest.raises(ValueError, match="n_shared_experts=0"):
        make_moe(n_shared_experts=1, activation="clamped_swiglu")


def test_param_counts_and_the_planner_count_the_biases(tmp_path):
    from meshwork.train.optim import make_optimizer
    from meshwork.train.state import abstract_state

    gpt_oss = [f"model.moe.{k}={str(v).lower()}" for k, v in GPT_OSS.items()]
    cfg = load_config(ROOT / "configs/moe_tiny.yaml", [*tiny_overrides(tmp_path), *gpt_oss])
    real = sum(x.size for x in jax.tree.leaves(nnx.state(nnx.eval_shape(lambda: build_model(cfg)), nnx.Param)))
    plain = load_config(ROOT / "configs/moe_tiny.yaml", tiny_overrides(tmp_path))
    m = cfg.model
    n_moe = m.moe.n_moe_layers(m.n_layers)
    assert param_counts(m)["total"] == real
    assert real - param_counts(plain.model)["total"] == n_moe * m.moe.n_experts * (1 + 2 * m.moe.d_expert + m.d_model)
    _, abstract = abstract_state(cfg, make_optimizer(cfg.optimizer, 10)[0])
    names = {
        ".".join(map(str, path)): (tuple(v.shape), tuple(v.get_metadata()["out_sharding"]))
        for path, v in nnx.to_flat_state(abstract.params)
    }
    assert {w.path: (w.shape, w.names) for w in model_weights(m)} == names


# ---------------------------------------------------------------- expert parallelism


@pytest.fixture(scope="module", params=["capacity", "dropless"])
def ep_case(request):
    """A gpt-oss layer with random nonzero biases and a clamp that acts (limit 1 at the test's
    pre-activation scale), its inputs and the single-device loss, outputs and gradients."""
    moe = make_moe(seed=21, capacity_factor=1.0 if request.param == "capacity" else None, swiglu_limit=1.0, **GPT_OSS)
    skew_router(moe, 1.0)
    keys = iter(jax.random.split(jax.random.key(22), len(BIASES)))
    load(moe, {n: 0.5 * jax.random.normal(next(keys), getattr(moe, n).shape) for n in BIASES})
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
    x = inputs(seed=23)
    expected = jax.jit(_loss_and_grads(graphdef, rest))(params, x)
    if request.param == "capacity":
        assert 0 < float(expected[0][1][1]["dropped_fraction"]) < 0.5
    return graphdef, params, rest, x, expected


def test_expert_parallel_equals_one_device(ep_case):
    graphdef, params, rest, x, ((loss_ref, (y_ref, stats_ref)), (g_params_ref, g_x_ref)) = ep_case
    mesh, rules = make_mesh({"expert": 4, "data": 2}), rules_for("ep")
    with jax.set_mesh(mesh), use_rules(rules):
        sharded = _place(params, mesh, rules)
        for n in ("w_gate", "b_gate", "b_up", "b_down"):  # the biases split like their weights
            assert sharded[n][...].addressable_shards[0].data.shape[0] == E // 4, n
        x_sharded = jax.device_put(x, logical_to_sharding(("act_batch", "act_seq", "act_embed"), mesh, rules))
        compiled = jax.jit(_loss_and_grads(graphdef, rest)).lower(sharded, x_sharded).compile()
        (loss, (y, stats)), (g_params, g_x) = compiled(sharded, x_sharded)

    errors = {"y": rel_err(y, y_ref), "loss": rel_err(loss, loss_ref), "grad x": rel_err(g_x, g_x_ref)}
    errors |= {f"stats {k}": rel_err(stats[k], v) for k, v in stats_ref.items() if np.abs(v).max() > 0}
    errors |= {f"grad {k}": rel_err(g_params[k][...], v[...]) for k, v in g_params_ref.items()}
    assert max(errors.values()) < REL, errors
    assert all(float(np.abs(g_params_ref[n][...]).max()) > 0 for n in BIASES)
    hlo = compiled.as_text()
    assert "all-to-all" in hlo
    assert not _all_gather_results(hlo), "an expert weight, bias or the routing was all-gathered"
