"""DeepSeek-V3 checkpoints in and out: parity with transformers' DeepseekV3ForCausalLM, greedy decoding
through the latent paged cache, the export round trip, the latent cache's size, refusals.

The fixtures (tests/fixtures/make_deepseek_golden.py; README there) are two tiny random float32
models: `deepseek_v3` (q-LoRA, YaRN past its original context with mscale_all_dim, interleaved
RoPE rows, 4 expert groups of which 2 per token, a shared expert, routed scaling 2.5, a dense first
layer, an MTP layer) and `deepseek_v3_noqlora` (no q-LoRA, values wider than the query/key heads,
rotate-half RoPE, one group, un-normalized top-k, every layer MoE).
"""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT
from flax import nnx
from safetensors.numpy import load_file

from meshwork.config_sections import MLAConfig, ModelConfig
from meshwork.engine.kv_cache import KVCache, cache_bytes_per_token
from meshwork.engine.sampling import SamplingParams
from meshwork.engine.serving import Request, Server
from meshwork.inference.hf_export import export_hf
from meshwork.models.hf import load_hf_checkpoint, model_from_hf
from meshwork.models.transformer import Transformer

FIXTURES = ROOT / "tests/fixtures/hf"
NAMES = ("deepseek_v3", "deepseek_v3_noqlora")


# The second configuration repeats every claim with other shapes and options: the slow tier's.
@pytest.fixture(scope="module", params=[NAMES[0], *(pytest.param(n, marks=pytest.mark.slow) for n in NAMES[1:])])
def loaded(request):
    cfg, model = model_from_hf(FIXTURES / request.param)
    return request.param, cfg, model, np.load(FIXTURES / request.param / "golden.npz")


def test_logits_equal_transformers_at_1_7_and_past_the_original_context(loaded):
    name, cfg, model, golden = loaded
    assert cfg.mla is not None and cfg.kind == "moe"
    for n in (1, 7, 48):  # 48 > the YaRN fixture's original context of 32
        want = golden[f"logits_{n}"]
        got = np.asarray(jax.jit(lambda t: model(t))(jnp.asarray(golden[f"input_ids_{n}"])))
        assert np.abs(got - want).max() / np.abs(want).max() <= 1e-5, (name, n)


def test_greedy_through_the_latent_paged_cache_equals_transformers(loaded):
    """16 greedy tokens from the paged server (prefix caching and 3-token prefill chunks on), which
    decodes with the absorbed form over pages of [latent, RoPE key]."""
    name, cfg, model, golden = loaded
    server = Server(model, slots=2, max_len=64, page_size=4, prefix_caching=True, prefill_chunk=3)
    assert server.k.shape[-2:] == (1, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) and server.v.shape[-1] == 0
    prompt = golden["prompt"][0].tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    results = server.run([Request(0, prompt, params), Request(1, prompt, params)])
    for r in results.values() if isinstance(results, dict) else results:
        assert list(r.tokens) == golden["generated"].tolist(), name


def test_export_round_trip_is_bit_exact(loaded, tmp_path):
    """Load -> export -> load gives the same parameters and selection biases, bit for bit; an
    interleaved-RoPE checkpoint (MTP layer included) comes back as the same file, tensor for tensor."""
    name, cfg, model, _ = loaded
    out = export_hf(cfg, model, tmp_path / "out")
    _, first = load_hf_checkpoint(FIXTURES / name)
    _, again = load_hf_checkpoint(out)
    assert jax.tree.structure(first) == jax.tree.structure(again)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)
    if json.loads((FIXTURES / name / "config.json").read_text()).get("rope_interleave", True):
        want, got = load_file(FIXTURES / name / "model.safetensors"), load_file(out / "model.safetensors")
        assert want.keys() == got.keys()
        assert all(np.array_equal(want[k], got[k]) for k in want)


def test_the_mtp_layer_and_selection_biases_are_loaded(loaded):
    name, cfg, model, _ = loaded
    if name != "deepseek_v3":
        assert model.mtp is None
        return
    tensors = load_file(FIXTURES / name / "model.safetensors")
    assert cfg.mtp.depth == 1
    np.testing.assert_array_equal(model.mtp[0].proj[...], tensors["model.layers.3.eh_proj.weight"].T)
    np.testing.assert_array_equal(
        model.moe_blocks.moe.router_bias[...][0], tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    )


def test_absorbed_decode_equals_the_expanded_attention():
    """Token by token through the latent cache (absorbed) against the full forward (expanded)."""
    cfg = ModelConfig(
        vocab_size=50, d_model=32, n_layers=2, n_heads=4, d_ff=48,
        mla=MLAConfig(q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=8),
    )  # fmt: skip
    model = Transformer(cfg, rngs=nnx.Rngs(3))
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 50)
    want = model(tokens)
    cache, steps = KVCache.zeros(cfg, 2, 16), []
    logits, cache = model.decode(tokens[:, :4], jnp.broadcast_to(jnp.arange(4), (2, 4)), cache)
    steps.append(logits)
    for t in range(4, 9):
        logits, cache = model.decode(tokens[:, t : t + 1], jnp.full((2, 1), t), cache)
        steps.append(logits)
    got = jnp.concatenate(steps, axis=1)
    assert float(jnp.abs(got - want).max() / jnp.abs(want).max()) <= 1e-5
    assert cache.k.shape[-2:] == (1, 14) and cache.v.size == 0  # the latent and RoPE key, nothing per head
    # What it allocates is the formula (DeepSeek-V3's shape: tests/test_planner_mla.py).
    assert cache.nbytes == 2 * 16 * cache_bytes_per_token(cfg, cache.k.dtype) == 2 * 16 * (10 + 4) * 2 * 4


@pytest.mark.parametrize(
    "change, match",
    [
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "dequantize first"),
        ({"attention_bias": True}, "attention_bias"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 5}, "topk_group"),
        ({"qk_rope_head_dim": 5}, "qk_rope_head_dim"),
        ({"first_k_dense_replace": 3}, "first_k_dense_replace"),
    ],
)
def test_unbuilt_settings_are_refused_in_one_line(tmp_path, change, match):
    shutil.copytree(FIXTURES / "deepseek_v3", tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt/config.json").read_text())
    (tmp_path / "ckpt/config.json").write_text(json.dumps(config | change))
    with pytest.raises(ValueError, match=match) as info:
        model_from_hf(tmp_path / "ckpt")
    assert "\n" not in str(info.value)


@pytest.mark.slow  # interpret-mode Pallas / an 8-device compile; the claim repeats the quick greedy test's
def test_the_pallas_paged_kernel_reads_the_latent_pages():
    """attention=pallas: the paged kernel attends over the latent pool in place (keys: all of it, values:
    its first kv_lora_rank dims); the same greedy tokens and log-probabilities as XLA's gathered pages."""
    golden, out = np.load(FIXTURES / "deepseek_v3/golden.npz"), {}
    params = SamplingParams(temperature=0.0, max_new_tokens=8, logprobs=True)
    for impl in ("xla", "pallas"):
        _, model = model_from_hf(FIXTURES / "deepseek_v3", attention=impl)
        server = Server(model, slots=1, max_len=32, page_size=4, prefill_chunk=3)
        out[impl] = server.run([Request(0, golden["prompt"][0].tolist(), params)])[0]
    assert list(out["pallas"].tokens) == list(out["xla"].tokens) == golden["generated"][:8].tolist()
    np.testing.assert_allclose(out["pallas"].logprobs, out["xla"].logprobs, atol=1e-5)


@pytest.mark.slow  # interpret-mode Pallas / an 8-device compile; the claim repeats the quick greedy test's
def test_the_latent_pool_on_data_4_x_tensor_2_gives_the_one_device_tokens():
    """Served on 8 devices (data 4 x tensor 2): query heads split over `tensor`, the one latent "head"
    of each page whole on every device of its replica; greedy tokens equal one device's. (A dense MLA
    model: the MoE layer cannot yet take a one-row prefill chunk split over data replicas.)"""
    from meshwork.sharding.mesh import make_mesh
    from meshwork.sharding.rules import rules_for

    cfg = load_hf_checkpoint(FIXTURES / "deepseek_v3")[0]
    model = Transformer(cfg.model_copy(update={"vocab_size": 96, "kind": "transformer"}), rngs=nnx.Rngs(5))
    mesh = make_mesh({"data": 4, "tensor": 2})
    server = Server(
        model, mesh=mesh, rules=rules_for("tp"), slots=4, max_len=32, page_size=4, prefill_chunk=5, n_pages=40
    )
    assert server.k.sharding.spec[3] is None and server.k.sharding.spec[1] is not None
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    prompts = [list(range(3, 14)), [7, 1, 90, 4, 4]]
    out = server.run([Request(i, p, params) for i, p in enumerate(prompts)])
    alone = Server(model, slots=2, max_len=32, page_size=4).run([Request(i, p, params) for i, p in enumerate(prompts)])
    assert [list(out[i].tokens) for i in (0, 1)] == [list(alone[i].tokens) for i in (0, 1)]


# The released DeepSeek-V3 config.json (deepseek-ai/DeepSeek-V3), FP8 quantization and auto_map aside.
V3_CONFIG = {
    "model_type": "deepseek_v3", "attention_bias": False, "aux_loss_alpha": 0.001, "ep_size": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip


def test_the_released_v3_config_reads_as_configs_deepseek_v3():
    """The released config.json maps to the model of configs/deepseek_v3.yaml (what the planner plans),
    field for field; DeepSeek-V2's routing keys are refused rather than read as V3's."""
    from meshwork.config import load_config
    from meshwork.models.hf.config import config_from_hf

    got = config_from_hf(V3_CONFIG)
    want = load_config(ROOT / "configs/deepseek_v3.yaml").model
    keys = ("kind", "vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "rope_theta", "norm_eps", "mla", "mtp")
    assert {k: getattr(got, k) for k in keys} == {k: getattr(want, k) for k in keys}
    moe_keys = ("n_experts", "top_k", "d_expert", "n_shared_experts", "router", "norm_topk_prob", "n_groups")
    moe_keys += ("topk_groups", "routed_scaling_factor", "first_dense_layers", "capacity_factor")
    assert {k: getattr(got.moe, k) for k in moe_keys} == {k: getattr(want.moe, k) for k in moe_keys}
    assert got.rope_scaling["factor"] == 40 and got.rope_scaling["mscale_all_dim"] == 1.0
    for key, value in (("scoring_func", "softmax"), ("topk_method", "greedy"), ("moe_layer_freq", 2)):
        with pytest.raises(ValueError, match=key):
            config_from_hf(V3_CONFIG | {key: value})
