"""TrainState is the old string-keyed dict state in a typed pytree: the same leaves, key paths and
checkpoint files, so runs saved before it resume after it and the other way round.

An optional part (ema, comm) the run does not have is absent from the tree, not a None leaf:
Orbax would otherwise refuse a checkpoint saved without it ("ema: Source MISSING").
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from meshwork.run.checkpoint import Checkpointer
from meshwork.run.fast_tier import FastTier
from meshwork.train.state import TrainState

VARIANTS = ("plain", "ema", "comm")


def _mesh():
    return jax.make_mesh((jax.device_count(),), ("fsdp",), axis_types=(AxisType.Auto,))


def _dict_state(variant: str) -> dict:
    """A small state as the dict the trainer used to build: rows split over the devices, a
    replicated scalar step, an optimizer-like tuple, and the variant's optional part."""
    mesh = _mesh()
    rows, whole = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())
    n = 2 * jax.device_count()
    w = jax.device_put(jax.random.normal(jax.random.key(0), (n, 3)), rows)
    b = jax.device_put(jnp.arange(3.0), whole)
    state = {
        "step": jax.device_put(jnp.int32(7), whole),
        "params": {"w": w, "b": b},
        "buffers": {"scale": jax.device_put(jnp.ones(3), whole)},
        "opt_state": ({"mu": {"w": w * 0.5, "b": b * 0.5}, "count": jax.device_put(jnp.int32(3), whole)},),
    }
    if variant == "ema":
        state["ema"] = {"w": w * 2, "b": b * 2}
    if variant == "comm":
        state["comm"] = {"local_params": {"w": w + 1, "b": b + 1}}
    return state


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _paths(tree) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.sharding == y.sharding
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("variant", VARIANTS)
def test_leaves_and_key_paths_are_the_dicts(variant):
    old = _dict_state(variant)
    new = TrainState(**old)
    assert _paths(new) == _paths(old)  # dict keys flatten sorted: buffers, comm, ema, opt_state, params, step
    assert all(x is y for x, y in zip(jax.tree.leaves(new), jax.tree.leaves(old)))
    assert set(new.parts()) == set(old)
    rebuilt = jax.tree.unflatten(jax.tree.structure(new), jax.tree.leaves(old))
    assert isinstance(rebuilt, TrainState) and rebuilt.parts().keys() == new.parts().keys()
    # A map that returns None for the step (a leaf right under the state) keeps the tree's shape.
    assert jax.tree.structure(jax.tree.map(lambda _: None, new)).num_leaves == 0
    assert _paths(jax.tree.map(lambda _: 0, new, is_leaf=lambda x: x is None)) == _paths(old)


@pytest.mark.parametrize("variant", VARIANTS)
def test_checkpoints_of_the_dict_and_of_trainstate_restore_into_each_other(tmp_path, variant):
    old = _dict_state(variant)
    new = TrainState(**old)
    ckpt = Checkpointer(tmp_path / "checkpoints", every=1, keep=5, use_async=False)
    ckpt.save(1, old, {"iterator": {"i": 1}}, {"run": "dict"}, force=True)
    ckpt.save(2, new, {"iterator": {"i": 2}}, {"run": "typed"}, force=True)
    ckpt.wait()
    from_dict, progress = ckpt.restore(1, _abstract(new))
    assert isinstance(from_dict, TrainState) and progress == {"iterator": {"i": 1}}
    _equal(from_dict, new)
    assert (from_dict.ema is None) == (variant != "ema") and (from_dict.comm is None) == (variant != "comm")
    from_typed, _ = ckpt.restore(2, _abstract(old))
    assert isinstance(from_typed, dict) and set(from_typed) == set(old)
    _equal(from_typed, old)
    ckpt.close()
    # The files name the same arrays: the tree metadata Orbax wrote is the same for both.
    one, two = (tmp_path / "checkpoints" / s / "state" / "_METADATA" for s in ("1", "2"))
    assert one.read_text() == two.read_text()


def test_fast_tier_snapshots_of_the_dict_restore_as_trainstate():
    old = _dict_state("ema")
    fast = FastTier(every=1, path=None, buffered=False)
    fast.save(3, old, {}, {})
    _equal(fast.restore(fast.latest(), _abstract(TrainState(**old))), old)


@pytest.mark.parametrize("variant", VARIANTS)
def test_jit_with_trainstate_shardings_round_trips(variant):
    state = TrainState(**_dict_state(variant))
    shardings = jax.tree.map(lambda x: x.sharding, state)
    expected = jax.tree.map(np.asarray, state)
    step = jax.jit(
        lambda s: s.replace(step=s.step + 1, params=jax.tree.map(lambda p: p * 2, s.params)),
        in_shardings=(shardings,),
        out_shardings=shardings,
        donate_argnums=0,
    )
    got = step(state)
    assert isinstance(got, TrainState) and _paths(got) == _paths(expected)
    assert int(got.step) == 8
    np.testing.assert_array_equal(np.asarray(got.params["w"]), expected.params["w"] * 2)
    for x, s in zip(jax.tree.leaves(got), jax.tree.leaves(shardings)):
        assert x.sharding == s
    np.testing.assert_array_equal(np.asarray(got.opt_state[0]["mu"]["w"]), expected.opt_state[0]["mu"]["w"])
