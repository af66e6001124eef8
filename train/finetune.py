"""Fine-tuning a trained run or a Hugging Face checkpoint: its checks, its starting weights, its accounting.

A `finetune` config trains a new run.dir from `finetune.base`: the latest
checkpoint of a meshwork run, or a Hugging Face checkpoint folder (config.json
and safetensors, as `meshwork.models.hf` reads them), whose config.json then
decides the model (`with_base_model`). `finetune.method: full` from a Hugging
Face folder is plain continued pre-training. What is trained is decided by `meshwork.models.build.split_model`:
with LoRA/QLoRA/adapters/prefixes only the method's own variables are
"params" (gradients, Adam moments); the base model's weights travel in the
state as "buffers", sharded by the same rules but never differentiated, so
XLA builds no weight gradients for them. Resuming a fine-tuning run restores
its own checkpoints like any run; the base is read only at step 0.
"""

from __future__ import annotations

import pathlib
import sys

import jax
from flax import nnx
from jax.sharding import Mesh

from meshwork.config import Config, ConfigError, validate
from meshwork.config_sections import FinetuneConfig, Section
from meshwork.models.build import DTYPES, build_model, split_model
from meshwork.models.hf import load_hf_config, load_hf_model
from meshwork.partitioning import abstract_with_shardings, variable_shardings
from meshwork.perf.flops import param_counts
from meshwork.run.checkpoint import Checkpointer
from meshwork.run.saved_config import how_the_copy_differs
from meshwork.sharding.rules import Rules
from meshwork.train.state import TrainState

# Model keys that choose how the model runs or starts, not what it computes: a config may set
# them beside a Hugging Face base.
_RUNTIME_KEYS = ("attention", "init_std")


def is_hf_base(cfg: Config) -> bool:
    """Whether `finetune.base` is a Hugging Face checkpoint folder (config.json, no checkpoints/ of a meshwork run)."""
    if cfg.finetune.method == "none" or not cfg.finetune.base:
        return False
    base_dir = pathlib.Path(cfg.finetune.base).expanduser()
    return (base_dir / "config.json").is_file() and not (base_dir / "checkpoints").is_dir()


def with_base_model(cfg: Config) -> Config:
    """`cfg` with its model read from a Hugging Face `finetune.base` (unchanged for a run-dir base).

    The checkpoint's config.json decides the architecture; a model key the config
    sets (in its file or as an override) must agree with it, else a one-line
    ConfigError names the key, both values and the fix. With `data.source: text` (or
    chat) and no `data.tokenizer`, the folder's tokenizer.json tokenizes the text (and its
    chat template renders the conversations).
    """
    if not is_hf_base(cfg):
        return cfg
    base_dir = pathlib.Path(cfg.finetune.base).expanduser()
    try:
        derived = load_hf_config(base_dir)
    except (ValueError, OSError) as e:
        raise ConfigError(f"finetune.base: {base_dir}: {e}") from None
    derived = derived.model_copy(update={k: getattr(cfg.model, k) for k in _RUNTIME_KEYS})
    if (clash := _first_difference(cfg.model, derived, "model")) is not None:
        key, ours, theirs = clash
        raise ConfigError(
            f"{key}: the Hugging Face base {base_dir} has {key}={theirs!r} (from its config.json), "
            f"not {ours!r}; drop {key} from the config, the model is read from finetune.base"
        )
    raw = {**cfg.to_dict(), "model": derived.model_dump(mode="json", by_alias=True)}
    if (
        cfg.data.source in ("text", "chat")
        and getattr(cfg.data, "tokenizer", None) is None
        and (base_dir / "tokenizer.json").is_file()
    ):
        raw["data"] = {**raw["data"], "tokenizer": str(base_dir / "tokenizer.json")}
    return validate(raw, f"finetune.base {base_dir}")


def _first_difference(user: Section, derived: Section, prefix: str) -> tuple[str, object, object] | None:
    """(dotted key, user's value, derived value) of the first key the user set that differs."""
    for name in sorted(user.model_fields_set):
        ours, theirs = getattr(user, name), getattr(derived, name)
        if isinstance(ours, Section):
            if (found := _first_difference(ours, theirs, f"{prefix}.{name}")) is not None:
                return found
        elif ours != theirs:
            return f"{prefix}.{name}", ours, theirs
    return None


def check_base(cfg: Config) -> Config | None:
    """The base run's config, after checking it can be fine-tuned into `cfg` (ConfigError if not);
    None when not fine-tuning or when the base is a Hugging Face folder (`with_base_model` checks it)."""
    if cfg.finetune.method == "none":
        return None
    base_dir = pathlib.Path(cfg.finetune.base).expanduser()
    if pathlib.Path(cfg.run.dir).expanduser().resolve() == base_dir.resolve():
        raise ConfigError("run.dir: is the base's own directory; fine-tune into a new run.dir")
    if is_hf_base(cfg):
        with_base_model(cfg)  # the checkpoint's own checks, and the model keys against it
        return None
    base, _ = base_run(base_dir, warn=True)
    if base.finetune.method != "none":
        raise ConfigError(f"finetune.base: {base_dir} is itself a fine-tuning run; start from the run it tuned")
    if base.model != cfg.model:
        key = next(k for k in type(cfg.model).model_fields if getattr(base.model, k) != getattr(cfg.model, k))
        raise ConfigError(
            f"model.{key}: the base run {base_dir} has model.{key}={getattr(base.model, key)!r}, "
            f"not {getattr(cfg.model, key)!r}; fine-tuning keeps the base architecture"
        )
    return base


def base_run(base_dir: pathlib.Path, *, warn: bool = False) -> tuple[Config, int]:
    """(the base run's config as saved in its latest checkpoint, that step). Its config.yaml is a
    copy: with `warn`, a line on stderr says where it differs from the checkpoint's or is unreadable."""
    if not (base_dir / "checkpoints").is_dir():
        has = "no checkpoints/" if (base_dir / "config.yaml").is_file() else "no config.yaml and no checkpoints/"
        raise ConfigError(
            f"finetune.base: {base_dir} has {has}; point it to a trained run's run.dir "
            "or a Hugging Face checkpoint folder (config.json and *.safetensors)"
        )
    ckpt = Checkpointer(base_dir / "checkpoints", every=1, keep=1, use_async=False)
    try:
        step = ckpt.latest_step()
        if step is None:
            raise ConfigError(f"finetune.base: {base_dir}/checkpoints holds no checkpoint; train the base run first")
        saved = ckpt.saved_config(step)
    finally:
        ckpt.close()
    differs = how_the_copy_differs(base_dir / "config.yaml", saved, step) if warn else None
    if differs is not None:
        print(f"warning: {base_dir / 'config.yaml'} {differs}; the base is what its checkpoint holds", file=sys.stderr)
    return validate(saved, f"finetune.base: checkpoint {step} in {base_dir}"), step


def load_base_params(cfg: Config, mesh: Mesh, rules_by_role: dict[str, Rules]) -> nnx.State:
    """The base run's latest trained weights, placed on `mesh` by the rules (resharded if
    the base trained on another layout); for a Hugging Face base, its weights read straight
    onto the devices in that layout, one layer at a time."""
    base_dir = pathlib.Path(cfg.finetune.base).expanduser()
    if is_hf_base(cfg):
        base = cfg.model_copy(update={"finetune": FinetuneConfig()})
        _, params, _ = split_model(nnx.eval_shape(lambda: build_model(base)), base)
        shardings = variable_shardings(params, mesh, rules_by_role["params"])
        _, model = load_hf_model(
            base_dir,
            shardings=shardings,
            dtype=DTYPES[cfg.train.compute_dtype],
            param_dtype=DTYPES[cfg.train.param_dtype],
        )
        return nnx.state(model, nnx.Param)
    base, step = base_run(base_dir)
    ckpt = Checkpointer(base_dir / "checkpoints", every=1, keep=base.checkpoint.keep, use_async=False)
    _, params, _ = split_model(nnx.eval_shape(lambda: build_model(base)), base)
    target = abstract_with_shardings(params, variable_shardings(params, mesh, rules_by_role["params"]))
    # Only the weights are read (Orbax partial restore): the base's Adam moments stay on disk.
    state = ckpt.restore_parts(step, {"params": target})
    ckpt.close()
    return state["params"]


def describe(cfg: Config, abstract: TrainState) -> str:
    """Start-up lines: trainable vs total parameters, and bytes of weights, gradients and Adam state."""

    def nbytes(tree):
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))

    trainable = sum(x.size for x in jax.tree.leaves(abstract.params))
    base = param_counts(cfg.model)["total"]
    total = base + (trainable if cfg.finetune.method not in ("full", "none") else 0)
    weights = nbytes(abstract.params) + nbytes(abstract.buffers)
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    return (
        f"finetune {cfg.finetune.method}: {trainable:,} trainable of {total:,} parameters "
        f"({100 * trainable / total:.3f}%)\n"
        f"  bytes: weights {mib(weights)} (frozen {mib(nbytes(abstract.buffers))}), "
        f"gradients {mib(nbytes(abstract.params))}, optimizer state {mib(nbytes(abstract.opt_state))}"
    )


def base_data_config(cfg: Config) -> Config | None:
    """`cfg` reading its base run's data instead (to report the loss on what the base learned),
    or None when not fine-tuning or the data is the same. `check_base` has vetted the base.
    None under train.objective dpo or grpo: the base's data holds no pairs or prompts to score."""
    if cfg.finetune.method == "none" or is_hf_base(cfg):  # a Hugging Face base brings no data of ours
        return None
    if cfg.train.objective in ("dpo", "grpo"):
        return None
    base, _ = base_run(pathlib.Path(cfg.finetune.base).expanduser())
    return None if base.data == cfg.data else cfg.model_copy(update={"data": base.data})
