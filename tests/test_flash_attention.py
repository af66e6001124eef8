"""Flash attention and flash-decoding Pallas kernels against their pure-JAX references.

Everything runs on CPU: the kernels under the Pallas interpreter (the GPU and
TPU block/layout configurations included), and the GPU/TPU code paths are
lowered for `cuda` and `tpu` without the hardware. Soft-capping (Gemma 2) and
attention sinks (gpt-oss) are checked the same way, and the references
against NumPy transcriptions of Hugging Face's eager attention.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from meshwork.kernels import decode_attention as da
from meshwork.kernels import flash_attention as fa
from meshwork.kernels import flash_attention_kernels as fk
from meshwork.kernels import pallas_backend as pb
from meshwork.kernels.decode_attention import decode_attention, decode_attention_reference
from meshwork.kernels.flash_attention import flash_attention, flash_attention_reference

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
# TPU interpret mode: memory starts as NaN, out-of-bounds reads raise, and the
# "parallel" grid axes run in a shuffled order (proving no program depends on another).
TPU_INTERPRET = pltpu.InterpretParams(random_seed=0, out_of_bounds_reads="raise", uninitialized_memory="nan")


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def packed(lengths):
    """Segment ids of sequences packed back to back: [3, 2] -> [0, 0, 0, 1, 1]."""
    return np.repeat(np.arange(len(lengths)), lengths)


def qkv(B, L, S, H, G, K, dtype, seed=0):
    kq, kk, kv, kg = jax.random.split(jax.random.key(seed), 4)
    return (
        jax.random.normal(kq, (B, L, H, K), dtype),
        jax.random.normal(kk, (B, S, G, K), dtype),
        jax.random.normal(kv, (B, S, G, K), dtype),
        jax.random.normal(kg, (B, L, H, K), dtype),
    )


def forward_and_grads(fn, q, k, v, do, **kw):
    """(o, dq, dk, dv) for the cotangent do."""

    def run(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **kw), q, k, v)
        return (o, *vjp(do))

    return jax.jit(run)(q, k, v, do)


# --------------------------------------------------------------------------
# Forward and gradients equal the reference
# --------------------------------------------------------------------------

# (B, L, S, H, G, K, dtype, kwargs). Block sizes are small so that every case
# spans several blocks; L or S not a multiple of the block exercises the padding.
CASES = {
    "causal-mha-f32": (2, 64, 64, 2, 2, 32, jnp.float32, dict(block_q=32, block_kv=32)),
    "noncausal-gqa2-ragged-f32": (1, 96, 80, 4, 2, 32, jnp.float32, dict(causal=False, block_q=64, block_kv=32)),
    "causal-gqa8-f32": (1, 128, 128, 8, 1, 64, jnp.float32, dict(block_q=32, block_kv=64)),
    "segments-gqa2-f32": (
        2,
        96,
        96,
        4,
        2,
        32,
        jnp.float32,
        dict(
            block_q=32,
            block_kv=32,
            segment_ids_q=np.stack([packed([40, 30, 26]), packed([96])]),
            segment_ids_kv=np.stack([packed([40, 30, 26]), packed([96])]),
        ),
    ),
    # Query segment 7 has no keys: those rows see nothing and must output 0.
    "segments-cross-empty-rows-f32": (
        1,
        64,
        48,
        2,
        1,
        32,
        jnp.float32,
        dict(
            causal=False,
            block_q=32,
            block_kv=32,
            segment_ids_q=np.array([[0] * 30 + [1] * 20 + [7] * 14]),
            segment_ids_kv=np.array([[0] * 20 + [1] * 28]),
        ),
    ),
    "window-ragged-f32": (1, 120, 120, 2, 1, 32, jnp.float32, dict(window=40, block_q=32, block_kv=32)),
    "causal-gqa2-ragged-bf16": (1, 100, 100, 8, 4, 64, jnp.bfloat16, dict(block_q=32, block_kv=32)),
    "segments-window-noncausal-bf16": (
        2,
        96,
        96,
        4,
        2,
        64,
        jnp.bfloat16,
        dict(
            causal=False,
            block_q=32,
            block_kv=32,
            segment_ids_q=np.stack([packed([50, 46]), packed([96])]),
            segment_ids_kv=np.stack([packed([50, 46]), packed([96])]),
        ),
    ),
    # The GPU configuration (power-of-two blocks >= 16, head dim 24 padded to
    # 32, model layout) under the generic interpreter.
    "gpu-config-window-gqa4-f32": (1, 80, 80, 4, 1, 24, jnp.float32, dict(window=33, backend="gpu", interpret=True)),
    # The TPU configuration ((B, H, L, K) layout, 128-lane key blocks) under TPU interpret mode.
    "tpu-config-segments-window-f32": (
        1,
        256,
        256,
        4,
        2,
        32,
        jnp.float32,
        dict(
            window=70,
            block_q=64,
            block_kv=128,
            backend="tpu",
            interpret=TPU_INTERPRET,
            segment_ids_q=packed([100, 156])[None],
            segment_ids_kv=packed([100, 156])[None],
        ),
    ),
}


@functools.cache  # each case compiles once for the four comparisons below
def results(name):
    B, L, S, H, G, K, dtype, kw = CASES[name]
    q, k, v, do = qkv(B, L, S, H, G, K, dtype)
    return (
        forward_and_grads(flash_attention, q, k, v, do, **kw),
        forward_and_grads(flash_attention_reference, q, k, v, do, **kw),
    )


@pytest.mark.parametrize("i, what", [(0, "o"), (1, "dq"), (2, "dk"), (3, "dv")])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name, i, what):
    kernel, reference = results(name)
    tol = TOL[CASES[name][6]]
    err = rel_err(kernel[i], reference[i])
    assert err <= tol, f"{name}: {what} relative error {err:.2e} > {tol:.0e}"


def test_rows_without_keys_output_zero():
    o, dq, _, _ = results("segments-cross-empty-rows-f32")[0]
    assert np.all(np.asarray(o)[0, 50:] == 0) and np.all(np.asarray(dq)[0, 50:] == 0)
    assert np.any(np.asarray(o)[0, :50] != 0)


# --------------------------------------------------------------------------
# Soft-capping (Gemma 2) and attention sinks (gpt-oss)
# --------------------------------------------------------------------------

# Per-head sink logits, from barely felt to a sizable share of the denominator
# (the scores' logsumexp is ~3-5 at these lengths). A case's `sinks=True` means SINKS[:H].
SINKS = np.linspace(-1.0, 4.0, 8).astype(np.float32)
CROSS_SEGMENTS = dict(
    segment_ids_q=np.array([[0] * 30 + [1] * 20 + [7] * 14]), segment_ids_kv=np.array([[0] * 20 + [1] * 28])
)

# (B, L, S, H, G, K, dtype, kwargs). softcap=2 caps scores of ~N(0, 1) hard enough to matter.
FEATURE_CASES = {
    "softcap-noncausal-ragged-f32": (
        1,
        96,
        80,
        4,
        2,
        32,
        jnp.float32,
        dict(causal=False, softcap=2.0, block_q=64, block_kv=32),
    ),
    "sinks-window-segments-f32": (
        2,
        96,
        96,
        4,
        2,
        32,
        jnp.float32,
        dict(
            sinks=True,
            window=24,
            block_q=32,
            block_kv=32,
            segment_ids_q=np.stack([packed([40, 30, 26]), packed([96])]),
            segment_ids_kv=np.stack([packed([40, 30, 26]), packed([96])]),
        ),
    ),
    # Query segment 7 has no keys: with a sink those rows must still output 0 (and add nothing to d sink).
    "softcap-sinks-empty-rows-f32": (
        1,
        64,
        48,
        2,
        1,
        32,
        jnp.float32,
        dict(causal=False, softcap=1.5, sinks=True, block_q=32, block_kv=32, **CROSS_SEGMENTS),
    ),
    "softcap-sinks-window-gqa4-ragged-bf16": (
        1,
        100,
        100,
        8,
        2,
        64,
        jnp.bfloat16,
        dict(softcap=2.0, sinks=True, window=40, block_q=32, block_kv=32),
    ),
    "gpu-config-softcap-sinks-window-f32": (
        1,
        80,
        80,
        4,
        1,
        24,
        jnp.float32,
        dict(softcap=2.0, sinks=True, window=33, backend="gpu", interpret=True),
    ),
    "tpu-config-softcap-sinks-window-f32": (
        1,
        192,
        192,
        4,
        2,
        32,
        jnp.float32,
        dict(softcap=2.0, sinks=True, window=70, block_q=64, block_kv=128, backend="tpu", interpret=TPU_INTERPRET),
    ),
}


def with_sinks(kw, H):
    """kw with sinks=True replaced by the (H,) array SINKS[:H]."""
    return {**kw, "sinks": jnp.asarray(SINKS[:H])} if kw.get("sinks") is True else kw


@functools.cache
def feature_results(name):
    """(o, dq, dk, dv[, dsinks]) of the kernel and of the reference."""
    B, L, S, H, G, K, dtype, kw = FEATURE_CASES[name]
    q, k, v, do = qkv(B, L, S, H, G, K, dtype)
    kw = with_sinks(kw, H)
    sinks = kw.pop("sinks", None)

    def run(fn):
        def f(q, k, v, sinks, do):
            o, vjp = jax.vjp(lambda q, k, v, sinks: fn(q, k, v, sinks=sinks, **kw), q, k, v, sinks)
            return (o, *vjp(do))

        out = jax.jit(f)(q, k, v, sinks, do)
        return out if sinks is not None else out[:4]

    return run(flash_attention), run(flash_attention_reference)


@pytest.mark.parametrize("name", list(FEATURE_CASES))
def test_softcap_and_sinks_match_reference(name):
    """Forward, dq, dk, dv and the sinks' gradient within the fp32 / bf16 tolerance of the reference."""
    kernel, reference = feature_results(name)
    tol = TOL[FEATURE_CASES[name][6]]
    errs = {what: rel_err(a, b) for what, a, b in zip(("o", "dq", "dk", "dv", "dsinks"), kernel, reference)}
    assert len(errs) == (5 if FEATURE_CASES[name][7].get("sinks") else 4)
    assert max(errs.values()) <= tol, f"{name}: relative errors {errs} > {tol:.0e}"


def test_rows_without_keys_output_zero_with_sinks():
    o, dq, *_ = feature_results("softcap-sinks-empty-rows-f32")[0]
    assert np.all(np.asarray(o)[0, 50:] == 0) and np.all(np.asarray(dq)[0, 50:] == 0)
    assert np.any(np.asarray(o)[0, :50] != 0)


def hf_eager_attention(q, k, v, mask, scale, softcap=None, sinks=None):
    """NumPy transcription of transformers' eager attention for Gemma 2 (softcap) and gpt-oss (sinks).

    q (L, H, K), k and v (S, G, K), mask (L, S) bool. Gemma 2: scores * scaling,
    then / softcap, tanh, * softcap, then + the additive mask. gpt-oss: the
    sink logit concatenated as a last column after the mask, the row max
    subtracted, softmax, the column dropped.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    R = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, R, axis=1), np.repeat(v, R, axis=1)  # repeat_kv
    w = np.einsum("lhk,shk->hls", q, k) * scale
    if softcap is not None:
        w = np.tanh(w / softcap) * softcap
    w = w + np.where(mask, 0.0, np.finfo(np.float32).min)[None]
    if sinks is not None:
        w = np.concatenate([w, np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None], w[..., :1].shape)], -1)
    w = np.exp(w - w.max(-1, keepdims=True))
    p = w / w.sum(-1, keepdims=True)
    if sinks is not None:
        p = p[..., :-1]
    return np.einsum("hls,shk->lhk", p, v)


@pytest.mark.parametrize(
    "kw",
    [dict(softcap=2.0), dict(sinks=True), dict(softcap=2.0, sinks=True, window=5)],
    ids=["gemma2", "gptoss", "gptoss-window-softcap"],
)
def test_references_follow_hugging_face_eager_attention(kw):
    """The flash and decode references equal transformers' eager formulas (fp64 NumPy) within 1e-5."""
    L, H, G, K = 12, 4, 2, 16
    q, k, v, _ = qkv(1, L, L, H, G, K, jnp.float32, seed=3)
    kw = with_sinks(kw, H)
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    mask = (j <= i) & ((j > i - kw["window"]) if "window" in kw else True)
    want = hf_eager_attention(q[0], k[0], v[0], mask, K**-0.5, kw.get("softcap"), kw.get("sinks"))
    assert rel_err(flash_attention_reference(q, k, v, **kw)[0], want) <= 1e-5
    # Decode: the last query over the whole cache.
    got = decode_attention_reference(q[:, -1], k, v, jnp.array([L]), **kw)
    assert rel_err(got[0], want[-1]) <= 1e-5


def test_softcap_and_sinks_arguments_are_checked():
    q, k, v, _ = qkv(1, 8, 8, 4, 2, 8, jnp.float32)
    with pytest.raises(ValueError, match=r"one logit per query head, shape \(4,\)"):
        flash_attention(q, k, v, sinks=jnp.zeros(2))
    with pytest.raises(ValueError, match="softcap=0.0: the cap must be a positive number"):
        decode_attention(q[:, 0], k, v, jnp.array([3]), softcap=0.0)


# --------------------------------------------------------------------------
# Block skipping: loop bounds, not just masks
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "causal, window, L, S, bq, bk",
    [
        (True, None, 128, 128, 32, 16),
        (True, None, 96, 160, 32, 64),
        (True, 40, 160, 160, 32, 16),
        (True, 1, 64, 64, 16, 32),
        (False, None, 80, 48, 32, 16),
    ],
)
def test_block_ranges_are_exactly_the_visible_blocks(causal, window, L, S, bq, bk):
    """The kernels' loops visit exactly the blocks holding a visible (query, key) pair."""
    cfg = fk.FlashConfig(
        causal=causal,
        window=window,
        scale=1.0,
        q_len=L,
        kv_len=S,
        blocks=fk.BlockSizes(bq, bk, bq, bk),
        rep=1,
        head_dim=8,
        backend="cpu",
        interpret=True,
        heads_major=False,
        segmented=False,
    )
    i, j = np.arange(pb.round_up(L, bq))[:, None], np.arange(pb.round_up(S, bk))[None, :]
    visible = (i < L) & (j < S) & ((j <= i) if causal else True) & ((j > i - window) if window else True)
    blocks = visible.reshape(i.size // bq, bq, j.size // bk, bk).any(axis=(1, 3))  # [q block, kv block]

    def as_set(lo, hi):
        return set(range(int(lo), int(hi)))

    for qb in range(blocks.shape[0]):
        assert as_set(*fk.kv_block_range(cfg, qb * bq, bq, bk)) == set(np.flatnonzero(blocks[qb])), qb
    for kb in range(blocks.shape[1]):
        assert as_set(*fk.q_block_range(cfg, kb * bk, bq, bk)) == set(np.flatnonzero(blocks[:, kb])), kb


def test_masked_blocks_are_never_read():
    """NaN keys/values that no query can see (causal, keys past the last query) leave every result clean.

    Masking alone would not: 0 * NaN = NaN in p @ v and in dS @ q.
    """
    q, k, v, do = qkv(1, 64, 128, 4, 2, 32, jnp.float32)
    k_bad, v_bad = k.at[:, 64:].set(jnp.nan), v.at[:, 64:].set(jnp.nan)
    o, dq, dk, dv = forward_and_grads(flash_attention, q, k_bad, v_bad, do, block_q=32, block_kv=32)
    ref = forward_and_grads(flash_attention_reference, q, k[:, :64], v[:, :64], do)
    for got, want in zip((o, dq, dk[:, :64], dv[:, :64]), ref):
        assert rel_err(got, want) <= 1e-5
    assert np.all(np.asarray(dk)[:, 64:] == 0) and np.all(np.asarray(dv)[:, 64:] == 0)


# --------------------------------------------------------------------------
# Every output element is written
# --------------------------------------------------------------------------


def test_poisoned_outputs_catch_an_unwritten_tile():
    """The check itself: a kernel whose grid misses the last tile leaves NaN behind."""
    cfg = fk.FlashConfig(
        causal=True,
        window=None,
        scale=1.0,
        q_len=64,
        kv_len=64,
        blocks=fk.BlockSizes(16, 16, 16, 16),
        rep=1,
        head_dim=8,
        backend="cpu",
        interpret=True,
        heads_major=False,
        segmented=False,
        poison=True,
    )

    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    x = jnp.ones((64, 8))
    (out,) = pb.launch(
        copy,
        cfg,
        grid=(3,),
        in_specs=[pl.BlockSpec((16, 8), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((16, 8), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)],
        args=(x,),
        name="misses_a_tile",
    )
    assert np.isnan(np.asarray(out)[48:]).all() and not np.isnan(np.asarray(out)[:48]).any()


@pytest.mark.parametrize(
    "backend, softcap, sinks", [("cpu", None, False), ("gpu", 2.0, True)], ids=["cpu", "gpu-softcap-sinks"]
)
def test_every_output_element_is_written(backend, softcap, sinks):
    """Raw padded kernel outputs (o, lse, dq, dk, dv; decode o, lse per chunk) start as NaN and end NaN-free.

    lse is +inf for rows that see no key (without sinks) and -inf for empty decode chunks: by design, not NaN.
    """
    B, L, S, H, G, K = 2, 96, 80, 4, 2, 24
    q, k, v, do = qkv(B, L, S, H, G, K, jnp.float32)
    seg_q, seg_kv = np.stack([packed([50, 46])] * B), np.stack([packed([40, 40])] * B)
    cfg = fa.plan(
        q.shape,
        k.shape,
        causal=True,
        scale=None,
        window=None,
        segmented=True,
        block_q=64,
        block_kv=32,
        backend=backend,
        interpret=True,
        softcap=softcap,
        sinks=sinks,
    )
    cfg = dataclasses.replace(cfg, poison=True)
    qp, kp, vp, sq, skv = fa.pad_inputs(q, k, v, seg_q, seg_kv, cfg)
    dop = fa.pad_inputs(do, k, v, seg_q, seg_kv, cfg)[0]
    o, lse = fk.flash_forward(qp, kp, vp, sq, skv, cfg, jnp.asarray(SINKS[:H]) if sinks else None)
    outputs = [o, lse, *fk.flash_backward(qp, kp, vp, sq, skv, o, lse, dop, cfg)]

    dcfg = da._Config(
        scale=K**-0.5,
        chunk=32,
        kv=16,
        rows=16 if backend == "gpu" else H // G,
        head_dim=cfg.head_dim,
        backend=backend,
        interpret=True,
        heads_major=False,
        poison=True,
        softcap=softcap,
    )
    outputs += da._decode_chunks(q[:, 0], k, v, jnp.array([7, 80]), dcfg)
    for name, x in zip(["o", "lse", "dq", "dk", "dv", "decode o", "decode lse"], outputs):
        assert not np.isnan(np.asarray(x)).any(), f"{name}: an output tile was never written"


# --------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------


FEATURES = dict(softcap=2.0, sinks=True, window=50)


@pytest.mark.parametrize(
    "kw",
    [
        dict(chunk=32, block_kv=16),
        dict(backend="gpu", interpret=True, chunk=32),
        dict(backend="tpu", interpret=TPU_INTERPRET, chunk=128, block_kv=128),
        dict(chunk=32, block_kv=16, **FEATURES),
        dict(backend="gpu", interpret=True, chunk=32, softcap=2.0, sinks=True),
        dict(backend="tpu", interpret=TPU_INTERPRET, chunk=128, block_kv=128, **FEATURES),
    ],
    ids=[
        "cpu",
        "gpu-config",
        "tpu-config",
        "cpu-softcap-sinks-window",
        "gpu-config-softcap-sinks",
        "tpu-config-softcap-sinks-window",
    ],
)
def test_decode_matches_reference_and_full_attention(kw):
    B, S, H, G, K = 4, 120, 8, 2, 32  # S is not a multiple of the chunk
    q, k, v, _ = qkv(B, 1, S, H, G, K, jnp.float32)
    q = q[:, 0]
    lengths = jnp.array([0, 37, 64, 120])
    kw = with_sinks(kw, H)
    feats = {f: kw[f] for f in ("softcap", "sinks", "window") if f in kw}
    o = jax.jit(lambda *a: decode_attention(*a, **kw))(q, k, v, lengths)
    assert rel_err(o, decode_attention_reference(q, k, v, lengths, **feats)) <= 1e-5
    assert np.all(np.asarray(o)[0] == 0), "a sequence with no keys gets zeros"
    window = feats.pop("window", None)
    for b in range(1, B):
        n = int(lengths[b])
        lo = 0 if window is None else max(0, n - window)
        full = flash_attention_reference(
            q[b : b + 1, None], k[b : b + 1, lo:n], v[b : b + 1, lo:n], causal=False, **feats
        )
        assert rel_err(o[b], full[0, 0]) <= 1e-5, b


# --------------------------------------------------------------------------
# Lowering for GPU (Triton) and TPU (Mosaic) without the hardware
# --------------------------------------------------------------------------
# What this proves: every kernel traces and lowers through Pallas's Triton and
# Mosaic lowerings into the custom call each backend compiles. What it cannot:
# `.compile()` needs the device (Triton -> PTX and Mosaic's layout/legality
# passes run in XLA:GPU and libtpu), so tiling or register limits on real chips
# are untested here.

LOWER_SHAPES = (1, 200, 4, 2, 64)  # B, L=S (not a multiple of any block), H, G, K


@pytest.mark.parametrize(
    "platform, backend, marker", [("cuda", "gpu", "__gpu$xla.gpu.triton"), ("tpu", "tpu", "tpu_custom_call")]
)
@pytest.mark.parametrize("what", ["forward", "forward+backward", "decode"])
def test_lowers_without_the_device(platform, backend, marker, what):
    B, L, H, G, K = LOWER_SHAPES
    q, k, v = (
        jnp.ones((B, L, H, K), jnp.bfloat16),
        jnp.ones((B, L, G, K), jnp.bfloat16),
        jnp.ones((B, L, G, K), jnp.bfloat16),
    )
    seg = jnp.zeros((B, L), jnp.int32)
    feats = dict(softcap=30.0, sinks=jnp.asarray(SINKS[:H]))  # every kernel with the soft cap; the forward with sinks

    def attn(q, k, v):
        return flash_attention(
            q,
            k,
            v,
            backend=backend,
            window=64,
            segment_ids_q=seg,
            segment_ids_kv=seg,
            **feats,
        )

    fn, n_kernels = {
        "forward": (attn, 1),
        "forward+backward": (jax.grad(lambda q, k, v: attn(q, k, v).astype(jnp.float32).sum(), (0, 1, 2)), 3),
        "decode": (lambda q, k, v: decode_attention(q[:, 0], k, v, jnp.array([150]), backend=backend, **feats), 1),
    }[what]
    with pb.lowering_target(platform):
        text = jax.jit(fn).trace(q, k, v).lower(lowering_platforms=(platform,)).as_text()
    assert text.count(marker) == n_kernels


def test_triton_launch_parameters_reach_the_lowered_calls():
    """num_warps / num_stages go into every Triton call (forward, dQ, dK/dV); None keeps the defaults."""
    B, L, H, G, K = LOWER_SHAPES
    q, k = jnp.ones((B, L, H, K), jnp.bfloat16), jnp.ones((B, L, G, K), jnp.bfloat16)

    def launches(**kw):
        loss = lambda q, k, v: flash_attention(q, k, v, backend="gpu", **kw).astype(jnp.float32).sum()  # noqa: E731
        with pb.lowering_target("cuda"):
            text = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()
        calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
        return [
            (int(re.search(r"num_warps = (\d+)", c)[1]), int(re.search(r"num_stages = (\d+)", c)[1])) for c in calls
        ]

    assert launches(num_warps=2, num_stages=3) == [(2, 3)] * 3
    assert launches() == [(4, 2)] * 3  # head_dim 64: 4 warps, 2 stages


# --------------------------------------------------------------------------
# Memory: linear in S for the kernel, quadratic for the reference
# --------------------------------------------------------------------------
# temp_size_in_bytes of the compiled forward+backward on CPU. For the kernel
# this is the interpreter's program, which holds more than a GPU/TPU would: it
# runs the grid as a while loop whose state carries every operand and output in
# full (blocks are dynamic-sliced out and written back), ~15 (S, H, K) arrays
# here, where the hardware kernel's only temporaries are o, lse and delta.
# Still no buffer grows faster than S: the score tile is (block_q, block_kv).


def _temp_bytes(fn, S, H=2, K=64):
    x = jax.ShapeDtypeStruct((1, S, H, K), jnp.float32)
    grads = jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2))
    return jax.jit(grads).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes


def test_kernel_memory_is_linear_in_sequence_length():
    kernel = [_temp_bytes(flash_attention, S) for S in (2048, 4096)]
    reference = [_temp_bytes(flash_attention_reference, S) for S in (2048, 4096)]
    assert 1.7 <= kernel[1] / kernel[0] <= 2.3, kernel
    assert 3.5 <= reference[1] / reference[0] <= 4.5, reference
    assert kernel[1] < 4096 * 4096 * 4, "the kernel holds less than one float32 S x S score matrix"
