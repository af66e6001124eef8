"""Gemma 2 and Gemma 3 checkpoints in and out: parity with transformers, greedy decoding through the
paged cache, the export round trip, refusals.

The fixtures (tests/fixtures/make_family_golden.py) are four tiny random float32 models: `gemma2`
(GQA, window 4 alternating with full layers, attention and final soft-caps small enough that tanh
bends, a query_pre_attn_scalar unlike head_dim, tied), `gemma2_mha`, `gemma3_text` (5 sliding : 1
full, q/k norms, sliding RoPE base 1e4 and full base 1e6 with linear scaling) and `gemma3_text_alt`
(1 : 1, one RoPE). Lengths 1, 7 and 24 (past every window).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT
from hf_family import assert_export_round_trip, assert_greedy_tokens, assert_logits_match

from meshwork.models.hf import model_from_hf
from meshwork.models.hf.config import config_from_hf

FIXTURES = ROOT / "tests/fixtures/hf"
NAMES = ("gemma2", "gemma2_mha", "gemma3_text", "gemma3_text_alt")


# gemma2_mha and gemma3_text_alt repeat their family's claims with other shapes and options: the slow tier's.
@pytest.fixture(
    scope="module",
    params=[n if n in ("gemma2", "gemma3_text") else pytest.param(n, marks=pytest.mark.slow) for n in NAMES],
)
def loaded(request):
    cfg, model = model_from_hf(FIXTURES / request.param)
    return request.param, cfg, model, np.load(FIXTURES / request.param / "golden.npz")


def test_logits_equal_transformers_at_1_7_and_past_the_window(loaded):
    name, cfg, model, golden = loaded
    assert_logits_match(name, model, golden)


def test_greedy_through_the_paged_cache_equals_transformers(loaded):
    """16 greedy tokens from the paged server (prefix caching, 3-token prefill chunks), whose layers
    each attend within their own window and RoPE."""
    name, cfg, model, golden = loaded
    assert_greedy_tokens(name, model, golden, prefix_caching=True, prefill_chunk=3)


def test_export_round_trip_is_bit_exact(loaded, tmp_path):
    name, cfg, model, _ = loaded
    assert_export_round_trip(FIXTURES / name, cfg, model, tmp_path / "out")


@pytest.mark.parametrize(
    "change, key",
    [
        ({"hidden_activation": "relu"}, "hidden_activation"),
        ({"attention_bias": True}, "attention_bias"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"layer_types": ["chunked_attention"] * 6}, "layer_types"),
    ],
)
def test_what_meshwork_cannot_compute_is_refused_by_name(tmp_path, change, key):
    config = json.loads((FIXTURES / "gemma3_text" / "config.json").read_text()) | change
    with pytest.raises(ValueError, match=key):
        config_from_hf(config)


@pytest.mark.parametrize("name", ["gemma2", pytest.param("gemma3_text", marks=pytest.mark.slow)])
def test_the_pallas_kernels_give_transformers_logits_and_tokens(name):
    """model.attention pallas (interpret mode here): the flash kernel soft-caps and windows per layer
    (one lax.switch branch per window), and the paged decode kernel does the same."""
    cfg, model = model_from_hf(FIXTURES / name, attention="pallas")
    assert cfg.attention == "pallas"
    golden = np.load(FIXTURES / name / "golden.npz")
    want = golden["logits_7"]
    got = np.asarray(jax.jit(lambda t: model(t))(jnp.asarray(golden["input_ids_7"])))
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-5
    assert_greedy_tokens(name, model, golden, prompts=1, new_tokens=6, slots=1, max_len=32)
