"""Qwen3-Next ("qwen3_next") checkpoints: config and layout.

A hybrid of Gated DeltaNet layers (models/layers/gated_deltanet.py; `linear_attention` in
`layer_types`, 3 of every 4 in the released models) and gated full-attention layers (q_proj makes a
query and an output gate per head, q/k norms, RoPE on the first partial_rotary_factor of each head),
with Qwen2-MoE's routed experts beside a sigmoid-gated shared expert, and zero-centered RMSNorms
(scale 1 + weight) everywhere but inside the DeltaNet.
"""

from __future__ import annotations

from typing import Any

from meshwork.config_sections import ModelConfig, MoEConfig
from meshwork.models.hf.rope import rope_from_hf
from meshwork.models.layers.gated_deltanet import linear_attention_from_hf

QWEN3_NEXT_DEFAULTS = (1e-6, 10000.0)


def qwen3_next_config(c: dict[str, Any], need, refuse, dense_layers) -> ModelConfig:
    """The ModelConfig of a qwen3_next config.json dict (`need`, `refuse`: the caller's one-line errors
    naming the key; `dense_layers(c, n_layers)`: Qwen2-MoE's rule for the layers without experts)."""
    refuse("hidden_act", c.get("hidden_act", "silu") == "silu", "meshwork's MLP is SwiGLU (silu) only")
    refuse("attention_bias", not c.get("attention_bias", False), "meshwork's gated attention has no biases")
    L, H = need("num_hidden_layers"), need("num_attention_heads")
    G = c.get("num_key_value_heads") or H
    refuse("num_key_value_heads", H % G == 0, f"must divide num_attention_heads={H}")
    every = c.get("full_attention_interval", 4)
    types = c.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(L)]
    refuse("layer_types", len(types) == L, f"needs one entry per layer ({L})")
    refuse(
        "layer_types",
        set(types) <= {"linear_attention", "full_attention"},
        "meshwork reads linear_attention and full_attention layers",
    )
    params = dict(c.get("rope_parameters") or {})
    partial = float(params.pop("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)))
    theta, scaling = rope_from_hf(
        {**c, "rope_parameters": params or None, "partial_rotary_factor": 1.0}, "qwen3_next", 1e4
    )
    head_dim = c.get("head_dim") or c["hidden_size"] // H
    refuse("partial_rotary_factor", int(head_dim * partial) % 2 == 0, "RoPE rotates pairs of dims")
    dense = dense_layers(c, L)
    E, k = need("num_experts"), need("num_experts_per_tok")
    refuse("num_experts", len(dense) < L, "a Qwen3-Next with no expert layer is not read (meshwork's hybrid is a MoE)")
    refuse("num_experts_per_tok", 0 < k <= E, f"must be between 1 and num_experts={E}")
    d_shared = c.get("shared_expert_intermediate_size") or 0
    moe = MoEConfig(
        n_experts=E,
        top_k=k,
        d_expert=need("moe_intermediate_size"),
        router="softmax",
        norm_topk_prob=bool(c.get("norm_topk_prob", True)),
        aux_loss_coef=c.get("router_aux_loss_coef", 0.001),
        z_loss_coef=0.0,
        dense_layers=tuple(dense) or None,
        **(dict(n_shared_experts=1, d_shared=d_shared, shared_expert_gate=True) if d_shared else {}),
    )
    for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"):
        need(key)
    linear = linear_attention_from_hf(c)
    return ModelConfig(
        kind="moe",
        vocab_size=need("vocab_size"),
        d_model=need("hidden_size"),
        n_layers=L,
        n_heads=H,
        n_kv_heads=G,
        head_dim=head_dim,
        d_ff=need("intermediate_size"),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=partial,
        norm_eps=c.get("rms_norm_eps") or QWEN3_NEXT_DEFAULTS[0],
        qk_norm=True,
        zero_centered_norm=True,
        attention_output_gate=True,
        layer_types=list(types),
        linear_attention=linear,
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        init_std=c.get("initializer_range", 0.02),
        moe=moe,
    )


def is_qwen3_next(cfg: ModelConfig) -> bool:
    return bool(cfg.linear_layers)


def qwen3_next_problems(cfg: ModelConfig) -> list[str]:
    """The settings of `cfg` a Qwen3-Next checkpoint cannot express."""
    m = cfg.moe
    checks = [
        (cfg.kind == "moe", f"kind={cfg.kind!r} (Qwen3-Next is a MoE)"),
        (cfg.zero_centered_norm, "zero_centered_norm=False (Qwen3-Next's norms scale by 1 + weight)"),
        (cfg.qk_norm and cfg.attention_output_gate, "qk_norm and attention_output_gate (Qwen3-Next has both)"),
        (set(cfg.attention_kinds) <= {"linear_attention", "full_attention"}, "sliding_attention layers"),
        (
            not (cfg.qkv_bias or cfg.attention_out_bias or cfg.attention_sinks or cfg.attn_logit_softcap),
            "attention biases, sinks or soft-capping",
        ),
        (m.router == "softmax", f"moe.router={m.router!r} (softmax top-k)"),
        (
            m.n_shared_experts <= 1 and (m.shared_expert_gate or not m.n_shared_experts),
            "shared experts other than one gated one",
        ),
        (m.routed_scaling_factor == 1.0, "moe.routed_scaling_factor"),
        (not (m.router_bias or m.expert_bias) and m.activation == "swiglu", "gpt-oss's MoE settings"),
    ]
    return [why for ok, why in checks if not ok]


def qwen3_next_hf_config(cfg: ModelConfig, c: dict[str, Any], moe_keys: dict[str, Any]) -> dict[str, Any]:
    """config.json of a Qwen3-Next: `c` (the keys every model shares), `moe_keys` (Qwen2-MoE's), and its own."""
    la, params = cfg.linear_attention, dict(c["rope_parameters"])
    params["partial_rotary_factor"] = cfg.partial_rotary_factor
    return (
        c
        | moe_keys
        | {
            "rope_parameters": params,
            "partial_rotary_factor": cfg.partial_rotary_factor,
            "attention_bias": False,
            "layer_types": cfg.attention_kinds,
            "linear_num_key_heads": la.num_k_heads,
            "linear_num_value_heads": la.num_v_heads,
            "linear_key_head_dim": la.head_k_dim,
            "linear_value_head_dim": la.head_v_dim,
            "linear_conv_kernel_dim": la.conv_kernel,
            "shared_expert_intermediate_size": cfg.moe.d_shared or cfg.moe.d_expert if cfg.moe.n_shared_experts else 0,
        }
    )


def linear_attention_tensors(cfg: ModelConfig, a: str, linear, vector, tensor) -> dict[str, Any]:
    """A Gated DeltaNet layer's tensors under prefix `a` (`model.layers.N.linear_attn.`); `linear`,
    `vector`, `tensor`: layout.py's builders of a Linear weight, a vector and an HFTensor."""
    la, D = cfg.linear_attention, cfg.d_model
    G, H, Kk, Kv, W = la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim, la.conv_kernel
    R, channels = H // G, 2 * G * Kk + H * Kv
    return {
        "w_qkvz": linear(a + "in_proj_qkvz.weight", G * (2 * Kk + 2 * R * Kv), D, (D, G, 2 * Kk + 2 * R * Kv)),
        "w_ba": linear(a + "in_proj_ba.weight", G * 2 * R, D, (D, G, 2 * R)),
        # (channels, 1, W) in the file, (W, channels) here: a transpose, as a Linear's.
        "conv": tensor(a + "conv1d.weight", (W, channels), (channels, 1, W), linear=True),
        "A_log": vector(a + "A_log", (H,)),
        "dt_bias": vector(a + "dt_bias", (H,)),
        "norm": {"scale": vector(a + "norm.weight", (Kv,))},
        "wo": linear(a + "out_proj.weight", D, H * Kv, (H, Kv, D)),
    }
