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
copies the cache. Any other impl keeps the gather fallback: each sequence's
pages are gathered into a contiguous (B, P * T, G, K) view per layer (one copy
of every live sequence's cache per step) and XLA attends over it. Two page
tables may name the same pages (a shared prompt prefix): reads never write.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshwork.config_sections import ModelConfig
from meshwork.kernels.decode_attention import decode_attention
from meshwork.kernels.paged_attention import gather_pages, paged_attention
from meshwork.sharding.parallel import current_rules
from meshwork.sharding.rules import Rules, compiler_axes, logical_to_sharding, split_axes

# Logical names of a cache's (layers, batch, seq, kv_heads, head_dim) dimensions.
CACHE_AXES = ("layers", "act_batch", None, "act_kv_heads", "act_head_dim")
# The paged pool's pages are split over the data axes, one range per data-parallel replica
# (_attend_per_replica); its sequences' rows are split the same way.
POOL_AXES = ("layers", "act_batch", None, "act_kv_heads", "act_head_dim")
NULL_PAGE = 0


def cache_bytes_per_token(cfg: ModelConfig, dtype: jnp.dtype) -> int:
    """2 (k and v) x layers x kv_heads x head_dim x bytes per element."""
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.resolved_head_dim * jnp.dtype(dtype).itemsize


def _zero_pair(shape: tuple[int, ...], dtype: jnp.dtype, sharding: NamedSharding | None) -> tuple[jax.Array, ...]:
    """Zeroed k and v arrays, each created directly in its sharding (no host copy)."""
    make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return make(), make()


def cached_attention(
    q_BLHK: jax.Array,
    k_BSGK: jax.Array,
    v_BSGK: jax.Array,
    positions_BL: jax.Array,
    impl: str = "xla",
    window: int | None = None,
) -> jax.Array:
    """Queries at `positions_BL` over cached keys 0..S-1, key j visible to a query at p iff j <= p
    (and p - window < j, with a sliding window).

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
    if impl == "pallas" and L == 1:
        return decode_attention(q_BLHK[:, 0], k_BSGK, v_BSGK, positions_BL[:, 0] + 1, window=window)[:, None]
    S = k_BSGK.shape[1]
    key_S, pos_B1L1 = jnp.arange(S)[None, None, None, :], positions_BL[:, None, :, None]
    mask_B1LS = key_S <= pos_B1L1
    if window is not None:
        mask_B1LS &= key_S > pos_B1L1 - window
    return jax.nn.dot_product_attention(q_BLHK, k_BSGK, v_BSGK, mask=mask_B1LS)


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, dtype: jnp.dtype = jnp.float32) -> int:
    """Bytes of a contiguous cache: keys and values of every layer, row and position."""
    return 2 * cfg.n_layers * batch * max_len * cfg.n_kv_heads * cfg.resolved_head_dim * jnp.dtype(dtype).itemsize


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Contiguous cache: row b holds sequence b's keys/values at positions 0..max_len-1."""

    k: jax.Array  # (layers, batch, max_len, kv_heads, head_dim)
    v: jax.Array

    @classmethod
    def zeros(
        cls,
        cfg: ModelConfig,
        batch: int,
        max_len: int,
        dtype: jnp.dtype = jnp.float32,
        sharding: NamedSharding | None = None,
    ) -> KVCache:
        return cls(*_zero_pair((cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.resolved_head_dim), dtype, sharding))

    @staticmethod
    def shardings(mesh: Mesh, rules: Rules) -> KVCache:
        s = logical_to_sharding(CACHE_AXES, mesh, rules)
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

    def attend(self, q_BLHK, k_BLGK, v_BLGK, positions_BL, impl="xla", window=None):
        B = positions_BL.shape[0]
        rows_B1 = jnp.arange(B)[:, None]
        # One scatter per array; positions past max_len are dropped, not clamped onto real data.
        k = self.cache.k.at[self.i, rows_B1, positions_BL].set(k_BLGK.astype(self.cache.k.dtype), mode="drop")
        v = self.cache.v.at[self.i, rows_B1, positions_BL].set(v_BLGK.astype(self.cache.v.dtype), mode="drop")
        o_BLHK = cached_attention(
            q_BLHK, k[self.i].astype(q_BLHK.dtype), v[self.i].astype(q_BLHK.dtype), positions_BL, impl, window
        )
        return o_BLHK, _ContiguousLayer(KVCache(k, v), self.i)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
    """Paged cache: sequence b's position p lives in page page_table[b, p // page_size]
    at offset p % page_size of a pool shared by all sequences."""

    k: jax.Array  # (layers, n_pages, page_size, kv_heads, head_dim)
    v: jax.Array
    page_table: jax.Array  # (batch, pages_per_seq) int32; NULL_PAGE where nothing is allocated

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
        k, v = _zero_pair((cfg.n_layers, n_pages, page_size, cfg.n_kv_heads, cfg.resolved_head_dim), dtype, sharding)
        return cls(k, v, jnp.full((batch, pages_per_seq), NULL_PAGE, jnp.int32))

    @staticmethod
    def shardings(mesh: Mesh, rules: Rules) -> PagedKVCache:
        s = logical_to_sharding(POOL_AXES, mesh, rules)
        return PagedKVCache(s, s, logical_to_sharding((), mesh, rules))

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    def layer(self, i: jax.Array) -> _PagedLayer:
        return _PagedLayer(self, i)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _PagedLayer:
    cache: PagedKVCache
    i: jax.Array

    def attend(self, q_BLHK, k_BLGK, v_BLGK, positions_BL, impl="xla", window=None):
        c = self.cache
        attend = functools.partial(_attend_pages, impl=impl, window=window)
        rules, mesh = current_rules(), jax.sharding.get_abstract_mesh()
        if rules is None or mesh.empty or all(n == 1 for n in mesh.shape.values()):
            o_BLHK, k, v = attend(q_BLHK, k_BLGK, v_BLGK, positions_BL, c.k, c.v, c.page_table, self.i)
        else:
            o_BLHK, k, v = _attend_per_replica(
                attend, rules, dict(mesh.shape), q_BLHK, k_BLGK, v_BLGK, positions_BL, c.k, c.v, c.page_table, self.i
            )
        return o_BLHK, _PagedLayer(PagedKVCache(k, v, c.page_table), self.i)


def _attend_pages(q_BLHK, k_BLGK, v_BLGK, positions_BL, k_pool, v_pool, table_BP, i, *, impl, window):
    """Writes the new keys/values into their pages, then attends the queries over the sequence's pages."""
    T, P = k_pool.shape[2], table_BP.shape[1]
    slot_BL = jnp.minimum(positions_BL // T, P - 1)
    page_BL = jnp.take_along_axis(table_BP, slot_BL, axis=1)
    # Past the table's reach a write goes to the null page, never into the row's last live page.
    page_BL = jnp.where(positions_BL < P * T, page_BL, NULL_PAGE)
    offset_BL = positions_BL % T
    k = k_pool.at[i, page_BL, offset_BL].set(k_BLGK.astype(k_pool.dtype))
    v = v_pool.at[i, page_BL, offset_BL].set(v_BLGK.astype(v_pool.dtype))
    if impl == "pallas":
        # The kernel takes the whole pool and the layer index: neither this layer nor its pages are copied.
        o_BLHK = paged_attention(q_BLHK, k, v, table_BP, positions_BL, layer=i, window=window)
    else:
        k_BSGK, v_BSGK = (gather_pages(pool, table_BP, i).astype(q_BLHK.dtype) for pool in (k, v))
        o_BLHK = cached_attention(q_BLHK, k_BSGK, v_BSGK, positions_BL, impl="xla", window=window)
    return o_BLHK, k, v


def _attend_per_replica(attend, rules, mesh_shape, q_BLHK, k_BLGK, v_BLGK, positions_BL, k_pool, v_pool, table_BP, i):
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
    the owner's output is summed across the replicas.
    """
    data = compiler_axes(split_axes("act_batch", rules, mesh_shape))
    heads = compiler_axes(split_axes("act_kv_heads", rules, mesh_shape))
    if heads != compiler_axes(split_axes("act_heads", rules, mesh_shape)):
        raise ValueError(
            "a paged cache needs query heads and kv heads split over the same mesh axes; "
            "map act_heads and act_kv_heads alike in the rules"
        )
    D = math.prod(mesh_shape[a] for a in data)
    rows_split = q_BLHK.shape[0] % D == 0
    row_axes = (data or None) if rows_split else None
    row = PartitionSpec(row_axes, None)
    act = PartitionSpec(row_axes, None, heads or None, None)
    pool = PartitionSpec(None, data or None, None, heads or None, None)

    def body(q, k_new, v_new, positions, k_pool, v_pool, table, i):
        r = jax.lax.axis_index(data) if data else 0
        per_replica = k_pool.shape[1]
        local = table - r * per_replica
        local = jnp.where((local >= 0) & (local < per_replica), local, NULL_PAGE)  # others' pages: the null page
        o, k, v = attend(q, k_new, v_new, positions, k_pool, v_pool, local, i)
        if data and not rows_split:
            mine = table[:, 0] // per_replica == r  # a row's pages all belong to one replica
            o = jax.lax.psum(jnp.where(mine[:, None, None, None], o, 0), data)
        return o, k, v

    # check_vma=False: pallas_call outputs cannot declare the mesh axes they vary over.
    return jax.shard_map(
        body,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(act, act, act, row, pool, pool, row, PartitionSpec()),
        out_specs=(act, pool, pool),
        check_vma=False,
    )(q_BLHK, k_BLGK, v_BLGK, positions_BL, k_pool, v_pool, table_BP, i)
