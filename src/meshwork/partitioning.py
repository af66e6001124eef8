"""From the logical names that NNX variables carry to `NamedSharding`s on a mesh.

Models give every weight dimension a logical name (variable metadata
`out_sharding`); `meshwork.sharding.rules` maps names to mesh axes. This module
joins the two for whole states, so the trainer (parameters, Adam moments), the
generator and the Hugging Face loader all place weights the same way:

    specs = logical_specs(abstract_params)                # PartitionSpecs of logical names
    shardings = variable_shardings(params, mesh, rules)   # NamedShardings, one per variable
    shardings = param_shardings(params, mesh, rules)      # one per array, any value (quantized too)

It is also the one home of placement helpers: abstract arrays carrying shardings (what a compile
or a restore is given), host-memory shardings for offload, and moving host arrays to the device.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshwork.sharding.rules import Rules, logical_to_spec, tree_shardings


def logical_specs(state: Any) -> Any:
    """Tree prefix of `state`: a PartitionSpec of logical names per annotated variable, else None."""

    def spec(leaf):
        names = leaf.get_metadata().get("out_sharding") if isinstance(leaf, nnx.Variable) else None
        return PartitionSpec(*names) if names else None

    return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def variable_shardings(tree: Any, mesh: Mesh, rules: Rules) -> Any:
    """A tree prefix of NamedShardings for a state of nnx Variables, by their logical names.

    A variable whose value is not one array (a frozen QLoRA base: a quantized
    weight's values and scales, of other shapes) gets one sharding per array
    from `param_shardings`.
    """
    plain = tree_shardings(logical_specs(tree), mesh, rules)

    def one(var, sharding):
        if isinstance(var, nnx.Variable) and not hasattr(var.get_value(), "shape"):
            return param_shardings(var, mesh, rules)
        return sharding

    return jax.tree.map(one, tree, plain, is_leaf=lambda x: isinstance(x, nnx.Variable))


def fit_sharding(names, shape: tuple[int, ...], mesh: Mesh, rules: Rules) -> NamedSharding:
    """The sharding the logical `names` give, with every dim its mesh axes do not divide replicated."""
    if not names:
        return NamedSharding(mesh, PartitionSpec())
    spec = []
    for axes, n in zip(logical_to_spec(names, rules), shape):
        axes_t = (axes,) if isinstance(axes, str) else tuple(axes or ())
        size = math.prod(mesh.shape[a] for a in axes_t)
        spec.append(axes if axes_t and n % size == 0 else None)
    return NamedSharding(mesh, PartitionSpec(*spec))


def param_shardings(params_state, mesh: Mesh, rules: Rules):
    """NamedShardings for a model's variables, plain or quantized: a tree like `params_state`
    (from `nnx.split` / `nnx.state`) with a NamedSharding in place of every array.

    Each array follows its Variable's logical names (`out_sharding`); the arrays
    of a quantized weight (meshwork.models.layers.quantized) have the float
    weight's rank, and each of their dims inherits the name of the dim it comes
    from (the packed int4 dim, a dim of groups of scales). A dim that its mesh
    axes do not divide (a scale dim of size 1, say) is replicated instead.

    >>> from meshwork.sharding.mesh import make_mesh
    >>> from meshwork.sharding.rules import rules_for
    >>> w = nnx.Param({"values": np.ones((2, 8, 4)), "scales": np.ones((2, 1, 4))},
    ...               out_sharding=("layers", "embed", "mlp"), eager_sharding=False)
    >>> sh = param_shardings(w, make_mesh({"tensor": 2, "data": -1}), rules_for("tp"))
    >>> sh.get_value()["values"].spec, sh.get_value()["scales"].spec
    (P(None, None, 'tensor'), P(None, None, 'tensor'))
    """

    def for_variable(var):
        names = var.get_metadata().get("out_sharding")
        return jax.tree.map(lambda a: fit_sharding(names, tuple(np.shape(a)), mesh, rules), var)

    return jax.tree.map(for_variable, params_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def indivisible(tree: Any) -> str | None:
    """The first array of `tree` (ShapeDtypeStructs or arrays carrying NamedShardings) that its
    sharding cannot split evenly, in words; None when every one divides.

    jax refuses such an array only when it is first placed, deep inside the compile; this names
    the parameter, the dimension and the mesh axes before anything runs.
    """
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    for path, leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, NamedSharding):
            continue
        for dim, (n, axes) in enumerate(zip(leaf.shape, sharding.spec)):
            names = (axes,) if isinstance(axes, str) else tuple(axes or ())
            ways = math.prod(sharding.mesh.shape[a] for a in names)
            if n % ways:
                where = ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
                where = where.removesuffix(".value")
                return (
                    f"{where}: dimension {dim} of size {n} cannot be split {ways} ways over mesh axis "
                    f"{' x '.join(names)}"
                )
    return None


# -- placement -------------------------------------------------------------


def abstract_with_shardings(abstract_state: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `abstract_state` carrying `shardings` (a tree prefix is fine)."""
    return jax.tree.map(
        lambda s, a: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), a),
        shardings,
        abstract_state,
    )


def per_leaf(prefix: Any, tree: Any) -> Any:
    """A tree prefix of shardings broadcast to one sharding per leaf of `tree`, in `tree`'s structure."""
    return jax.tree.map(
        lambda s, sub: jax.tree.map(lambda _: s, sub),
        prefix,
        tree,
        is_leaf=lambda s: isinstance(s, jax.sharding.Sharding),
    )


HOST = "pinned_host"


def on_host(shardings: Any) -> Any:
    """The same shardings (same partition specs) with memory_kind="pinned_host": arrays laid
    out by them live in host memory, one shard per device's host.

    >>> on_host(NamedSharding(mesh, PartitionSpec("fsdp"))).memory_kind   # doctest: +SKIP
    'pinned_host'
    """
    return jax.tree.map(
        lambda s: s.with_memory_kind(HOST), shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding)
    )


def to_device_memory(x: jax.Array) -> jax.Array:
    """`x` moved to device memory if, in a traced function, it lives in host memory (an
    input whose sharding has memory_kind="pinned_host"); anything else is returned as is.

    >>> jax.jit(lambda w: to_device_memory(w) * 2)(w_on_host)   # doctest: +SKIP
    """
    if getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host:
        return jax.device_put(x, jax.memory.Space.Device)
    return x
