"""Hugging Face checkpoints load into meshwork and give HF's logits (golden files; no torch),
at 16, 1 and 7 tokens, for every family, Qwen2-MoE with dense layers anywhere among them
(`pytest -s` prints the errors; tests/test_hf_generate.py checks greedy tokens).

tests/fixtures/make_hf_golden.py wrote tests/fixtures/hf/<model>/ with
transformers on CPU (versions in tests/fixtures/hf/versions.json).
"""

import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import ROOT
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from meshwork.models.hf import build_hf_model, load_hf_checkpoint, model_from_hf
from meshwork.models.hf.config import config_from_hf

FIXTURES = ROOT / "tests/fixtures/hf"
MODELS = ["llama", "mixtral", "qwen2_moe", "qwen2", "qwen3", "mistral", "qwen3_moe"]
# Qwen2-MoE with dense layers after a MoE layer: decoder_sparse_step 2, mlp_only_layers [1].
PATTERNS = ["qwen2_moe_step2", "qwen2_moe_mlp_only"]


def hf_config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def max_logit_error(model, name: str, suffix: str = "") -> float:
    """max |logit error| against golden.npz's logits{suffix} (the (2, 16) batch, or `_1`, `_7`)."""
    golden = np.load(FIXTURES / name / "golden.npz")
    logits = np.asarray(model(golden["input_ids" + suffix]))
    assert logits.dtype == np.float32 and logits.shape == golden["logits" + suffix].shape
    return float(np.abs(logits - golden["logits" + suffix]).max())


@pytest.fixture(scope="module")
def loaded():
    """name -> the model loaded from its fixture folder, once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = model_from_hf(FIXTURES / name)[1]
        return cache[name]

    return get


# Every family at 16 tokens in the quick tier; the 1- and 7-token lengths (the same code path at
# another length) for llama there, for the other families in the slow tier.
@pytest.mark.parametrize(
    "name, length",
    [
        pytest.param(
            name, length, id=f"{name}-{length}", marks=[] if length == 16 or name == "llama" else [pytest.mark.slow]
        )
        for name in MODELS + PATTERNS
        for length in (16, 1, 7)
    ],
)
def test_logits_match_transformers(loaded, name, length):
    # Measured on CPU, float32 (2026-12-02, benchmarks/RESULTS.md): max |error| / max |logit| at most
    # 1.2e-6 over the families and lengths, for logits up to 4.3 in magnitude; the bound is 1e-5.
    suffix = "" if length == 16 else f"_{length}"
    error = max_logit_error(loaded(name), name, suffix)
    top = float(np.abs(np.load(FIXTURES / name / "golden.npz")["logits" + suffix]).max())
    print(f"{name} L={length}: max |logit error| / max |logit| = {error / top:.1e}")
    assert error <= 1e-5 and error / top <= 1e-5


def test_parity_is_sensitive_to_the_conventions():
    """A wrong rope_theta or eps must show far above the tolerance, or the parity test proves little."""
    cfg, params = load_hf_checkpoint(FIXTURES / "llama")
    assert max_logit_error(build_hf_model(cfg.model_copy(update={"rope_theta": 10000.0}), params), "llama") > 1e-2
    params["blocks"]["attn_norm"]["scale"] = np.ones_like(params["blocks"]["attn_norm"]["scale"])
    assert max_logit_error(build_hf_model(cfg, params), "llama") > 1e-2
    # Qwen3's q/k norm scales are read and applied (here: replaced by HF's init, ones).
    cfg, params = load_hf_checkpoint(FIXTURES / "qwen3")
    assert jax.tree.map(np.shape, params["blocks"]["attn"]["q_norm"]) == {"scale": (2, 16)}
    for which in ("q_norm", "k_norm"):
        changed = jax.tree.map(np.copy, params)
        changed["blocks"]["attn"][which]["scale"] = np.ones_like(params["blocks"]["attn"][which]["scale"])
        assert max_logit_error(build_hf_model(cfg, changed), "qwen3") > 1e-2


def test_config_mapping():
    llama = config_from_hf(hf_config("llama"))
    assert (llama.kind, llama.vocab_size, llama.d_model, llama.n_layers) == ("transformer", 128, 64, 3)
    assert (llama.n_heads, llama.n_kv_heads, llama.resolved_head_dim, llama.d_ff) == (4, 2, 24, 80)
    assert (llama.rope_theta, llama.norm_eps, llama.qkv_bias, llama.tie_embeddings) == (5e5, 1e-5, False, False)

    mixtral = config_from_hf(hf_config("mixtral"))
    m = mixtral.moe
    assert mixtral.kind == "moe" and mixtral.rope_theta == 25000.0 and mixtral.resolved_head_dim == 16
    assert (m.n_experts, m.top_k, m.d_expert, m.n_shared_experts, m.first_dense_layers) == (8, 2, 16, 0, 0)
    assert m.router == "softmax" and m.norm_topk_prob and m.aux_loss_coef == 0.02

    qwen = config_from_hf(hf_config("qwen2_moe"))
    q = qwen.moe
    assert qwen.kind == "moe" and qwen.qkv_bias and qwen.tie_embeddings and qwen.d_ff == 64
    assert (q.n_experts, q.top_k, q.d_expert, q.n_shared_experts, q.d_shared) == (4, 2, 16, 1, 32)
    assert q.shared_expert_gate and not q.norm_topk_prob and q.first_dense_layers == 1

    qwen2 = config_from_hf(hf_config("qwen2"))
    assert (qwen2.kind, qwen2.qkv_bias, qwen2.qk_norm, qwen2.resolved_head_dim) == ("transformer", True, False, 12)
    assert (qwen2.vocab_size, qwen2.n_kv_heads, qwen2.rope_theta, qwen2.norm_eps) == (97, 2, 1e6, 1e-6)

    qwen3 = config_from_hf(hf_config("qwen3"))
    assert (qwen3.kind, qwen3.qkv_bias, qwen3.qk_norm, qwen3.resolved_head_dim) == ("transformer", False, True, 16)
    assert (qwen3.d_model, qwen3.n_heads, qwen3.n_kv_heads, qwen3.tie_embeddings) == (48, 4, 2, True)

    mistral = config_from_hf(hf_config("mistral"))
    assert (mistral.kind, mistral.qkv_bias, mistral.qk_norm, mistral.n_kv_heads) == ("transformer", False, False, 1)
    assert (mistral.resolved_head_dim, mistral.norm_eps) == (12, 1e-5)

    qwen3_moe = config_from_hf(hf_config("qwen3_moe"))
    q = qwen3_moe.moe
    assert qwen3_moe.kind == "moe" and qwen3_moe.qk_norm and not qwen3_moe.qkv_bias and qwen3_moe.d_ff == 48
    assert (q.n_experts, q.top_k, q.d_expert, q.n_shared_experts, q.first_dense_layers) == (4, 2, 16, 0, 1)
    assert q.norm_topk_prob and not q.shared_expert_gate


def test_mistral_sliding_window_that_never_masks_is_accepted():
    """null, or a window at least max_position_embeddings long, is plain causal attention."""
    for window in (None, 64, 4096):
        assert config_from_hf(hf_config("mistral") | {"sliding_window": window}).kind == "transformer"


def test_qwen3_moe_reads_num_experts_too():
    """Hub Qwen3-MoE configs name the expert count num_experts; transformers 5 writes num_local_experts."""
    hub = {k: v for k, v in hf_config("qwen3_moe").items() if k != "num_local_experts"} | {"num_experts": 4}
    assert config_from_hf(hub).moe.n_experts == 4


def test_config_mapping_reads_the_older_config_form():
    """transformers 4 wrote rope_theta/rope_scaling at the top level and often omitted head_dim and kv heads."""
    old = {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }
    cfg = config_from_hf(old)
    assert (cfg.n_kv_heads, cfg.resolved_head_dim, cfg.rope_theta, cfg.norm_eps) == (32, 128, 5e5, 1e-6)
    # Qwen2-MoE: dense layers off the sparse-step grid are representable when they lead.
    qwen = hf_config("qwen2_moe") | {"mlp_only_layers": [], "decoder_sparse_step": 2, "num_hidden_layers": 2}
    assert config_from_hf(qwen).moe.first_dense_layers == 1


@pytest.mark.parametrize(
    "name, change, match",
    [
        ("llama", {"model_type": "gpt2"}, "model_type='gpt2' is not supported"),
        (
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "longrope",
                    "rope_theta": 5e5,
                    "short_factor": [1.0],
                    "long_factor": [1.0],
                }
            },
            "rope_type 'longrope' is not implemented",
        ),
        ("llama", {"rope_scaling": {"type": "mrope", "mrope_section": [1, 1]}}, "mrope_section"),
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("mixtral", {"sliding_window": 4096}, "sliding_window=4096"),
        ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window"),
        (
            "qwen2_moe",
            {"decoder_sparse_step": -2},
            "qwen2_moe config decoder_sparse_step=-2: expected a positive integer",
        ),
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"]},
            "qwen2 config layer_types=\\['sliding_attention', 'full_attention'\\]: layers \\[0\\] have sliding_window=32",
        ),
        ("qwen2", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ("qwen3", {"attention_bias": True}, "attention_bias=True"),
        ("qwen3", {"head_dim": None}, "no 'head_dim'"),
        (
            "qwen3",
            {"use_sliding_window": True, "sliding_window": 32, "layer_types": None, "max_window_layers": 1},
            "qwen3 config max_window_layers=1: layers \\[1\\] have sliding_window=32 and the others full attention",
        ),
    ],
)
def test_unsupported_configs_raise(name, change, match):
    with pytest.raises(ValueError, match=match) as info:
        config_from_hf(hf_config(name) | change)
    assert "\n" not in str(info.value)


def test_weights_that_do_not_fit_the_config_raise(tmp_path):
    shutil.copy(FIXTURES / "llama/model.safetensors", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_config("llama") | {"num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="have no place"):
        load_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_config("llama") | {"intermediate_size": 96}))
    with pytest.raises(ValueError, match="mlp.gate_proj.weight' has shape"):
        load_hf_checkpoint(tmp_path)


def test_sharded_bfloat16_checkpoint(tmp_path):
    """Real checkpoints are bf16 and split over files listed in model.safetensors.index.json."""
    with safe_open(FIXTURES / "llama/model.safetensors", framework="numpy") as f:
        tensors = {k: f.get_tensor(k).astype(ml_dtypes.bfloat16) for k in f.keys()}
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, tmp_path / file)
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(FIXTURES / "llama/config.json", tmp_path)

    cfg, params = load_hf_checkpoint(tmp_path)
    _, reference = load_hf_checkpoint(FIXTURES / "llama")
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(reference)):
        assert got.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(got, want.astype(ml_dtypes.bfloat16))
    # bf16 weights, float32 compute: close to the float32 logits, within bf16 rounding.
    assert max_logit_error(build_hf_model(cfg, params), "llama") < 0.1


@pytest.mark.parametrize(
    "name, change, dense",
    [
        ("qwen2_moe", {"mlp_only_layers": [], "decoder_sparse_step": 2}, (0, 2)),  # off the step grid
        ("qwen2_moe", {"mlp_only_layers": [1]}, (1,)),  # listed, after a MoE layer
        ("qwen2_moe", {"mlp_only_layers": [0, 7], "decoder_sparse_step": 3}, (0, 1)),  # leading; 7 past the end
        ("qwen3_moe", {"mlp_only_layers": [2]}, (2,)),
        ("qwen3_moe", {"mlp_only_layers": [0, 2]}, (0, 2)),
    ],
)
def test_dense_layers_anywhere_follow_transformers(name, change, dense):
    """Layer i is a MoE layer iff i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    (transformers' Qwen2MoeDecoderLayer); leading dense layers keep first_dense_layers."""
    cfg = config_from_hf(hf_config(name) | change)
    assert cfg.moe.dense_layer_indices(cfg.n_layers) == dense
    leading = dense == tuple(range(len(dense)))
    assert (cfg.moe.first_dense_layers, cfg.moe.dense_layers) == ((len(dense), None) if leading else (0, dense))


def test_pattern_fixtures_map_to_runs():
    step2, mlp_only = (config_from_hf(hf_config(n)) for n in PATTERNS)
    assert step2.moe.dense_layers == (0, 2) and step2.qkv_bias and not step2.moe.norm_topk_prob
    assert [r.name for r in step2.moe.layer_runs(step2.n_layers)] == [
        "dense_blocks_0",
        "moe_blocks_1",
        "dense_blocks_2",
        "moe_blocks_3",
    ]
    assert mlp_only.moe.dense_layers == (1,) and not mlp_only.qkv_bias and mlp_only.moe.norm_topk_prob
    assert (mlp_only.moe.n_shared_experts, mlp_only.moe.d_shared, mlp_only.moe.shared_expert_gate) == (1, 24, True)


@pytest.mark.parametrize(
    "name, step, mlp_only", [("qwen2_moe_step2", 2, []), ("qwen2_moe_mlp_only", 1, [1]), ("qwen2_moe", 1, [0])]
)
def test_export_round_trip_keeps_the_dense_layers(loaded, tmp_path, name, step, mlp_only):
    """load -> export -> load: the same parameters and the hub file's tensors bit for bit, with a
    decoder_sparse_step and mlp_only_layers that make the same layers dense (what transformers
    computes from such an export: tests/fixtures/hf/export_check.json)."""
    from meshwork.inference.hf_export import export_hf

    model = loaded(name)
    export_hf(model.cfg, model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert (written["model_type"], written["decoder_sparse_step"], written["mlp_only_layers"]) == (
        "qwen2_moe",
        step,
        mlp_only,
    )
    with (
        safe_open(FIXTURES / name / "model.safetensors", framework="numpy") as a,
        safe_open(tmp_path / "model.safetensors", framework="numpy") as b,
    ):
        assert sorted(a.keys()) == sorted(b.keys())
        for k in a.keys():
            np.testing.assert_array_equal(a.get_tensor(k), b.get_tensor(k), err_msg=k)
    cfg2, params2 = load_hf_checkpoint(tmp_path)
    assert cfg2 == model.cfg
    want = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert jax.tree.structure(params2) == jax.tree.structure(want)
    for got, ref in zip(jax.tree.leaves(params2), jax.tree.leaves(want)):
        np.testing.assert_array_equal(got, np.asarray(ref))
