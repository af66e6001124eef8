"""The paged-attention kernel reads K/V pages through the block table and equals the gather path and full attention.

Kernel level: decode (one query) and chunked-prefill (a chunk of queries at
given positions) rows with ragged lengths, GQA, a sliding window, and two
block tables that name the same physical pages (a shared prefix, as prefix
caching makes) give the gather reference's output and plain causal attention
over each sequence's contiguous keys, under the CPU interpreter and in the GPU
and TPU configurations, also with Gemma 2's soft cap and gpt-oss's attention
sinks; the GPU/TPU code lowers without the device.
Model level: a paged cache read by the kernel (attention impl pallas) gives
the gather path's logits and a full forward pass's, and the compiled decode
step gathers no pages.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, XLA_EMITTERS
from flax import nnx
from jax.experimental.pallas import tpu as pltpu

from meshwork.config import load_config
from meshwork.engine import kv_cache
from meshwork.engine.generate import Generator
from meshwork.engine.kv_cache import NULL_PAGE, PagedKVCache
from meshwork.engine.per_layer import restack_layers
from meshwork.kernels import cpu_paged_attention
from meshwork.kernels import paged_attention as pa
from meshwork.kernels.paged_attention import paged_attention, paged_attention_reference
from meshwork.kernels.pallas_backend import lowering_target
from meshwork.models.build import build_model

TPU_INTERPRET = pltpu.InterpretParams(random_seed=0, out_of_bounds_reads="raise", uninitialized_memory="nan")


def rel_err(a, b) -> float:
    """Max abs error over the largest reference value."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def contiguous_attention(q_LHK, k_SGK, v_SGK, positions_L, window=None, softcap=None, sinks=None):
    """NumPy causal attention of queries at positions_L over one sequence's contiguous keys (no cache).

    softcap: scores -> softcap * tanh(scores / softcap); sinks (H,): one more logit per head in the
    softmax's denominator, weighing no value.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q_LHK, k_SGK, v_SGK))
    L, H, K = q.shape
    G = k.shape[1]
    out = np.zeros((L, H, K))
    for i, p in enumerate(np.asarray(positions_L)):
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(H):
            g = h // (H // G)
            s = k[lo : p + 1, g] @ q[i, h] / np.sqrt(K)
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)
            m = s.max() if sinks is None else max(s.max(), sinks[h])
            w = np.exp(s - m)
            out[i, h] = w @ v[lo : p + 1, g] / (w.sum() + (0.0 if sinks is None else np.exp(sinks[h] - m)))
    return out


def pool_with_shared_prefix(T, P, G, K, lengths, shared_pages, layers=2, layer=1, seed=0):
    """Contiguous keys/values per sequence and a pool holding them through shuffled block tables.

    Row 2's first `shared_pages` table entries name row 0's pages (the same physical pages,
    not a copy), so row 2's keys there are row 0's; unused entries name the null page.
    """
    rng = np.random.default_rng(seed)
    B = len(lengths)
    N = 1 + B * P
    k_pool = rng.standard_normal((layers, N, T, G, K)).astype(np.float32)
    v_pool = rng.standard_normal((layers, N, T, G, K)).astype(np.float32)
    table = np.full((B, P), NULL_PAGE, np.int32)
    free = list(1 + rng.permutation(N - 1))
    for b, n in enumerate(lengths):
        need = -(-n // T)
        table[b, :need] = [free.pop() for _ in range(need)]
    table[2, :shared_pages] = table[0, :shared_pages]
    k_seq = [k_pool[layer][table[b, : -(-n // T)]].reshape(-1, G, K)[:n] for b, n in enumerate(lengths)]
    v_seq = [v_pool[layer][table[b, : -(-n // T)]].reshape(-1, G, K)[:n] for b, n in enumerate(lengths)]
    return jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.asarray(table), k_seq, v_seq


CONFIGS = {
    "cpu": dict(T=4, kw=dict(pages_per_split=3, block_rows=8)),
    "gpu-config": dict(T=16, kw=dict(backend="gpu", interpret=True, pages_per_split=1)),
    "tpu-config": dict(T=16, kw=dict(backend="tpu", interpret=TPU_INTERPRET)),
}


# Quick tier: each configuration once, both query kinds and both masks among them, and each configuration
# once with soft-capping and sinks; slow: the rest.
QUICK = {
    ("cpu", 1, None, False),
    ("cpu", 5, 6, False),
    ("gpu-config", 5, 6, False),
    ("tpu-config", 1, 6, False),
    ("tpu-config", 5, None, False),
    ("cpu", 5, 6, True),
    ("gpu-config", 1, None, True),
    ("tpu-config", 5, 6, True),
}
KERNEL_CASES = [
    pytest.param(
        c,
        L,
        w,
        f,
        id=f"{c}-{'decode' if L == 1 else f'chunk{L}'}-window{w}{'-softcap-sinks' if f else ''}",
        marks=() if (c, L, w, f) in QUICK else pytest.mark.slow,
    )
    for f in (False, True)
    for c in CONFIGS
    for L in (1, 5)
    for w in (None, 6)
]
# softcap=2 caps scores of ~N(0, 1) hard enough to matter; sinks range from barely felt to most of a short row's weight.
SOFTCAP, SINKS = 2.0, np.linspace(-1.0, 4.0, 4).astype(np.float32)


@pytest.mark.parametrize("config, L, window, features", KERNEL_CASES)
def test_kernel_equals_gather_and_contiguous_attention(config, L, window, features):
    """Ragged rows (one sees a single key), a shared prefix, GQA; every query within 1e-5 of both references."""
    T, kw = CONFIGS[config]["T"], CONFIGS[config]["kw"]
    B, P, H, G, K = 3, 4, 4, 2, 16
    # Row 0 ends early in its last page; row 1 sees one key (decode) or straddles a page; row 2 shares row 0's
    # first two pages and reads past them.
    last = [2 * T + 1, L - 1, 3 * T + 2]
    lengths = [p + 1 for p in last]
    k_pool, v_pool, table, k_seq, v_seq = pool_with_shared_prefix(T, P, G, K, lengths, shared_pages=2)
    assert (np.asarray(table)[0, :2] == np.asarray(table)[2, :2]).all()
    positions = jnp.asarray([np.arange(p - L + 1, p + 1) for p in last], jnp.int32)
    q = jnp.asarray(np.random.default_rng(1).standard_normal((B, L, H, K)), jnp.float32)
    feats = dict(window=window, softcap=SOFTCAP, sinks=jnp.asarray(SINKS)) if features else dict(window=window)
    got = jax.jit(lambda *a: paged_attention(*a, layer=1, **feats, **kw))(q, k_pool, v_pool, table, positions)
    want = paged_attention_reference(q, k_pool, v_pool, table, positions, layer=1, **feats)
    assert rel_err(got, want) <= 1e-5
    for b in range(B):
        full = contiguous_attention(q[b], k_seq[b], v_seq[b], positions[b], **feats)
        assert rel_err(got[b], full) <= 1e-5, b


# The C++ kernel XLA:CPU calls (kernels/cpu_paged_attention.py): decode and a chunk, each mask, and
# soft-capping with sinks, in the quick tier; the other combinations in the slow one.
NATIVE_CASES = [
    pytest.param(
        L,
        w,
        f,
        id=f"{'decode' if L == 1 else f'chunk{L}'}-window{w}{'-softcap-sinks' if f else ''}",
        marks=() if (L, w, f) in {(1, None, False), (5, 6, False), (5, 6, True)} else pytest.mark.slow,
    )
    for f in (False, True)
    for L in (1, 5)
    for w in (None, 6)
]


@pytest.mark.parametrize("L, window, features", NATIVE_CASES)
def test_cpu_kernel_equals_gather_and_contiguous_attention(L, window, features):
    """The same rows as the Pallas kernel's test, 4 query heads per kv head, padding rows (position
    -1: zeros) and a position past the table (sees all P * T keys); within 1e-5 of both references."""
    assert cpu_paged_attention.available(), cpu_paged_attention.unavailable_reason()
    T, B, P, H, G, K = 4, 3, 4, 8, 2, 16
    last = [2 * T + 1, L - 1, 3 * T + 2]
    k_pool, v_pool, table, k_seq, v_seq = pool_with_shared_prefix(T, P, G, K, [p + 1 for p in last], shared_pages=2)
    positions = np.asarray([np.arange(p - L + 1, p + 1) for p in last], np.int32)
    q = jnp.asarray(np.random.default_rng(1).standard_normal((B, L, H, K)), jnp.float32)
    sinks = jnp.asarray(np.linspace(-1.0, 4.0, H), jnp.float32)
    feats = dict(window=window, softcap=SOFTCAP, sinks=sinks) if features else dict(window=window)
    kernel = jax.jit(lambda *a: cpu_paged_attention.cpu_paged_attention(*a, layer=1, **feats))
    got = kernel(q, k_pool, v_pool, table, jnp.asarray(positions))
    want = paged_attention_reference(q, k_pool, v_pool, table, jnp.asarray(positions), layer=1, **feats)
    assert rel_err(got, want) <= 1e-5
    for b in range(B):
        full = contiguous_attention(q[b], k_seq[b], v_seq[b], positions[b], **feats)
        assert rel_err(got[b], full) <= 1e-5, b
    padded = positions.copy()
    padded[1] = -1  # a padding row
    padded[0, -1] = P * T + 3  # past the table
    got = np.asarray(kernel(q, k_pool, v_pool, table, jnp.asarray(padded)))
    assert (got[1] == 0).all()
    want = paged_attention_reference(q, k_pool, v_pool, table, jnp.asarray(padded), layer=1, **feats)
    assert rel_err(got[0], want[0]) <= 1e-5


def test_every_output_element_is_written():
    """Outputs start as NaN (poisoned); splits past a row's pages and padding rows must still be written."""
    T, B, P, H, G, K = 4, 3, 4, 4, 2, 16
    k_pool, v_pool, table, _, _ = pool_with_shared_prefix(T, P, G, K, [9, 3, 14], shared_pages=2)
    q = jnp.ones((B, 3, H, K))
    cfg = pa._Config(
        scale=0.25, page_size=T, pages_per_split=1, rows=8, head_dim=K, backend="cpu", interpret=True, poison=True
    )
    pos = jnp.asarray([[6, 7, 8], [0, 1, 2], [11, 12, 13]], jnp.int32)
    o, lse = pa._paged_splits(q, k_pool, v_pool, table, pos, jnp.asarray(1), 2, cfg)
    assert o.shape[3] == P, "one split per page: most splits of the short row see nothing"
    assert not np.isnan(np.asarray(o)).any() and not np.isnan(np.asarray(lse)).any()


@pytest.mark.parametrize(
    "platform, backend, marker", [("cuda", "gpu", "__gpu$xla.gpu.triton"), ("tpu", "tpu", "tpu_custom_call")]
)
@pytest.mark.parametrize("L", [1, 7], ids=["decode", "chunk7"])
def test_lowers_without_the_device(platform, backend, marker, L):
    """One kernel call, and the pool reaches it whole: no gather of pages around it."""
    B, N, T, G, K, H, P = 2, 9, 16, 2, 64, 8, 4
    q, pool = jnp.ones((B, L, H, K), jnp.bfloat16), jnp.ones((3, N, T, G, K), jnp.bfloat16)
    table, pos = jnp.ones((B, P), jnp.int32), jnp.full((B, L), 40, jnp.int32)
    fn = functools.partial(paged_attention, layer=2, backend=backend, window=20, softcap=30.0, sinks=jnp.zeros(H))
    with lowering_target(platform):
        text = jax.jit(fn).trace(q, pool, pool, table, pos).lower(lowering_platforms=(platform,)).as_text()
    assert text.count(marker) == 1
    assert "gather" not in text


def test_triton_refuses_pages_it_cannot_tile():
    q, pool = jnp.ones((1, 1, 4, 32)), jnp.ones((5, 8, 2, 32))
    with pytest.raises(ValueError, match="page_size and head_dim powers of two >= 16, got page_size 8"):
        paged_attention(q, pool, pool, jnp.ones((1, 2), jnp.int32), jnp.ones((1, 1), jnp.int32), backend="gpu")


# --------------------------------------------------------------------------
# The paged KV cache reads through the kernel
# --------------------------------------------------------------------------

T_MODEL, P_MODEL, CHUNK, NEW = 4, 8, 5, 4
PROMPTS = (13, 7, 11)  # row 2 shares row 0's first 2 pages (8 tokens) and prefills only what follows
SHARED = 2


@pytest.fixture(scope="module")
def models():
    """lm_tiny with 2 layers: the pallas-attention model and an xla one with the same weights."""
    over = ["model.n_layers=2", "model.init_std=0.1"]
    pallas_model = build_model(load_config(ROOT / "configs/lm_tiny.yaml", ["model.attention=pallas", *over]))
    xla_model = build_model(load_config(ROOT / "configs/lm_tiny.yaml", over))
    nnx.update(xla_model, nnx.state(pallas_model))
    return pallas_model, xla_model


@pytest.fixture(scope="module")
def sequences():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, 256, n + NEW).astype(np.int32) for n in PROMPTS]
    seqs[2][: SHARED * T_MODEL] = seqs[0][: SHARED * T_MODEL]
    return seqs


def paged_run(model, sequences) -> list[np.ndarray]:
    """Chunked prefill (CHUNK tokens per call, one row at a time), then NEW batched decode steps.

    Row 2's table starts with row 0's first SHARED pages, which row 0's prefill wrote: row 2
    prefills from position SHARED * T on, as it would after a prefix-cache hit. Returns each
    row's logits at the positions it computed.
    """
    gen = Generator(model)
    B = len(sequences)
    cache = PagedKVCache.zeros(model.cfg, n_pages=1 + B * P_MODEL, page_size=T_MODEL, batch=B, pages_per_seq=P_MODEL)
    table = 1 + np.random.default_rng(1).permutation(B * P_MODEL).reshape(B, P_MODEL).astype(np.int32)
    table[2, :SHARED] = table[0, :SHARED]
    k, v = cache.k, cache.v
    out = [[] for _ in sequences]
    for b, (seq, n) in enumerate(zip(sequences, PROMPTS)):
        for start in range(SHARED * T_MODEL if b == 2 else 0, n, CHUNK):
            # The last chunk is right-padded at the following positions (overwritten before they are read).
            tokens = np.zeros((1, CHUNK), np.int32)
            real = seq[start : min(start + CHUNK, n)]
            tokens[0, : len(real)] = real
            logits, c = gen.forward(
                tokens, np.arange(start, start + CHUNK)[None], PagedKVCache(k, v, jnp.asarray(table[b : b + 1]))
            )
            k, v = c.k, c.v
            out[b] += list(np.asarray(logits[0, : len(real)]))
    for step in range(NEW):
        pos = np.array([n + step for n in PROMPTS], np.int32)
        tok = np.array([s[p] for s, p in zip(sequences, pos)], np.int32)
        logits, c = gen.forward(tok[:, None], pos[:, None], PagedKVCache(k, v, jnp.asarray(table)))
        k, v = c.k, c.v
        for b in range(B):
            out[b].append(np.asarray(logits[b, 0]))
    return [np.stack(rows) for rows in out]


def test_paged_kernel_equals_gather_path_and_full_recomputation(models, sequences):
    """The Pallas kernel, the C++ kernel (attention impl xla on the CPU) and the gather path without it."""
    pallas_model, xla_model = models
    kernel, native = paged_run(pallas_model, sequences), paged_run(xla_model, sequences)
    with cpu_paged_attention.disabled():
        gather = paged_run(xla_model, sequences)
    # One causal forward over the batch right-padded to the longest row (no cache).
    tokens = np.zeros((len(sequences), max(map(len, sequences))), np.int32)
    for b, s in enumerate(sequences):
        tokens[b, : len(s)] = s
    logits = np.asarray(xla_model(jnp.asarray(tokens)))
    full = [logits[b, : len(s)] for b, s in enumerate(sequences)]
    full[2] = full[2][SHARED * T_MODEL :]  # row 2 computed only the positions after the shared pages
    for b in range(len(sequences)):
        assert kernel[b].shape == full[b].shape
        assert rel_err(kernel[b], gather[b]) <= 1e-5, b
        assert rel_err(native[b], gather[b]) <= 1e-5, b
        assert rel_err(kernel[b], full[b]) <= 1e-5, b
        assert rel_err(gather[b], full[b]) <= 1e-5, b


def page_gathers(hlo: str, page: tuple[int, ...]) -> list[str]:
    """The shapes of an optimized HLO text's gathers whose output ends in `page`: whole pages, as
    (T, G, K) blocks or as rows of T * G * K."""
    shapes = re.findall(r"= \w+\[([\d,]*)\]\{[\d,]*\} gather\(", hlo)
    return [s for s in shapes if tuple(int(d) for d in s.split(",") if d)[-len(page) :] == page]


def test_compiled_decode_step_gathers_no_pages(models, monkeypatch):
    """Neither kernel path gathers pages: Pallas, nor XLA:CPU's C++ kernel (one call per layer). The
    gather path it replaces copies every row's whole page table (B x P pages) per layer."""
    B, cfg = 4, models[0].cfg
    T, G, K = 16, cfg.n_kv_heads, cfg.resolved_head_dim
    cache = PagedKVCache.zeros(cfg, n_pages=1 + B * P_MODEL, page_size=T, batch=B, pages_per_seq=P_MODEL)

    def args(gen):
        return (gen.state, jnp.zeros((B, 1), jnp.int32), jnp.zeros((B, 1), jnp.int32), cache)

    def compiled(model):
        gen = Generator(model)
        # XLA's own fusion emitters (off for the session): its fusion decides the gathers' shapes.
        return gen._forward.lower(*args(gen)).compile(compiler_options=XLA_EMITTERS).as_text()

    texts = {"pallas": compiled(models[0]), "xla": compiled(models[1])}
    with cpu_paged_attention.disabled():
        texts["gather"] = compiled(models[1])
    # B x P whole pages (rows of T * G * K) of k and of v, per layer (a generator runs its layers
    # unrolled, each on its own weights: src/meshwork/engine/per_layer.py).
    n = cfg.n_layers
    assert page_gathers(texts["gather"], (T * G * K,)) == [f"{B * P_MODEL},1,{T * G * K}"] * 2 * n
    for name in ("pallas", "xla"):
        assert page_gathers(texts[name], (T * G * K,)) == page_gathers(texts[name], (T, G, K)) == [], name
    assert texts["xla"].count(f'custom_call_target="{cpu_paged_attention.TARGET}"') == n
    # The same step lowered for a GPU: one Triton call per layer and no gather of pages.
    monkeypatch.setattr(kv_cache, "paged_attention", functools.partial(paged_attention, backend="gpu"))
    gen = Generator(models[0])
    with lowering_target("cuda"):
        text = jax.jit(gen.apply).trace(*args(gen)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == n
    assert not [ln for ln in text.splitlines() if "stablehlo.gather" in ln and f"x{T * G * K}x" in ln]


def copies_of(hlo: str, shapes: set[tuple[int, ...]]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the instructions of an optimized HLO text (any computation) that produce an
    array of one of `shapes`, its dimensions in any order and those of size 1 dropped, other than by
    naming it: parameters, bitcasts and gathers are not copies."""
    wanted = {tuple(sorted(s)) for s in shapes}
    out = []
    for name, dims, op in re.findall(r"%(\S+) = \w+\[([\d,]*)\]\S* ([\w-]+)\(", hlo):
        shape = tuple(int(d) for d in dims.split(",") if d and int(d) != 1)
        if tuple(sorted(shape)) in wanted and op not in ("parameter", "bitcast") and "gather" not in name:
            out.append((name, shape))
    return out


def test_compiled_decode_step_copies_no_weight_and_no_page(models):
    """A generator's decode step reads each layer's weights where they lie (one array per layer,
    engine/per_layer.py), and without the C++ kernel its one-token attention reads the gathered keys
    and values as the gather lays them out (kv_cache._one_token_attention): no instruction of the
    compiled step copies a layer's weight or the gathered keys in any order. With the trainer's
    stacked weights the same step runs a scan whose body copies every weight of the layer it runs."""
    B, model = 4, models[1]
    cfg = model.cfg
    cache = PagedKVCache.zeros(cfg, n_pages=1 + B * P_MODEL, page_size=16, batch=B, pages_per_seq=P_MODEL)
    gen = Generator(model)
    layer_shapes = {
        tuple(d for d in x.shape[1:] if d != 1)
        for x in jax.tree.leaves(nnx.state(model.blocks, nnx.Param))
        if x.ndim > 2  # the norms' (D,) scales have the activations' shape
    }
    S, G, K = P_MODEL * 16, cfg.n_kv_heads, cfg.resolved_head_dim
    tokens = jnp.zeros((B, 1), jnp.int32)

    def text(state):
        return gen._forward.lower(state, tokens, tokens, cache).compile().as_text()

    with cpu_paged_attention.disabled():
        per_layer = text(gen.state)
        assert copies_of(per_layer, layer_shapes) == []
        assert copies_of(per_layer, {(B, S, G, K)}) == []
        stacked = copies_of(text(restack_layers(gen.state)), layer_shapes)
    assert {tuple(sorted(shape)) for _, shape in stacked} == {tuple(sorted(s)) for s in layer_shapes}
