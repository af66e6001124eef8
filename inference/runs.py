"""Loading a trained run: its resolved config and the weights of its latest checkpoint."""

from __future__ import annotations

import pathlib

import jax
from flax import nnx

from meshwork.config import Config, ConfigError, load_config
from meshwork.models.build import build_model, ema_decay, split_model
from meshwork.run.checkpoint import Checkpointer


def load_run(run_dir: str | pathlib.Path, *, ema: bool = True) -> tuple:
    """(config, model with the trained weights, step) from `run_dir` (config.yaml + checkpoints/).

    `ema`: use the exponential moving average of the weights when the run kept one.
    The checkpoint is restored onto the default device, whatever mesh trained it.
    """
    run_dir = pathlib.Path(run_dir).expanduser()
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"--checkpoint: {run_dir} has no config.yaml; pass the run.dir of a training run")
    cfg = load_config(run_dir / "config.yaml")
    # Orbax creates the folder it opens: look first, since reading a run must not change it.
    ckpt = None
    if (run_dir / "checkpoints").is_dir():
        ckpt = Checkpointer(run_dir / "checkpoints", every=1, keep=cfg.checkpoint.keep, use_async=False)
    step = ckpt.latest_step() if ckpt is not None else None
    if step is None:
        raise ConfigError(f"--checkpoint: {run_dir}/checkpoints holds no complete checkpoint; train first")
    # Only the weights are read (Orbax partial restore): no optimizer state is built or loaded.
    graphdef, params, buffers = split_model(nnx.eval_shape(lambda: build_model(cfg)), cfg)
    weights = "ema" if ema and ema_decay(cfg) else "params"
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), {weights: params, "buffers": buffers}
    )
    try:
        _check_model(cfg, ckpt.saved_config(step), run_dir, step)
        state = ckpt.restore_parts(step, target)
    except ConfigError:
        raise
    except (ValueError, OSError) as e:  # truncated or corrupt files: Orbax raises from deep inside
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"--checkpoint: checkpoint {step} in {run_dir}/checkpoints cannot be read ({first}); "
            "it is damaged: restore it from a copy or retrain"
        ) from None
    finally:
        ckpt.close()
    return cfg, nnx.merge(graphdef, state[weights], state["buffers"]), step


def _check_model(cfg: Config, saved: dict, run_dir: pathlib.Path, step: int) -> None:
    """An edited config.yaml would fail deep inside Orbax on the first mis-shaped array; say which key instead."""
    now = cfg.to_dict()["model"]
    key = next((k for k in now if saved.get("model", {}).get(k) != now[k]), None)
    if key is not None:
        raise ConfigError(
            f"model.{key}: {run_dir}/config.yaml has model.{key}={now[key]!r} but checkpoint {step} was "
            f"trained with {saved.get('model', {}).get(key)!r}; put the original value back"
        )
