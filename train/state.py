"""The train state and its abstract-first, sharded initialization.

State is a `TrainState` pytree (step, params, buffers, opt_state, and ema/comm when the run
has them); the model's
structure (its nnx GraphDef) is kept apart and closed over by the step, so
the jitted functions see only arrays. Parameters and Adam moments are
`nnx.Param` variables carrying their logical axis names, which is all the
sharding rules need:

    graphdef, abstract = abstract_state(cfg, tx)          # shapes only
    shardings = state_shardings(abstract, mesh, rules)    # names -> mesh
    state = init_state(cfg, tx, shardings)                # born sharded
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from meshwork.config import Config
from meshwork.config_sections import OffloadConfig
from meshwork.models.build import build_model, ema_decay, split_model
from meshwork.partitioning import logical_specs, on_host, per_leaf, variable_shardings
from meshwork.sharding.rules import Rules, tree_shardings

# The parts in the order they flatten: the sorted key order of the dict the state used to be, so
# leaves, jit shardings, donation and checkpoints (Orbax names a leaf by its key path) are unchanged.
_PARTS = ("buffers", "comm", "ema", "opt_state", "params", "step")
_OPTIONAL = ("comm", "ema")


@dataclasses.dataclass(frozen=True)
class TrainState:
    """The train state: a pytree in which the optional parts a run does not have are absent.

    `ema` is the diffusion EMA of the weights, `comm` the per-replica buffers of explicit gradient
    reduction or DiLoCo; None means the run has none, and the part is then no node of the tree
    (not a None leaf). Each present part flattens under `DictKey(name)`, in sorted name order, so
    `TrainState(step, params, buffers, opt_state)` has exactly the leaves, key paths and on-disk
    names of the dict {"step", "params", "buffers", "opt_state"} it replaces: checkpoints of either
    restore into the other. A TrainState of shardings (a tree prefix) lays out one of arrays.

    >>> state = state.replace(step=state.step + 1)   # doctest: +SKIP
    """

    step: Any
    params: Any
    buffers: Any
    opt_state: Any
    ema: Any = None
    comm: Any = None

    def replace(self, **changes: Any) -> TrainState:
        return dataclasses.replace(self, **changes)

    def parts(self) -> dict[str, Any]:
        """The parts in the tree by name, in flattening order (the required four always)."""
        return {k: getattr(self, k) for k in _PARTS if k not in _OPTIONAL or getattr(self, k) is not None}


def _flatten_with_keys(state: TrainState) -> tuple[list[tuple[jax.tree_util.DictKey, Any]], tuple[str, ...]]:
    # Only the optional parts may be absent: a map that turns the step (a leaf) into None must keep
    # the node, or the tree would change shape under Orbax's and jax's own maps.
    parts = state.parts()
    return [(jax.tree_util.DictKey(name), part) for name, part in parts.items()], tuple(parts)


jax.tree_util.register_pytree_with_keys(
    TrainState,
    _flatten_with_keys,
    lambda names, children: TrainState(**dict(zip(names, children))),
    lambda state: (list(state.parts().values()), tuple(state.parts())),
)


def _graphdef_and_state(
    cfg: Config, tx: optax.GradientTransformation, base_params: nnx.State | None = None
) -> tuple[nnx.GraphDef, TrainState]:
    graphdef, params, buffers = split_model(build_model(cfg, base_params=base_params), cfg)
    ema = jax.tree.map(jnp.copy, params) if ema_decay(cfg) else None
    return graphdef, TrainState(jnp.zeros((), jnp.int32), params, buffers, tx.init(params), ema=ema)


def _fresh_state(cfg: Config, tx: optax.GradientTransformation, base_params: nnx.State | None = None) -> TrainState:
    return _graphdef_and_state(cfg, tx, base_params)[1]


def abstract_state(cfg: Config, tx: optax.GradientTransformation) -> tuple[nnx.GraphDef, TrainState]:
    """(graphdef, state of ShapeDtypeStructs): no parameter memory is touched. One trace of the
    model gives both: the graphdef holds no arrays, so it leaves the trace beside the shapes."""
    kept = {}

    def state_only() -> TrainState:
        kept["graphdef"], state = _graphdef_and_state(cfg, tx)
        return state

    state = jax.eval_shape(state_only)
    return kept["graphdef"], state


def state_shardings(
    abstract: TrainState, mesh: Mesh, rules: Mapping[str, Rules], offload: OffloadConfig | None = None
) -> TrainState:
    """NamedShardings for every state leaf (a TrainState, a tree prefix of the state); `comm` is
    left out (the trainer lays it out, train/comm.py).

    `rules` maps a role to its table (see `sharding.rules.ROLES`): parameters
    follow "params", Adam's moments "opt_state" (they differ under ZeRO-1/2).
    `offload` (train.offload) moves the optimizer state and/or the scanned
    layers' parameters ("blocks") to pinned host memory; only the memory kind
    changes, so offload composes with every preset.
    """
    params = variable_shardings(abstract.params, mesh, rules["params"])
    opt_state = tree_shardings(logical_specs(abstract.opt_state), mesh, rules["opt_state"])
    ema = params if abstract.ema is not None else None
    if offload is not None and offload.optimizer:
        # A prefix sharding may stand for a whole subtree: expand to one per leaf first.
        opt_state = on_host(per_leaf(opt_state, abstract.opt_state))
    if offload is not None and offload.params:
        params = per_leaf(params, abstract.params)
        params["blocks"] = on_host(params["blocks"])
    return TrainState(
        step=tree_shardings(None, mesh, rules["params"]),
        params=params,
        buffers=variable_shardings(abstract.buffers, mesh, rules["params"]),
        opt_state=opt_state,
        ema=ema,
    )


def init_state(
    cfg: Config, tx: optax.GradientTransformation, shardings: TrainState, base_params: nnx.State | None = None
) -> TrainState:
    """Initializes directly into `shardings`: each device computes only its shards.

    `base_params`: a trained run's weights to start from (fine-tuning), already placed.
    """
    fresh = jax.jit(lambda base: _fresh_state(cfg, tx, base), out_shardings=shardings)
    return compiled_for_one_run(fresh.lower(base_params))(base_params)


# Initialization runs once per run, so it is compiled for compile speed: on CPU a sharded UNet's
# init compiled in 6.5 s instead of 15.9 s and ran 66 ms slower, once (benchmarks/compile_options.py,
# RESULTS.md 2026-12-02). The trainer's step keeps XLA's defaults: it runs every step.
RUN_ONCE_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def compiled_for_one_run(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
    """`lowered` compiled with RUN_ONCE_OPTIONS, or with the defaults where the backend has no such options."""
    try:
        return lowered.compile(compiler_options=RUN_ONCE_OPTIONS)
    except jax.errors.JaxRuntimeError as e:
        if "No such compile option" not in str(e):
            raise
        return lowered.compile()


def param_count(state: TrainState) -> int:
    return sum(x.size for x in jax.tree.leaves(state.params))
