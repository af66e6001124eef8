"""Qwen3-Next checkpoints in and out: parity with transformers, greedy decoding through the serving
engine (recurrent states per slot beside the paged KV of the full-attention layers), the export round
trip, refusals.

The fixtures (tests/fixtures/make_qwen3_next_golden.py) are two tiny random float32 hybrids:
`qwen3_next` (3 Gated DeltaNet layers then a gated full-attention layer, GQA, quarter-rotary heads, 4
experts top-2 beside a gated shared expert) and `qwen3_next_alt` (linear, full, linear; MHA,
half-rotary; top-1 of 3 experts, un-normalized; a dense middle layer; tied).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT
from hf_family import assert_export_round_trip, assert_greedy_tokens, assert_logits_match

from meshwork.config import ConfigError
from meshwork.engine.generate import Generator
from meshwork.engine.kv_cache import cache_layers
from meshwork.engine.recurrent_states import RecurrentStates
from meshwork.engine.sampling import SamplingArrays, SamplingParams
from meshwork.engine.serving import Request, Server
from meshwork.models.hf import load_hf_checkpoint, model_from_hf
from meshwork.models.hf.config import config_from_hf
from meshwork.sharding.mesh import make_mesh
from meshwork.sharding.rules import rules_for

FIXTURES = ROOT / "tests/fixtures/hf"
NAMES = ("qwen3_next", "qwen3_next_alt")


# The second configuration repeats every claim with other shapes and options: the slow tier's.
@pytest.fixture(scope="module", params=[NAMES[0], *(pytest.param(n, marks=pytest.mark.slow) for n in NAMES[1:])])
def loaded(request):
    cfg, model = model_from_hf(FIXTURES / request.param)
    return request.param, cfg, model, np.load(FIXTURES / request.param / "golden.npz")


def test_logits_equal_transformers_at_1_7_and_24_tokens(loaded):
    name, cfg, model, golden = loaded
    assert cfg.linear_layers and cfg.attention_output_gate and cfg.partial_rotary_factor < 1
    assert_logits_match(name, model, golden)


def test_greedy_through_the_serving_engine_equals_transformers(loaded):
    """16 greedy tokens from the paged server, prompts prefilled in 3-token chunks (each chunk continues
    its slot's recurrent state; its padding leaves the state alone) while another slot decodes."""
    name, cfg, model, golden = loaded
    server = Server(model, slots=2, max_len=64, page_size=4, prefill_chunk=3)
    assert server.k.shape[0] == cache_layers(cfg) == cfg.n_layers - len(cfg.linear_layers)
    prompt = golden["prompt"][0].tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    results = server.run([Request(0, prompt, params), Request(1, prompt[:5], params), Request(2, prompt, params)])

    assert list(results[0].tokens) == golden["generated"].tolist() == list(results[2].tokens), name


@pytest.mark.slow
def test_serving_with_heads_split_over_tensor_gives_transformers_tokens():
    """Attention's and the DeltaNet's heads split over tensor, the states and pages with them:
    transformers' greedy tokens still come out."""
    cfg, model = model_from_hf(FIXTURES / "qwen3_next")
    golden = np.load(FIXTURES / "qwen3_next" / "golden.npz")
    # Heads over tensor 2, the rest of the 8 devices replicas of it: the server's one-row prefill
    # chunks cannot split over data replicas in a MoE layer (a known limit of MoE serving).
    mesh, rules = make_mesh({"sequence": 4, "tensor": 2}), rules_for("tp", {"vocab": None})
    assert_greedy_tokens("qwen3_next", model, golden, prompts=3, slots=8, mesh=mesh, rules=rules, prefill_chunk=5)


def test_preempted_requests_recompute_their_states(loaded):
    """A pool too small for three 24-token sequences preempts one; it returns to a slot whose states
    are zeroed and re-prefills its prompt and tokens, so every request still gets transformers' tokens."""
    name, cfg, model, golden = loaded
    server = Server(model, slots=3, max_len=32, page_size=4, n_pages=14)
    prompt = golden["prompt"][0].tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    results = server.run([Request(i, prompt, params) for i in range(3)])
    assert server.preemptions >= 1
    assert all(list(results[i].tokens) == golden["generated"].tolist() for i in range(3)), name


def test_batched_prefill_with_padding_equals_one_row_at_a_time(loaded):
    """The contiguous generator prefills right-padded prompts of different lengths in one batch: the
    padding sits past the cache, so each row's states and first token equal the prompt run alone."""
    name, cfg, model, golden = loaded
    gen = Generator(model)
    prompt = golden["prompt"][0]
    tokens = np.zeros((2, 8), np.int32)
    tokens[0], tokens[1, :5] = prompt, prompt[:5]
    arrays = SamplingArrays.stack([SamplingParams(temperature=0.0)] * 2)
    batch = gen.prefill(tokens, np.array([8, 5]), gen.new_cache(2, 32), arrays)
    alone = gen.prefill(tokens[1:, :5], np.array([5]), gen.new_cache(1, 32), SamplingArrays.stack([SamplingParams()]))
    assert int(batch.tokens[0]) == int(golden["generated"][0])
    np.testing.assert_allclose(np.asarray(batch.logits[1]), np.asarray(alone.logits[0]), rtol=1e-5, atol=1e-5)
    for a, b in zip(batch.cache.states.arrays, alone.cache.states.arrays):
        np.testing.assert_allclose(np.asarray(a[:, 1]), np.asarray(b[:, 0]), rtol=1e-5, atol=1e-6)


def test_export_round_trip_is_bit_exact(loaded, tmp_path):
    name, cfg, model, _ = loaded
    assert_export_round_trip(FIXTURES / name, cfg, model, tmp_path / "out")


def test_states_are_a_fixed_size_per_sequence_and_prefix_caching_is_refused(loaded):
    name, cfg, model, _ = loaded
    states = RecurrentStates.zeros(cfg, 3, jnp.float32)
    assert sum(a.nbytes for a in states.arrays) == 3 * RecurrentStates.bytes_per_sequence(cfg, jnp.float32)
    with pytest.raises(ConfigError, match="prefix caching"):
        Server(model, slots=2, max_len=32, page_size=4, prefix_caching=True)


def test_the_mtp_layer_of_a_released_checkpoint_is_left_unread(tmp_path):
    """Released Qwen3-Next folders also hold an MTP layer (`mtp.*`), which transformers does not run:
    the loader leaves it, and the model is the same."""
    import shutil

    from safetensors.numpy import save_file

    folder = tmp_path / "qwen3_next"
    shutil.copytree(FIXTURES / "qwen3_next", folder)
    save_file({"mtp.fc.weight": np.ones((4, 8), np.float32)}, folder / "mtp.safetensors")
    _, with_mtp = load_hf_checkpoint(folder)
    _, plain = load_hf_checkpoint(FIXTURES / "qwen3_next")
    for a, b in zip(jax.tree.leaves(with_mtp), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "change, key",
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"layer_types": ["sliding_attention"] * 4}, "layer_types"),
        ({"linear_num_value_heads": 3}, "num_v_heads"),
    ],
)
def test_what_meshwork_cannot_compute_is_refused_by_name(change, key):
    config = json.loads((FIXTURES / "qwen3_next" / "config.json").read_text()) | change
    with pytest.raises(ValueError, match=key):
        config_from_hf(config)
