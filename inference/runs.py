"""Loading a trained run: its resolved config and the weights of its latest checkpoint."""

from __future__ import annotations

import pathlib

import jax
from flax import nnx

from meshwork.checkpoint import Checkpointer
from meshwork.config import ConfigError, load_config
from train.optim import make_optimizer
from train.state import abstract_state


def load_run(run_dir: str | pathlib.Path, *, ema: bool = True) -> tuple:
    """(config, model with the trained weights, step) from `run_dir` (config.yaml + checkpoints/).

    `ema`: use the exponential moving average of the weights when the run kept one.
    The checkpoint is restored onto the default device, whatever mesh trained it.
    """
    run_dir = pathlib.Path(run_dir).expanduser()
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"--checkpoint: {run_dir} has no config.yaml; pass the run.dir of a training run")
    cfg = load_config(run_dir / "config.yaml")
    ckpt = Checkpointer(run_dir / "checkpoints", every=1, keep=cfg.checkpoint.keep, use_async=False)
    step = ckpt.latest_step()
    if step is None:
        raise ConfigError(f"--checkpoint: {run_dir}/checkpoints holds no checkpoint yet; train first")
    tx, _ = make_optimizer(cfg.optimizer, cfg.train.steps)
    graphdef, abstract = abstract_state(cfg, tx)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract)
    state, _ = ckpt.restore(step, target)
    ckpt.close()
    params = state["ema"] if ema and "ema" in state else state["params"]
    return cfg, nnx.merge(graphdef, params, state["buffers"]), step
