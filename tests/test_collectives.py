"""Hand-written collectives equal XLA's, and send exactly the bytes their formulas say.

Every case is traced once (inside `record_transfers`, which counts the sends
the Python algorithm makes), compiled once (whose HLO gives the sends XLA
will really run), and run once (whose result is compared with `lax.psum` or
`lax.all_to_all`). Three independent views of the same program must agree.
"""

import doctest
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, PartitionSpec

import meshwork.sharding.all_reduce_algorithms as ar
import meshwork.sharding.all_to_all_algorithms as a2a
import meshwork.sharding.collective_traffic as traffic
import meshwork.sharding.point_to_point as p2p
from meshwork.sharding.mesh import make_mesh

RTOL, ATOL = 1e-6, 1e-6


@functools.cache
def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> jax.sharding.Mesh:
    n = math.prod(shape)
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=jax.devices()[:n])


def _random(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _run(body, mesh, axes, x):
    """(output, TransferLog, optimized HLO text) of shard_map(body) with dim 0 split over `axes`."""
    spec = PartitionSpec(axes)
    with p2p.record_transfers() as log:
        traced = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)).trace(x)
    compiled = traced.lower().compile()
    return np.asarray(compiled(x)), log, compiled.as_text()


@functools.cache
def _all_reduce_case(algorithm: str, n_devices: int, per_device: tuple[int, ...]):
    mesh = _mesh((n_devices,), ("ring",))
    x = _random((n_devices,) + per_device)
    body = {"naive": ar.naive_all_reduce, "ring": ar.ring_all_reduce, "tree": ar.tree_all_reduce, "psum": lax.psum}[
        algorithm
    ]
    return (x, mesh) + _run(lambda b: body(b, "ring"), mesh, "ring", x)


ALL_REDUCE_CASES = [
    ("naive", 8, (1, 16)),
    ("ring", 8, (1, 16)),  # 16 elements: 8 chunks of 2
    ("ring", 8, (1, 3, 5)),  # 15 elements: padded to 16
    ("tree", 8, (1, 16)),
    ("naive", 6, (1, 7)),  # a non-power-of-two ring
    ("ring", 6, (1, 7)),
]
ROUNDS = {"naive": lambda p: 2 * (p - 1), "ring": lambda p: 2 * (p - 1), "tree": lambda p: int(math.log2(p))}


@pytest.mark.parametrize("algorithm,n_devices,per_device", ALL_REDUCE_CASES)
def test_all_reduce_equals_psum(algorithm, n_devices, per_device):
    x, _, y, _, _ = _all_reduce_case(algorithm, n_devices, per_device)
    _, _, ref, _, _ = _all_reduce_case("psum", n_devices, per_device)
    np.testing.assert_allclose(y, ref, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(y, np.broadcast_to(x.sum(0, keepdims=True), x.shape), rtol=RTOL, atol=ATOL)


def test_tree_and_naive_leave_every_device_bitwise_equal():
    # Partners add the same two numbers (a + b == b + a); naive broadcasts one sum.
    for algorithm in ("tree", "naive"):
        _, _, y, _, _ = _all_reduce_case(algorithm, 8, (1, 16))
        assert (y == y[:1]).all(), algorithm


@pytest.mark.parametrize("algorithm,n_devices,per_device", ALL_REDUCE_CASES)
def test_all_reduce_bytes_counted_compiled_and_formula_agree(algorithm, n_devices, per_device):
    x, mesh, _, log, hlo = _all_reduce_case(algorithm, n_devices, per_device)
    n_bytes = x[0].nbytes
    formula = traffic.bytes_sent_formula(algorithm, n_bytes, n_devices, itemsize=x.itemsize)
    counted = log.bytes_sent(mesh).ravel()
    n_permutes, compiled = traffic.compiled_traffic(hlo, n_devices)
    np.testing.assert_array_equal(counted, formula)
    np.testing.assert_array_equal(compiled, formula)
    assert len(log.transfers) == n_permutes == ROUNDS[algorithm](n_devices)


def test_ring_formula_is_two_p_minus_one_over_p_n_and_naive_is_lopsided():
    assert (traffic.bytes_sent_formula("ring", 8000, 8) == 2 * 7 * 8000 // 8).all()
    naive = traffic.bytes_sent_formula("naive", 8000, 8)
    assert naive.max() == 7 * 8000 and naive.mean() == 2 * 7 * 8000 / 8
    assert naive.sum() == traffic.bytes_sent_formula("ring", 8000, 8).sum()  # same total, different spread
    assert (traffic.bytes_sent_formula("tree", 8000, 8) == 3 * 8000).all()


def test_tree_refuses_a_non_power_of_two_axis():
    mesh = _mesh((6,), ("ring",))
    with pytest.raises(ValueError, match="power-of-two number of devices, got 6"):
        ar.all_reduce(jnp.zeros((6, 4)), mesh, "ring", algorithm="tree")
    with pytest.raises(ValueError, match="got 6"):
        traffic.bytes_sent_formula("tree", 64, 6)


def test_all_reduce_wrapper_over_two_axes_of_the_project_mesh():
    mesh = make_mesh({"data": 2, "fsdp": -1})
    x = jnp.asarray(_random((8, 6), seed=1))
    ref = ar.all_reduce(x, mesh, ("data", "fsdp"), algorithm="psum")
    out = ar.all_reduce(x, mesh, ("data", "fsdp"), algorithm="ring")
    np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="unknown algorithm 'butterfly'"):
        ar.all_reduce(x, mesh, "data", algorithm="butterfly")


# ---------------------------------------------------------------------------
# All-to-all
# ---------------------------------------------------------------------------

PER_DEVICE = (8, 8, 2)  # every axis that might be split has size P = 8
A2A_CASES = [  # (split_axis, concat_axis, tiled)
    (0, 0, True),
    (1, 2, True),
    (-2, -1, True),  # negative axes, as lax allows
    (1, 2, False),  # the split axis (size P) vanishes; a new axis of size P appears at 2
    (0, 1, False),
]


@functools.cache
def _a2a_case(algorithm: str, mesh_shape: tuple[int, int], split_axis: int, concat_axis: int, tiled: bool):
    mesh = _mesh(mesh_shape, ("node", "local"))
    x = _random((8 * PER_DEVICE[0],) + PER_DEVICE[1:], seed=2)
    axes = ("node", "local")

    def body(b):
        if algorithm == "hierarchical":
            return a2a.hierarchical_all_to_all(b, "node", "local", split_axis, concat_axis, tiled=tiled)
        if algorithm == "direct":
            return a2a.direct_all_to_all(b, axes, split_axis, concat_axis, tiled=tiled)
        # lax.all_to_all in jax 0.10.2 lowers negative axes as-is and can segfault.
        return lax.all_to_all(b, axes, split_axis % b.ndim, concat_axis % b.ndim, tiled=tiled)

    return (x, mesh) + _run(body, mesh, axes, x)


@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("split_axis,concat_axis,tiled", A2A_CASES)
def test_hierarchical_all_to_all_equals_lax(mesh_shape, split_axis, concat_axis, tiled):
    _, _, ref, _, _ = _a2a_case("lax", mesh_shape, split_axis, concat_axis, tiled)
    _, _, y, _, _ = _a2a_case("hierarchical", mesh_shape, split_axis, concat_axis, tiled)
    np.testing.assert_array_equal(y, ref)  # pure data movement: bitwise


def test_all_to_all_semantics_spelled_out():
    # Device j ends with block j of every device, ordered by source j = node * L + local.
    x, _, y, _, _ = _a2a_case("hierarchical", (2, 4), 1, 2, True)
    x_PABC = x.reshape(8, 8, 8, 2)  # per device: (8, 8, 2); split axis 1 into 8 blocks of 1
    expect = np.stack([np.concatenate([x_PABC[src][:, dst : dst + 1] for src in range(8)], axis=2) for dst in range(8)])
    np.testing.assert_array_equal(y.reshape(expect.shape), expect)


@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_all_to_all_bytes_counted_compiled_and_formula_agree(mesh_shape):
    m, l = mesh_shape
    for algorithm, rounds in (("hierarchical", (l - 1) + (m - 1)), ("direct", m * l - 1)):
        x, mesh, _, log, hlo = _a2a_case(algorithm, mesh_shape, 1, 2, True)
        n_bytes = x.nbytes // 8
        formula = traffic.bytes_sent_formula(f"{algorithm}_all_to_all", n_bytes, 8, n_local=l)
        n_permutes, compiled = traffic.compiled_traffic(hlo, 8)
        np.testing.assert_array_equal(log.bytes_sent(mesh).ravel(), formula)
        np.testing.assert_array_equal(compiled, formula)
        assert len(log.transfers) == n_permutes == rounds, algorithm
    # Hierarchical sends more in all, but the same bytes across nodes as direct.
    n = 8 * 128
    assert (
        traffic.bytes_sent_formula("hierarchical_all_to_all", n, 8, n_local=l)[0] == (l - 1) * n // l + (m - 1) * n // m
    )
    assert traffic.bytes_sent_formula("direct_all_to_all", n, 8)[0] == 7 * n // 8


def test_all_to_all_errors_name_the_bad_value():
    mesh = _mesh((2, 4), ("node", "local"))
    with pytest.raises(ValueError, match="size 6, not divisible by the 8 devices"):
        a2a.all_to_all(jnp.zeros((8, 6)), mesh, ("node", "local"), split_axis=1, concat_axis=1)
    with pytest.raises(ValueError, match="has size 6 but there are 8 devices"):
        a2a.all_to_all(jnp.zeros((8, 6)), mesh, ("node", "local"), split_axis=1, concat_axis=1, tiled=False)
    with pytest.raises(ValueError, match="needs n_local"):
        traffic.bytes_sent_formula("hierarchical_all_to_all", 64, 8)


@pytest.mark.parametrize("module", [p2p, ar, a2a, traffic], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_a_conditional_counts_as_its_heaviest_branch():
    """One branch of a `switch` runs per execution (a pipeline step runs one op): the report counts
    the branch with the most collective bytes, not the sum of all branches."""
    from meshwork.sharding.hlo import collective_summary

    mesh = make_mesh({"data": 8})

    def per_device(i, x):
        one = lambda x: lax.psum(x, "data")  # noqa: E731
        two = lambda x: lax.psum(jnp.sin(lax.psum(x, "data")), "data")  # noqa: E731
        return lax.switch(i, [one, two, lambda x: x * 2], x)

    f = jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(PartitionSpec(), PartitionSpec("data")),
            out_specs=PartitionSpec("data"),
            check_vma=False,
        )
    )
    hlo = f.lower(jnp.int32(0), jnp.ones(8 * 64)).compile().as_text()
    summary = collective_summary(hlo)["all-reduce"]
    assert summary["count"] == 2, summary  # branch `two`; all branches summed would say 3
    assert summary["payload_bytes"] == 2 * 64 * 4
