"""Helpers for code inside `jax.shard_map`: making values vary over manual axes.

Under shard_map's check_vma every value carries the set of manual mesh axes
it varies over; ring attention and collective matmul build accumulators
that must match the varying type of their inputs.
"""

from __future__ import annotations

import jax

__all__ = ["vary_like", "vary_over"]


def _varying_axes(x) -> frozenset:
    # jax 0.10 keeps the varying manual axes in `aval.manual_axis_type.varying`
    # (earlier versions: `aval.vma`).
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def vary_like(tree, *refs):
    """Marks freshly made arrays as varying over the manual axes that `refs` vary over.

    Under shard_map's check_vma, a loop carry or a cond branch must keep one
    type; accumulators start as constants (invariant) but become varying after
    the first update, so they are made varying up front.
    """
    axes = frozenset().union(*(_varying_axes(r) for r in refs))

    def cast(x):
        missing = tuple(sorted(axes - _varying_axes(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def vary_over(tree, axes):
    """`tree`'s arrays made varying over the manual `axes` (those they vary over already stay)."""

    def cast(x):
        missing = tuple(a for a in axes if a not in _varying_axes(x))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)
