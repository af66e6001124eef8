"""Mistral's sliding window: a checkpoint whose window (8) is shorter than the sequences gives
transformers' logits and greedy tokens (golden: tests/fixtures/make_sliding_window_golden.py),
through the full forward pass and through every KV-cache path; every attention path agrees with
a NumPy mask formula; and a per-layer mix of windowed and full layers is refused."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshwork.config_sections import ModelConfig, MoEConfig
from meshwork.engine.generate import Generator
from meshwork.engine.kv_cache import KVCache, PagedKVCache
from meshwork.engine.sampling import SamplingParams
from meshwork.inference.hf_export import export_hf, hf_config
from meshwork.kernels.decode_attention import decode_attention, decode_attention_reference
from meshwork.models.hf import model_from_hf
from meshwork.models.hf.config import config_from_hf
from meshwork.models.layers.attention import attend

# Not from conftest: benchmarks/gpu_suite.sh runs the kernel cases on the GPU with --noconftest.
ROOT = pathlib.Path(__file__).resolve().parents[1]

FIXTURE = ROOT / "tests/fixtures/hf/mistral_window"
WINDOW = 8
LENGTHS = (1, 7, 27)  # 27 > 2 x WINDOW


@pytest.fixture(scope="module")
def loaded():
    cfg, model = model_from_hf(FIXTURE)
    return cfg, model, np.load(FIXTURE / "golden.npz")


def relative_error(got, want) -> float:
    return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


# --------------------------------------------------------------------------
# The checkpoint against transformers
# --------------------------------------------------------------------------


@pytest.mark.parametrize("length", LENGTHS)
def test_logits_match_transformers(loaded, length):
    cfg, model, golden = loaded
    assert cfg.sliding_window == WINDOW
    error = relative_error(model(golden[f"input_ids_{length}"]), golden[f"logits_{length}"])
    print(f"mistral window={WINDOW} L={length}: max |logit error| / max |logit| = {error:.2e}")
    assert error <= 1e-5


def test_the_window_matters(loaded):
    """The same weights without the window are far off at 27 positions: the tests above see it."""
    _, _, golden = loaded
    plain = model_from_hf(FIXTURE)[1]
    plain.blocks.attn.window = None
    assert relative_error(plain(golden["input_ids_27"]), golden["logits_27"]) > 1e-2


def test_greedy_generation_through_the_cache_matches_transformers(loaded):
    """16 greedy tokens after a 20-token prompt (decoding reaches position 35 > 4 x window)."""
    _, model, golden = loaded
    n = len(golden["generated"])
    got = Generator(model).generate([golden["prompt"][0].tolist()], SamplingParams(temperature=0.0, max_new_tokens=n))
    print(f"greedy tokens equal transformers': {got[0] == golden['generated'].tolist()}")
    assert got[0] == golden["generated"].tolist()


def paged(cfg, pages_per_seq=8, page_size=4):
    """One sequence's pages, out of order in the pool (page 0 is the null page)."""
    cache = PagedKVCache.zeros(
        cfg, n_pages=1 + pages_per_seq, page_size=page_size, batch=1, pages_per_seq=pages_per_seq
    )
    order = 1 + np.random.default_rng(0).permutation(pages_per_seq)[None]
    return PagedKVCache(cache.k, cache.v, jnp.asarray(order, jnp.int32))


@pytest.mark.parametrize("cache, impl", [("contiguous", "xla"), ("paged", "xla"), ("contiguous", "pallas")])
def test_every_cache_path_gives_transformers_logits(loaded, cache, impl):
    """A 10-token prefill (already past the window), then one token at a time to 27: each step's
    logits are transformers'. impl pallas runs the one-token steps in the flash-decoding kernel
    (interpreted on CPU) with the window given to the kernel."""
    cfg, _, golden = loaded
    model = model_from_hf(FIXTURE)[1]
    model.blocks.attn.impl = impl
    gen = Generator(model)
    ids, want = golden["input_ids_27"], golden["logits_27"][0]
    kv = KVCache.zeros(cfg, 1, 32) if cache == "contiguous" else paged(cfg)
    prefill = 10
    logits, kv = gen.forward(ids[:, :prefill], np.arange(prefill)[None], kv)
    got = [np.asarray(logits[0])]
    for p in range(prefill, ids.shape[1]):
        logits, kv = gen.forward(ids[:, p : p + 1], np.array([[p]]), kv)
        got.append(np.asarray(logits[0]))
    error = relative_error(np.concatenate(got), want)
    print(f"{cache} cache, {impl}: max |logit error| / max |logit| = {error:.2e}")
    assert error <= 1e-5


def test_export_writes_the_window(loaded, tmp_path):
    cfg, model, golden = loaded
    path = export_hf(cfg, model, tmp_path, max_position_embeddings=64)
    written = json.loads((path / "config.json").read_text())
    assert (written["model_type"], written["sliding_window"]) == ("mistral", WINDOW)
    cfg2, model2 = model_from_hf(path)
    assert cfg2.sliding_window == WINDOW
    np.testing.assert_array_equal(np.asarray(model2(golden["input_ids_27"])), np.asarray(model(golden["input_ids_27"])))


# --------------------------------------------------------------------------
# Every attention path against the mask formula
# --------------------------------------------------------------------------


def numpy_attention(q, k, v, visible):
    """softmax(q k^T / sqrt(K), masked by visible[b, i, j]) v with G kv heads shared by H/G query heads."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    s = np.einsum("blhk,bshk->bhls", q, k) / np.sqrt(q.shape[-1])
    s = np.where(visible[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhls,bshk->blhk", p / p.sum(-1, keepdims=True), v)


def visible_mask(L, segments, window):
    """Key j visible to query i iff j <= i, i - window < j (window) and both in one document."""
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    mask = (j <= i) & ((i - j < window) if window else True)
    return mask[None] & (segments[:, :, None] == segments[:, None, :])


@pytest.fixture(scope="module")
def qkv():
    B, L, H, G, K = 2, 24, 2, 1, 8
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (B, L, H, K))
    # Keys scaled up: a sharp softmax makes a dropped or extra key visible in the output.
    return q, 3 * jax.random.normal(kk, (B, L, G, K)), jax.random.normal(kv, (B, L, G, K))


@pytest.mark.parametrize("impl", ["xla", "pallas", "reference"])
@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "packed"])
def test_attend_paths_agree_with_the_mask_formula(qkv, impl, packed):
    q, k, v = qkv
    B, L = q.shape[:2]
    window = 5
    segments = (
        np.stack([np.repeat([0, 1], [10, 14]), np.repeat([0, 1, 2], [3, 13, 8])])
        if packed
        else np.zeros((B, L), np.int32)
    )
    seg = jnp.asarray(segments, jnp.int32) if packed else None
    got = np.asarray(attend(q, k, v, causal=True, impl=impl, segment_ids_BL=seg, window=window))
    want = numpy_attention(q, k, v, visible_mask(L, segments, window))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # The window changes the answer, so this test would catch a path that ignored it.
    unwindowed = numpy_attention(q, k, v, visible_mask(L, segments, None))
    assert np.abs(unwindowed - want).max() > 0.1


@pytest.mark.parametrize("window", [1, 5, 40])
def test_decode_kernel_takes_the_window(window):
    """One query per sequence at position length - 1 sees keys length - window .. length - 1; the
    chunks (16 keys, steps of 8) put the window's start inside a chunk, on a chunk edge and before key 0."""
    B, S, H, G, K = 3, 48, 4, 2, 8
    kq, kk, kv = jax.random.split(jax.random.key(1), 3)
    q, k, v = (
        jax.random.normal(kq, (B, H, K)),
        3 * jax.random.normal(kk, (B, S, G, K)),
        jax.random.normal(kv, (B, S, G, K)),
    )
    lengths = np.array([3, 21, 48])

    def run(**kw):
        return np.asarray(decode_attention(q, k, v, jnp.asarray(lengths), chunk=16, block_kv=8, **kw))

    got = run(window=window)
    j = np.arange(S)[None, :]
    visible = ((j < lengths[:, None]) & (j >= lengths[:, None] - window))[:, None, :]  # (B, 1 query, S)
    want = numpy_attention(q[:, None], k, v, visible)[:, 0]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    np.testing.assert_allclose(
        decode_attention_reference(q, k, v, jnp.asarray(lengths), window=window), want, atol=1e-5 * np.abs(want).max()
    )
    if window < S:
        assert np.abs(run() - want).max() > 0.1  # the window changes the answer


# --------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------


def qwen2(**change) -> dict:
    return json.loads((ROOT / "tests/fixtures/hf/qwen2/config.json").read_text()) | change


@pytest.mark.parametrize(
    "change, match",
    [
        (
            dict(use_sliding_window=True, sliding_window=8, layer_types=["full_attention", "sliding_attention"]),
            "qwen2 config layer_types=\\['full_attention', 'sliding_attention'\\]: layers \\[1\\] have sliding_window=8 "
            "and the others full attention; meshwork has one attention for every layer",
        ),
        (
            dict(use_sliding_window=True, sliding_window=8, layer_types=None, max_window_layers=1),
            "qwen2 config max_window_layers=1: layers \\[1\\] have sliding_window=8",
        ),
    ],
)
def test_a_per_layer_mix_is_refused(change, match):
    with pytest.raises(ValueError, match=match) as info:
        config_from_hf(qwen2(**change))
    assert "\n" not in str(info.value)


def test_windows_that_reach_every_layer_are_read():
    """As transformers reads them: the window only with use_sliding_window, in every layer, shorter
    than max_position_embeddings (64 here); otherwise plain causal attention."""
    sliding = ["sliding_attention"] * 2
    assert config_from_hf(qwen2(use_sliding_window=True, sliding_window=8, layer_types=sliding)).sliding_window == 8
    assert (
        config_from_hf(
            qwen2(use_sliding_window=True, sliding_window=8, layer_types=None, max_window_layers=0)
        ).sliding_window
        == 8
    )
    assert config_from_hf(qwen2(use_sliding_window=False, sliding_window=8, layer_types=None)).sliding_window is None
    assert config_from_hf(qwen2(use_sliding_window=True, sliding_window=64, layer_types=sliding)).sliding_window is None
    mistral = json.loads((FIXTURE / "config.json").read_text())
    for window, want in [(None, None), (8, 8), (64, None)]:
        assert config_from_hf(mistral | {"sliding_window": window}).sliding_window == want


def test_export_refuses_a_window_it_cannot_write_back():
    moe = ModelConfig(kind="moe", moe=MoEConfig(router="softmax"), sliding_window=8)
    with pytest.raises(ValueError, match="cannot export to Mixtral: sliding_window=8"):
        hf_config(moe)
    c = hf_config(ModelConfig(qkv_bias=True, sliding_window=8))
    assert (c["model_type"], c["use_sliding_window"], c["sliding_window"], c["layer_types"]) == (
        "qwen2",
        True,
        8,
        ["sliding_attention"] * c["num_hidden_layers"],
    )
    assert config_from_hf(c).sliding_window == 8
