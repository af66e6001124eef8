"""Llama checkpoints with scaled RoPE (llama3, linear, dynamic, yarn), and Qwen2 and Qwen3 with yarn, give transformers' logits at
lengths 1, 7 and 2.5x the original context, and its greedy tokens through the KV cache
(goldens: tests/fixtures/make_rope_model_golden.py)."""

import numpy as np
import pytest
from conftest import ROOT

from meshwork.engine.generate import Generator
from meshwork.engine.sampling import SamplingParams
from meshwork.models.hf import model_from_hf
from meshwork.models.layers.layer_pattern import LayerPattern

FIXTURES = ROOT / "tests/fixtures/hf/llama_rope"
# Llama with each scaling, and Qwen2 and Qwen3 with yarn (their long-context setting).
TYPES = ["llama3", "linear", "dynamic", "yarn", "qwen2_yarn", "qwen3_yarn"]


@pytest.fixture(scope="module", params=TYPES)
def loaded(request):
    cfg, model = model_from_hf(FIXTURES / request.param)
    return request.param, cfg, model, np.load(FIXTURES / request.param / "golden.npz")


def test_the_config_carries_the_scaling(loaded):
    name, cfg, _, _ = loaded
    assert cfg.rope_scaling["rope_type"] == name.split("_")[-1]


@pytest.mark.parametrize("length", [1, 7, 40])
def test_logits_match_transformers(loaded, length):
    name, _, model, golden = loaded
    want = golden[f"logits_{length}"]
    got = np.asarray(model(golden[f"input_ids_{length}"]))
    error = np.abs(got - want).max() / np.abs(want).max()
    print(f"{name} L={length}: max |logit error| / max |logit| = {error:.2e}")
    assert error <= 1e-5


def test_scaling_matters_past_the_original_context(loaded):
    """Plain RoPE on the same weights is far off at 40 positions: the test sees the scaling."""
    name, cfg, _, golden = loaded
    plain = model_from_hf(FIXTURES / name)[1]
    plain.blocks.attn.pattern = LayerPattern.uniform(cfg.sliding_window, cfg.rope_theta, None)
    want = golden["logits_40"]
    assert np.abs(np.asarray(plain(golden["input_ids_40"])) - want).max() > 1e-3 * np.abs(want).max()


def test_greedy_generation_matches_transformers(loaded):
    name, _, model, golden = loaded
    n = len(golden["generated"])
    got = Generator(model).generate([golden["prompt"][0].tolist()], SamplingParams(temperature=0.0, max_new_tokens=n))
    assert got[0] == golden["generated"].tolist(), name


def test_export_keeps_the_scaling(loaded, tmp_path):
    from meshwork.inference.hf_export import export_hf

    name, cfg, model, golden = loaded
    cfg2, model2 = model_from_hf(export_hf(cfg, model, tmp_path, max_position_embeddings=4 * 16))
    assert cfg2.rope_scaling == cfg.rope_scaling
    np.testing.assert_array_equal(np.asarray(model2(golden["input_ids_40"])), np.asarray(model(golden["input_ids_40"])))
