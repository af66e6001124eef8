"""Ring attention (context parallelism) against full causal attention on one device.

Fake CPU devices (tests/conftest.py): meshes data=2 x sequence=4 and
sequence=8, so every device holds 1/4 or 1/8 of the sequence.
"""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshwork.sharding.ring_attention
from meshwork.sharding.mesh import make_mesh
from meshwork.sharding.ring_attention import (
    attention_reference,
    ring_attention,
    ring_attention_shard,
    zigzag_inverse,
    zigzag_permutation,
)

B, L, H, G, K = 2, 64, 4, 2, 16
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def qkv():
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    return (
        jax.random.normal(kq, (B, L, H, K), jnp.float32),
        jax.random.normal(kk, (B, L, G, K), jnp.float32),
        jax.random.normal(kv, (B, L, G, K), jnp.float32),
    )


def _loss(attn):
    # A non-linear readout so that every output element gets a distinct cotangent.
    return lambda q, k, v: jnp.sum(jnp.sin(attn(q, k, v)) * jnp.arange(K))


@pytest.fixture(scope="module")
def expected(qkv):
    full = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    return full(*qkv), jax.grad(_loss(full), argnums=(0, 1, 2))(*qkv)


def _ring_in_layout(mesh, order, **kw):
    """Ring attention on tokens reordered by `order`, result back in token order."""
    inv = np.argsort(order)
    pos = jnp.broadcast_to(jnp.asarray(order, jnp.int32), (B, L))

    def attn(q, k, v):
        out = ring_attention(q[:, order], k[:, order], v[:, order], pos, mesh=mesh, **kw)
        return out[:, inv]

    return attn


@pytest.mark.parametrize(
    "mesh_sizes, layout",
    [
        ({"data": 2, "sequence": 4}, "zigzag"),
        ({"data": 2, "sequence": 4}, "contiguous"),
        ({"sequence": 8}, "zigzag"),
        ({"sequence": 4, "tensor": 2}, "zigzag"),
    ],
)
def test_ring_equals_full_causal_attention(qkv, expected, mesh_sizes, layout):
    mesh = make_mesh(mesh_sizes)
    n = mesh.shape["sequence"]  # 4 or 8: each device holds L/4 or L/8 tokens
    order = zigzag_permutation(L, n) if layout == "zigzag" else np.arange(L)
    attn = _ring_in_layout(mesh, order)
    out = jax.jit(attn)(*qkv)
    grads = jax.jit(jax.grad(_loss(attn), argnums=(0, 1, 2)))(*qkv)
    np.testing.assert_allclose(out, expected[0], **TOL)
    for name, g, g_ref in zip("qkv", grads, expected[1]):
        np.testing.assert_allclose(g, g_ref, err_msg=f"d{name}", **TOL)


def test_mesh_from_set_mesh_and_hlo_has_collective_permutes(qkv, expected):
    mesh = make_mesh({"data": 2, "sequence": 4})
    pos = jnp.broadcast_to(jnp.arange(L), (B, L))
    f = jax.jit(lambda q, k, v: ring_attention(q, k, v, pos))
    with jax.set_mesh(mesh):
        np.testing.assert_allclose(f(*qkv), expected[0], **TOL)
        hlo = f.lower(*qkv).compile().as_text()
    assert "collective-permute" in hlo
    assert "conditional" in hlo  # masked sub-blocks are skipped at run time
    # The ring replaces gathers: no device ever assembles the full K/V; only the keys'
    # positions (int32) are all-gathered, for each hop to slice the visiting block's.
    gathers = [line for line in hlo.splitlines() if " all-gather(" in line]
    assert gathers and all("= s32[" in line for line in gathers), gathers


def test_non_causal_and_reference(qkv):
    """Non-causal ring = full attention; the reference's position mask = is_causal."""
    q, k, v = qkv
    mesh = make_mesh({"data": 2, "sequence": 4})
    pos = jnp.broadcast_to(jnp.arange(L), (B, L))
    np.testing.assert_allclose(
        jax.jit(lambda *a: ring_attention(*a, pos, mesh=mesh, causal=False))(q, k, v),
        jax.nn.dot_product_attention(q, k, v),
        **TOL,
    )
    np.testing.assert_allclose(
        attention_reference(q, k, v, pos, pos), jax.nn.dot_product_attention(q, k, v, is_causal=True), **TOL
    )


def test_grad_under_scan_and_remat(qkv):
    """As the model will call it: inside a scanned, rematerialized layer stack."""
    mesh = make_mesh({"data": 2, "sequence": 4})
    order = zigzag_permutation(L, 4)
    pos = jnp.broadcast_to(jnp.asarray(order), (B, L))
    q, k, v = (x[:, order] for x in qkv)

    def stack(attn):
        def loss(q):
            def layer(x, _):
                return jnp.tanh(attn(x, k, v) + x), None

            y, _ = jax.lax.scan(jax.checkpoint(layer), q, None, length=2)
            return jnp.sum(y * y)

        return jax.jit(jax.value_and_grad(loss))

    got = stack(lambda q, k, v: ring_attention(q, k, v, pos, mesh=mesh))(q)
    want = stack(lambda q, k, v: attention_reference(q, k, v, pos, pos))(q)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], **TOL)


def test_bfloat16_close_to_float32(qkv, expected):
    mesh = make_mesh({"data": 2, "sequence": 4})
    pos = jnp.broadcast_to(jnp.arange(L), (B, L))
    out = jax.jit(lambda *a: ring_attention(*a, pos, mesh=mesh))(*(x.astype(jnp.bfloat16) for x in qkv))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), expected[0], atol=3e-2)


def test_shard_body_under_user_shard_map(qkv, expected):
    """The per-device body inside a hand-written shard_map, sequence the only axis."""
    mesh = make_mesh({"sequence": 8})
    spec = jax.P(None, "sequence")
    pos = jnp.broadcast_to(jnp.arange(L), (B, L))
    f = jax.shard_map(
        lambda q, k, v, p: ring_attention_shard(q, k, v, p, p, axis_name="sequence", sub_blocks=1),
        mesh=mesh,
        in_specs=(spec,) * 4,
        out_specs=spec,
    )
    np.testing.assert_allclose(jax.jit(f)(*qkv, pos), expected[0], **TOL)


def test_errors_name_the_fix(qkv):
    q, k, v = qkv
    pos = jnp.broadcast_to(jnp.arange(L), (B, L))
    with pytest.raises(ValueError, match="set_mesh"):
        ring_attention(q, k, v, pos)
    with pytest.raises(ValueError, match="not divisible"):
        ring_attention(q[:, :60], k[:, :60], v[:, :60], pos[:, :60], mesh=make_mesh({"sequence": 8}))
    with pytest.raises(ValueError, match="multiple of 2"):
        zigzag_permutation(60, 4)


def test_docstring_examples():
    result = doctest.testmod(meshwork.sharding.ring_attention, optionflags=doctest.ELLIPSIS)
    assert result.attempted and result.failed == 0


# --- zigzag layout -----------------------------------------------------------


def _visible_pairs_per_device(order: np.ndarray, n: int) -> np.ndarray:
    """Causal (query, key) pairs each device computes when tokens are laid out in `order`."""
    return np.array([(np.arange(L)[None, :] <= q[:, None]).sum() for q in np.split(order, n)])


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zigzag_is_a_balanced_permutation(n):
    perm, inv = zigzag_permutation(L, n), zigzag_inverse(L, n)
    assert sorted(perm) == list(range(L))
    np.testing.assert_array_equal(perm[inv], np.arange(L))
    np.testing.assert_array_equal(inv[perm], np.arange(L))
    work = _visible_pairs_per_device(perm, n)
    assert (work == work[0]).all() and work.sum() == L * (L + 1) // 2
    contiguous = _visible_pairs_per_device(np.arange(L), n)
    assert contiguous[-1] > 2 * contiguous[0]


def test_zigzag_skipping_balances_computed_blocks(monkeypatch):
    """Counts the (query, key) sub-blocks each device really computes (not skipped).

    4 devices, 2 sub-blocks per side: 4 ring steps x 4 sub-block pairs = 16 per
    device. Zigzag computes 3 on the diagonal step and 2 on each other: 9
    everywhere. Contiguous blocks compute 3 + 4(d) on device d: 3 ... 15.
    """
    import collections

    import meshwork.sharding.ring_attention as ra

    counts = collections.Counter()
    fold = ra._fwd_block

    def counted(state, **kw):
        # jax.debug.callback fails to lower in a partly-manual shard_map
        # (jax 0.10.2), hence the all-manual, sequence-only mesh below.
        jax.debug.callback(lambda i: counts.update([int(i)]), jax.lax.axis_index("sequence"))
        return fold(state, **kw)

    monkeypatch.setattr(ra, "_fwd_block", counted)

    mesh = jax.make_mesh((4,), ("sequence",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    spec = jax.P(None, "sequence")
    f = jax.jit(
        jax.shard_map(
            lambda q, k, v, p: ring_attention_shard(q, k, v, p, p, axis_name="sequence"),
            mesh=mesh,
            in_specs=(spec,) * 4,
            out_specs=spec,
        )
    )
    x = jnp.ones((1, L, 1, 8))
    computed = {}
    for layout, order in (("zigzag", zigzag_permutation(L, 4)), ("contiguous", np.arange(L))):
        counts.clear()
        jax.block_until_ready(f(x, x, x, jnp.asarray(order)[None]))
        jax.effects_barrier()
        computed[layout] = [counts[d] for d in range(4)]
    assert computed == {"zigzag": [9, 9, 9, 9], "contiguous": [3, 7, 11, 15]}


def test_zigzag_chunks():
    # Device 0 holds chunks 0 and 7, device 3 chunks 3 and 4 (8 chunks of 2 tokens).
    perm = zigzag_permutation(16, 4).reshape(4, 4)
    np.testing.assert_array_equal(perm[0], [0, 1, 14, 15])
    np.testing.assert_array_equal(perm[3], [6, 7, 8, 9])
