"""OpenAI's gpt-oss ("gpt_oss") checkpoints: config, layout and export.

What sets it apart from Mixtral, each a ModelConfig / MoEConfig field (models/transformer.py,
models/layers/moe.py):

- attention: biases on q, k, v and o (`attention_bias`: `qkv_bias` and `attention_out_bias`), one
  learned sink logit per head in every softmax's denominator (`attention_sinks`), sliding-window and
  full layers alternating (`layer_types`, window 128), head_dim 64 whatever hidden_size / heads,
  YaRN RoPE by default (factor 32 over 4096 positions, `truncate` false: an unrounded ramp);
- a MoE in every layer: the router is a linear layer with a bias (`router_bias`) whose top-k logits
  are softmaxed (Mixtral's renormalized top-k); each expert has biases (`expert_bias`) and a clamped
  SwiGLU, (clip(up) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit) (`clamped_swiglu`);
- the experts stored stacked, gate and up fused with gate at the even columns and up at the odd
  ones: `gate_up_proj` (E, D, 2F), `gate_up_proj_bias` (E, 2F), `down_proj` (E, F, D),
  `down_proj_bias` (E, D) (models/hf/gpt_oss_experts.py); the layout reads each of gate and up as
  columns of the one file tensor (`HFTensor.columns`) and writes them back interleaved.

Refused by name: a `quantization_config` (the released checkpoints store the experts as MXFP4
blocks and scales; dequantize to bf16 first), layer types other than full and sliding, sliding
layers without a window, per-layer RoPE. Ignored: `hidden_act` (no gpt-oss module reads it),
dropout, `router_aux_loss_coef` unless `output_router_logits` (transformers adds the aux loss
only then).
"""

from __future__ import annotations

from typing import Any

from meshwork.config_sections import ModelConfig, MoEConfig
from meshwork.models.hf.rope import rope_from_hf

GPT_OSS_TYPES = ("gpt_oss",)
GPT_OSS_DEFAULTS = {"gpt_oss": (1e-5, 150000.0)}
# transformers' GptOssConfig when config.json has neither rope_parameters nor rope_scaling.
YARN_DEFAULT = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
DEQUANTIZE = (
    "meshwork reads bfloat16/float32 weights: dequantize to bf16 first, e.g. "
    "AutoModelForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True), "
    "dtype=torch.bfloat16).save_pretrained(out_dir) with transformers"
)


def gpt_oss_config(c: dict[str, Any], need, refuse) -> ModelConfig:
    """The ModelConfig of a gpt_oss config.json dict, with transformers' GptOssConfig defaults for
    the keys it omits (`need`, `refuse`: the caller's one-line errors naming the key).

    >>> from meshwork.models.hf.config import config_from_hf
    >>> cfg = config_from_hf({"model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
    ...     "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
    ...     "num_local_experts": 32, "num_experts_per_tok": 4})
    >>> cfg.n_kv_heads, cfg.head_dim, cfg.sliding_window, cfg.layer_types[:2], cfg.rope_scaling["factor"]
    (8, 64, 128, ['sliding_attention', 'full_attention'], 32.0)
    """
    quant = c.get("quantization_config")
    refuse(
        "quantization_config",
        not quant,
        f"the weights are {(quant or {}).get('quant_method', 'quantized')}-quantized (the released gpt-oss "
        f"experts are MXFP4 *_blocks and *_scales); {DEQUANTIZE}",
    )
    D, L, H = need("hidden_size"), need("num_hidden_layers"), need("num_attention_heads")
    G = c.get("num_key_value_heads", 8)
    refuse("num_key_value_heads", isinstance(G, int) and G > 0 and H % G == 0, f"must divide num_attention_heads={H}")
    K = c.get("head_dim", 64)
    refuse("head_dim", isinstance(K, int) and K > 0 and K % 2 == 0, "RoPE needs a positive, even head_dim")
    types = c.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]
    refuse("layer_types", len(types) == L, f"needs one entry per layer ({L})")
    refuse(
        "layer_types",
        set(types) <= {"full_attention", "sliding_attention"},
        "meshwork reads full_attention and sliding_attention layers",
    )
    window = c.get("sliding_window", 128) if "sliding_attention" in types else None
    refuse(
        "sliding_window",
        window is not None or "sliding_attention" not in types,
        "layer_types has sliding_attention layers, which need a window",
    )
    if not c.get("rope_scaling") and not c.get("rope_parameters"):
        c = c | {"rope_parameters": YARN_DEFAULT}
    theta, scaling = rope_from_hf(c, "gpt_oss", GPT_OSS_DEFAULTS["gpt_oss"][1])
    E = c.get("num_local_experts", c.get("num_experts"))
    if E is None:
        need("num_local_experts")
    k = need("num_experts_per_tok")
    refuse("num_experts_per_tok", 0 < k <= E, f"must be between 1 and num_local_experts={E}")
    for key, default in (("swiglu_limit", 7.0), ("swiglu_alpha", 1.702)):
        refuse(key, c.get(key, default) > 0, "must be positive")
    bias = bool(c.get("attention_bias", True))
    moe = MoEConfig(
        n_experts=E,
        top_k=k,
        d_expert=need("intermediate_size"),
        router="softmax",
        norm_topk_prob=True,  # softmax over the top-k logits
        router_bias=True,
        expert_bias=True,
        activation="clamped_swiglu",
        swiglu_limit=float(c.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(c.get("swiglu_alpha", 1.702)),
        # transformers' aux loss is k x meshwork's (its expert fractions sum to k, meshwork's to 1) and
        # is added only with output_router_logits; gpt-oss has no z-loss.
        aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)) * k if c.get("output_router_logits") else 0.0,
        z_loss_coef=0.0,
    )
    return ModelConfig(
        kind="moe",
        vocab_size=need("vocab_size"),
        d_model=D,
        n_layers=L,
        n_heads=H,
        n_kv_heads=G,
        head_dim=K,
        d_ff=need("intermediate_size"),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=c.get("rms_norm_eps") or GPT_OSS_DEFAULTS["gpt_oss"][0],
        qkv_bias=bias,
        attention_out_bias=bias,
        attention_sinks=True,
        sliding_window=window,
        layer_types=None if set(types) == {"full_attention"} else list(types),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        init_std=c.get("initializer_range", 0.02),
        moe=moe,
    )


def is_gpt_oss(cfg: ModelConfig) -> bool:
    """Whether a model has one of gpt-oss's marks: a MoE with attention sinks, router or expert
    biases, or the clamped SwiGLU (then it exports as gpt-oss or not at all)."""
    m = cfg.moe
    return cfg.kind == "moe" and (
        cfg.attention_sinks or m.router_bias or m.expert_bias or m.activation == "clamped_swiglu"
    )


def gpt_oss_problems(cfg: ModelConfig) -> list[str]:
    """The settings of `cfg` (a MoE model) that a gpt-oss checkpoint cannot express (the capacity
    factor aside: the caller decides on dropless export)."""
    m = cfg.moe
    checks = [
        (cfg.attention_sinks, "attention_sinks=False (every gpt-oss attention has sinks)"),
        (
            cfg.qkv_bias == cfg.attention_out_bias,
            f"qkv_bias={cfg.qkv_bias} with attention_out_bias={cfg.attention_out_bias} "
            "(gpt-oss's attention_bias biases q, k, v and o together)",
        ),
        (not cfg.qk_norm, "qk_norm=True (gpt-oss has no q/k norms)"),
        (cfg.local_rope_theta is None, "local_rope_theta (gpt-oss has one RoPE)"),
        (cfg.attn_logit_softcap is None, "attn_logit_softcap (gpt-oss does not soft-cap)"),
        (cfg.final_logit_softcap is None, "final_logit_softcap (gpt-oss does not soft-cap)"),
        (cfg.query_pre_attn_scalar is None, "query_pre_attn_scalar (gpt-oss scales scores by head_dim ** -0.5)"),
        (not cfg.sandwich_norm, "sandwich_norm (gpt-oss norms only the sublayers' inputs)"),
        (not cfg.zero_centered_norm, "zero_centered_norm (gpt-oss's norms scale by the weight)"),
        (not cfg.scale_embeddings, "scale_embeddings (gpt-oss does not scale embeddings)"),
        (not m.dense_layer_indices(cfg.n_layers), "dense layers (every gpt-oss layer is a MoE layer)"),
        (m.router == "softmax", f"moe.router={m.router!r} (gpt-oss routes by softmax top-k)"),
        (m.norm_topk_prob, "moe.norm_topk_prob=False (gpt-oss softmaxes the top-k logits)"),
        (m.router_bias, "moe.router_bias=False (gpt-oss's router has a bias)"),
        (m.expert_bias, "moe.expert_bias=False (gpt-oss's experts have biases)"),
        (m.activation == "clamped_swiglu", f"moe.activation={m.activation!r} (gpt-oss's experts clamp)"),
        (not m.n_shared_experts, f"moe.n_shared_experts={m.n_shared_experts} (gpt-oss has none)"),
        (m.routed_scaling_factor == 1.0, f"moe.routed_scaling_factor={m.routed_scaling_factor} (gpt-oss has none)"),
    ]
    return [why for ok, why in checks if not ok]


def gpt_oss_hf_config(cfg: ModelConfig, c: dict[str, Any]) -> dict[str, Any]:
    """The config.json of a gpt-oss model: `c` (the keys every model shares) with gpt-oss's own."""
    m = cfg.moe
    return c | {
        "intermediate_size": m.d_expert,
        "num_local_experts": m.n_experts,
        "num_experts_per_tok": m.top_k,
        "swiglu_limit": m.swiglu_limit,
        "swiglu_alpha": m.swiglu_alpha,
        "attention_bias": cfg.qkv_bias,
        "sliding_window": cfg.sliding_window,
        "layer_types": cfg.attention_kinds,
        "router_aux_loss_coef": m.aux_loss_coef / m.top_k,
        "output_router_logits": m.aux_loss_coef > 0,
    }


def gpt_oss_moe(cfg: ModelConfig, q: str, tensor) -> dict[str, Any]:
    """One layer's MoE tensors, under `q` ("model.layers.{i}.mlp."; `tensor`: layout.py's HFTensor):
    the names of gpt_oss_experts.HF_NAMES, gate and up as columns of the fused tensors."""
    m, D = cfg.moe, cfg.d_model
    E, F = m.n_experts, m.d_expert
    gate_up, gate_up_bias = q + "experts.gate_up_proj", q + "experts.gate_up_proj_bias"
    return {
        "router": tensor(q + "router.weight", (D, E), (E, D), linear=True),
        "b_router": tensor(q + "router.bias", (E,), (E,)),
        "w_gate": tensor(gate_up, (E, D, F), (E, D, 2 * F), columns=(0, 2)),
        "w_up": tensor(gate_up, (E, D, F), (E, D, 2 * F), columns=(1, 2)),
        "b_gate": tensor(gate_up_bias, (E, F), (E, 2 * F), columns=(0, 2)),
        "b_up": tensor(gate_up_bias, (E, F), (E, 2 * F), columns=(1, 2)),
        "w_down": tensor(q + "experts.down_proj", (E, F, D), (E, F, D)),
        "b_down": tensor(q + "experts.down_proj_bias", (E, D), (E, D)),
    }
