"""KV caches for autoregressive decoding: contiguous (one row per sequence) and paged.

A decoder recomputes nothing for tokens it has seen: each layer's keys and
values are stored once, and a new token's query attends over them. Both caches
here are pytrees the model threads through its layer scan
(`models/transformer.py: decode_layers`); `cache.layer(i)` is layer i's view,
whose `attend` writes the new keys/values at their positions and attends the
new queries over everything cached for the sequence so far (causally, by
position), returning the updated cache.

- `KVCache`: k and v of shape (layers, batch, max_len, kv_heads, head_dim),
  preallocated for the longest sequence. Batch is split over the data axes and
  kv heads over `tensor` by the same rules table as training (`shardings`).
  The layout keeps `layers` leading (the scan indexes it) and (S, G, K)
  trailing, the layout the flash-decoding kernel reads.
- `PagedKVCache`: a pool of fixed-size pages (layers, pages, page_size,
  kv_heads, head_dim) plus a page table per sequence (vLLM's PagedAttention
  layout). Memory follows what the live sequences use, not
  batch x longest; `serving.py` hands pages out and takes them back. Page 0 is
  never handed out: unused page-table entries point at it, so writes of
  padding or of idle slots land there and never in a live page.

Positions drive everything: a token at position p is written at p and sees
the keys at positions <= p (and > p - window with a sliding window, Mistral's;
the cache still keeps every position, so its memory is not bounded by the
window). Right-padded prompts therefore need no mask of their own: padding sits
after the real tokens, and the next real token overwrites the first padded slot
before anything can attend to it.

Reading a paged cache: with attention impl "pallas" the paged-attention
kernel (meshwork.kernels.paged_attention) reads each sequence's pages in place
through its page table, for decode steps and prefill chunks alike, so no step
copies the cache. With impl "xla" on the CPU a C++ kernel does the same
(meshwork.kernels.cpu_paged_attention, float32 pools). Everything else keeps the
gather: each sequence's pages are gathered into a contiguous (B, P * T, G, K)
view per layer (one copy of every live sequence's cache per step) and XLA
attends over it. Two page tables may name the same pages (a shared prompt
prefix): reads never write.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshwork.config_sections import ModelConfig
from meshwork.engine.recurrent_states import RecurrentStates, StateLayerView
from meshwork.kernels import cpu_paged_attention
from meshwork.kernels.decode_attention import decode_attention
from meshwork.kernels.paged_attention import gather_pages, paged_attention
from meshwork.kernels.score_modifiers import soft_cap, softmax_with_sinks
from meshwork.sharding.parallel import current_rules
from meshwork.sharding.rules import Rules, compiler_axes, logical_to_sharding, split_axes

# Logical names of a cache's (layers, batch, seq, kv_heads, head_dim) dimensions.
CACHE_AXES = ("layers", "act_batch", None, "act_kv_heads", "act_head_dim")
# The paged pool's pages are split over the data axes, one range per data-parallel replica
# (_attend_per_replica); its sequences' rows are split the same way.
POOL_AXES = ("layers", "act_batch", None, "act_kv_heads", "act_head_dim")
NULL_PAGE = 0


def cache_geometry(cfg: ModelConfig) -> tuple[int, int, int]:
    """(kv heads, key width, value width) that one layer caches per token.

    Dense attention: (kv_heads, head_dim, head_dim). Multi-head latent attention
    (models/layers/mla.py): one "head" of the latent and the RoPE key, (1, kv_lora_rank +
    qk_rope_head_dim, 0); its values are the latent itself (the key's first kv_lora_rank dims),
    so `v` is a zero-width array and `attend_latent` reads them from `k`.
    """
    if cfg.mla is not None:
        return 1, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim, 0
    return cfg.n_kv_heads, cfg.resolved_head_dim, cfg.resolved_head_dim


def cache_bytes_per_token(cfg: ModelConfig, dtype: jnp.dtype) -> int:
    """layers x kv_heads x (key + value width) x bytes per element: 2 x layers x kv_heads x head_dim x
    bytes for dense attention, layers x (kv_lora_rank + qk_rope_head_dim) x bytes for MLA; `layers`
    counts one more per MTP module (`cache_layers`: their draft's cache is allocated with the model's)."""
    G, Kk, Kv = cache_geometry(cfg)
    return cache_layers(cfg) * G * (Kk + Kv) * jnp.dtype(dtype).itemsize


def cache_layers(cfg: ModelConfig) -> int:
    """Layers a cache holds: the model's attention layers (not a hybrid model's linear ones, which keep
    `RecurrentStates` instead), then one per multi-token-prediction module (their draft)."""
    return cfg.n_layers - len(cfg.linear_layers) + cfg.mtp.depth


def _zero_pair(
    cfg: ModelConfig, lead: tuple[int, ...], dtype: jnp.dtype, sharding: NamedSharding | None
) -> tuple[jax.Array, ...]:
    """Zeroed k and v arrays of shape (layers, *lead, kv heads, width), each created directly in its
    sharding (no host copy)."""
    G, Kk, Kv = cache_geometry(cfg)
    return tuple(_zeros((cache_layers(cfg), *lead, G, K), jnp.dtype(dtype), sharding)() for K in (Kk, Kv))


@functools.cache
def _zeros(shape: tuple[int, ...], dtype: jnp.dtype, sharding: NamedSharding | None):
    """A program making a zeroed array in `sharding`, one per (shape, dtype, sharding) and process:
    every cache of a shape made later reuses its trace (a fresh jit of a lambda traced and lowered
    again each time: 807 times in one run of the quick tier)."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def _latent(axes: tuple) -> tuple:
    """A cache's logical axes with its kv-heads dimension left whole: MLA's one latent "head" is
    read by every query head, so it is replicated where the heads are split."""
    return tuple(None if a == "act_kv_heads" else a for a in axes)


def cached_attention(
    q_BLHK: jax.Array,
    k_BSGK: jax.Array,
    v_BSGK: jax.Array,
    positions_BL: jax.Array,
    impl: str = "xla",
    window: int | jax.Array | None = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks_H: jax.Array | None = None,
) -> jax.Array:
    """Queries at `positions_BL` over cached keys 0..S-1, key j visible to a query at p iff j <= p
    (and p - window < j, with a sliding window; a traced window is a layer pattern's,
    models/layers/layer_pattern.py). `scale`, `softcap`, `sinks_H`: as in training
    (models/layers/attention_local.py).

    A single new token per sequence with impl "pallas" runs the flash-decoding
    kernel (meshwork.kernels.decode_attention), which takes the window itself
    (it starts at the window's first block, skipping the keys before it);
    everything else is XLA's attention with the position mask (grouped heads
    without repeating K/V).

    >>> q = jnp.ones((1, 1, 2, 8)); k = v = jnp.ones((1, 16, 1, 8))
    >>> cached_attention(q, k, v, jnp.array([[9]]), window=4).shape
    (1, 1, 2, 8)
    """
    L = positions_BL.shape[1]
    modifiers = _modifiers(scale, softcap, sinks_H)
    if impl == "pallas" and L == 1:
        lengths_B = positions_BL[:, 0] + 1
        return decode_attention(q_BLHK[:, 0], k_BSGK, v_BSGK, lengths_B, window=window, **modifiers)[:, None]
    S = k_BSGK.shape[1]
    key_S, pos_B1L1 = jnp.arange(S)[None, None, None, :], positions_BL[:, None, :, None]
    mask_B1LS = key_S <= pos_B1L1
    if window is not None:
        mask_B1LS &= key_S > pos_B1L1 - window
    if L == 1 and k_BSGK.shape[2] <= BLOCK_DIAGONAL_MAX_KV_HEADS:
        return _one_token_attention(q_BLHK, k_BSGK, v_BSGK, mask_B1LS[:, 0, 0], scale, softcap, sinks_H)
    if softcap is not None or sinks_H is not None:
        return _modified_attention(q_BLHK, k_BSGK, v_BSGK, mask_B1LS, scale, softcap, sinks_H)
    return jax.nn.dot_product_attention(q_BLHK, k_BSGK, v_BSGK, mask=mask_B1LS, scale=scale)


# One new token per row: up to this many kv heads, the block-diagonal form below (its dots do
# kv-heads times the useful FLOPs, which one token per row can afford).
BLOCK_DIAGONAL_MAX_KV_HEADS = 8


def _one_token_attention(q_B1HK, k_BSGK, v_BSGK, mask_BS, scale, softcap, sinks_H):
    """Attention of one query token per row, read straight from the (B, S, G, K) cache layout.

    Per head it is a (1, K) x (K, S) product: XLA:CPU runs such dots batched over (row, head) only
    after transposing the cache to put the heads before the positions, a strided copy of every key
    and value that cost more than the rest of the decode step together. Instead the queries go
    into a block-diagonal (G*K, H) matrix (head h's query in the rows of its kv group), so the
    scores are one (S, G*K) x (G*K, H) product per row on the cache as it lies, and the output one
    (H, S) x (S, G*K) product whose diagonal blocks are the heads' outputs. Scores and softmax in
    float32, as `_modified_attention`."""
    B, _, H, K = q_B1HK.shape
    S, G = k_BSGK.shape[1:3]
    R = H // G
    eye_GG = jnp.eye(G, dtype=jnp.float32)
    q_BGKR = jnp.swapaxes(q_B1HK[:, 0].astype(jnp.float32).reshape(B, G, R, K), 2, 3)
    q_BXH = (q_BGKR[:, :, :, None, :] * eye_GG[None, :, None, :, None]).reshape(B, G * K, H)
    s_BSH = jnp.einsum(
        "BSX,BXH->BSH", k_BSGK.reshape(B, S, G * K), q_BXH.astype(k_BSGK.dtype), preferred_element_type=jnp.float32
    ) * (K**-0.5 if scale is None else scale)
    s_BSH = jnp.where(mask_BS[:, :, None], soft_cap(s_BSH, softcap), jnp.finfo(jnp.float32).min)
    p_BHS = softmax_with_sinks(jnp.swapaxes(s_BSH, 1, 2), None if sinks_H is None else sinks_H[:, None])
    o_BHX = jnp.einsum(
        "BHS,BSX->BHX", p_BHS.astype(v_BSGK.dtype), v_BSGK.reshape(B, S, G * K), preferred_element_type=jnp.float32
    )
    o_BGRK = (o_BHX.reshape(B, G, R, G, K) * eye_GG[None, :, None, :, None]).sum(3)
    return o_BGRK.reshape(B, 1, H, K).astype(q_B1HK.dtype)


def _modified_attention(q_BLHK, k_BSGK, v_BSGK, mask_B1LS, scale, softcap, sinks_H):
    """Attention with soft-capped scores and sinks (kernels/score_modifiers.py), scores in float32."""
    (B, L, H, K), G = q_BLHK.shape, k_BSGK.shape[2]
    q_BLGRK = q_BLHK.astype(jnp.float32).reshape(B, L, G, H // G, K)
    s_BGRLS = jnp.einsum("BLGRK,BSGK->BGRLS", q_BLGRK, k_BSGK.astype(jnp.float32)) * (
        K**-0.5 if scale is None else scale
    )
    s_BGRLS = jnp.where(mask_B1LS[:, :, None], soft_cap(s_BGRLS, softcap), jnp.finfo(jnp.float32).min)
    sinks = None if sinks_H is None else sinks_H.reshape(G, H // G)[:, :, None, None]
    p_BGRLS = softmax_with_sinks(s_BGRLS, sinks)
    o_BLGRK = jnp.einsum("BGRLS,BSGK->BLGRK", p_BGRLS, v_BSGK.astype(jnp.float32))
    return o_BLGRK.reshape(B, L, H, K).astype(q_BLHK.dtype)


def _modifiers(scale: float | None, softcap: float | None, sinks_H: jax.Array | None) -> dict:
    """The kernels' keywords for the score modifiers in use (none: the call is as before them)."""
    return {k: v for k, v in (("scale", scale), ("softcap", softcap), ("sinks", sinks_H)) if v is not None}


def latent_attention(
    q_BLHC: jax.Array,
    cache_BSC: jax.Array,
    positions_BL: jax.Array,
    *,
    scale: float,
    values: int,
    window: int | None = None,
) -> jax.Array:
    """Absorbed-query attention over cached latents: softmax(q . cache * scale, causal by position) x
    cache[..., :values], (B, L, H, values). Scores and softmax in float32.

    >>> q = jnp.ones((1, 1, 2, 6)); cache = jnp.ones((1, 8, 6))
    >>> latent_attention(q, cache, jnp.array([[3]]), scale=0.5, values=4).shape
    (1, 1, 2, 4)
    """
    S = cache_BSC.shape[1]
    s_BHLS = jnp.einsum("BLHC,BSC->BHLS", q_BLHC.astype(jnp.float32), cache_BSC.astype(jnp.float32)) * scale
    key_S, pos_B1L1 = jnp.arange(S)[None, None, None, :], positions_BL[:, None, :, None]
    mask = key_S <= pos_B1L1
    if window is not None:
        mask &= key_S > pos_B1L1 - window
    p_BHLS = jax.nn.softmax(jnp.where(mask, s_BHLS, jnp.finfo(jnp.float32).min), axis=-1)
    return jnp.einsum("BHLS,BSR->BLHR", p_BHLS, cache_BSC[..., :values].astype(jnp.float32)).astype(q_BLHC.dtype)


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, dtype: jnp.dtype = jnp.float32) -> int:
    """Bytes of a contiguous cache: keys and values (or latents) of every layer, row and position."""
    return batch * max_len * cache_bytes_per_token(cfg, dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Contiguous cache: row b holds sequence b's keys/values at positions 0..max_len-1."""

    k: jax.Array  # (layers, batch, max_len, kv_heads, head_dim)
    v: jax.Array
    states: RecurrentStates | None = None  # a hybrid model's linear layers' states, one per row
    rows: jax.Array | None = None  # always None: row b is sequence b

    @classmethod
    def zeros(
        cls,
        cfg: ModelConfig,
        batch: int,
        max_len: int,
        dtype: jnp.dtype = jnp.float32,
        sharding: NamedSharding | None = None,
    ) -> KVCache:
        return cls(*_zero_pair(cfg, (batch, max_len), dtype, sharding), RecurrentStates.zeros(cfg, batch, dtype))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def linear_layer(self, j: jax.Array) -> StateLayerView:
        return StateLayerView(self, j)

    @staticmethod
    def shardings(mesh: Mesh, rules: Rules, latent: bool = False) -> KVCache:
        """The cache's layout by the rules; `latent`: an MLA cache (kv-heads dimension replicated)."""
        s = logical_to_sharding(_latent(CACHE_AXES) if latent else CACHE_AXES, mesh, rules)
        return KVCache(s, s)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def layer(self, i: jax.Array) -> _ContiguousLayer:
        return _ContiguousLayer(self, i)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _ContiguousLayer:
    cache: KVCache
    i: jax.Array

    def attend(self, q_BLHK, k_BLGK, v_BLGK, positions_BL, impl="xla", window=None, **modifiers):
        """Writes this call's keys and values at their positions and attends the queries over the
        row's cache; `modifiers`: `cached_attention`'s scale, softcap and sinks_H."""
        B = positions_BL.shape[0]
        rows_B1 = jnp.arange(B)[:, None]
        # One scatter per array; positions past max_len are dropped, not clamped onto real data.
        k = self.cache.k.at[self.i, rows_B1, positions_BL].set(k_BLGK.astype(self.cache.k.dtype), mode="drop")
        v = self.cache.v.at[self.i, rows_B1, positions_BL].set(v_BLGK.astype(self.cache.v.dtype), mode="drop")
        o_BLHK = cached_attention(
            q_BLHK,
            k[self.i].astype(q_BLHK.dtype),
            v[self.i].astype(q_BLHK.dtype),
            positions_BL,
            impl,
            window,
            **modifiers,
        )
        return o_BLHK, _ContiguousLayer(dataclasses.replace(self.cache, k=k, v=v), self.i)

    def attend_latent(self, q_BLHC, entry_BLC, positions_BL, *, scale, values, window=None, impl="xla"):
        """MLA's absorbed attention (models/layers/mla.py): writes each token's [latent, RoPE key] at its
        position and attends the latent-space queries over the row's cached entries; (B, L, H, values).
        (`impl` is for the paged cache's kernel; a contiguous cache attends with XLA.)"""
        rows_B1 = jnp.arange(positions_BL.shape[0])[:, None]
        k = self.cache.k.at[self.i, rows_B1, positions_BL, 0].set(entry_BLC.astype(self.cache.k.dtype), mode="drop")
        o_BLHR = latent_attention(q_BLHC, k[self.i, :, :, 0], positions_BL, scale=scale, values=values, window=window)
        return o_BLHR, _ContiguousLayer(dataclasses.replace(self.cache, k=k), self.i)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
    """Paged cache: sequence b's position p lives in page page_table[b, p // page_size]
    at offset p % page_size of a pool shared by all sequences."""

    k: jax.Array  # (layers, n_pages, page_size, kv_heads, head_dim)
    v: jax.Array
    page_table: jax.Array  # (batch, pages_per_seq) int32; NULL_PAGE where nothing is allocated
    states: RecurrentStates | None = None  # a hybrid model's linear layers' states, one per slot
    rows: jax.Array | None = None  # the slot of each batch row (None: row b is slot b)

    @classmethod
    def zeros(
        cls,
        cfg: ModelConfig,
        n_pages: int,
        page_size: int,
        batch: int,
        pages_per_seq: int,
        dtype: jnp.dtype = jnp.float32,
        sharding: NamedSharding | None = None,
    ) -> PagedKVCache:
        k, v = _zero_pair(cfg, (n_pages, page_size), dtype, sharding)
        table = jnp.full((batch, pages_per_seq), NULL_PAGE, jnp.int32)
        return cls(k, v, table, RecurrentStates.zeros(cfg, batch, dtype))

    @staticmethod
    def shardings(mesh: Mesh, rules: Rules, latent: bool = False) -> PagedKVCache:
        """The pool's layout by the rules; `latent`: an MLA pool (kv-heads dimension replicated)."""
        s = logical_to_sharding(_latent(POOL_AXES) if latent else POOL_AXES, mesh, rules)
        return PagedKVCache(s, s, logical_to_sharding((), mesh, rules))

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def capacity(self) -> int:
        """Positions a row's page table reaches (past them a write goes to the null page)."""
        return self.page_table.shape[1] * self.page_size

    def linear_layer(self, j: jax.Array) -> StateLayerView:
        return StateLayerView(self, j)

    def layer(self, i: jax.Array) -> _PagedLayer:
        return _PagedLayer(self, i)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _PagedLayer:
    cache: PagedKVCache
    i: jax.Array

    def attend(
        self, q_BLHK, k_BLGK, v_BLGK, positions_BL, impl="xla", window=None, *, scale=None, softcap=None, sinks_H=None
    ):
        """As `_ContiguousLayer.attend`, over the sequence's pages."""
        c = self.cache
        # A traced window (a layer pattern's) and the sinks are arrays: they enter the per-replica
        # shard_map as arguments, the sinks split like the heads.
        traced_window = window if isinstance(window, jax.Array) else None
        attend = functools.partial(
            _attend_pages,
            impl=impl,
            window=None if traced_window is not None else window,
            scale=scale,
            softcap=softcap,
        )
        args = (q_BLHK, k_BLGK, v_BLGK, positions_BL, c.k, c.v, c.page_table, self.i)
        rules, mesh = current_rules(), jax.sharding.get_abstract_mesh()
        if rules is None or mesh.empty or all(n == 1 for n in mesh.shape.values()):
            o_BLHK, k, v = attend(*args, traced_window, sinks_H)
        else:
            o_BLHK, k, v = _attend_per_replica(attend, rules, dict(mesh.shape), *args, extras=(traced_window, sinks_H))
        return o_BLHK, _PagedLayer(dataclasses.replace(c, k=k, v=v), self.i)

    def attend_latent(self, q_BLHC, entry_BLC, positions_BL, *, scale, values, window=None, impl="xla"):
        """MLA's absorbed attention over the sequence's pages, as `_ContiguousLayer.attend_latent`. With
        impl "pallas" the paged kernel reads the pages in place, the latent pool serving as both the
        keys (all C dims) and the values (their first `values` dims); otherwise XLA over gathered pages."""
        c = self.cache
        attend = functools.partial(_latent_pages, scale=scale, values=values, window=window, impl=impl)
        # The shared paths take (q, k_new, v_new, ...): the entry rides as the "keys", one latent head.
        args = (q_BLHC, entry_BLC[:, :, None], entry_BLC[:, :, None, :0], positions_BL, c.k, c.v, c.page_table, self.i)
        rules, mesh = current_rules(), jax.sharding.get_abstract_mesh()
        if rules is None or mesh.empty or all(n == 1 for n in mesh.shape.values()):
            o_BLHR, k, v = attend(*args)
        else:
            o_BLHR, k, v = _attend_per_replica(attend, rules, dict(mesh.shape), *args, latent=True)
        return o_BLHR, _PagedLayer(dataclasses.replace(c, k=k, v=v), self.i)


def _write_pages(new_BLGK, positions_BL, pool, table_BP, i):
    """`pool` with this layer's new entries written at their positions' pages and offsets."""
    T, P = pool.shape[2], table_BP.shape[1]
    slot_BL = jnp.minimum(positions_BL // T, P - 1)
    page_BL = jnp.take_along_axis(table_BP, slot_BL, axis=1)
    # Past the table's reach a write goes to the null page, never into the row's last live page.
    page_BL = jnp.where(positions_BL < P * T, page_BL, NULL_PAGE)
    return pool.at[i, page_BL, positions_BL % T].set(new_BLGK.astype(pool.dtype))


def _latent_pages(q_BLHC, entry_BL1C, _v, positions_BL, k_pool, v_pool, table_BP, i, *, scale, values, window, impl):
    """Writes the new [latent, RoPE key] entries into their pages, then attends over the sequence's pages."""
    k = _write_pages(entry_BL1C, positions_BL, k_pool, table_BP, i)
    if impl == "pallas":
        # One latent "head" read by all H query heads (grouped-query attention with G = 1); the values'
        # extra RoPE-key columns (Dr of C) are computed and dropped.
        o_BLHC = paged_attention(q_BLHC, k, k, table_BP, positions_BL, layer=i, scale=scale, window=window)
        return o_BLHC[..., :values], k, v_pool
    cache_BSC = gather_pages(k, table_BP, i)[:, :, 0]
    return latent_attention(q_BLHC, cache_BSC, positions_BL, scale=scale, values=values, window=window), k, v_pool


# Query tokens per row up to which XLA:CPU reads pages with the C++ kernel: decode (1) and speculative
# verification (k + 1). A prefill chunk's queries each read their keys again in the kernel, where after
# the gather XLA's products share them: one layer of a 256-token chunk over 256 keys took 6.2 ms in
# the kernel and 2.6 ms gathered, 8 tokens 0.43 and 0.54 ms (CPU host D, 8 kv heads of 64).
CPU_KERNEL_MAX_QUERIES = 8


def _attend_pages(
    q_BLHK,
    k_BLGK,
    v_BLGK,
    positions_BL,
    k_pool,
    v_pool,
    table_BP,
    i,
    traced_window=None,
    sinks_H=None,
    *,
    impl,
    window,
    scale=None,
    softcap=None,
):
    """Writes the new keys/values into their pages, then attends the queries over the sequence's pages
    (within `window`, or `traced_window` where a layer pattern gives it as data)."""
    k = _write_pages(k_BLGK, positions_BL, k_pool, table_BP, i)
    v = _write_pages(v_BLGK, positions_BL, v_pool, table_BP, i)
    window = traced_window if traced_window is not None else window
    if impl == "pallas":
        # The kernel takes the whole pool and the layer index: neither this layer nor its pages are copied.
        modifiers = _modifiers(scale, softcap, sinks_H)
        o_BLHK = paged_attention(q_BLHK, k, v, table_BP, positions_BL, layer=i, window=window, **modifiers)
    else:

        def gathered():
            k_BSGK, v_BSGK = (gather_pages(pool, table_BP, i).astype(q_BLHK.dtype) for pool in (k, v))
            return cached_attention(
                q_BLHK, k_BSGK, v_BSGK, positions_BL, "xla", window, scale=scale, softcap=softcap, sinks_H=sinks_H
            )

        def in_place():  # the C++ kernel (kernels/cpu_paged_attention.py) reads the pages where they lie
            modifiers = _modifiers(scale, softcap, sinks_H)
            return cpu_paged_attention.cpu_paged_attention(
                q_BLHK, k, v, table_BP, positions_BL, layer=i, window=window, **modifiers
            )

        if (
            impl == "xla"
            and q_BLHK.shape[1] <= CPU_KERNEL_MAX_QUERIES
            and cpu_paged_attention.available()
            and cpu_paged_attention.supports(q_BLHK, k, v)
        ):
            o_BLHK = jax.lax.platform_dependent(cpu=in_place, default=gathered)  # other platforms: the gather
        else:
            o_BLHK = gathered()
    return o_BLHK, k, v


def _attend_per_replica(
    attend,
    rules,
    mesh_shape,
    q_BLHK,
    k_BLGK,
    v_BLGK,
    positions_BL,
    k_pool,
    v_pool,
    table_BP,
    i,
    latent=False,
    extras=(),
):
    """`attend` on each device's share of the pool, inside `shard_map`.

    The pool's pages are split over the data axes: data-parallel replica r
    holds pages r*N/D .. (r+1)*N/D - 1 (N pages, D replicas), the first of
    them its own null page, and its rows' page tables name only those
    (serving.py allocates per replica). Kv heads are split over `tensor` as
    in training. So each device writes and reads only pages it holds: no
    collective touches the cache. Rows split over the data axes like the
    pool (decode: each replica runs its own rows); a batch that does not
    divide (a one-row prefill chunk) is replicated instead, every replica
    writes only the pages it holds (the others' land on its null page) and
    the owner's output is summed across the replicas. `latent` (MLA): the pool's one latent
    "head" is whole on every device of the heads' axes, which each attend their query heads over it.
    `extras`: (a traced window or None, the sinks or None), passed on to `attend` after the layer index.
    """
    data = compiler_axes(split_axes("act_batch", rules, mesh_shape))
    heads = compiler_axes(split_axes("act_kv_heads", rules, mesh_shape))
    q_heads = compiler_axes(split_axes("act_heads", rules, mesh_shape))
    if latent:
        heads = ()
    elif heads != q_heads:
        raise ValueError(
            "a paged cache needs query heads and kv heads split over the same mesh axes; "
            "map act_heads and act_kv_heads alike in the rules"
        )
    D = math.prod(mesh_shape[a] for a in data)
    rows_split = q_BLHK.shape[0] % D == 0
    row_axes = (data or None) if rows_split else None
    row = PartitionSpec(row_axes, None)
    act = PartitionSpec(row_axes, None, (q_heads if latent else heads) or None, None)
    new = PartitionSpec(row_axes, None, heads or None, None)
    pool = PartitionSpec(None, data or None, None, heads or None, None)

    given = [x is not None for x in extras]
    extra_specs = (PartitionSpec(), PartitionSpec(q_heads or None))[: len(extras)]

    def body(q, k_new, v_new, positions, k_pool, v_pool, table, i, *present):
        it = iter(present)
        more = [next(it) if g else None for g in given]
        r = jax.lax.axis_index(data) if data else 0
        per_replica = k_pool.shape[1]
        local = table - r * per_replica
        local = jnp.where((local >= 0) & (local < per_replica), local, NULL_PAGE)  # others' pages: the null page
        o, k, v = attend(q, k_new, v_new, positions, k_pool, v_pool, local, i, *more)
        if data and not rows_split:
            mine = table[:, 0] // per_replica == r  # a row's pages all belong to one replica
            o = jax.lax.psum(jnp.where(mine[:, None, None, None], o, 0), data)
        return o, k, v

    # check_vma=False: pallas_call outputs cannot declare the mesh axes they vary over.
    return jax.shard_map(
        body,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(act, new, new, row, pool, pool, row, PartitionSpec())
        + tuple(s for s, g in zip(extra_specs, given, strict=True) if g),
        out_specs=(act, pool, pool),
        check_vma=False,
    )(q_BLHK, k_BLGK, v_BLGK, positions_BL, k_pool, v_pool, table_BP, i, *(x for x in extras if x is not None))
