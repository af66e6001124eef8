"""Muon as an optax transformation: momentum, Newton-Schulz orthogonalization on the mesh, a
scale per matrix shape; `muon` pairs it with AdamW for the weights that are not matrices.

optax supplies everything but the orthogonalization (its `contrib.muon` iterates on whatever
array it is given, so a sharded matrix would be gathered by the partitioner on every device):
momentum and orthogonalization are here, and they run as `optimizer.muon.newton_schulz` says
(optimizers/newton_schulz.py). Which weights are matrices, and how each is one, comes from the
logical names the weights carry (optimizers/matrices.py); where they lie on the mesh comes from
the same names through the optimizer state's rules, so the orthogonalization runs on the
momentum's own blocks.

    tx = muon(cfg.optimizer, adamw, muon_schedule, rules)   # train/optim.py builds it
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import optax
from flax import nnx
from jax.sharding import PartitionSpec

from meshwork.config_sections import MuonConfig, OptimizerConfig
from meshwork.optimizers.matrices import MatrixLayout, matrix_layout
from meshwork.optimizers.newton_schulz import orthogonalize, placement
from meshwork.sharding.rules import Rules, logical_to_spec


class MuonState(NamedTuple):
    momentum: optax.Updates


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _names(var: nnx.Variable) -> tuple | None:
    return var.get_metadata().get("out_sharding")


def muon_labels(params: Any) -> Any:
    """A prefix of `params`: "muon" for each weight that is a stack of matrices, else "adamw"."""
    return jax.tree.map(
        lambda v: "muon" if _is_variable(v) and matrix_layout(_names(v)) else "adamw", params, is_leaf=_is_variable
    )


def update_scale(layout: MatrixLayout, shape: tuple[int, ...], scaling: str) -> float:
    """The factor on the orthogonalized update of an (m inputs x n outputs) matrix.

    >>> update_scale(MatrixLayout(0, 1), (64, 256), "rms_match"), update_scale(MatrixLayout(0, 1), (64, 256), "shape")
    (3.2, 2.0)
    """
    _, m, n = layout.shape(shape)
    return 0.2 * math.sqrt(max(m, n)) if scaling == "rms_match" else math.sqrt(max(1.0, n / m))


def orthogonalize_tree(tree: Any, cfg: MuonConfig, rules: Rules | None) -> Any:
    """Every matrix stack of `tree` (nnx Variables carrying logical names) orthogonalized and
    scaled, on the current mesh, laid out by `rules` (None: as one replicated block)."""
    variables = jax.tree.leaves(tree, is_leaf=_is_variable)
    arrays, treedef = jax.tree.flatten(tree)
    if len(arrays) != len(variables) or not all(map(_is_variable, variables)):
        raise ValueError("Muon's updates must be nnx Variables that carry logical names, one array each")
    mesh = jax.sharding.get_abstract_mesh()
    mesh_shape = {} if mesh.empty else dict(mesh.shape)
    layouts = [matrix_layout(_names(v)) for v in variables]
    placements = [
        placement(
            lay, a.shape, logical_to_spec(_names(v), rules) if rules and mesh_shape else PartitionSpec(), mesh_shape
        )
        for lay, a, v in zip(layouts, arrays, variables, strict=True)
    ]
    done = orthogonalize(arrays, placements, cfg.newton_schulz, cfg.ns_steps)
    scaled = [d * update_scale(lay, a.shape, cfg.scaling) for d, lay, a in zip(done, layouts, arrays, strict=True)]
    return jax.tree.unflatten(treedef, scaled)


def scale_by_muon(cfg: MuonConfig, rules: Rules | None = None) -> optax.GradientTransformation:
    """Momentum (Nesterov by default), orthogonalized: the direction of Muon's update."""

    def init(params):
        return MuonState(momentum=optax.tree_utils.tree_zeros_like(params))

    def update(updates, state, params=None):
        del params
        momentum = jax.tree.map(lambda m, g: cfg.beta * m + g, state.momentum, updates)
        direction = jax.tree.map(lambda m, g: cfg.beta * m + g, momentum, updates) if cfg.nesterov else momentum
        return orthogonalize_tree(direction, cfg, rules), MuonState(momentum)

    return optax.GradientTransformation(init, update)


def muon(
    cfg: OptimizerConfig,
    adamw: optax.GradientTransformation,
    muon_schedule: optax.Schedule,
    rules: Rules | None = None,
) -> optax.GradientTransformation:
    """Muon for the matrix stacks (decoupled weight decay, `muon_schedule`), `adamw` for every other weight."""
    matrices = optax.chain(
        scale_by_muon(cfg.muon_settings, rules),
        optax.add_decayed_weights(cfg.weight_decay),
        optax.scale_by_learning_rate(muon_schedule),
    )
    return optax.partition({"muon": matrices, "adamw": adamw}, muon_labels)
