"""FLOPs per token of a decoder LM, as in the PaLM paper (Chowdhery et al., 2022, App. B).

Training costs 6 FLOPs per parameter per token (2 forward, 4 backward) plus the
attention score and value matmuls, 12 * n_layers * n_heads * head_dim * seq_len
(forward and backward; without causal savings, as PaLM counts them). Remat's
recomputation is not counted: MFU measures useful work only.
"""

from __future__ import annotations

from meshwork.config import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul for every token.

    The input embedding is a lookup (no FLOPs) unless it doubles as the output
    projection; norm scales are negligible and left out.
    """
    D, F, V, K = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.resolved_head_dim
    attn = D * K * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    mlp = 3 * D * F
    return cfg.n_layers * (attn + mlp) + D * V


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.resolved_head_dim * seq_len
    return 6 * matmul_params(cfg) + attention
