"""Parameter counts and FLOPs per token of a decoder LM, from the config alone.

FLOPs follow the PaLM paper (Chowdhery et al., 2022, App. B): training costs
6 FLOPs per parameter a token passes through (2 forward, 4 backward) plus the
attention score and value matmuls, 12 * n_layers * n_heads * head_dim *
seq_len (forward and backward, without causal savings, as PaLM counts them).
For a Mixture of Experts only the activated parameters count: the router,
the k chosen experts and the shared experts. Remat's recomputation is not
counted: MFU measures useful work only.

Multi-head latent attention (`model.mla`, models/layers/mla.py) counts its own
projections (`mla_attention_params`) and, in the attention term, scores over
qk_nope + qk_rope dims and values over v_head_dim dims: 6 * n_heads * (Dq + Dv)
* seq_len per layer and token (the PaLM term with head_dim = (Dq + Dv) / 2).
Training runs the expanded form, whose values are zero-padded to the key width
when v_head_dim < Dq: those FLOPs are `mla_padding_flops_per_token`, not useful
work. Multi-token prediction (`model.mtp`, models/mtp.py) adds, per depth, a
module (two norms, a 2D -> D projection, one block, an output norm) and one
more pass through the shared head: `mtp_param_counts`.

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
    q_lora_rank: int | None,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
) -> int:
    """DeepSeek-V2/V3 multi-head latent attention: low-rank q and joint kv projections
    (with their RMSNorms), a decoupled RoPE key shared by all heads, and the output.
    `q_lora_rank` None (or 0): a full (D, H, Dn + Dr) query projection, as DeepSeek-V2-Lite."""
    qk_head = qk_nope_head_dim + qk_rope_head_dim
    if q_lora_rank:
        q = d_model * q_lora_rank + q_lora_rank + q_lora_rank * n_heads * qk_head
    else:
        q = d_model * n_heads * qk_head
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
    router_bias: bool = False,
    expert_bias: bool = False,
) -> dict[str, int]:
    """{"total", "activated"} parameters of a decoder LM of which `n_moe_layers` layers
    (whichever they are) are Mixture-of-Experts (SwiGLU experts: 3 matrices each, and with
    `expert_bias` their biases, 2 d_expert + d_model; `router_bias`: E more in the router: gpt-oss).

    "activated" counts what one token passes through, embedding table included
    (the convention of the DeepSeek and Mixtral reports).
    """
    D = d_model
    norms = 2 * D
    dense_layer = attention + 3 * D * d_ff + norms
    router = D * n_experts + (n_experts if router_bias else 0)
    shared = 3 * D * d_shared + (D if shared_gate else 0)
    expert = 3 * D * d_expert + ((2 * d_expert + D) if expert_bias else 0)
    moe_total = attention + router + n_experts * expert + shared + norms
    moe_active = attention + router + top_k * expert + shared + norms
    embeddings = vocab_size * D * (1 if tie_embeddings else 2) + D  # + final norm
    n_dense = n_layers - n_moe_layers
    return {
        "total": n_dense * dense_layer + n_moe_layers * moe_total + embeddings,
        "activated": n_dense * dense_layer + n_moe_layers * moe_active + embeddings,
    }


def attention_params(cfg: ModelConfig) -> int:
    """Parameters of one layer's attention: MLA's when `cfg.mla` is set, else grouped-query attention's."""
    if cfg.mla is not None:
        a = cfg.mla
        return mla_attention_params(
            cfg.d_model,
            cfg.n_heads,
            a.q_lora_rank,
            a.kv_lora_rank,
            a.qk_nope_head_dim,
            a.qk_rope_head_dim,
            a.v_head_dim,
        )
    D, H, K = cfg.d_model, cfg.n_heads, cfg.resolved_head_dim
    extras = (
        H * K * D * cfg.attention_output_gate  # Qwen3-Next: q_proj also makes the output gate
        + 2 * K * cfg.qk_norm
        + H * cfg.attention_sinks
        + D * cfg.attention_out_bias
    )
    return gqa_attention_params(D, H, cfg.n_kv_heads, K, cfg.qkv_bias) + extras


def linear_attention_params(cfg: ModelConfig) -> int:
    """Parameters of one Gated DeltaNet layer (models/layers/gated_deltanet.py): the fused q/k/v/z and
    b/a projections, the convolution over q, k and v, A_log and dt_bias, the output norm, the output
    projection."""
    la, D = cfg.linear_attention, cfg.d_model
    G, H, Kk, Kv, W = la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim, la.conv_kernel
    channels = 2 * G * Kk + H * Kv
    return D * (2 * G * Kk + 2 * H * Kv) + D * 2 * H + W * channels + 2 * H + Kv + H * Kv * D


def _layer_extras(cfg: ModelConfig) -> int:
    """What the layers hold beyond `lm_param_counts`' uniform attention: the Gated DeltaNet layers'
    own count in place of attention's, and Gemma's two sandwich norms per layer."""
    linear = len(cfg.linear_layers) * (linear_attention_params(cfg) - attention_params(cfg)) if cfg.linear_layers else 0
    return linear + 2 * cfg.d_model * cfg.n_layers * cfg.sandwich_norm


def _moe_kw(cfg: ModelConfig) -> dict:
    m = cfg.moe
    return dict(
        n_experts=m.n_experts,
        top_k=m.top_k,
        d_expert=m.d_expert,
        d_shared=(m.d_shared or m.n_shared_experts * m.d_expert) if m.n_shared_experts else 0,
        shared_gate=m.shared_expert_gate and m.n_shared_experts > 0,
        router_bias=m.router_bias,
        expert_bias=m.expert_bias,
    )


def mtp_block_is_moe(cfg: ModelConfig) -> bool:
    """Whether the MTP modules' block routes to experts: models/moe.py gives them the kind of the
    model's last layer (DeepSeek-V3: a MoE block)."""
    return cfg.kind == "moe" and cfg.moe.layer_runs(cfg.n_layers)[-1].moe


def mtp_param_counts(cfg: ModelConfig) -> dict[str, int]:
    """{"total", "activated"} parameters of the `cfg.mtp.depth` MTP modules (models/mtp.py): per
    module two input RMSNorms, the (2D, D) projection, one block and the output RMSNorm. The
    embedding and the head are the model's (shared), so not counted here.

    >>> from meshwork.config_sections import MTPConfig
    >>> mtp_param_counts(ModelConfig(mtp=MTPConfig(depth=0)))["total"]
    0
    """
    D, n = cfg.d_model, cfg.mtp.depth
    if not n:
        return {"total": 0, "activated": 0}
    own = 3 * D + 2 * D * D
    kw = dict(vocab_size=0, d_model=D, n_layers=1, attention=attention_params(cfg), d_ff=cfg.d_ff, tie_embeddings=True)
    if mtp_block_is_moe(cfg):
        block = lm_param_counts(**kw, n_moe_layers=1, **_moe_kw(cfg))
    else:
        block = lm_param_counts(**kw)
    # lm_param_counts adds a final norm (D) that a lone block does not have.
    return {k: n * (own + block[k] - D) for k in ("total", "activated")}


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Total and per-token activated parameters of meshwork's model for `cfg`, MTP modules
    included ("mtp": theirs alone, "mtp_activated": what one token passes through in them)."""
    kw = dict(
        vocab_size=cfg.vocab_size,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        attention=attention_params(cfg),
        d_ff=cfg.d_ff,
        tie_embeddings=cfg.tie_embeddings,
    )
    if cfg.kind != "moe":
        counts = lm_param_counts(**kw)
    else:
        counts = lm_param_counts(**kw, n_moe_layers=cfg.moe.n_moe_layers(cfg.n_layers), **_moe_kw(cfg))
    counts = {k: v + _layer_extras(cfg) for k, v in counts.items()}
    if not cfg.mtp.depth:
        return counts
    mtp = mtp_param_counts(cfg)
    return {
        "total": counts["total"] + mtp["total"],
        "activated": counts["activated"] + mtp["activated"],
        "mtp": mtp["total"],
        "mtp_activated": mtp["activated"],
    }


def _norm_params(cfg: ModelConfig) -> int:
    """RMSNorm scales: two per layer, the final norm, MLA's latent norms, and per MTP module three
    plus its block's two."""
    D = cfg.d_model
    norms = 2 * D * cfg.n_layers + D
    if cfg.mla is not None:
        norms += (cfg.mla.kv_lora_rank + (cfg.mla.q_lora_rank or 0)) * (cfg.n_layers + cfg.mtp.depth)
    return norms + 5 * D * cfg.mtp.depth


def matmul_params(cfg: ModelConfig) -> int:
    """Activated parameters that take part in a matmul for every token.

    The input embedding is a lookup (no FLOPs) unless it doubles as the output
    projection; norm scales are negligible and left out. Each MTP module runs the
    shared head once more: + depth x vocab x d_model.
    """
    lookup = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    mtp_heads = cfg.mtp.depth * cfg.vocab_size * cfg.d_model
    return param_counts(cfg)["activated"] - _norm_params(cfg) - lookup + mtp_heads


def attention_dims(cfg: ModelConfig) -> tuple[int, int]:
    """(query/key width, value width) of one head in the attention core: (head_dim, head_dim),
    or MLA's (qk_nope + qk_rope, v_head_dim)."""
    if cfg.mla is not None:
        return cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim
    return cfg.resolved_head_dim, cfg.resolved_head_dim


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of the attention scores (Q K^T) and values (P V), forward and
    backward, over every layer and MTP block: 6 x layers x heads x (Dq + Dv) x seq_len,
    PaLM's 12 L H K T when Dq = Dv = K."""
    layers = cfg.n_layers + cfg.mtp.depth
    if cfg.mla is None:
        return 12 * layers * cfg.n_heads * cfg.resolved_head_dim * seq_len
    dq, dv = attention_dims(cfg)
    return 6 * layers * cfg.n_heads * (dq + dv) * seq_len


def mla_padding_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token the expanded MLA form spends on zero padding: q, k and v all go
    through the attention kernel at width max(Dq, Dv), so the narrower side's matmul runs over
    the extra dims too (DeepSeek-V3: values padded from 128 to 192). 0 without MLA.

    >>> from meshwork.config_sections import MLAConfig
    >>> mla_padding_flops_per_token(ModelConfig(mla=MLAConfig(qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=48)), 8)
    0
    """
    if cfg.mla is None:
        return 0
    dq, dv = attention_dims(cfg)
    width = max(dq, dv)
    return 6 * (cfg.n_layers + cfg.mtp.depth) * cfg.n_heads * (2 * width - dq - dv) * seq_len


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    return 6 * matmul_params(cfg) + attention_flops_per_token(cfg, seq_len)
