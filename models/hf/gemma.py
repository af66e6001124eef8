"""Gemma 2 ("gemma2") and Gemma 3's text model ("gemma3_text") checkpoints: config and layout.

What sets them apart from Llama, each a ModelConfig field (models/transformer.py): GeGLU with
tanh-approximated gelu, zero-centered RMSNorms (scale 1 + weight), sandwich norms (the attention's
and the MLP's outputs normed before the residual adds), embeddings scaled by sqrt(hidden_size),
scores scaled by query_pre_attn_scalar ** -0.5, sliding-window and full layers interleaved
(`layer_types`), tied embeddings; Gemma 2 also soft-caps attention scores and final logits; Gemma 3
norms each head's q and k and gives the sliding layers their own RoPE base.
"""

from __future__ import annotations

from typing import Any

from meshwork.config_sections import ModelConfig
from meshwork.models.hf.rope import rope_from_hf, rope_to_hf

GEMMA_TYPES = ("gemma2", "gemma3_text")
GEMMA_DEFAULTS = {"gemma2": (1e-6, 10000.0), "gemma3_text": (1e-6, 1_000_000.0)}


def gemma_config(c: dict[str, Any], need, refuse) -> ModelConfig:
    """The ModelConfig of a gemma2 / gemma3_text config.json dict (`need`, `refuse`: the caller's
    one-line errors naming the key)."""
    kind = c["model_type"]
    refuse(
        "hidden_activation",
        c.get("hidden_activation", "gelu_pytorch_tanh") in ("gelu_pytorch_tanh", "gelu_tanh"),
        "meshwork's Gemma MLP is GeGLU with tanh-approximated gelu",
    )
    refuse("attention_bias", not c.get("attention_bias", False), "meshwork's Gemma attention has no biases")
    refuse(
        "use_bidirectional_attention",
        not c.get("use_bidirectional_attention", False),
        "meshwork's decoder attends causally",
    )
    L, H = need("num_hidden_layers"), need("num_attention_heads")
    G = c.get("num_key_value_heads") or H
    refuse("num_key_value_heads", H % G == 0, f"must divide num_attention_heads={H}")
    types = c.get("layer_types") or _default_layer_types(kind, c, L)
    refuse("layer_types", len(types) == L, f"needs one entry per layer ({L})")
    refuse(
        "layer_types",
        set(types) <= {"full_attention", "sliding_attention"},
        "meshwork reads full_attention and sliding_attention layers",
    )
    window = c.get("sliding_window") if "sliding_attention" in types else None
    refuse("sliding_window", window is not None or "sliding_attention" not in types, "sliding layers need a window")
    default_theta = GEMMA_DEFAULTS[kind][1]
    params = c.get("rope_parameters") or {}
    local_theta = local_scaling = None
    if kind == "gemma3_text" and "full_attention" in params:  # transformers 5: one RoPE per layer type
        theta, scaling = rope_from_hf({"rope_parameters": params["full_attention"]}, kind, default_theta)
        local_theta, local_scaling = rope_from_hf({"rope_parameters": params["sliding_attention"]}, kind, 10000.0)
    else:
        theta, scaling = rope_from_hf(c, kind, default_theta)
        if kind == "gemma3_text":  # the older form: rope_local_base_freq beside rope_theta/rope_scaling
            local_theta = c.get("rope_local_base_freq", 10000.0)
    if (local_theta, local_scaling) == (theta, scaling):
        local_theta = local_scaling = None
    return ModelConfig(
        kind="transformer",
        vocab_size=need("vocab_size"),
        d_model=need("hidden_size"),
        n_layers=L,
        n_heads=H,
        n_kv_heads=G,
        head_dim=c.get("head_dim") or 256,
        d_ff=need("intermediate_size"),
        rope_theta=theta,
        rope_scaling=scaling,
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
        norm_eps=c.get("rms_norm_eps") or GEMMA_DEFAULTS[kind][0],
        qk_norm=kind == "gemma3_text",
        sliding_window=window,
        layer_types=None if set(types) == {"full_attention"} else list(types),
        attn_logit_softcap=c.get("attn_logit_softcapping"),
        final_logit_softcap=c.get("final_logit_softcapping"),
        query_pre_attn_scalar=c.get("query_pre_attn_scalar") or 256,
        sandwich_norm=True,
        zero_centered_norm=True,
        scale_embeddings=True,
        mlp_activation="gelu_tanh",
        tie_embeddings=bool(c.get("tie_word_embeddings", True)),
        init_std=c.get("initializer_range", 0.02),
    )


def _default_layer_types(kind: str, c: dict[str, Any], n_layers: int) -> list[str]:
    """transformers' layer_types when config.json has none: Gemma 2 alternates sliding and full
    layers (sliding first); Gemma 3 makes every `sliding_window_pattern`-th layer full (6)."""
    if kind == "gemma2":
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
    every = c.get("sliding_window_pattern", 6)
    return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]


def gemma_type(cfg: ModelConfig) -> str | None:
    """ "gemma2" or "gemma3_text" for a model with Gemma's marks (sandwich norms), else None."""
    if not cfg.sandwich_norm:
        return None
    return "gemma3_text" if cfg.qk_norm else "gemma2"


def gemma_problems(cfg: ModelConfig, model_type: str) -> list[str]:
    """The settings of `cfg` a `model_type` checkpoint cannot express."""
    name = {"gemma2": "Gemma 2", "gemma3_text": "Gemma 3"}[model_type]
    checks = [
        (cfg.kind == "transformer", f"kind={cfg.kind!r} ({name} is dense)"),
        (cfg.zero_centered_norm, f"zero_centered_norm=False ({name}'s norms scale by 1 + weight)"),
        (cfg.scale_embeddings, f"scale_embeddings=False ({name} scales embeddings by sqrt(hidden_size))"),
        (cfg.mlp_activation == "gelu_tanh", f"mlp_activation={cfg.mlp_activation!r} ({name}'s MLP is GeGLU)"),
        (not cfg.qkv_bias and not cfg.attention_out_bias, f"attention biases ({name} has none)"),
        (not cfg.attention_sinks, f"attention_sinks=True ({name} has none)"),
        (model_type == "gemma3_text" or cfg.local_rope_theta is None, "local_rope_theta (Gemma 2 has one RoPE)"),
    ]
    return [why for ok, why in checks if not ok]


def gemma_hf_config(cfg: ModelConfig, model_type: str, c: dict[str, Any]) -> dict[str, Any]:
    """The config.json of a Gemma model: `c` (the keys every model shares) with Gemma's own."""
    kinds = cfg.attention_kinds
    c = c | {
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.resolved_head_dim,
        "sliding_window": cfg.sliding_window,
        "layer_types": kinds,
        "attn_logit_softcapping": cfg.attn_logit_softcap,
        "final_logit_softcapping": cfg.final_logit_softcap,
        "attention_bias": False,
    }
    if model_type == "gemma3_text":
        local = rope_to_hf(
            cfg.local_rope_theta or cfg.rope_theta, cfg.local_rope_scaling if cfg.local_rope_theta else cfg.rope_scaling
        )
        full = rope_to_hf(cfg.rope_theta, cfg.rope_scaling)
        for key in ("rope_theta", "rope_scaling"):
            c.pop(key, None)
        c["rope_parameters"] = {
            "full_attention": full["rope_parameters"],
            "sliding_attention": local["rope_parameters"],
        }
        c["use_bidirectional_attention"] = False
    return c


def gemma_layer(cfg: ModelConfig, i: int, vector, attention) -> dict[str, Any]:
    """Layer i's tensors (`vector`, `attention`: layout.py's builders of a norm vector and of the
    attention projections)."""
    p, D = f"model.layers.{i}.", cfg.d_model
    norm = lambda name: {"scale": vector(p + name + ".weight", (D,))}  # noqa: E731
    return {
        "attn_norm": norm("input_layernorm"),
        "attn": attention(cfg, p + "self_attn."),
        "attn_out_norm": norm("post_attention_layernorm"),
        "mlp_norm": norm("pre_feedforward_layernorm"),
        "mlp_out_norm": norm("post_feedforward_layernorm"),
    }
