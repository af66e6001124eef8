"""Paged attention: queries attend to K/V pages read in place through a per-sequence block table.

A paged KV cache (vLLM's PagedAttention layout, src/meshwork/engine/kv_cache.py) keeps
keys and values in a pool of fixed-size pages, (layers, N, T, G, K), and each
sequence's page table names the pool page that holds its positions
j*T .. j*T + T - 1. Gathering every sequence's pages into a contiguous
(B, P*T, G, K) view before attending copies the whole live cache every step;
this kernel instead loads page table[b, j] itself, one page per inner step,
so the only K/V traffic is the pages a query can see.

One kernel serves decode (L = 1 query per sequence) and chunked prefill (a
chunk of L query tokens at arbitrary positions, whose own keys the caller has
already written to the pool): the query at position p sees the keys at
positions <= p (and > p - window with a sliding window). Rows of one program
are (query token, query head of one kv head) pairs, so grouped K/V heads are
read once for all their H/G query heads. The page loop runs only over the
pages some row of the block can see; its range is split into `pages_per_split`
programs for parallelism on long contexts (flash-decoding) and the splits are
merged exactly (decode_attention.merge_chunks). Soft-capping (Gemma 2) caps
the scores in the kernel; attention sinks (gpt-oss) join the merge as one
more split with output 0 and lse = the row's sink. Inference only: no gradient.

Backends (see pallas_backend.py): GPU (Triton) and the CPU interpreter index
the pool in place, with the layer and page as scalar offsets; TPU (Mosaic)
keeps the pool in HBM (memory_space ANY) and copies each page into VMEM by
DMA. The pool is passed whole, with the layer index, so reading one layer of
a scanned model's cache does not slice (copy) that layer out either.
Triton needs the page size and head_dim to be powers of two >= 16 (the pool
cannot be padded without a copy).

    >>> q = jnp.ones((2, 1, 8, 32)); pool = jnp.ones((9, 16, 2, 32))
    >>> table = jnp.array([[1, 2, 3, 4], [5, 6, 7, 8]]); pos = jnp.array([[40], [63]])
    >>> paged_attention(q, pool, pool, table, pos).shape
    (2, 1, 8, 32)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from meshwork.kernels.decode_attention import merge_chunks, online_softmax_step
from meshwork.kernels.pallas_backend import (
    F32,
    MASKED,
    check_features,
    compiler_params,
    dot,
    dot_precision,
    floor_div,
    masked_softmax,
    resolve_backend,
    round_up,
    soft_cap,
)

# Untuned: keys per split program ~512 on GPU (as flash-decoding's chunk), the
# whole table on CPU (the interpreter gains nothing from more programs).
DEFAULT_KEYS_PER_SPLIT = {"gpu": 512, "tpu": 2048, "cpu": None}
# Query rows (tokens x heads per kv head) per program in a prefill chunk.
DEFAULT_ROWS = 64


@dataclasses.dataclass(frozen=True)
class _Config:
    scale: float
    page_size: int
    pages_per_split: int
    rows: int  # rows per program, padded (Triton: power of two >= 16)
    head_dim: int
    backend: str
    interpret: object
    window: int | None = None
    poison: bool = False
    softcap: float | None = None  # Gemma 2: scores -> softcap * tanh(scores / softcap), before the mask


def _paged_kernel(layer_ref, table_ref, lo_ref, hi_ref, pos_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, cfg: _Config):
    b, g, c, s = (pl.program_id(i) for i in range(4))
    T = cfg.page_size
    layer = layer_ref[0]
    # Pages [lo, hi) are the ones some row of this query block can see; this split owns a slice of them.
    lo = jnp.maximum(lo_ref[b, c], s * cfg.pages_per_split)
    hi = jnp.minimum(hi_ref[b, c], (s + 1) * cfg.pages_per_split)
    q = q_ref[...]
    prec = dot_precision(q.dtype)
    pos = pos_ref[...][:, None]  # (rows, 1); padding rows are -1 and see nothing

    def load(ref, page):
        if cfg.backend == "tpu":

            def copy(buf):
                pltpu.sync_copy(ref.at[layer, page, :, pl.ds(g, 1), :], buf)
                return buf[:, 0, :]

            return pl.run_scoped(copy, pltpu.VMEM((T, 1, cfg.head_dim), ref.dtype))
        return ref[layer, page, :, g, :]

    def step(j, carry):
        m, l, acc = carry
        page = table_ref[b, j]
        k, v = load(k_ref, page).astype(q.dtype), load(v_ref, page).astype(q.dtype)
        scores = soft_cap(dot(q, k, (1, 1), prec) * cfg.scale, cfg.softcap)
        key = j * T + lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        mask = key <= pos
        if cfg.window:
            mask &= key > pos - cfg.window
        return online_softmax_step(m, l, acc, scores, mask, v, prec)

    init = (
        jnp.full((cfg.rows, 1), MASKED, F32),
        jnp.zeros((cfg.rows, 1), F32),
        jnp.zeros((cfg.rows, cfg.head_dim), F32),
    )
    m, l, acc = lax.fori_loop(lo, jnp.maximum(lo, hi), step, init)
    empty = l == 0.0  # no visible key in this split: weight exp(-inf) = 0 in the merge
    l = jnp.where(empty, 1.0, l)
    o_ref[...] = acc / l
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log(l))


def check_shapes(q_BLHK, k_pool, v_pool, page_table_BP, positions_BL):
    """The pools with a layers axis ([layers,] pages, page_size, G, K); ValueError naming every shape
    when they do not fit the queries, table and positions."""
    if k_pool.ndim == 4:
        k_pool, v_pool = k_pool[None], v_pool[None]
    (B, L, H, K), (_, _, _, G, Kk) = q_BLHK.shape, k_pool.shape
    if (
        k_pool.ndim != 5
        or v_pool.shape != k_pool.shape
        or K != Kk
        or H % G
        or page_table_BP.ndim != 2
        or page_table_BP.shape[0] != B
        or positions_BL.shape != (B, L)
    ):
        raise ValueError(
            f"paged_attention wants q (B, L, H, K), k and v pools ([layers,] pages, page_size, G, K) "
            f"with H a multiple of G, page_table (B, P) and positions (B, L); got q {q_BLHK.shape}, "
            f"k {k_pool.shape}, v {v_pool.shape}, page_table {page_table_BP.shape}, "
            f"positions {positions_BL.shape}"
        )
    return k_pool, v_pool


def paged_attention(
    q_BLHK: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    page_table_BP: jax.Array,
    positions_BL: jax.Array,
    *,
    layer: jax.Array | int = 0,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
    block_rows: int | None = None,
    pages_per_split: int | None = None,
    backend: str | None = None,
    interpret=None,
) -> jax.Array:
    """Queries at positions_BL over the keys their sequence's pages hold at positions <= theirs.

    q_BLHK: L new tokens per sequence (L = 1: decode; L > 1: a prefill chunk,
    whose keys must already be in the pool). k_pool, v_pool: (N, T, G, K) or
    (layers, N, T, G, K) with `layer` picking one (an int or a traced scalar:
    the pool is not sliced). page_table_BP[b, j]: the pool page holding
    positions j*T .. j*T + T - 1 of sequence b. A query at position p sees
    keys j <= p (and j > p - window); positions past the table see all P*T.
    scale: default 1/sqrt(K). block_rows: query rows (tokens x H/G heads) per
    program. pages_per_split: pages per program along the sequence (default
    ~DEFAULT_KEYS_PER_SPLIT keys). backend, interpret: as in `flash_attention`.
    softcap, sinks: Gemma 2's logit cap and gpt-oss's (H,) per-head sink
    logits, as in `flash_attention`.

    >>> q = jnp.ones((1, 3, 4, 16)); pool = jnp.ones((5, 8, 1, 16))
    >>> paged_attention(q, pool, pool, jnp.array([[3, 1, 4, 2]]), jnp.array([[9, 10, 11]]), window=4).shape
    (1, 3, 4, 16)
    >>> paged_attention(q, pool, pool, jnp.array([[3, 1, 4, 2]]), jnp.array([[9, 10, 11]]), sinks=jnp.zeros(4)).shape
    (1, 3, 4, 16)
    """
    k_pool, v_pool = check_shapes(q_BLHK, k_pool, v_pool, page_table_BP, positions_BL)
    if window is not None and window < 1:
        raise ValueError(f"paged_attention window={window}: a window must see at least the query's own key (>= 1)")
    backend, interpret = resolve_backend(backend, interpret)
    (B, L, H, K), (_, _, T, G, _), P = q_BLHK.shape, k_pool.shape, page_table_BP.shape[1]
    check_features(softcap, sinks, H)
    R = H // G
    if backend == "gpu" and (T < 16 or T & (T - 1) or K < 16 or K & (K - 1)):
        raise ValueError(
            f"paged_attention on GPU (Triton) needs page_size and head_dim powers of two >= 16, got "
            f"page_size {T}, head_dim {K}; change the page size, or read the pages by gather "
            f"(attention impl xla)"
        )
    # Rows per program: whole query tokens (all R heads of one), at least one token.
    tokens = max(1, min(L, (block_rows or DEFAULT_ROWS) // R))
    rows = tokens * R
    if backend == "gpu":
        rows = max(16, pl.next_power_of_2(rows))  # tl.dot needs M >= 16, Triton power-of-two shapes
    elif backend == "tpu":
        rows = round_up(rows, 8)
    per_split = pages_per_split or (-(-DEFAULT_KEYS_PER_SPLIT[backend] // T) if DEFAULT_KEYS_PER_SPLIT[backend] else P)
    cfg = _Config(
        scale=float(K**-0.5 if scale is None else scale),
        page_size=T,
        pages_per_split=max(1, min(per_split, P)),
        rows=rows,
        head_dim=K,
        backend=backend,
        interpret=interpret,
        window=window,
        softcap=None if softcap is None else float(softcap),
    )
    o, lse = _paged_splits(q_BLHK, k_pool, v_pool, page_table_BP, positions_BL, jnp.asarray(layer), tokens, cfg)
    sink = None
    if sinks is not None:  # (1, G, 1, 1, rows, 1): row token * R + r of kv head g is query head g * R + r
        sink = jnp.tile(jnp.asarray(sinks, F32).reshape(G, R), (1, tokens))
        sink = jnp.pad(sink, ((0, 0), (0, rows - tokens * R)))[None, :, None, None, :, None]
    o = merge_chunks(o, lse, axis=3, sink=sink)  # (B, G, C, rows, K)
    C = o.shape[2]
    o = o[:, :, :, : tokens * R].reshape(B, G, C * tokens, R, K)[:, :, :L]
    return o.transpose(0, 2, 1, 3, 4).reshape(B, L, H, K).astype(q_BLHK.dtype)


def _paged_splits(q_BLHK, k_pool, v_pool, page_table_BP, positions_BL, layer, tokens, cfg):
    """Lay out the query blocks, bound each block's pages and run the kernel: per split o and lse, float32."""
    (B, L, H, K), G, P = q_BLHK.shape, k_pool.shape[3], page_table_BP.shape[1]
    R, T = H // G, cfg.page_size
    C = -(-L // tokens)
    S = -(-P // cfg.pages_per_split)
    pos_BL = jnp.pad(positions_BL.astype(jnp.int32), ((0, 0), (0, C * tokens - L)), constant_values=-1)
    pos_BC_t = pos_BL.reshape(B, C, tokens)
    # Pages a block can see: up to its last query's page; with a window, from its first query's window start.
    hi_BC = jnp.minimum(floor_div(jnp.maximum(pos_BC_t.max(-1), -1) + 1 + T - 1, T), P)
    if cfg.window:
        first = jnp.where(pos_BC_t >= 0, pos_BC_t, jnp.iinfo(jnp.int32).max).min(-1)
        lo_BC = jnp.minimum(floor_div(jnp.maximum(first - cfg.window + 1, 0), T), P)
    else:
        lo_BC = jnp.zeros((B, C), jnp.int32)
    pos_BC_rows = jnp.repeat(pos_BC_t, R, axis=2)  # row = token * R + head
    pos_BC_rows = jnp.pad(pos_BC_rows, ((0, 0), (0, 0), (0, cfg.rows - tokens * R)), constant_values=-1)
    q = jnp.pad(q_BLHK, ((0, 0), (0, C * tokens - L), (0, 0), (0, 0))).reshape(B, C, tokens, G, R, K)
    q = q.transpose(0, 3, 1, 2, 4, 5).reshape(B, G, C, tokens * R, K)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, cfg.rows - tokens * R), (0, 0)))
    table = page_table_BP.astype(jnp.int32)
    layer = jnp.reshape(layer.astype(jnp.int32), (1,))
    if cfg.backend == "tpu":
        smem = pl.BlockSpec(memory_space=pltpu.SMEM)
        small = [smem] * 4
        pool_spec = pl.BlockSpec(memory_space=pl.ANY)
    else:

        def whole(shape):
            return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))

        small = [whole((1,)), whole(table.shape), whole(lo_BC.shape), whole(hi_BC.shape)]
        pool_spec = whole(k_pool.shape)

    def out_spec(n):
        return pl.BlockSpec((None, None, None, None, cfg.rows, n), lambda b, g, c, s: (b, g, c, s, 0, 0))

    out_shape = [
        jax.ShapeDtypeStruct((B, G, C, S, cfg.rows, K), F32),
        jax.ShapeDtypeStruct((B, G, C, S, cfg.rows, 1), F32),
    ]
    in_specs = [
        *small,
        pl.BlockSpec((None, None, cfg.rows), lambda b, g, c, s: (b, c, 0)),
        pl.BlockSpec((None, None, None, cfg.rows, K), lambda b, g, c, s: (b, g, c, 0, 0)),
        pool_spec,
        pool_spec,
    ]
    args = (layer, table, lo_BC, hi_BC, pos_BC_rows, q, k_pool, v_pool)
    out_specs = [out_spec(K), out_spec(1)]
    kernel = functools.partial(_paged_kernel, cfg=cfg)
    aliases = {}
    if cfg.poison:  # outputs start as NaN: a tile the kernel never writes stays NaN (as pallas_backend.launch)
        n = len(args)
        args = (*args, *(jnp.full(s.shape, jnp.nan, s.dtype) for s in out_shape))
        in_specs, aliases = [*in_specs, *out_specs], {n: 0, n + 1: 1}

        def kernel(*refs):
            return _paged_kernel(*refs[:n], *refs[n + 2 :], cfg=cfg)

    grid = (B, G, C, S)
    params = compiler_params(cfg.backend, len(grid), K)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=cfg.interpret,
        name="paged_attention",
        compiler_params=params,
    )(*args)


def paged_attention_reference(
    q_BLHK: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    page_table_BP: jax.Array,
    positions_BL: jax.Array,
    *,
    layer: jax.Array | int = 0,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
    block_rows: int | None = None,
    pages_per_split: int | None = None,
    backend: str | None = None,
    interpret=None,
) -> jax.Array:
    """`paged_attention` in plain JAX: gather each sequence's pages into (B, P*T, G, K), mask, softmax in float32.

    This is the gather the kernel avoids (and the XLA path's fallback).

    >>> q = jnp.ones((1, 3, 4, 16)); pool = jnp.ones((5, 8, 1, 16))
    >>> paged_attention_reference(q, pool, pool, jnp.array([[3, 1, 4, 2]]), jnp.array([[9, 10, 11]])).shape
    (1, 3, 4, 16)
    """
    del block_rows, pages_per_split, backend, interpret
    k_pool, v_pool = check_shapes(q_BLHK, k_pool, v_pool, page_table_BP, positions_BL)
    (B, L, H, K), G = q_BLHK.shape, k_pool.shape[3]
    check_features(softcap, sinks, H)
    scale = K**-0.5 if scale is None else scale
    k, v = gather_pages(k_pool, page_table_BP, layer), gather_pages(v_pool, page_table_BP, layer)
    q_BLGRK = q_BLHK.astype(F32).reshape(B, L, G, H // G, K)
    s = soft_cap(jnp.einsum("BLGRK,BSGK->BGRLS", q_BLGRK, k.astype(F32), precision="highest") * scale, softcap)
    key_S, pos_BL1 = jnp.arange(k.shape[1]), positions_BL[:, :, None]
    visible_BLS = key_S <= pos_BL1
    if window is not None:
        visible_BLS &= key_S > pos_BL1 - window
    sink = None if sinks is None else jnp.asarray(sinks, F32).reshape(1, G, H // G, 1, 1)
    p = masked_softmax(s, visible_BLS[:, None, None], sink)
    o = jnp.einsum("BGRLS,BSGK->BLGRK", p, v.astype(F32), precision="highest")
    return o.reshape(B, L, H, K).astype(q_BLHK.dtype)


def gather_pages(pool: jax.Array, page_table_BP: jax.Array, layer: jax.Array | int = 0) -> jax.Array:
    """One layer's pages of every sequence, in table order: a contiguous (B, P*T, G, K) copy.

    >>> gather_pages(jnp.ones((2, 5, 8, 1, 16)), jnp.array([[3, 1]]), layer=1).shape
    (1, 16, 1, 16)
    """
    if pool.ndim == 4:
        pool = pool[None]
    L, N, T, *rest = pool.shape
    (B, P), page = page_table_BP.shape, math.prod(rest) * T
    # Whole pages as rows of a 2-D view, indexed by layer * N + page, in bounds by construction (the
    # table holds allocated pages or the null page): XLA:CPU copies such rows 2-3x faster than it
    # gathers (T, G, K) blocks out of the 5-D pool, and nothing copies the layer out first.
    rows = pool.reshape(L * N, page).at[layer * N + page_table_BP].get(mode="promise_in_bounds")
    return rows.reshape(B, P * T, *rest)
