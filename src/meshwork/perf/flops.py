"""Parameter counts and FLOPs per token of a decoder LM, from the config alone.

FLOPs follow the PaLM paper (Chowdhery et al., 2022, App. B): training costs
6 FLOPs per parameter a token passes through (2 forward, 4 backward) plus the
attention score and value matmuls, 12 * n_layers * n_heads * head_dim *
seq_len (forward and backward, without causal savings, as PaLM counts them).
For a Mixture of Experts only the activated parameters count: the router,
the k chosen experts and the shared experts. Remat's recomputation is not
counted: MFU measures useful work only.

    >>> from meshwork.config_sections import ModelConfig
    >>> counts = param_counts(ModelConfig())
    >>> counts["total"] == counts["activated"]   # dense: every token uses every weight
    True
"""

from __future__ import annotations

from meshwork.config_sections import ModelConfig


def gqa_attention_params(d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, qkv_bias: bool = False) -> int:
    """q, k, v, o projections of grouped-query attention."""
    bias = (n_heads + 2 * n_kv_heads) * head_dim if qkv_bias else 0
    return d_model * head_dim * (2 * n_heads + 2 * n_kv_heads) + bias


def mla_attention_params(
    d_model: int,
    n_heads: int,
    q_lora_rank: int,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
) -> int:
    """DeepSeek-V2/V3 multi-head latent attention: low-rank q and joint kv projections
    (with their RMSNorms), a decoupled RoPE key shared by all heads, and the output."""
    qk_head = qk_nope_head_dim + qk_rope_head_dim
    q = d_model * q_lora_rank + q_lora_rank + q_lora_rank * n_heads * qk_head
    kv = (
        d_model * (kv_lora_rank + qk_rope_head_dim)
        + kv_lora_rank
        + kv_lora_rank * n_heads * (qk_nope_head_dim + v_head_dim)
    )
    return q + kv + n_heads * v_head_dim * d_model


def lm_param_counts(
    *,
    vocab_size: int,
    d_model: int,
    n_layers: int,
    attention: int,
    d_ff: int,
    tie_embeddings: bool,
    n_moe_layers: int = 0,
    n_experts: int = 0,
    top_k: int = 0,
    d_expert: int = 0,
    d_shared: int = 0,
    shared_gate: bool = False,
) -> dict[str, int]:
    """{"total", "activated"} parameters of a decoder LM of which `n_moe_layers` layers
    (whichever they are) are Mixture-of-Experts (SwiGLU experts: 3 matrices each).

    "activated" counts what one token passes through, embedding table included
    (the convention of the DeepSeek and Mixtral reports).
    """
    D = d_model
    norms = 2 * D
    dense_layer = attention + 3 * D * d_ff + norms
    router = D * n_experts
    shared = 3 * D * d_shared + (D if shared_gate else 0)
    moe_total = attention + router + n_experts * 3 * D * d_expert + shared + norms
    moe_active = attention + router + top_k * 3 * D * d_expert + shared + norms
    embeddings = vocab_size * D * (1 if tie_embeddings else 2) + D  # + final norm
    n_dense = n_layers - n_moe_layers
    return {
        "total": n_dense * dense_layer + n_moe_layers * moe_total + embeddings,
        "activated": n_dense * dense_layer + n_moe_layers * moe_active + embeddings,
    }


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Total and per-token activated parameters of meshwork's model for `cfg`."""
    attention = gqa_attention_params(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim, cfg.qkv_bias)
    kw = dict(
        vocab_size=cfg.vocab_size,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        attention=attention,
        d_ff=cfg.d_ff,
        tie_embeddings=cfg.tie_embeddings,
    )
    if cfg.kind != "moe":
        return lm_param_counts(**kw)
    m = cfg.moe
    return lm_param_counts(
        **kw,
        n_moe_layers=m.n_moe_layers(cfg.n_layers),
        n_experts=m.n_experts,
        top_k=m.top_k,
        d_expert=m.d_expert,
        d_shared=(m.d_shared or m.n_shared_experts * m.d_expert) if m.n_shared_experts else 0,
        shared_gate=m.shared_expert_gate and m.n_shared_experts > 0,
    )


def matmul_params(cfg: ModelConfig) -> int:
    """Activated parameters that take part in a matmul for every token.

    The input embedding is a lookup (no FLOPs) unless it doubles as the output
    projection; norm scales are negligible and left out.
    """
    norms = 2 * cfg.d_model * cfg.n_layers + cfg.d_model
    lookup = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    return param_counts(cfg)["activated"] - norms - lookup


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.resolved_head_dim * seq_len
    return 6 * matmul_params(cfg) + attention
