"""Run configuration: YAML with `include:`, the root `Config`, CLI overrides.

A run is described by one YAML file validated into `Config`, whose sections
(`run`, `model`, `data`, `optimizer`, `train`, `mesh`, `rules`, `checkpoint`,
`log`, `comm`, `finetune`) are the frozen pydantic models of
`meshwork.config_sections`; `Config` adds the checks across sections.

    cfg = load_config("configs/lm_tiny.yaml", ["train.steps=50", "mesh.data=2"])

Errors are raised as `ConfigError`, whose message is one line naming the file,
the dotted key and the fix; the command-line entry points print it and exit 2.
This module does not import jax, so validation is instant.
"""

from __future__ import annotations

import difflib
import pathlib
from typing import Any

import pydantic
import yaml

from meshwork.config_sections import (
    CheckpointConfig,
    CommConfig,
    DataConfig,
    FinetuneConfig,
    LogConfig,
    MeshConfig,
    ModelConfig,
    OptimizerConfig,
    RulesConfig,
    RunConfig,
    Section,
    TrainConfig,
    chunk_runs,
)


class ConfigError(ValueError):
    """A user error in the configuration; the message is one actionable line."""


class Config(Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = MeshConfig()
    rules: RulesConfig = RulesConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    finetune: FinetuneConfig = FinetuneConfig()
    comm: CommConfig = CommConfig()

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> Config:
        m, t = self.model, self.train
        if m.n_heads % m.n_kv_heads:
            raise _KeyError(
                "model.n_kv_heads", f"{m.n_kv_heads} does not divide model.n_heads={m.n_heads}; use a divisor"
            )
        if m.kind == "moe":
            e = m.moe
            if e.top_k > e.n_experts:
                raise _KeyError("model.moe.top_k", f"{e.top_k} exceeds model.moe.n_experts={e.n_experts}")
            if e.n_experts % e.n_groups or e.topk_groups > e.n_groups:
                raise _KeyError(
                    "model.moe.n_groups",
                    f"{e.n_experts} experts in {e.n_groups} groups with "
                    f"topk_groups={e.topk_groups}: groups must divide the experts and topk_groups <= n_groups",
                )
            if e.first_dense_layers >= m.n_layers:
                raise _KeyError(
                    "model.moe.first_dense_layers",
                    f"{e.first_dense_layers} leaves no MoE layer of "
                    f"model.n_layers={m.n_layers}; lower it, or use model.kind=transformer",
                )
            _check_dense_layers(e.dense_layers, e.first_dense_layers, m.n_layers)
        if t.global_batch % t.microbatches:
            raise _KeyError(
                "train.microbatches", f"{t.microbatches} does not divide train.global_batch={t.global_batch}"
            )
        if (self.mesh.stage != 1) != (t.pipeline != "none"):
            raise _KeyError(
                "train.pipeline",
                f"train.pipeline={t.pipeline} with mesh.stage={self.mesh.stage}; "
                "a pipeline needs mesh.stage > 1 and mesh.stage > 1 needs a pipeline (gpipe, 1f1b, interleaved or zb-h1)",
            )
        if t.pipeline != "none" and m.mtp.depth:
            raise _KeyError(
                "model.mtp.depth",
                f"{m.mtp.depth} MTP modules with train.pipeline={t.pipeline}: the modules read the last "
                "stage's hidden states and the first stage's embedding, which the pipeline does not route; "
                "set model.mtp.depth=0 or train.pipeline=none",
            )
        if t.pipeline != "none" and m.layer_types is not None and len(set(m.layer_types)) > 1:
            raise _KeyError(
                "model.layer_types",
                f"layers of different kinds ({', '.join(sorted(set(m.layer_types)))}) with train.pipeline="
                f"{t.pipeline}: pipeline stages do not pass each layer its kind yet; set train.pipeline=none",
            )
        if m.mla is not None and self.finetune.method == "prefix":
            raise _KeyError(
                "finetune.method",
                "prefix tuning adds per-head keys and values, which multi-head latent attention (model.mla) "
                "does not cache; use lora, qlora or adapter",
            )
        if t.pipeline != "none" and m.kind == "unet":
            raise _KeyError(
                "train.pipeline",
                "pipelines are built for the language models, not model.kind=unet; "
                "set train.pipeline=none and mesh.stage=1",
            )
        if t.pipeline != "none" and m.kind == "moe":
            _check_moe_pipeline(m, self.mesh.stage, t.virtual_stages if t.pipeline == "interleaved" else 1)
        if t.pipeline != "none" and self.mesh.stage > 0 and m.n_layers % self.mesh.stage:
            raise _KeyError(
                "model.n_layers", f"{m.n_layers} layers cannot be split into mesh.stage={self.mesh.stage} equal stages"
            )
        if t.virtual_stages > 1 and t.pipeline != "interleaved":
            raise _KeyError(
                "train.virtual_stages",
                f"{t.virtual_stages} chunks per stage need "
                f"train.pipeline=interleaved, not {t.pipeline}; set train.virtual_stages=1",
            )
        if t.pipeline == "interleaved" and self.mesh.stage > 0:
            chunks = self.mesh.stage * t.virtual_stages
            if m.n_layers % chunks:
                raise _KeyError(
                    "model.n_layers",
                    f"{m.n_layers} layers cannot be split into mesh.stage="
                    f"{self.mesh.stage} x train.virtual_stages={t.virtual_stages} equal chunks",
                )
            if t.microbatches % self.mesh.stage:
                raise _KeyError(
                    "train.microbatches",
                    f"{t.microbatches} is not a multiple of mesh.stage="
                    f"{self.mesh.stage}, which train.pipeline=interleaved needs",
                )
        ft = self.finetune
        if ft.method != "none" and not ft.base:
            raise _KeyError(
                "finetune.base",
                f"finetune.method={ft.method} starts from a trained model; "
                "set finetune.base to a run's run.dir or a Hugging Face checkpoint folder",
            )
        if ft.method not in ("none", "full") and m.kind != "transformer":
            raise _KeyError(
                "finetune.method", f"{ft.method} is built for the dense transformer, not model.kind={m.kind}; use full"
            )
        if ft.method in ("lora", "qlora", "adapter", "prefix") and t.pipeline != "none":
            raise _KeyError(
                "finetune.method",
                f"{ft.method} with train.pipeline={t.pipeline} is not supported; set train.pipeline=none",
            )
        o, c = t.offload, self.comm
        if (o.optimizer or o.params) and (c.compression != "none" or c.stale_gradients or c.local_steps > 1):
            raise _KeyError(
                "train.offload",
                "host offload with comm.compression, comm.stale_gradients or "
                "comm.local_steps > 1 is not supported; turn one of them off",
            )
        if o.params and (m.kind != "transformer" or t.pipeline != "none" or ft.method not in ("none", "full")):
            raise _KeyError(
                "train.offload.params",
                f"parameter offload streams the dense transformer's scanned "
                f"layers (model.kind={m.kind}, train.pipeline={t.pipeline}, finetune.method="
                f"{ft.method}); use model.kind=transformer, train.pipeline=none, finetune none or full",
            )
        if isinstance(t.loss_chunk, int) and (t.pipeline != "none" or m.kind == "unet"):
            raise _KeyError(
                "train.loss_chunk",
                f"the chunked loss is for unpipelined language models (train.pipeline="
                f"{t.pipeline}, model.kind={m.kind}); set train.loss_chunk to auto or null",
            )
        if t.remat not in ("none", "full", "dots_saveable") and m.kind == "unet":
            raise _KeyError(
                "train.remat",
                f"{t.remat} is a policy of the scanned transformer layers; "
                "use none, full or dots_saveable for model.kind=unet",
            )
        if o.params and not t.scan_layers:
            raise _KeyError(
                "train.offload.params", "parameter offload streams one layer per scan step; set train.scan_layers=true"
            )
        _check_tiers_and_elasticity(self)
        if self.data.source == "tokens" and not (self.data.train_path and self.data.val_path):
            raise _KeyError("data.train_path", "data.source=tokens needs data.train_path and data.val_path")
        if self.data.source in ("text", "chat"):
            _check_packed_documents(self)
        if self.optimizer.name == "muon":
            _check_muon(self)
        if t.objective == "dpo":
            _check_dpo(self)
        if t.objective == "grpo":
            _check_grpo(self)
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)


class _KeyError(ValueError):
    """Cross-field error that knows which dotted key to blame."""

    def __init__(self, key: str, msg: str):
        super().__init__(msg)
        self.key, self.msg = key, msg


def _check_tiers_and_elasticity(cfg: Config) -> None:
    """checkpoint.every=auto, the fast tier and train.elastic: what each needs from the others."""
    ck, t, c = cfg.checkpoint, cfg.train, cfg.comm
    if ck.every == "auto" and cfg.run.mttf_hours is None:
        raise _KeyError(
            "checkpoint.every",
            "auto picks the Young/Daly interval from the measured checkpoint "
            "cost and the job's mean time to failure; set run.mttf_hours (e.g. 24), or a number of steps",
        )
    if ck.fast_path is not None and ck.fast_every is None:
        raise _KeyError(
            "checkpoint.fast_path",
            f"{ck.fast_path} is the fast tier's folder, but no fast tier is "
            "written; set checkpoint.fast_every (e.g. 5) or drop checkpoint.fast_path",
        )
    if ck.fast_every is not None and ck.fast_path is None and not t.elastic:
        raise _KeyError(
            "checkpoint.fast_every",
            "a fast tier in host RAM dies with the process and only "
            "train.elastic reads it back; set checkpoint.fast_path to a local disk folder, or "
            "train.elastic=true",
        )
    if t.elastic and cfg.mesh.stage != 1:
        raise _KeyError(
            "train.elastic",
            f"mesh.stage={cfg.mesh.stage}: pipeline stages cannot shrink (each "
            "holds its own layers); elasticity shrinks the data-parallel axes, so set mesh.stage=1 "
            "and train.pipeline=none, or train.elastic=false",
        )
    if t.elastic and (c.compression != "none" or c.stale_gradients or c.local_steps > 1):
        raise _KeyError(
            "train.elastic",
            "comm.compression, comm.stale_gradients and comm.local_steps > 1 keep "
            "state per data-parallel replica, which a changing device count would orphan; turn "
            "them off, or train.elastic=false",
        )


def _check_dense_layers(dense: tuple[int, ...] | None, first_dense: int, n_layers: int) -> None:
    """model.moe.dense_layers: layer indices, each once, in order, in range, leaving a MoE layer,
    and not beside first_dense_layers (two descriptions of one thing could disagree)."""
    if not dense:
        return
    key, got = "model.moe.dense_layers", list(dense)
    if first_dense:
        raise _KeyError(
            key,
            f"{got} with model.moe.first_dense_layers={first_dense}: set one of them "
            "(dense_layers lists any layers; first_dense_layers counts leading ones)",
        )
    if got != sorted(set(got)):
        raise _KeyError(key, f"{got}: list each layer once, in increasing order")
    if got[-1] >= n_layers:
        raise _KeyError(
            key,
            f"{got}: layer {got[-1]} is past the last layer of model.n_layers={n_layers} "
            f"(layers are numbered 0..{n_layers - 1})",
        )
    if len(got) == n_layers:
        raise _KeyError(key, f"{got} makes every layer dense; leave a MoE layer, or use model.kind=transformer")


def _check_moe_pipeline(m, stage: int, virtual_stages: int) -> None:
    """A pipelined MoE model: every stage runs one program, so each of the n_chunks equal chunks of
    layers needs the same dense/MoE pattern; the noisy router's per-step noise is not carried
    through the schedule."""
    if stage <= 0:
        return  # mesh.stage=-1: checked once the mesh is known
    n_chunks = stage * virtual_stages
    runs = m.moe.layer_runs(m.n_layers)
    if m.n_layers % n_chunks == 0 and chunk_runs(runs, n_chunks) is None:
        raise _KeyError(
            "model.moe",
            f"dense layers {list(m.moe.dense_layer_indices(m.n_layers))} of {m.n_layers} "
            f"differ between the pipeline's {n_chunks} chunks of {m.n_layers // n_chunks} layers; every "
            "stage runs one program, so use a pattern that repeats per chunk (e.g. no dense layers) or "
            "train.pipeline=none",
        )
    for run in runs:
        if run.count % stage:
            raise _KeyError(
                "model.moe",
                f"the run of {run.count} {'MoE' if run.moe else 'dense'} layers from layer "
                f"{run.start} cannot be split over mesh.stage={stage} (each run of layers is stored "
                "split by stage); use no dense layers or train.pipeline=none",
            )
    if m.moe.router == "noisy":
        raise _KeyError(
            "model.moe.router",
            "the noisy router's per-step noise is not carried through a pipeline "
            "schedule; use softmax or sigmoid, or train.pipeline=none",
        )


def _check_packed_documents(cfg: Config) -> None:
    """data.source=text (and chat) packs documents into rows with segment ids; the paths that cannot
    keep documents apart (the pipeline's stages, cuDNN attention, prefix tuning) refuse it here."""
    source = cfg.data.source
    if not cfg.data.text_files:
        raise _KeyError(
            "data.text_files",
            "data.source=chat needs data.text_files: .jsonl files or globs, one conversation "
            "(a messages list) per line, e.g. data.text_files=[chats/*.jsonl]"
            if source == "chat"
            else "data.source=text needs data.text_files: files or globs "
            "(.txt, .jsonl, .parquet), e.g. data.text_files=[notes/*.txt]",
        )
    if cfg.train.pipeline != "none":
        raise _KeyError(
            "data.source",
            f"{source} (packed documents) is not supported with train.pipeline="
            f"{cfg.train.pipeline}; set train.pipeline=none and mesh.stage=1",
        )
    if cfg.model.attention == "cudnn":
        raise _KeyError(
            "model.attention",
            f"cudnn takes no segment ids, which data.source={source}'s packed documents need; use xla or pallas",
        )
    if cfg.finetune.method == "prefix":
        raise _KeyError(
            "finetune.method",
            f"prefix tuning over packed documents (data.source={source}) is not implemented; use lora, adapter or full",
        )
    if source == "chat" and not cfg.data.messages_field:
        raise _KeyError("data.messages_field", "is empty; name the JSON field holding the messages (e.g. messages)")


def _check_muon(cfg: Config) -> None:
    """What Muon (optimizer.name=muon) trains: the language models' full weight matrices."""
    m, ft, t = cfg.model, cfg.finetune, cfg.train
    if m.kind == "unet":
        raise _KeyError(
            "optimizer.name",
            "muon orthogonalizes the language models' weight matrices, not model.kind=unet's convolutions; use adamw",
        )
    if ft.method not in ("none", "full"):
        raise _KeyError(
            "optimizer.name",
            f"muon trains whole weight matrices, and finetune.method={ft.method} trains adapters; "
            "use optimizer.name=adamw or finetune.method full",
        )
    if t.offload.optimizer or cfg.comm.local_steps > 1:
        raise _KeyError(
            "optimizer.name",
            "muon with train.offload.optimizer or comm.local_steps > 1 is not supported; "
            "use optimizer.name=adamw or turn them off",
        )


def _check_dpo(cfg: Config) -> None:
    """train.objective=dpo: preference pairs (data.source=chat) and a reference the run can compute."""
    if cfg.data.source != "chat":
        raise _KeyError(
            "train.objective",
            f"dpo reads preference pairs rendered like chat data; set data.source=chat, not {cfg.data.source}, "
            "and data.text_files to .jsonl files of pairs (prompt or messages, chosen, rejected)",
        )
    reference = cfg.train.dpo.reference
    if reference == "adapters_off" and cfg.finetune.method not in ("lora", "qlora"):
        raise _KeyError(
            "train.dpo.reference",
            f"adapters_off is the base model under LoRA adapters, not available with finetune.method="
            f"{cfg.finetune.method}; use finetune.method lora or qlora, or train.dpo.reference precomputed",
        )
    if reference == "frozen_copy" and cfg.train.elastic:
        raise _KeyError(
            "train.dpo.reference", "frozen_copy stays on the devices it started on; use precomputed with train.elastic"
        )
    if reference != "adapters_off" and cfg.finetune.method == "none":
        raise _KeyError(
            "train.dpo.reference",
            f"{reference} is the fine-tuning base's log-probabilities, and finetune.method is none; set "
            "finetune.method (full, lora, ...) and finetune.base",
        )
    if cfg.mesh.sequence != 1 or cfg.train.pipeline != "none":
        raise _KeyError(
            "train.objective", "dpo is not supported with context parallelism (mesh.sequence) or train.pipeline"
        )


def _check_grpo(cfg: Config) -> None:
    """train.objective=grpo: prompts (data.source=chat), whole groups per step, a reference to hand."""
    g, t = cfg.train.grpo, cfg.train
    if cfg.data.source != "chat":
        raise _KeyError(
            "train.objective",
            f"grpo reads prompts rendered like chat data; set data.source=chat, not {cfg.data.source}, "
            "and data.text_files to .jsonl files of prompts (prompt or messages, and the reward's fields)",
        )
    if t.global_batch % g.group_size:
        raise _KeyError(
            "train.grpo.group_size",
            f"{g.group_size} completions per prompt do not divide train.global_batch={t.global_batch}; "
            "a step trains on whole groups: use a divisor of it",
        )
    if g.kl_coef > 0 and cfg.finetune.method not in ("lora", "qlora", "full"):
        raise _KeyError(
            "train.grpo.kl_coef",
            f"{g.kl_coef}: the KL's reference is the fine-tuning base (LoRA's adapters off, or a frozen copy for "
            f"full fine-tuning), and finetune.method is {cfg.finetune.method}; use lora, qlora or full with "
            "finetune.base, or kl_coef 0",
        )
    if cfg.mesh.sequence != 1 or t.pipeline != "none" or t.microbatches != 1:
        raise _KeyError(
            "train.objective",
            "grpo is not supported with context parallelism (mesh.sequence), train.pipeline or train.microbatches > 1",
        )
    if cfg.comm.local_steps > 1:
        raise _KeyError("train.objective", "grpo syncs the engine after every step; set comm.local_steps 1")
    if t.elastic:
        raise _KeyError("train.elastic", "grpo's serving engine stays on the devices it started on; set false")


# ---------------------------------------------------------------- loading


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key written twice in one mapping (YAML would keep the last)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(
                    f"line {key_node.start_mark.line + 1}: key {key!r} appears twice in one mapping; keep one of them"
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: pathlib.Path, seen: tuple[pathlib.Path, ...] = ()) -> dict[str, Any]:
    """Reads a YAML file, resolving `include:` (a path or list, relative to the file)."""
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found; pass an existing YAML file to --config")
    if path.resolve() in seen:
        raise ConfigError(f"{path}: include cycle through {' -> '.join(map(str, seen))}")
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader) or {}
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (not UTF-8); pass a YAML config file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror}); check the path and its permissions") from None
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    includes = raw.pop("include", [])
    includes = [includes] if isinstance(includes, str) else includes
    if not isinstance(includes, list) or not all(isinstance(inc, str) and inc for inc in includes):
        raise ConfigError(f"{path}: include: expected a file path or a list of file paths, got {includes!r}")
    merged: dict[str, Any] = {}
    for inc in includes:
        merged = _deep_merge(merged, _read_yaml(path.parent / inc, seen + (path.resolve(),)))
    return _deep_merge(merged, raw)


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def apply_overrides(raw: dict[str, Any], overrides: list[str], source: str = "command line") -> dict[str, Any]:
    """Applies `a.b=value` strings; values are parsed as YAML (`3`, `true`, `[q, v]`, `null`)."""
    raw = _deep_merge({}, raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{source}: override {item!r} is not of the form section.key=value")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        node = raw
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{source}: {key}: {p} is not a section")
        node[leaf] = value
    return raw


def validate(raw: dict[str, Any], source: str = "config") -> Config:
    """Validates a raw mapping into a Config, turning the first error into a one-line ConfigError."""
    try:
        return Config.model_validate(raw)
    except pydantic.ValidationError as e:
        raise ConfigError(_explain(e, source)) from None


def _explain(e: pydantic.ValidationError, source: str) -> str:
    err = e.errors()[0]
    loc = [str(p) for p in err["loc"]]
    key = ".".join(loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        section = _section_model(loc[:-1])
        names = [f.alias or n for n, f in section.model_fields.items()]
        close = difflib.get_close_matches(loc[-1], names, n=1)
        hint = f"did you mean {'.'.join([*loc[:-1], close[0]])}? " if close else ""
        return f"{source}: {key}: unknown key; {hint}valid keys here are: {', '.join(names)}"
    if "ctx" in err and isinstance(err["ctx"].get("error"), _KeyError):
        ke = err["ctx"]["error"]
        return f"{source}: {ke.key}: {ke.msg}"
    msg = err["msg"].removeprefix("Value error, ")
    return f"{source}: {key}: {msg} (got {err['input']!r})"


def _section_model(loc: list[str]) -> type[pydantic.BaseModel]:
    model: type[pydantic.BaseModel] = Config
    for part in loc:
        field = model.model_fields.get(part)
        if (
            field is None
            or not isinstance(field.annotation, type)
            or not issubclass(field.annotation, pydantic.BaseModel)
        ):
            break
        model = field.annotation
    return model


def load_config(path: str | pathlib.Path, overrides: list[str] = ()) -> Config:
    """Loads, merges includes, applies overrides and validates. Raises ConfigError."""
    path = pathlib.Path(path)
    raw = apply_overrides(_read_yaml(path), list(overrides))
    source = f"{path}" + (f" + {len(overrides)} override(s)" if overrides else "")
    return validate(raw, source)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
