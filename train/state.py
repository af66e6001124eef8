"""The train state and its abstract-first, sharded initialization.

State is a plain dict pytree {"step", "params", "opt_state"}; the model's
structure (its nnx GraphDef) is kept apart and closed over by the step, so
the jitted functions see only arrays. Parameters and Adam moments are
`nnx.Param` variables carrying their logical axis names, which is all the
sharding rules need:

    graphdef, abstract = abstract_state(cfg, tx)          # shapes only
    shardings = state_shardings(abstract, mesh, rules)    # names -> mesh
    state = init_state(cfg, tx, shardings)                # born sharded
"""

from __future__ import annotations

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


def _fresh_state(cfg: Config, tx: optax.GradientTransformation, base_params: nnx.State | None = None) -> dict[str, Any]:
    _, params, buffers = split_model(build_model(cfg, base_params=base_params), cfg)
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "buffers": buffers, "opt_state": tx.init(params)}
    if ema_decay(cfg):
        state["ema"] = jax.tree.map(jnp.copy, params)
    return state


def abstract_state(cfg: Config, tx: optax.GradientTransformation) -> tuple[nnx.GraphDef, dict[str, Any]]:
    """(graphdef, state of ShapeDtypeStructs): no parameter memory is touched."""
    graphdef = split_model(nnx.eval_shape(lambda: build_model(cfg)), cfg)[0]
    return graphdef, jax.eval_shape(lambda: _fresh_state(cfg, tx))


def state_shardings(abstract: Any, mesh: Mesh, rules: Mapping[str, Rules], offload: OffloadConfig | None = None) -> Any:
    """NamedShardings for every state leaf (a tree prefix of the state).

    `rules` maps a role to its table (see `sharding.rules.ROLES`): parameters
    follow "params", Adam's moments "opt_state" (they differ under ZeRO-1/2).
    `offload` (train.offload) moves the optimizer state and/or the scanned
    layers' parameters ("blocks") to pinned host memory; only the memory kind
    changes, so offload composes with every preset.
    """
    shardings = {
        "step": tree_shardings(None, mesh, rules["params"]),
        "params": variable_shardings(abstract["params"], mesh, rules["params"]),
        "buffers": variable_shardings(abstract["buffers"], mesh, rules["params"]),
        "opt_state": tree_shardings(logical_specs(abstract["opt_state"]), mesh, rules["opt_state"]),
    }
    if "ema" in abstract:
        shardings["ema"] = shardings["params"]
    if offload is not None and offload.optimizer:
        # A prefix sharding may stand for a whole subtree: expand to one per leaf first.
        shardings["opt_state"] = on_host(per_leaf(shardings["opt_state"], abstract["opt_state"]))
    if offload is not None and offload.params:
        params = per_leaf(shardings["params"], abstract["params"])
        params["blocks"] = on_host(params["blocks"])
        shardings["params"] = params
    return shardings


def init_state(
    cfg: Config, tx: optax.GradientTransformation, shardings: Any, base_params: nnx.State | None = None
) -> dict[str, Any]:
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


def param_count(state: dict[str, Any]) -> int:
    return sum(x.size for x in jax.tree.leaves(state["params"]))
