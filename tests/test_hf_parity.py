"""Hugging Face checkpoints load into meshwork and give HF's logits (golden files; no torch).

tests/fixtures/make_hf_golden.py wrote tests/fixtures/hf/<model>/ with
transformers on CPU (versions in tests/fixtures/hf/versions.json).
"""

import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from meshwork.inference.hf import build_hf_model, load_hf_checkpoint, model_from_hf
from meshwork.inference.hf_config import config_from_hf

from conftest import ROOT

FIXTURES = ROOT / "tests/fixtures/hf"
MODELS = ["llama", "mixtral", "qwen2_moe"]


def hf_config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def max_logit_error(model, name: str) -> float:
    golden = np.load(FIXTURES / name / "golden.npz")
    logits = np.asarray(model(golden["input_ids"]))
    assert logits.dtype == np.float32 and logits.shape == golden["logits"].shape
    return float(np.abs(logits - golden["logits"]).max())


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers(name):
    # Measured on CPU, float32 (benchmarks/hf_parity.py): 2.8e-6 (llama), 2.5e-6 (mixtral),
    # 1.8e-6 (qwen2_moe) for logits up to 3.9 in magnitude; the bound leaves x3.6 headroom.
    _, model = model_from_hf(FIXTURES / name)
    assert max_logit_error(model, name) <= 1e-5


def test_parity_is_sensitive_to_the_conventions():
    """A wrong rope_theta or eps must show far above the tolerance, or the parity test proves little."""
    cfg, params = load_hf_checkpoint(FIXTURES / "llama")
    assert max_logit_error(build_hf_model(cfg.model_copy(update={"rope_theta": 10000.0}), params), "llama") > 1e-2
    params["blocks"]["attn_norm"]["scale"] = np.ones_like(params["blocks"]["attn_norm"]["scale"])
    assert max_logit_error(build_hf_model(cfg, params), "llama") > 1e-2


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


def test_config_mapping_reads_the_older_config_form():
    """transformers 4 wrote rope_theta/rope_scaling at the top level and often omitted head_dim and kv heads."""
    old = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
           "rope_theta": 500000.0, "rope_scaling": None, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    cfg = config_from_hf(old)
    assert (cfg.n_kv_heads, cfg.resolved_head_dim, cfg.rope_theta, cfg.norm_eps) == (32, 128, 5e5, 1e-6)
    # Qwen2-MoE: dense layers off the sparse-step grid are representable when they lead.
    qwen = hf_config("qwen2_moe") | {"mlp_only_layers": [], "decoder_sparse_step": 2, "num_hidden_layers": 2}
    assert config_from_hf(qwen).moe.first_dense_layers == 1


@pytest.mark.parametrize("name, change, match", [
    ("llama", {"model_type": "gpt2"}, "model_type='gpt2' is not supported"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "rope_type 'llama3'"),
    ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("mixtral", {"sliding_window": 4096}, "sliding_window=4096"),
    ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen2_moe", {"mlp_only_layers": [1]}, "dense layers \\[1\\] must be the leading ones"),
])
def test_unsupported_configs_raise(name, change, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(hf_config(name) | change)


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
