"""Loading a trained run: its resolved config and the weights of its latest checkpoint."""

from __future__ import annotations

import pathlib
import sys

import jax
from flax import nnx

from meshwork.config import Config, ConfigError, validate
from meshwork.models.build import build_model, ema_decay, split_model
from meshwork.run.checkpoint import Checkpointer
from meshwork.run.saved_config import how_the_copy_differs


def load_run(run_dir: str | pathlib.Path, *, ema: bool = True, attention: str | None = None) -> tuple:
    """(config, model with the trained weights, step) from `run_dir`'s latest checkpoint.

    The config is the one saved inside that checkpoint: the run dir's config.yaml is a copy a user
    may have edited or deleted, and where it differs from the checkpoint's (or cannot be read) a
    warning on stderr says so and it is not used. `ema`: use the exponential moving average of the
    weights when the run kept one. `attention` replaces `model.attention` (xla, pallas, cudnn,
    reference), which changes no weight. The checkpoint is restored onto the default device,
    whatever mesh trained it.
    """
    run_dir = pathlib.Path(run_dir).expanduser()
    # Orbax creates the folder it opens: look first, since reading a run must not change it.
    if not (run_dir / "checkpoints").is_dir():
        has = "config.yaml but no checkpoints/" if (run_dir / "config.yaml").is_file() else "no config.yaml"
        raise ConfigError(f"--checkpoint: {run_dir} has {has}; pass the run.dir of a training run that saved one")
    ckpt = Checkpointer(run_dir / "checkpoints", every=1, keep=1, use_async=False)
    try:
        step = ckpt.latest_step()
        if step is None:
            raise ConfigError(f"--checkpoint: {run_dir}/checkpoints holds no complete checkpoint; train first")
        cfg = _saved_config(ckpt, step, run_dir, attention)
        # Only the weights are read (Orbax partial restore): no optimizer state is built or loaded.
        graphdef, params, buffers = split_model(nnx.eval_shape(lambda: build_model(cfg)), cfg)
        weights = "ema" if ema and ema_decay(cfg) else "params"
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), {weights: params, "buffers": buffers}
        )
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


def _saved_config(ckpt: Checkpointer, step: int, run_dir: pathlib.Path, attention: str | None) -> Config:
    """Checkpoint `step`'s own config (with `attention` put in), after a warning if config.yaml says otherwise."""
    saved = ckpt.saved_config(step)
    differs = how_the_copy_differs(run_dir / "config.yaml", saved, step)
    if differs is not None:
        print(
            f"warning: {run_dir / 'config.yaml'} {differs}; loading with the checkpoint's config",
            file=sys.stderr,
            flush=True,
        )
    if attention is not None:
        saved = {**saved, "model": {**saved["model"], "attention": attention}}
    return validate(saved, f"checkpoint {step} in {run_dir}")
