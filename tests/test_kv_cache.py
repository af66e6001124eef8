"""KV-cache decoding gives the logits of a full forward pass, on one device and sharded on eight,
with a contiguous or a paged cache, and the decode step updates the cache in place."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT
from flax import nnx

from meshwork.config import load_config
from meshwork.engine.generate import Generator
from meshwork.engine.kv_cache import KVCache, PagedKVCache, cache_bytes_per_token
from meshwork.engine.sampling import SamplingArrays, SamplingParams
from meshwork.inference.runs import load_run
from meshwork.models.build import build_model
from meshwork.sharding.mesh import make_mesh
from meshwork.sharding.rules import rules_for

PROMPT_LENGTHS = (5, 13, 2, 9)
NEW = 6  # decode steps after the prefill


@pytest.fixture(scope="module")
def trained(lm_tiny_runs):
    cfg, model, _ = load_run(lm_tiny_runs["1dev"]["run_dir"])
    return cfg, model


@pytest.fixture(scope="module")
def sequences(trained):
    """Per row: prompt + NEW tokens (real text from the corpus's byte range)."""
    rng = np.random.default_rng(0)
    text = np.frombuffer(b"def add(a, b):\n    return a + b\nclass Point:\n    x: int = 0\n", np.uint8)
    return [text[rng.integers(0, len(text) - 30) :][: n + NEW].astype(np.int32) for n in PROMPT_LENGTHS]


def cached_logits(gen: Generator, sequences, cache) -> list[np.ndarray]:
    """Prefill the right-padded prompts in one call, then feed the known continuation one token
    at a time; per row, the logits at positions 0..len+NEW-1 as the cache path computed them.
    The batch is the cache's (rows past the prompts repeat the first one)."""
    B, L = cache.k.shape[1] if isinstance(cache, KVCache) else len(sequences), max(PROMPT_LENGTHS)
    lengths = [PROMPT_LENGTHS[b] if b < len(sequences) else PROMPT_LENGTHS[0] for b in range(B)]
    rows = [sequences[b] if b < len(sequences) else sequences[0] for b in range(B)]
    tokens = np.zeros((B, L), np.int32)
    for b, n in enumerate(lengths):
        tokens[b, :n] = rows[b][:n]
    logits, cache = gen.forward(tokens, np.broadcast_to(np.arange(L), (B, L)), cache)
    out = [list(np.asarray(logits[b, :n])) for b, n in enumerate(lengths)]
    for step in range(NEW):
        pos = np.array([n + step for n in lengths], np.int32)
        tok = np.array([s[p] for s, p in zip(rows, pos)], np.int32)
        logits, cache = gen.forward(tok[:, None], pos[:, None], cache)
        for b in range(B):
            out[b].append(np.asarray(logits[b, 0]))
    return [np.stack(rows) for rows in out[: len(sequences)]]


def full_logits(model, sequences) -> list[np.ndarray]:
    """One causal forward over the batch right-padded to the longest row (padding comes after
    every position compared, so it cannot change them)."""
    L = max(len(s) for s in sequences)
    tokens = np.zeros((len(sequences), L), np.int32)
    for b, s in enumerate(sequences):
        tokens[b, : len(s)] = s
    logits = np.asarray(model(jnp.asarray(tokens)))
    return [logits[b, : len(s)] for b, s in enumerate(sequences)]


def paged_cache(cfg, B: int, page_size: int = 4, pages_per_seq: int = 8) -> PagedKVCache:
    """Each row gets its own pages, deliberately out of order in the pool."""
    cache = PagedKVCache.zeros(
        cfg.model, n_pages=1 + B * pages_per_seq, page_size=page_size, batch=B, pages_per_seq=pages_per_seq
    )
    pages = 1 + np.random.default_rng(1).permutation(B * pages_per_seq).reshape(B, pages_per_seq)
    return PagedKVCache(cache.k, cache.v, jnp.asarray(pages, jnp.int32))


LAYOUTS = {
    "1dev": None,
    "8dev_data4_tensor2": ({"data": 4, "tensor": 2}, "tp"),
    "8dev_fsdp8": ({"fsdp": 8}, "fsdp"),
}


# fsdp 8 is a layout repeat of data 4 x tensor 2 (the cache sharded by batch and by heads): slow tier.
@pytest.mark.parametrize(
    "layout", [pytest.param(name, marks=[pytest.mark.slow] if name == "8dev_fsdp8" else []) for name in LAYOUTS]
)
def test_cached_decoding_equals_full_recomputation(trained, sequences, layout):
    cfg, model = trained
    reference = full_logits(model, sequences)
    if LAYOUTS[layout] is None:
        gen = Generator(model)
    else:
        sizes, preset = LAYOUTS[layout]
        gen = Generator(model, mesh=make_mesh(sizes), rules=rules_for(preset))
    cache = gen.new_cache(-(-len(sequences) // gen.batch_multiple) * gen.batch_multiple, 32)
    if LAYOUTS[layout] == ({"data": 4, "tensor": 2}, "tp"):
        # The cache is split as the rules say: 4 sequences over data, 2 kv heads over tensor.
        assert cache.k.addressable_shards[0].data.shape == (cfg.model.n_layers, 1, 32, 1, cfg.model.resolved_head_dim)
    got = cached_logits(gen, sequences, cache)
    scale = max(float(np.abs(r).max()) for r in reference)
    assert scale > 5  # a trained model's logits, not near-zero noise
    for b in range(len(sequences)):
        np.testing.assert_allclose(got[b], reference[b], atol=1e-5 * scale, rtol=0)


def test_paged_cache_equals_full_recomputation(trained, sequences):
    cfg, model = trained
    got = cached_logits(Generator(model), sequences, paged_cache(cfg, len(sequences)))
    for g, r in zip(got, full_logits(model, sequences)):
        np.testing.assert_allclose(g, r, atol=1e-5 * np.abs(r).max(), rtol=0)


def test_flash_decoding_kernel_path_matches(sequences):
    """model.attention=pallas: the one-token steps run the Pallas flash-decoding kernel (interpreted on CPU)."""
    cfg = load_config(ROOT / "configs/lm_tiny.yaml", ["model.attention=pallas", "model.n_layers=2"])
    pallas_model = build_model(cfg)
    xla_model = build_model(load_config(ROOT / "configs/lm_tiny.yaml", ["model.n_layers=2"]))
    nnx.update(xla_model, nnx.state(pallas_model))
    got = cached_logits(Generator(pallas_model), sequences, KVCache.zeros(cfg.model, len(sequences), 32))
    for g, r in zip(got, full_logits(xla_model, sequences)):
        np.testing.assert_allclose(g, r, atol=1e-5 * np.abs(r).max() + 1e-6, rtol=0)


def test_decode_step_writes_the_cache_in_place(trained):
    cfg, model = trained
    gen = Generator(model)
    B, S = 2, 1024
    cache = gen.new_cache(B, S)
    assert cache.nbytes == B * S * cache_bytes_per_token(cfg.model, jnp.float32)
    args = (
        gen.state,
        jnp.zeros(B, jnp.int32),
        jnp.zeros(B, jnp.int32),
        cache,
        SamplingArrays.stack([SamplingParams()] * B),
        jnp.zeros((B, cfg.model.vocab_size), bool),
    )
    memory = gen._decode.lower(*args).compile().memory_analysis()
    # The cache output aliases the donated input, and no temporary as large as the cache exists.
    assert memory.alias_size_in_bytes >= cache.nbytes
    assert memory.temp_size_in_bytes < cache.nbytes
    gen._decode(*args)
    assert cache.k.is_deleted() and cache.v.is_deleted()


def test_generate_batches_prompts_of_different_lengths(trained, sequences):
    """Greedy generation of a batch equals each prompt generated alone (padding changes nothing)."""
    _, model = trained
    gen = Generator(model)
    prompts = [list(s[:n]) for s, n in zip(sequences, PROMPT_LENGTHS)]
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    together = gen.generate(prompts, params)
    assert together == [gen.generate([p], params)[0] for p in prompts]
    assert all(len(t) == 8 for t in together)
    # A stop token ends its row (and is included); the other rows go on.
    stop = together[1][2]
    cut = gen.generate(
        prompts, [params, SamplingParams(temperature=0.0, max_new_tokens=8, stop_tokens=(stop,)), params, params]
    )
    assert cut[1] == together[1][: together[1].index(stop) + 1] and cut[0] == together[0]
