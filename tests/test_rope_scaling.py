"""Scaled RoPE (linear, llama3, dynamic NTK, yarn) gives transformers' frequencies, cos and sin (no torch).

tests/fixtures/make_rope_golden.py wrote tests/fixtures/hf/rope_scaling.npz with
transformers' LlamaRotaryEmbedding (head_dim 16, original context 16, lengths 1, 7, 40).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT

from meshwork.models.hf.rope import rope_from_hf, rope_to_hf
from meshwork.models.layers.rope import apply_rope, rope_cos_sin, rope_frequencies

GOLDEN = np.load(ROOT / "tests/fixtures/hf/rope_scaling.npz")
META = json.loads(str(GOLDEN["configs"]))
CASES = sorted(META["cases"])
LENGTHS = META["lengths"]
K = META["head_dim"]
# float32 throughout, as transformers computes it: a few ulps of the largest value.
RTOL = 1e-6


def parsed(name: str) -> tuple[float, dict | None]:
    return rope_from_hf(META["base_config"] | META["cases"][name], "llama", 10000.0)


def rel_error(got, want) -> float:
    """Max abs error over the largest golden value (sin at position 0 alone is all zeros: plain abs error)."""
    want = np.asarray(want, np.float64)
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / (np.max(np.abs(want)) or 1.0))


def rotate_half_reference(x_BLHK: np.ndarray, cos_LK: np.ndarray, sin_LK: np.ndarray) -> np.ndarray:
    """transformers' apply_rotary_pos_emb, in numpy."""
    x1, x2 = np.split(x_BLHK, 2, axis=-1)
    rotated = np.concatenate([-x2, x1], axis=-1)
    return x_BLHK * cos_LK[None, :, None] + rotated * sin_LK[None, :, None]


@pytest.mark.parametrize("name", CASES)
def test_matches_transformers(name):
    theta, scaling = parsed(name)
    # Traced positions, as in a jitted forward: dynamic NTK reads max(positions) + 1 at run time.
    cos_sin = jax.jit(lambda pos: rope_cos_sin(pos, K, theta, scaling))
    rope = jax.jit(lambda x, pos: apply_rope(x, pos, theta, scaling))
    for L in LENGTHS:
        g = {k: GOLDEN[f"{name}/L{L}/{k}"] for k in ("inv_freq", "cos", "sin", "attention_scaling")}
        seq_len = L if (scaling or {}).get("rope_type") == "dynamic" else None
        inv_freq, scale = rope_frequencies(K, theta, scaling, seq_len)
        assert rel_error(inv_freq, g["inv_freq"]) <= RTOL, (name, L)
        assert scale == pytest.approx(float(g["attention_scaling"]), rel=1e-12)
        cos, sin = cos_sin(jnp.arange(L)[None])
        # transformers repeats the half-size table ("rotate half").
        assert rel_error(np.tile(cos[0], 2), g["cos"]) <= RTOL, (name, L)
        assert rel_error(np.tile(sin[0], 2), g["sin"]) <= RTOL, (name, L)
        x = np.random.default_rng(L).standard_normal((2, L, 3, K)).astype(np.float32)
        want = rotate_half_reference(x, g["cos"], g["sin"])
        got = rope(jnp.asarray(x), jnp.broadcast_to(jnp.arange(L), (2, L)))
        assert rel_error(got, want) <= 2 * RTOL, (name, L)


def test_scaling_is_not_ignored():
    """Past the original context every scaled type must differ from plain RoPE, and the goldens show it."""
    L = max(LENGTHS)
    default = GOLDEN[f"default/L{L}/cos"]
    for name in CASES:
        if name == "default":
            continue
        assert np.max(np.abs(GOLDEN[f"{name}/L{L}/cos"] - default)) > 1e-2, name
        theta, scaling = parsed(name)
        plain, _ = rope_cos_sin(jnp.arange(L)[None], K, theta)
        ours, _ = rope_cos_sin(jnp.arange(L)[None], K, theta, scaling)
        assert np.max(np.abs(np.asarray(ours) - np.asarray(plain))) > 1e-2, name


def test_dynamic_base_grows_only_past_the_original_context():
    theta, scaling = parsed("dynamic")
    original = scaling["original_max_position_embeddings"]
    plain, _ = rope_frequencies(K, theta)
    at_original, _ = rope_frequencies(K, theta, scaling, original)
    np.testing.assert_array_equal(at_original, plain)
    longer, _ = rope_frequencies(K, theta, scaling, original + 1)
    assert np.all(np.asarray(longer)[1:] < np.asarray(plain)[1:])


def test_default_path_is_plain_rope():
    x = jax.random.normal(jax.random.key(0), (1, 5, 2, 8))
    pos = jnp.arange(5)[None]
    plain = apply_rope(x, pos, 500.0)
    np.testing.assert_array_equal(plain, apply_rope(x, pos, 500.0, {"rope_type": "default"}))
    angles = np.arange(5)[:, None] / 500.0 ** (np.arange(0, 8, 2) / 8)  # float64 reference
    cos, sin = np.cos(angles)[None, :, None], np.sin(angles)[None, :, None]
    x1, x2 = np.split(np.asarray(x, np.float64), 2, axis=-1)
    np.testing.assert_allclose(plain, np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1), atol=1e-6)


def test_rope_from_hf_both_forms():
    params = {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    want = (
        5e5,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
    )
    assert rope_from_hf({"rope_parameters": params}, "llama", 1e4) == want
    old = {k: v for k, v in params.items() if k not in ("rope_type", "rope_theta")} | {"type": "llama3"}
    assert rope_from_hf({"rope_theta": 5e5, "rope_scaling": old}, "llama", 1e4) == want
    # rope_scaling wins over rope_parameters, as in transformers 5.
    assert (
        rope_from_hf(
            {"rope_scaling": old | {"rope_theta": 5e5}, "rope_parameters": {"rope_type": "default"}}, "llama", 1e4
        )
        == want
    )
    assert rope_from_hf({}, "mixtral", 1e6) == (1e6, None)
    assert rope_from_hf({"rope_theta": 2e4, "rope_scaling": None}, "llama", 1e4) == (2e4, None)


def test_rope_from_hf_fills_the_original_context_as_transformers_does():
    yarn = rope_from_hf(
        {
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "truncate": False},
        },
        "qwen2",
        1e4,
    )[1]
    assert yarn == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "truncate": False,
    }
    # The model config keeps the flag a boolean, so an export writes `false`, not 0.
    from meshwork.config_sections import ModelConfig

    assert ModelConfig(rope_scaling=yarn).rope_scaling["truncate"] is False
    # DeepSeek-V3's yarn: no factor, the ratio of the two lengths.
    deepseek = rope_from_hf(
        {
            "max_position_embeddings": 163840,
            "rope_parameters": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096},
        },
        "llama",
        1e4,
    )[1]
    assert deepseek["factor"] == 40.0
    # Dynamic NTK grows from max_position_embeddings, whatever else the dict says.
    dynamic = rope_from_hf(
        {
            "max_position_embeddings": 2048,
            "rope_scaling": {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 99},
        },
        "llama",
        1e4,
    )[1]
    assert dynamic == {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 2048}


@pytest.mark.parametrize(
    "config, match",
    [
        ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}}, "'longrope'"),
        ({"rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 4]}}, "mrope"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ({"partial_rotary_factor": 0.25, "rope_theta": 1e4}, "partial_rotary_factor"),
        (
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                }
            },
            "'low_freq_factor'",
        ),
        ({"rope_parameters": {"rope_type": "linear"}}, "'factor'"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "'max_position_embeddings'"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per-layer"),
    ],
)
def test_rope_from_hf_refuses(config, match):
    with pytest.raises(ValueError, match=match):
        rope_from_hf(config, "llama", 1e4)


@pytest.mark.parametrize(
    "scaling, match",
    [
        ({"rope_type": "longrope", "factor": 2.0}, "'longrope'"),
        ({"factor": 2.0}, "rope_type"),
        (
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 16},
            "'high_freq_factor'",
        ),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fst": 8}, "'beta_fst'"),
    ],
)
def test_rope_frequencies_refuses(scaling, match):
    with pytest.raises(ValueError, match=match):
        rope_frequencies(K, 1e4, scaling)


@pytest.mark.parametrize("name", CASES)
def test_rope_to_hf_round_trips(name):
    theta, scaling = parsed(name)
    exported = rope_to_hf(theta, scaling)
    for form in ("rope_parameters", "rope_scaling"):
        alone = {k: v for k, v in exported.items() if k != form}
        assert rope_from_hf(META["base_config"] | alone, "llama", 1.0) == (theta, scaling), form
