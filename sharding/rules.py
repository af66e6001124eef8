"""THE logical-axis table: logical names -> mesh axes, and its presets.

Models name every weight and activation dimension with a logical name
(`embed`, `heads`, `act_batch`, ...) and never mention mesh axes. A rules table
maps each logical name to a mesh axis (or a tuple of them, or None for
replicated). Parallelism strategies are presets of this table plus mesh sizes:

- `dp`: parameters replicated; the batch is split over `data` (and `fsdp`,
  which is data-parallel for activations); XLA all-reduces the gradients.
- `fsdp` (ZeRO-3): as `dp`, and every weight is split over `fsdp` along its
  `embed` dimension, so parameters, gradients and Adam moments all live in
  1/fsdp pieces; XLA all-gathers weights before use and reduce-scatters
  gradients. With `data` > 1 as well this is hybrid sharding (HSDP).

    >>> rules = rules_for("fsdp")
    >>> logical_to_spec(("embed", "mlp"), rules) == PartitionSpec("fsdp", None)
    True
    >>> logical_to_spec(("act_batch", "act_seq", "act_embed"), rules) == PartitionSpec(("data", "fsdp"), None, None)
    True
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

# Every logical name used by models/ appears here; a name missing from the
# table is an error rather than a silent "replicated".
_DP: dict[str, MeshAxes] = {
    # weights
    "vocab": None,
    "embed": None,
    "heads": None,
    "kv_heads": None,
    "head_dim": None,
    "mlp": None,
    "layers": None,
    # activations
    "act_batch": ("data", "fsdp"),
    "act_seq": None,
    "act_embed": None,
    "act_heads": None,
    "act_kv_heads": None,
    "act_head_dim": None,
    "act_mlp": None,
    "act_vocab": None,
}

PRESETS: dict[str, dict[str, MeshAxes]] = {
    "dp": _DP,
    "fsdp": {**_DP, "embed": "fsdp"},
}


def rules_for(preset: str, overrides: Mapping[str, MeshAxes | Sequence[str]] | None = None) -> Rules:
    """Returns the rules of `preset` with `overrides` applied, as a tuple of pairs.

    >>> dict(rules_for("dp", {"mlp": "tensor"}))["mlp"]
    'tensor'
    """
    if preset not in PRESETS:
        raise KeyError(f"rules.preset: unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    table = dict(PRESETS[preset])
    for name, axes in (overrides or {}).items():
        if name not in table:
            raise KeyError(f"rules.overrides: unknown logical axis {name!r}; known: {sorted(table)}")
        table[name] = tuple(axes) if isinstance(axes, list | tuple) else axes
    return tuple(table.items())


def logical_to_spec(names: Sequence[str | None], rules: Rules) -> PartitionSpec:
    """Maps a tuple of logical names to a PartitionSpec.

    A mesh axis is used at most once per array: a later dimension that maps
    to an axis already taken stays unsharded (as Linen's rules do).

    >>> logical_to_spec(("embed", "embed"), rules_for("fsdp")) == PartitionSpec("fsdp", None)
    True
    """
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name in names:
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no rule; add it to sharding/rules.py")
        axes = table[name]
        axes_t = (axes,) if isinstance(axes, str) else tuple(axes or ())
        axes_t = tuple(a for a in axes_t if a not in used)
        used.update(axes_t)
        out.append(None if not axes_t else axes_t[0] if len(axes_t) == 1 else axes_t)
    return PartitionSpec(*out)


def logical_to_sharding(names: Sequence[str | None], mesh: Mesh, rules: Rules) -> NamedSharding:
    """NamedSharding on `mesh` for an array whose dimensions have logical `names`.

    >>> from sharding.mesh import make_mesh
    >>> mesh = make_mesh({"fsdp": -1})
    >>> logical_to_sharding(("embed", "mlp"), mesh, rules_for("fsdp")).spec == PartitionSpec("fsdp", None)
    True
    """
    return NamedSharding(mesh, logical_to_spec(names, rules))


def tree_shardings(logical_specs: Any, mesh: Mesh, rules: Rules) -> Any:
    """Maps a pytree whose leaves are PartitionSpecs of logical names to NamedShardings.

    Leaves that are None (no annotation, e.g. a scalar step count) become
    replicated shardings.
    """
    return jax.tree.map(
        lambda s: logical_to_sharding(tuple(s) if s is not None else (), mesh, rules),
        logical_specs,
        is_leaf=lambda s: s is None or isinstance(s, PartitionSpec),
    )


_RULES: contextvars.ContextVar[Rules | None] = contextvars.ContextVar("meshwork_rules", default=None)


@contextlib.contextmanager
def use_rules(rules: Rules) -> Iterator[Rules]:
    """Makes `rules` the table that `with_logical_constraint` reads while tracing.

    Use together with `jax.set_mesh(mesh)` around the first call (the trace)
    of a jitted function; jit's cache does not key on the rules.
    """
    token = _RULES.set(tuple(rules))
    try:
        yield rules
    finally:
        _RULES.reset(token)


def current_rules() -> Rules | None:
    return _RULES.get()


def with_logical_constraint(x: jax.Array, names: Sequence[str | None], rules: Rules | None = None) -> jax.Array:
    """Constrains activation `x` to the sharding its logical `names` map to.

    A no-op outside a mesh (`jax.set_mesh`) or without rules, so model code can
    call it unconditionally and still run on one device.

    >>> from sharding.mesh import make_mesh
    >>> mesh = make_mesh({"data": -1})
    >>> f = jax.jit(lambda x: with_logical_constraint(x * 2, ("act_batch", "act_embed")))
    >>> with jax.set_mesh(mesh), use_rules(rules_for("dp")):
    ...     y = f(jax.numpy.ones((jax.device_count(), 4)))
    >>> y.addressable_shards[0].data.shape   # one row per device
    (1, 4)
    """
    rules = rules if rules is not None else current_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, rules))
