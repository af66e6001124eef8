"""meshwork language models as Hugging Face checkpoints (config.json + model.safetensors).

The inverse of `models.hf.load_hf_checkpoint`: a dense Transformer becomes a
Llama checkpoint (Mistral with a sliding window, Qwen2 with q/k/v biases, Qwen3
with q/k norms, Gemma 2 / 3 with sandwich norms) and a Mixtral-style MoE model a Mixtral one
(Qwen3-MoE with q/k norms, Qwen2-MoE with a gated shared expert; their dense layers, leading
or not, as decoder_sparse_step and mlp_only_layers; gpt-oss with attention sinks, biased router
and experts and the clamped SwiGLU: models/hf/gpt_oss.py), in the hub's tensor names and layouts. Both
directions follow one table, `models.hf.layout.hf_layout`, so export then load gives
back the same parameters:

    path = export_hf(cfg.model, model, "out/my_llama")
    cfg2, model2 = load_hf_model(path)                  # the same weights
    # transformers: AutoModelForCausalLM.from_pretrained("out/my_llama")

What transformers computes from the export is checked (outside the test suite,
which has no torch) by tests/fixtures/check_hf_export.py.

A configuration that none of these can express (q/k/v biases with q/k norms or in
Mixtral, sigmoid or noisy routers, ungated shared experts, Mixtral with dense layers or
unnormalized top-k, scaled routing, a sliding window in a MoE) raises ValueError naming
each such setting. Training-only settings
(auxiliary-loss coefficients other than Mixtral's router_aux_loss_coef, the
z-loss, selection-bias updates) are dropped. A capacity-factor MoE (`moe.capacity_factor`
set) is refused: Mixtral is dropless, so the export would compute every token that meshwork's
model drops, i.e. what meshwork computes with capacity_factor null. `allow_dropless=True`
(`python3 -m inference export-hf --allow-dropless`) writes it anyway, with a warning saying so.
"""

from __future__ import annotations

import json
import math
import pathlib
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from meshwork.config_sections import ModelConfig
from meshwork.models.hf.gemma import GEMMA_TYPES, gemma_hf_config, gemma_problems, gemma_type
from meshwork.models.hf.gpt_oss import gpt_oss_hf_config, gpt_oss_problems, is_gpt_oss
from meshwork.models.hf.layout import (
    HF_DTYPE_NAMES,
    as_pure_dict,
    check_tree,
    hf_layout,
    layout_shapes,
    mtp_shared_copies,
    split_buffers,
)
from meshwork.models.hf.qwen3_next import is_qwen3_next, qwen3_next_hf_config, qwen3_next_problems
from meshwork.models.hf.rope import rope_to_hf
from meshwork.models.layers.moe_routing import RouterBias

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}
NAMES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "mixtral": "Mixtral",
    "qwen3_moe": "Qwen3-MoE",
    "qwen2_moe": "Qwen2-MoE",
    "deepseek_v3": "DeepSeek-V3",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3",
    "gpt_oss": "gpt-oss",
    "qwen3_next": "Qwen3-Next",
}


def hf_model_type(cfg: ModelConfig, *, allow_dropless: bool = False) -> str:
    """The Hugging Face architecture that computes what `cfg` computes: "llama" (kind transformer),
    "qwen2" (with q/k/v biases), "qwen3" (with q/k norms), "mixtral" (kind moe), "qwen3_moe"
    (kind moe with q/k norms), "qwen2_moe" (kind moe with a gated shared expert), "gemma2" /
    "gemma3_text" (sandwich norms) or "gpt_oss" (kind moe with attention sinks, router or expert
    biases or the clamped SwiGLU). ValueError names every setting that it cannot express.

    >>> from meshwork.config_sections import MoEConfig
    >>> hf_model_type(ModelConfig(kind="moe", moe=MoEConfig(router="softmax")))
    'mixtral'
    >>> hf_model_type(ModelConfig(qk_norm=True))
    'qwen3'
    >>> hf_model_type(ModelConfig(kind="moe", moe=MoEConfig(router="sigmoid", first_dense_layers=1)))
    Traceback (most recent call last):
    ...
    ValueError: cannot export to Mixtral: moe.router='sigmoid' (Mixtral routes by softmax top-k); \
moe.first_dense_layers=1 (every Mixtral layer is a MoE layer)
    """
    if cfg.kind not in ("transformer", "moe"):
        raise ValueError(
            f"cannot export model.kind={cfg.kind!r}: only transformer (as Llama, Mistral, Qwen2 or Qwen3) "
            "and moe (as Mixtral, Qwen2-MoE or Qwen3-MoE) models have a Hugging Face form here"
        )
    if cfg.mla is not None:
        return _deepseek_v3_type(cfg, allow_dropless)
    if cfg.mtp.depth:
        raise ValueError(
            f"cannot export mtp.depth={cfg.mtp.depth}: multi-token prediction modules have a Hugging Face "
            "form only in DeepSeek-V3 checkpoints (model.mla set); set mtp.depth 0 to export without them"
        )
    gemma = gemma_type(cfg)
    if gemma is not None:
        if problems := gemma_problems(cfg, gemma):
            raise ValueError(f"cannot export to {NAMES[gemma]}: {'; '.join(problems)}")
        return gemma
    if is_qwen3_next(cfg):
        if problems := qwen3_next_problems(cfg):
            raise ValueError(f"cannot export to Qwen3-Next: {'; '.join(problems)}")
        return "qwen3_next"
    if is_gpt_oss(cfg):
        problems = gpt_oss_problems(cfg)
        if cfg.moe.capacity_factor is not None and not allow_dropless:
            problems.append(f"{_dropless(cfg.moe.capacity_factor, 'gpt-oss')}; allow_dropless=True writes it anyway)")
        if problems:
            raise ValueError(f"cannot export to gpt-oss: {'; '.join(problems)}")
        return "gpt_oss"
    if cfg.kind == "transformer":  # Llama has no sliding window; Mistral is Llama with one
        model_type = (
            "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "mistral" if cfg.sliding_window else "llama"
        )
    else:  # Qwen2-MoE's mark is its gated shared expert; a plain routed MoE is Mixtral's
        model_type = "qwen3_moe" if cfg.qk_norm else "qwen2_moe" if cfg.moe.shared_expert_gate else "mixtral"
    name = NAMES[model_type]
    problems = _attention_feature_problems(cfg, name)
    if cfg.qk_norm and cfg.qkv_bias:
        problems.append(f"qkv_bias=True ({name} has q/k norms but no attention biases)")
    if model_type == "mixtral" and cfg.qkv_bias:
        problems.append("qkv_bias=True (Mixtral has no attention biases)")
    if cfg.kind == "moe" and cfg.sliding_window is not None:
        problems.append(
            f"sliding_window={cfg.sliding_window} (meshwork reads a window back from Mistral, "
            f"Qwen2 and Qwen3 checkpoints only, not from {name})"
        )
    if cfg.kind == "moe":
        m = cfg.moe
        problems += [
            why
            for ok, why in [
                (m.router == "softmax", f"moe.router={m.router!r} ({name} routes by softmax top-k)"),
                (
                    m.norm_topk_prob or model_type != "mixtral",
                    "moe.norm_topk_prob=False (Mixtral renormalizes the top-k weights)",
                ),
                (
                    not m.n_shared_experts or model_type == "qwen2_moe",
                    f"moe.n_shared_experts={m.n_shared_experts} ({name} has no shared experts)",
                ),
                (
                    m.n_shared_experts == 1 or model_type != "qwen2_moe",
                    f"moe.n_shared_experts={m.n_shared_experts} (Qwen2-MoE has one gated shared expert)",
                ),
                (
                    not m.shared_expert_gate or model_type == "qwen2_moe",
                    f"moe.shared_expert_gate=True ({name} has no shared expert gate)",
                ),
                (
                    not m.first_dense_layers or model_type != "mixtral",
                    f"moe.first_dense_layers={m.first_dense_layers} (every Mixtral layer is a MoE layer)",
                ),
                (
                    not m.dense_layers or model_type != "mixtral",
                    f"moe.dense_layers={list(m.dense_layers or ())} (every Mixtral layer is a MoE layer)",
                ),
                (
                    m.routed_scaling_factor == 1.0,
                    f"moe.routed_scaling_factor={m.routed_scaling_factor} ({name} does not scale the experts' output)",
                ),
            ]
            if not ok
        ]
        if m.capacity_factor is not None and not allow_dropless:
            problems.append(
                f"{_dropless(m.capacity_factor, name)}; allow_dropless=True, or --allow-dropless, writes it anyway)"
            )
    if problems:
        raise ValueError(f"cannot export to {name}: {'; '.join(problems)}")
    return model_type


def _attention_feature_problems(cfg: ModelConfig, name: str) -> list[str]:
    """The Gemma / gpt-oss settings (models/transformer.py) that a Llama-family checkpoint lacks."""
    checks = [
        (cfg.layer_types is None or len(set(cfg.layer_types)) == 1, "layer_types mixing sliding and full layers"),
        (cfg.local_rope_theta is None, "local_rope_theta"),
        (cfg.attn_logit_softcap is None, "attn_logit_softcap"),
        (cfg.final_logit_softcap is None, "final_logit_softcap"),
        (not cfg.attention_sinks, "attention_sinks"),
        (not cfg.attention_out_bias, "attention_out_bias"),
        (cfg.query_pre_attn_scalar is None, "query_pre_attn_scalar"),
        (not cfg.sandwich_norm, "sandwich_norm"),
        (not cfg.zero_centered_norm, "zero_centered_norm"),
        (not cfg.scale_embeddings, "scale_embeddings"),
        (cfg.mlp_activation == "silu", f"mlp_activation={cfg.mlp_activation!r}"),
    ]
    return [f"{what} ({name} has no such setting)" for ok, what in checks if not ok]


def _deepseek_v3_type(cfg: ModelConfig, allow_dropless: bool) -> str:
    """ "deepseek_v3" for an MLA model DeepSeek-V3's config can express, else ValueError naming each setting."""
    m = cfg.moe
    checks = [
        (not cfg.qkv_bias and not cfg.qk_norm, "qkv_bias/qk_norm (DeepSeek-V3's MLA has neither)"),
        (cfg.sliding_window is None, f"sliding_window={cfg.sliding_window} (DeepSeek-V3 attends to every key)"),
    ]
    if cfg.kind == "moe":
        checks += [
            (m.router == "sigmoid", f"moe.router={m.router!r} (DeepSeek-V3 routes by sigmoid scores)"),
            (not m.dense_layers, f"moe.dense_layers={list(m.dense_layers or ())} (only leading dense layers)"),
            (not m.shared_expert_gate, "moe.shared_expert_gate=True (DeepSeek-V3's shared experts are ungated)"),
            (
                m.d_shared in (None, m.n_shared_experts * m.d_expert),
                f"moe.d_shared={m.d_shared} (DeepSeek-V3's shared experts are n_shared_experts x d_expert wide)",
            ),
            (m.capacity_factor is None or allow_dropless, _dropless(m.capacity_factor or 0, "DeepSeek-V3") + ")"),
            (not m.router_bias and not m.expert_bias, "moe.router_bias/expert_bias (gpt-oss's, not DeepSeek-V3's)"),
            (m.activation == "swiglu", f"moe.activation={m.activation!r} (DeepSeek-V3's experts are SwiGLU)"),
        ]
    checks.append(
        (
            cfg.kind == "moe" or not cfg.mtp.depth,
            f"mtp.depth={cfg.mtp.depth} in a dense model (DeepSeek-V3's MTP layer is a MoE layer)",
        )
    )
    problems = [why for ok, why in checks if not ok]
    if problems:
        raise ValueError(f"cannot export to DeepSeek-V3: {'; '.join(problems)}")
    return "deepseek_v3"


def _deepseek_v3_config(cfg: ModelConfig, c: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's config.json keys beside the common ones of `hf_config` (RoPE rows written interleaved)."""
    m, a = cfg.moe, cfg.mla
    dense = cfg.n_layers if cfg.kind == "transformer" else m.first_dense_layers
    groups = m.n_groups if cfg.kind == "moe" else 1
    return {k: v for k, v in c.items() if k != "head_dim"} | {
        "num_key_value_heads": cfg.n_heads,
        "q_lora_rank": a.q_lora_rank,
        "kv_lora_rank": a.kv_lora_rank,
        "qk_nope_head_dim": a.qk_nope_head_dim,
        "qk_rope_head_dim": a.qk_rope_head_dim,
        "v_head_dim": a.v_head_dim,
        "rope_interleave": True,
        "moe_intermediate_size": m.d_expert,
        "n_routed_experts": m.n_experts,
        "num_experts_per_tok": m.top_k,
        "n_shared_experts": m.n_shared_experts,
        "n_group": groups,
        "topk_group": m.topk_groups if cfg.kind == "moe" else 1,
        "routed_scaling_factor": m.routed_scaling_factor,
        "norm_topk_prob": m.norm_topk_prob,
        "first_k_dense_replace": dense,
        "num_nextn_predict_layers": cfg.mtp.depth,
        "attention_bias": False,
    }


def _dropless(capacity_factor: float, name: str = "Mixtral") -> str:
    return (
        f"moe.capacity_factor={capacity_factor} ({name} is dropless: it computes the tokens this model "
        "drops at capacity, so its outputs differ"
    )


def hf_config(
    cfg: ModelConfig, *, dtype: str = "float32", max_position_embeddings: int = 2048, allow_dropless: bool = False
) -> dict[str, Any]:
    """The config.json dict transformers reads as the model `cfg` describes.

    `max_position_embeddings` is only a declared limit (meshwork's RoPE has
    none): pass the sequence length the model was trained on (`data.seq_len`).

    >>> c = hf_config(ModelConfig())
    >>> c["model_type"], c["architectures"], c["num_key_value_heads"], c["head_dim"]
    ('llama', ['LlamaForCausalLM'], 2, 32)
    """
    model_type = hf_model_type(cfg, allow_dropless=allow_dropless)
    c: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.moe.d_expert if model_type == "mixtral" else cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": max_position_embeddings,
        # Both forms (transformers 5 reads rope_parameters, earlier versions rope_theta/rope_scaling);
        # after max_position_embeddings, which dynamic scaling sets to the original context.
        **rope_to_hf(cfg.rope_theta, cfg.rope_scaling),
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if model_type == "llama":
        return c | {"attention_bias": False, "mlp_bias": False}
    if model_type == "deepseek_v3":
        return _deepseek_v3_config(cfg, c)
    if model_type in GEMMA_TYPES:
        return gemma_hf_config(cfg, model_type, c)
    if model_type == "gpt_oss":
        return gpt_oss_hf_config(cfg, c)
    if model_type == "mistral":
        return c | {"sliding_window": cfg.sliding_window}
    full_attention = {
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": cfg.n_layers,
        "layer_types": ["full_attention"] * cfg.n_layers,
    }
    if cfg.sliding_window is not None:  # Qwen2 / Qwen3: the window in every layer (none is a full one)
        full_attention = {
            "use_sliding_window": True,
            "sliding_window": cfg.sliding_window,
            "max_window_layers": 0,
            "layer_types": ["sliding_attention"] * cfg.n_layers,
        }
    if model_type == "qwen2":
        return c | full_attention
    if model_type == "qwen3":
        return c | full_attention | {"attention_bias": False}
    m = cfg.moe
    step, mlp_only = sparse_step(m.dense_layer_indices(cfg.n_layers), cfg.n_layers)
    qwen_moe = {
        "num_experts": m.n_experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.d_expert,
        "norm_topk_prob": m.norm_topk_prob,
        "decoder_sparse_step": step,
        "mlp_only_layers": mlp_only,
        "router_aux_loss_coef": m.aux_loss_coef,
        "output_router_logits": False,
    }
    if model_type == "qwen3_moe":
        return c | full_attention | qwen_moe | {"attention_bias": False}
    if model_type == "qwen3_next":
        return qwen3_next_hf_config(cfg, c, qwen_moe)
    if model_type == "qwen2_moe":
        return (
            c
            | full_attention
            | qwen_moe
            | {"qkv_bias": cfg.qkv_bias, "shared_expert_intermediate_size": m.d_shared or m.d_expert}
        )
    return c | {
        "num_local_experts": m.n_experts,
        "num_experts_per_tok": m.top_k,
        "router_aux_loss_coef": m.aux_loss_coef,
        "output_router_logits": False,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
    }


def sparse_step(dense: tuple[int, ...], n_layers: int) -> tuple[int, list[int]]:
    """(decoder_sparse_step, mlp_only_layers) under which Qwen2-MoE / Qwen3-MoE make exactly the
    layers `dense` dense: layer i is a MoE layer iff i is not in mlp_only_layers and
    (i + 1) % decoder_sparse_step == 0. The step is the largest that keeps every MoE layer on its
    grid (the gcd of their i + 1); mlp_only_layers lists the dense layers left on the grid.

    >>> sparse_step((0, 2), 4), sparse_step((0,), 3), sparse_step((1,), 3)
    ((2, []), (1, [0]), (1, [1]))
    """
    step = math.gcd(*(i + 1 for i in range(n_layers) if i not in dense))
    return step, [i for i in dense if (i + 1) % step == 0]


def export_hf(
    cfg: ModelConfig,
    model_or_params: nnx.Module | Mapping[str, Any],
    out_dir: str | pathlib.Path,
    *,
    max_position_embeddings: int = 2048,
    allow_dropless: bool = False,
) -> pathlib.Path:
    """Writes `out_dir`/config.json and `out_dir`/model.safetensors; returns `out_dir`.

    `model_or_params`: the meshwork model `cfg` describes, or its parameters
    as `nnx.to_pure_dict(nnx.state(model, nnx.Param))` (numpy or jax arrays,
    sharded ones too). Tensors keep the parameters' dtype (config.json's
    torch_dtype says which). Layers are fetched to the host one at a time, but
    safetensors writes a file from one dict, so host memory peaks at the
    whole model in its dtype (plus one tensor being transposed).

    >>> import tempfile
    >>> from meshwork.models.hf import load_hf_model
    >>> cfg, model = load_hf_model("tests/fixtures/hf/mixtral")
    >>> path = export_hf(cfg, model, tempfile.mkdtemp())
    >>> sorted(p.name for p in path.iterdir()), json.loads((path / "config.json").read_text())["architectures"]
    (['config.json', 'model.safetensors'], ['MixtralForCausalLM'])
    """
    model_type = hf_model_type(cfg, allow_dropless=allow_dropless)
    if cfg.kind == "moe" and cfg.moe.capacity_factor is not None:
        warnings.warn(
            f"exporting {_dropless(cfg.moe.capacity_factor)}, as this model does with capacity_factor null)",
            UserWarning,
            stacklevel=2,
        )
    if isinstance(model_or_params, nnx.Module):
        params = nnx.to_pure_dict(nnx.state(model_or_params, nnx.Param))
        buffers = nnx.to_pure_dict(nnx.state(model_or_params, RouterBias))
    else:
        params, buffers = as_pure_dict(model_or_params), None
    layout, buffers_layout = split_buffers(hf_layout(cfg, model_type))
    check_tree(layout_shapes(layout), params)
    if buffers_layout and buffers is None:
        warnings.warn(
            "exporting DeepSeek-V3 from parameters alone: the experts' selection biases are model buffers, "
            "not parameters, and are written as zeros; pass the model to export its own",
            UserWarning,
            stacklevel=2,
        )
        buffers = jax.tree.map(lambda s: np.zeros(s.shape, np.float32), layout_shapes(buffers_layout))
    dtype = np.dtype(params["embed"]["table"].dtype)
    if dtype not in HF_DTYPE_NAMES:
        raise ValueError(
            f"parameters of dtype {dtype} have no Hugging Face torch_dtype; cast them to one of "
            f"{', '.join(HF_DTYPE_NAMES.values())}"
        )

    tensors: dict[str, np.ndarray] = {}
    for tree, values in ((layout, params), (buffers_layout, buffers)):
        for key, part in tree.items():
            for i, layer in enumerate(part) if isinstance(part, list) else [(None, part)]:
                jax.tree.map(
                    lambda spec, x: spec.write_into(tensors, np.asarray(x if i is None else x[i])), layer, values[key]
                )
    for copy, source in mtp_shared_copies(cfg).items():  # DeepSeek's MTP layers store the shared tensors again
        tensors[copy] = tensors[source]

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stale = sorted(
        p.name
        for p in out.iterdir()
        if p.name != "model.safetensors" and (p.suffix == ".safetensors" or p.name == "model.safetensors.index.json")
    )
    if stale:
        raise ValueError(
            f"{out} already holds {stale}, which a loader would read with the export; export into an empty directory"
        )
    (out / "config.json").write_text(
        json.dumps(
            hf_config(
                cfg,
                dtype=HF_DTYPE_NAMES[dtype],
                max_position_embeddings=max_position_embeddings,
                allow_dropless=allow_dropless,
            ),
            indent=2,
        )
        + "\n"
    )
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})  # transformers wants "pt"
    return out
