"""gpt-oss checkpoints in and out: parity with transformers, greedy decoding through the paged cache,
the export round trip, refusals, and a training step through the gpt-oss-only parameters.

The fixtures (tests/fixtures/make_family_golden.py) are two tiny random float32 models: `gpt_oss`
(GQA 4:2, head_dim 12, window 4 alternating with full layers, q/k/v/o biases, YaRN with truncate
false, 4 experts top-2, swiglu_limit 1 so the clamp bites) and `gpt_oss_mha` (MHA, every layer
sliding, no attention biases, default RoPE, 3 experts top-1, tied embeddings). Both have random
attention sinks and router and expert biases. Lengths 1, 7 and 24 (past every window).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ROOT
from flax import nnx
from hf_family import assert_export_round_trip, assert_greedy_tokens, assert_logits_match
from safetensors.numpy import load_file

from meshwork.config_sections import ModelConfig, MoEConfig
from meshwork.inference.hf_export import hf_model_type
from meshwork.models.hf import load_hf_checkpoint, model_from_hf
from meshwork.models.hf.config import config_from_hf
from meshwork.models.hf.gpt_oss_experts import moe_params_from_hf
from meshwork.objectives.next_token import next_token_loss

FIXTURES = ROOT / "tests/fixtures/hf"
NAMES = ("gpt_oss", "gpt_oss_mha")


# The second configuration repeats every claim with other shapes and options: the slow tier's.
@pytest.fixture(scope="module", params=[NAMES[0], *(pytest.param(n, marks=pytest.mark.slow) for n in NAMES[1:])])
def loaded(request):
    cfg, model = model_from_hf(FIXTURES / request.param)
    return request.param, cfg, model, np.load(FIXTURES / request.param / "golden.npz")


def test_logits_equal_transformers_at_1_7_and_past_the_window(loaded):
    name, cfg, model, golden = loaded
    assert_logits_match(name, model, golden)


def test_greedy_through_the_paged_cache_equals_transformers(loaded):
    """16 greedy tokens from the paged server (prefix caching, 3-token prefill chunks): each layer
    attends within its own window, with its sinks, and routes each step's token."""
    name, cfg, model, golden = loaded
    assert_greedy_tokens(name, model, golden, prefix_caching=True, prefill_chunk=3)


def test_export_round_trip_is_bit_exact(loaded, tmp_path):
    """Also: gate and up come back interleaved in gate_up_proj."""
    name, cfg, model, _ = loaded
    assert_export_round_trip(FIXTURES / name, cfg, model, tmp_path / "out")


def test_layout_reads_the_experts_as_the_gpt_oss_helper_splits_them():
    """The layout's column reads of gate_up_proj give models/hf/gpt_oss_experts.py's split."""
    _, params = load_hf_checkpoint(FIXTURES / "gpt_oss")
    tensors = load_file(FIXTURES / "gpt_oss" / "model.safetensors")
    for i in range(3):
        want = moe_params_from_hf(tensors, f"model.layers.{i}.mlp.")
        got = {k: v[i] for k, v in params["moe_blocks"]["moe"].items()}
        assert got.keys() == want.keys()
        assert all(np.array_equal(got[k], want[k]) for k in want)


def test_one_training_step_reaches_the_gpt_oss_parameters(loaded):
    """The LM loss's gradients are finite and nonzero for the sinks, the output bias, the router and
    expert biases (top-1 routing passes no gradient to the router: its one weight is 1), and an
    Adam step lowers the loss on its batch."""
    name, cfg, model, golden = loaded
    tokens = jnp.asarray(golden["input_ids_24"])
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    graphdef, params, buffers = nnx.split(model, nnx.Param, ...)
    loss_fn = next_token_loss(graphdef)
    optimizer = optax.adam(1e-3)

    @jax.jit
    def step(params, opt_state):
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, buffers, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), loss, grads

    new_params, loss, grads = step(params, optimizer.init(params))
    g = nnx.to_pure_dict(grads)["moe_blocks"]
    names = {"sinks": g["attn"]["sinks"], **{k: g["moe"][k] for k in ("b_gate", "b_up", "b_down")}}
    if cfg.attention_out_bias:
        names["bo"] = g["attn"]["bo"]
    if cfg.moe.top_k > 1:
        names["b_router"] = g["moe"]["b_router"]
    for key, grad in names.items():
        assert np.isfinite(grad).all() and np.abs(grad).max() > 0, (name, key)
    after, _ = jax.jit(loss_fn)(new_params, buffers, batch)
    assert float(after) < float(loss), name


def _config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


@pytest.mark.parametrize(
    "change, key",
    [
        ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config.*dequantize"),
        ({"layer_types": ["chunked_attention"] * 3}, "layer_types"),
        ({"layer_types": ["sliding_attention"] * 2}, "layer_types"),
        ({"sliding_window": None}, "sliding_window"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "longrope"),
    ],
)
def test_what_meshwork_cannot_compute_is_refused_by_name(change, key):
    with pytest.raises(ValueError, match=key):
        config_from_hf(_config("gpt_oss") | change)


def test_released_defaults_fill_what_config_json_omits():
    """transformers' GptOssConfig defaults: head_dim 64, 8 KV heads, window 128 alternating (sliding
    first), YaRN 32 over 4096 with truncate false at base 150000; the aux loss only with
    output_router_logits, k times transformers' coefficient."""
    sizes = {k: _config("gpt_oss")[k] for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size")}
    cfg = config_from_hf(
        sizes | {"num_hidden_layers": 2, "num_attention_heads": 16, "num_local_experts": 4, "num_experts_per_tok": 2}
    )
    assert (cfg.head_dim, cfg.n_kv_heads, cfg.sliding_window) == (64, 8, 128)
    assert cfg.layer_types == ["sliding_attention", "full_attention"]
    assert cfg.rope_theta == 150000.0 and cfg.rope_scaling["truncate"] is False
    assert (cfg.rope_scaling["factor"], cfg.rope_scaling["original_max_position_embeddings"]) == (32.0, 4096)
    assert cfg.moe.aux_loss_coef == 0.0
    routed = config_from_hf(_config("gpt_oss") | {"output_router_logits": True, "router_aux_loss_coef": 0.01})
    assert routed.moe.aux_loss_coef == 0.02


GPT_OSS = ModelConfig(
    kind="moe",
    attention_sinks=True,
    qkv_bias=True,
    attention_out_bias=True,
    moe=MoEConfig(router_bias=True, expert_bias=True, activation="clamped_swiglu", aux_loss_coef=0.0),
)


@pytest.mark.parametrize(
    "change, why",
    [
        ({"qk_norm": True}, "qk_norm"),
        ({"attention_out_bias": False}, "attention_bias biases q, k, v and o together"),
        ({"attention_sinks": False}, "attention_sinks=False"),
        ({"moe": GPT_OSS.moe.model_copy(update={"first_dense_layers": 1})}, "dense layers"),
        ({"moe": GPT_OSS.moe.model_copy(update={"activation": "swiglu"})}, "moe.activation='swiglu'"),
        ({"moe": GPT_OSS.moe.model_copy(update={"capacity_factor": 1.25})}, "capacity_factor"),
    ],
)
def test_export_refuses_what_gpt_oss_cannot_express(change, why):
    assert hf_model_type(GPT_OSS) == "gpt_oss"
    with pytest.raises(ValueError, match=f"cannot export to gpt-oss: .*{why}"):
        hf_model_type(GPT_OSS.model_copy(update=change))


def test_other_families_refuse_the_gpt_oss_attention():
    with pytest.raises(ValueError, match="attention_sinks"):
        hf_model_type(ModelConfig(attention_sinks=True))


def test_doctests(monkeypatch):
    import doctest

    import meshwork.models.hf.gpt_oss

    monkeypatch.chdir(ROOT)
    assert doctest.testmod(meshwork.models.hf.gpt_oss, optionflags=doctest.ELLIPSIS).failed == 0


def test_the_pallas_kernels_give_transformers_logits_and_tokens():
    """model.attention pallas (interpret mode here): the flash kernel takes the sinks (and the sliding
    layers' window, per layer), and the paged decode kernel does the same."""
    cfg, model = model_from_hf(FIXTURES / "gpt_oss", attention="pallas")
    golden = np.load(FIXTURES / "gpt_oss" / "golden.npz")
    want = golden["logits_7"]
    got = np.asarray(jax.jit(lambda t: model(t))(jnp.asarray(golden["input_ids_7"])))
    assert cfg.attention_sinks and np.abs(got - want).max() / np.abs(want).max() <= 1e-5
    assert_greedy_tokens("gpt_oss", model, golden, prompts=1, new_tokens=6, slots=1, max_len=32)
