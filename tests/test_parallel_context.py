"""The ParallelContext on its own (sharding/parallel.py): the one value through which layers learn
how to run on the mesh. Each choice is checked without a model: what it picks for a mesh and a
rules table, and what the function it wraps is handed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshwork.sharding.mesh import make_mesh
from meshwork.sharding.parallel import ParallelContext, current_parallel, current_rules, use_parallel, use_rules
from meshwork.sharding.rules import rules_for

B, L, H, G, K = 8, 16, 4, 2, 8


def _qkv(seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((B, L, H, K), (B, L, G, K), (B, L, G, K)))


def _plain(q, k, v, segment_ids):
    assert segment_ids is None
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def test_a_context_is_a_hashable_value_and_nesting_restores_the_outer_one():
    a, b = ParallelContext(rules_for("dp")), ParallelContext(list(rules_for("dp")))
    assert a == b and hash(a) == hash(b)  # the rules are normalized to a tuple, whatever sequence came in
    assert ParallelContext(rules_for("sp"), collective_matmul=True) != ParallelContext(rules_for("sp"))
    assert current_parallel() == ParallelContext() and current_rules() is None
    with use_parallel(a):
        with use_rules(rules_for("fsdp")):
            assert current_rules() == rules_for("fsdp") and not current_parallel().collective_matmul
        assert current_parallel() is a
    assert current_parallel() == ParallelContext()


@pytest.mark.parametrize(
    "preset,sizes,want",
    [
        ("sp", {"data": 4, "tensor": 2}, ("tensor", ("data",))),
        ("tp", {"data": 4, "tensor": 2}, None),  # tp keeps the sequence whole: no ring to overlap
        ("sp", {"data": 8}, None),  # nothing splits the MLP
    ],
)
def test_collective_matmul_is_chosen_only_where_the_rules_are_megatron_sp(preset, sizes, want):
    with jax.set_mesh(make_mesh(sizes)):
        assert ParallelContext(rules_for(preset), collective_matmul=True).collective_matmul_axes() == want
        assert ParallelContext(rules_for(preset), collective_matmul=False).collective_matmul_axes() is None


def test_an_opaque_kernel_runs_per_device_on_its_batch_and_head_shards():
    seen = []

    def local(q, k, v, segment_ids, sinks_H):
        seen.append((q.shape, k.shape))
        return _plain(q, k, v, segment_ids)

    q, k, v = _qkv()
    want = _plain(q, k, v, None)
    with jax.set_mesh(make_mesh({"data": 4, "tensor": 2})):
        parallel = ParallelContext(rules_for("tp"))
        got = jax.jit(lambda q, k, v: parallel.attention(local, q, k, v, None, causal=True, scale=None, opaque=True))(
            q, k, v
        )
    assert seen == [((B // 4, L, H // 2, K), (B // 4, L, G // 2, K))]
    np.testing.assert_allclose(got, want, atol=1e-5)

    seen.clear()  # not opaque: the whole arrays, for XLA to partition (a trace shows it; no compile needed)
    with jax.set_mesh(make_mesh({"data": 4, "tensor": 2})):
        jax.jit(lambda q, k, v: parallel.attention(local, q, k, v, None, causal=True, scale=None)).trace(q, k, v)
    assert seen == [((B, L, H, K), (B, L, G, K))]


def test_a_split_sequence_goes_round_the_ring_and_equals_the_formula():
    def local(*_):
        raise AssertionError("a split sequence must not reach the single-device formula")

    q, k, v = _qkv(1)
    positions = jnp.broadcast_to(jnp.arange(L), (B, L))
    with jax.set_mesh(make_mesh({"data": 2, "sequence": 4})):
        parallel = ParallelContext(rules_for("cp"))
        compiled = (
            jax.jit(lambda q, k, v: parallel.attention(local, q, k, v, positions, causal=True, scale=None))
            .lower(q, k, v)
            .compile()
        )
        got = compiled(q, k, v)
    assert "collective-permute" in compiled.as_text()
    np.testing.assert_allclose(got, _plain(q, k, v, None), atol=1e-5)


@pytest.mark.parametrize("algorithm", ["all_gather", "ulysses"])
def test_the_chosen_algorithm_hands_the_formula_whole_rows_or_all_keys(algorithm):
    """all_gather: each device's queries against every key, with explicit positions; ulysses: whole
    rows for a share of the heads (B/2 rows, H/4 query heads, G/2 kv heads repeated to 1 each)."""
    seen = []

    def local(q, k, v, segment_ids, sinks_H, positions=None, kv_segment_ids_BS=None):
        seen.append((q.shape, k.shape, None if positions is None else tuple(p.shape for p in positions)))
        q_pos, k_pos = positions
        return jax.nn.dot_product_attention(q, k, v, mask=(q_pos[:, :, None] >= k_pos[:, None, :])[:, None])

    local.masks_by_position = True
    q, k, v = _qkv(2)
    positions = jnp.broadcast_to(jnp.arange(L), (B, L))
    with jax.set_mesh(make_mesh({"data": 2, "sequence": 4})):
        parallel = ParallelContext(rules_for("cp"), context_parallel=algorithm)
        got = jax.jit(lambda q, k, v: parallel.attention(local, q, k, v, positions, causal=True, scale=None))(q, k, v)
    want = {
        "all_gather": ((B // 2, L // 4, H, K), (B // 2, L, G, K), ((B // 2, L // 4), (B // 2, L))),
        "ulysses": ((B // 2, L, H // 4, K), (B // 2, L, 1, K), ((B // 2, L), (B // 2, L))),
    }[algorithm]
    assert seen == [want]
    np.testing.assert_allclose(got, _plain(q, k, v, None), atol=1e-5)


def test_context_parallel_is_part_of_the_value_and_checked():
    assert ParallelContext(rules_for("cp"), context_parallel="ulysses") != ParallelContext(rules_for("cp"))
    assert ParallelContext().context_parallel == "ring"  # today's behaviour is the default
    with pytest.raises(ValueError, match="choose one of ring, all_gather, ulysses, usp"):
        ParallelContext(rules_for("cp"), context_parallel="tree")
