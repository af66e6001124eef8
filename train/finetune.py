"""Fine-tuning a trained run: its checks, its starting weights, its accounting.

A `finetune` config trains a new run.dir from the latest checkpoint of
`finetune.base`. What is trained is decided by `meshwork.models.build.split_model`:
with LoRA/QLoRA/adapters/prefixes only the method's own variables are
"params" (gradients, Adam moments); the base model's weights travel in the
state as "buffers", sharded by the same rules but never differentiated, so
XLA builds no weight gradients for them. Resuming a fine-tuning run restores
its own checkpoints like any run; the base is read only at step 0.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from meshwork.config import Config, ConfigError, load_config
from meshwork.models.build import build_model, split_model
from meshwork.partitioning import variable_shardings
from meshwork.perf.flops import param_counts
from meshwork.run.checkpoint import Checkpointer, abstract_with_shardings
from meshwork.sharding.rules import Rules


def check_base(cfg: Config) -> Config | None:
    """The base run's config, after checking it can be fine-tuned into `cfg` (ConfigError if not)."""
    if cfg.finetune.method == "none":
        return None
    base_dir = pathlib.Path(cfg.finetune.base).expanduser()
    if not (base_dir / "config.yaml").is_file():
        raise ConfigError(f"finetune.base: {base_dir} has no config.yaml; point it to a trained run's run.dir")
    base = load_config(base_dir / "config.yaml")
    if base.finetune.method != "none":
        raise ConfigError(f"finetune.base: {base_dir} is itself a fine-tuning run; start from the run it tuned")
    if base.model != cfg.model:
        key = next(k for k in type(cfg.model).model_fields if getattr(base.model, k) != getattr(cfg.model, k))
        raise ConfigError(f"model.{key}: the base run {base_dir} has model.{key}={getattr(base.model, key)!r}, "
                          f"not {getattr(cfg.model, key)!r}; fine-tuning keeps the base architecture")
    if Checkpointer(base_dir / "checkpoints", every=1, keep=1, use_async=False).latest_step() is None:
        raise ConfigError(f"finetune.base: {base_dir}/checkpoints holds no checkpoint; train the base run first")
    if pathlib.Path(cfg.run.dir).expanduser().resolve() == base_dir.resolve():
        raise ConfigError("run.dir: is the base run's own directory; fine-tune into a new run.dir")
    return base


def load_base_params(cfg: Config, mesh: Mesh, rules_by_role: dict[str, Rules]) -> nnx.State:
    """The base run's latest trained weights, placed on `mesh` by the rules (resharded if
    the base trained on another layout)."""
    base_dir = pathlib.Path(cfg.finetune.base).expanduser()
    base = load_config(base_dir / "config.yaml")
    ckpt = Checkpointer(base_dir / "checkpoints", every=1, keep=base.checkpoint.keep, use_async=False)
    _, params, _ = split_model(nnx.eval_shape(lambda: build_model(base)), base)
    target = abstract_with_shardings(params, variable_shardings(params, mesh, rules_by_role["params"]))
    # Only the weights are read (Orbax partial restore): the base's Adam moments stay on disk.
    state = ckpt.restore_parts(ckpt.latest_step(), {"params": target})
    ckpt.close()
    return state["params"]


def describe(cfg: Config, abstract: dict[str, Any]) -> str:
    """Start-up lines: trainable vs total parameters, and bytes of weights, gradients and Adam state."""
    def nbytes(tree):
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))

    trainable = sum(x.size for x in jax.tree.leaves(abstract["params"]))
    base = param_counts(cfg.model)["total"]
    total = base + (trainable if cfg.finetune.method not in ("full", "none") else 0)
    weights = nbytes(abstract["params"]) + nbytes(abstract["buffers"])
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    return (f"finetune {cfg.finetune.method}: {trainable:,} trainable of {total:,} parameters "
            f"({100 * trainable / total:.3f}%)\n"
            f"  bytes: weights {mib(weights)} (frozen {mib(nbytes(abstract['buffers']))}), "
            f"gradients {mib(nbytes(abstract['params']))}, optimizer state {mib(nbytes(abstract['opt_state']))}")


def base_data_config(cfg: Config) -> Config | None:
    """`cfg` reading its base run's data instead (to report the loss on what the base learned),
    or None when not fine-tuning or the data is the same. `check_base` has vetted the base."""
    if cfg.finetune.method == "none":
        return None
    base = load_config(pathlib.Path(cfg.finetune.base).expanduser() / "config.yaml")
    return None if base.data == cfg.data else cfg.model_copy(update={"data": base.data})
