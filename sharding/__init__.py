"""Sharding helpers: build meshes, map logical axis names to mesh axes.

Depends on jax only, so research code can import it on its own:

    from meshwork.sharding import make_mesh, rules_for, logical_to_sharding
"""

from meshwork.sharding.mesh import MESH_AXES, MeshSizeError, make_mesh, resolve_mesh_shape
from meshwork.sharding.parallel import (
    ParallelContext,
    current_parallel,
    current_rules,
    use_parallel,
    use_rules,
    with_logical_constraint,
)
from meshwork.sharding.rules import PRESETS, logical_to_sharding, logical_to_spec, rules_for, tree_shardings

__all__ = [
    "MESH_AXES",
    "MeshSizeError",
    "make_mesh",
    "resolve_mesh_shape",
    "PRESETS",
    "current_rules",
    "logical_to_sharding",
    "logical_to_spec",
    "rules_for",
    "tree_shardings",
    "use_rules",
    "with_logical_constraint",
    "ParallelContext",
    "current_parallel",
    "use_parallel",
]
