"""Hugging Face config.json as meshwork's ModelConfig (and MoEConfig).

`config_from_hf` reads Llama ("llama"), Mistral ("mistral"), Mixtral
("mixtral"), Qwen2 ("qwen2"), Qwen2-MoE ("qwen2_moe"), Qwen3 ("qwen3"),
Qwen3-MoE ("qwen3_moe"), DeepSeek-V3 ("deepseek_v3"), Gemma 2 ("gemma2"), Gemma 3's text model
("gemma3_text"; models/hf/gemma.py) and gpt-oss ("gpt_oss"; models/hf/gpt_oss.py) configs. Training-only settings (dropout, Mixtral's
router jitter, output_router_logits) are ignored; anything that changes the
forward pass and that meshwork does not implement (RoPE scalings other than llama3,
linear, dynamic and yarn (models/hf/rope.py), a sliding window in only some
layers or in a MoE model, other activations, extra biases) raises a ValueError
that names the key. A sliding window in every layer (Mistral; Qwen2 and Qwen3 with
use_sliding_window) becomes `sliding_window`.
"""

from __future__ import annotations

from typing import Any

from meshwork.config_sections import MLAConfig, ModelConfig, MoEConfig, MTPConfig
from meshwork.models.hf.gemma import GEMMA_DEFAULTS, GEMMA_TYPES, gemma_config
from meshwork.models.hf.gpt_oss import GPT_OSS_DEFAULTS, GPT_OSS_TYPES, gpt_oss_config
from meshwork.models.hf.qwen3_next import QWEN3_NEXT_DEFAULTS, qwen3_next_config
from meshwork.models.hf.rope import rope_from_hf

# model_type -> (rms_norm_eps, rope_theta) that transformers assumes when config.json omits them.
DEFAULTS = {
    "llama": (1e-6, 10000.0),
    "mistral": (1e-6, 10000.0),
    "mixtral": (1e-5, 1e6),
    "qwen2": (1e-6, 10000.0),
    "qwen2_moe": (1e-6, 10000.0),
    "qwen3": (1e-6, 10000.0),
    "qwen3_moe": (1e-6, 10000.0),
    "deepseek_v3": (1e-6, 10000.0),
    **GEMMA_DEFAULTS,
    "qwen3_next": QWEN3_NEXT_DEFAULTS,
    **GPT_OSS_DEFAULTS,
}
SUPPORTED = tuple(DEFAULTS)
_QWEN = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def config_from_hf(hf_config: dict[str, Any]) -> ModelConfig:
    """The meshwork ModelConfig for a Hugging Face config.json dict.

    Reads both the transformers 5 form (`rope_parameters`) and the older one
    (`rope_theta`, `rope_scaling`). Raises ValueError for a model type or a
    setting meshwork cannot reproduce.

    >>> cfg = config_from_hf({"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
    ...     "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
    ...     "rope_theta": 10000.0, "rms_norm_eps": 1e-6})
    >>> cfg.n_kv_heads, cfg.resolved_head_dim, cfg.norm_eps
    (32, 128, 1e-06)
    """
    c = dict(hf_config)
    kind = c.get("model_type")
    if kind not in SUPPORTED:
        raise ValueError(f"model_type={kind!r} is not supported; meshwork reads {', '.join(SUPPORTED)} checkpoints")
    defaults = DEFAULTS[kind]

    def need(key: str) -> Any:
        if c.get(key) is None:
            raise ValueError(f"{kind} config has no {key!r}; a complete config.json is needed")
        return c[key]

    def refuse(key: str, ok: bool, why: str) -> None:
        if not ok:
            raise ValueError(f"{kind} config {key}={c.get(key)!r}: {why}")

    if kind == "qwen3_next":
        return qwen3_next_config(c, need, refuse, _qwen_moe_dense_layers)
    if kind in GEMMA_TYPES:
        return gemma_config(c, need, refuse)
    if kind in GPT_OSS_TYPES:  # its experts' activation is fixed; no module reads hidden_act
        return gpt_oss_config(c, need, refuse)
    refuse("hidden_act", c.get("hidden_act", "silu") == "silu", "meshwork's MLP is SwiGLU (silu) only")
    if kind == "deepseek_v3":
        return _deepseek_v3(c, need, refuse)
    D, H = need("hidden_size"), need("num_attention_heads")
    G = c.get("num_key_value_heads") or H
    refuse("num_key_value_heads", H % G == 0, f"must divide num_attention_heads={H}")
    # Qwen3's config class defaults head_dim to 128, not hidden_size / heads: only an explicit one is safe.
    head_dim = need("head_dim") if kind == "qwen3" else c.get("head_dim") or D // H
    refuse("head_dim", head_dim % 2 == 0, "RoPE needs an even head_dim")
    theta, rope_scaling = rope_from_hf(c, kind, defaults[1])
    if kind in ("llama", "qwen3", "qwen3_moe"):
        refuse(
            "attention_bias",
            not c.get("attention_bias", False),
            f"{kind}'s attention_bias also biases o_proj, which meshwork's attention does not have",
        )
    if kind == "llama":
        refuse("mlp_bias", not c.get("mlp_bias", False), "meshwork's MLP has no biases")
    if kind == "mixtral":
        refuse(
            "sliding_window",
            c.get("sliding_window") is None,
            "meshwork attends causally over the whole sequence; set it to null only if no sequence "
            "you run is longer than the window",
        )
    window = None
    if kind == "mistral":  # every layer; transformers' MistralConfig defaults both keys when absent
        window = _masking_window(c.get("sliding_window", 4096), c.get("max_position_embeddings", 4096 * 32))
    if kind in ("qwen2", "qwen3"):
        window = _qwen_window(c, kind, need("num_hidden_layers"))
    elif kind in _QWEN:
        refuse(
            "use_sliding_window",
            not c.get("use_sliding_window", False),
            "meshwork attends causally over the whole sequence (no sliding window)",
        )
        refuse(
            "layer_types",
            all(t == "full_attention" for t in c.get("layer_types") or []),
            "meshwork has full attention in every layer",
        )

    common = dict(
        vocab_size=need("vocab_size"),
        d_model=D,
        n_layers=need("num_hidden_layers"),
        n_heads=H,
        n_kv_heads=G,
        head_dim=head_dim,
        d_ff=need("intermediate_size"),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        norm_eps=c.get("rms_norm_eps") or defaults[0],
        # Qwen2 always has q/k/v biases; Qwen2-MoE has them unless qkv_bias says not.
        qkv_bias=kind == "qwen2" or (kind == "qwen2_moe" and c.get("qkv_bias", True)),
        qk_norm=kind in ("qwen3", "qwen3_moe"),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        init_std=c.get("initializer_range", 0.02),
        sliding_window=window,
    )
    if kind in ("llama", "mistral", "qwen2", "qwen3"):
        return ModelConfig(kind="transformer", **common)
    if kind == "mixtral":
        E, k = need("num_local_experts"), need("num_experts_per_tok")
        refuse("num_experts_per_tok", 0 < k <= E, f"must be between 1 and num_local_experts={E}")
        moe = MoEConfig(
            n_experts=E,
            top_k=k,
            d_expert=need("intermediate_size"),
            router="softmax",
            norm_topk_prob=True,
            aux_loss_coef=c.get("router_aux_loss_coef", 0.001),
            z_loss_coef=0.0,
        )
        return ModelConfig(kind="moe", moe=moe, **common)

    # qwen2_moe, qwen3_moe (transformers 5 writes Qwen3-MoE's num_experts as num_local_experts)
    if c.get("num_experts") is None and c.get("num_local_experts") is not None:
        c["num_experts"] = c["num_local_experts"]
    dense = _qwen_moe_dense_layers(c, common["n_layers"])
    if len(dense) == common["n_layers"]:  # no MoE layer at all: a dense model
        return ModelConfig(kind="transformer", **common)
    # Leading dense layers as first_dense_layers (the model's parameters keep their usual names),
    # any other pattern as the list of dense layers.
    leading = dense == list(range(len(dense)))
    pattern = dict(first_dense_layers=len(dense)) if leading else dict(dense_layers=tuple(dense))
    E, k = need("num_experts"), need("num_experts_per_tok")
    refuse("num_experts_per_tok", 0 < k <= E, f"must be between 1 and num_experts={E}")
    d_shared = c.get("shared_expert_intermediate_size", 0) if kind == "qwen2_moe" else 0
    shared = dict(n_shared_experts=1, d_shared=d_shared, shared_expert_gate=True) if d_shared else {}
    moe = MoEConfig(
        n_experts=E,
        top_k=k,
        d_expert=need("moe_intermediate_size"),
        router="softmax",
        norm_topk_prob=bool(c.get("norm_topk_prob", False)),
        aux_loss_coef=c.get("router_aux_loss_coef", 0.001),
        z_loss_coef=0.0,
        **pattern,
        **shared,
    )
    return ModelConfig(kind="moe", moe=moe, **common)


def _masking_window(window: int | None, longest: int | None) -> int | None:
    """The window, or None when it never masks a key: null, or at least max_position_embeddings long."""
    return None if window is None or (longest is not None and window >= longest) else window


def _qwen_window(c: dict[str, Any], kind: str, n_layers: int) -> int | None:
    """Qwen2 / Qwen3's sliding window as transformers 5 reads config.json, if every layer has it.

    transformers takes `sliding_window` only with `use_sliding_window` (else null) and
    applies it to the layers `layer_types` marks "sliding_attention"; without
    `layer_types`, to the layers from `max_window_layers` on. meshwork has one attention
    for all layers, so a mix of windowed and full layers raises a ValueError naming the key.
    """
    window = c.get("sliding_window", 4096) if c.get("use_sliding_window", False) else None
    key, types = "layer_types", c.get("layer_types")
    if types is None:
        key, start = "max_window_layers", c.get("max_window_layers", 28)
        types = [
            "sliding_attention" if window is not None and i >= start else "full_attention" for i in range(n_layers)
        ]
    bad = sorted(set(types) - {"full_attention", "sliding_attention"})
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if bad:
        raise ValueError(
            f"{kind} config layer_types has {bad}: meshwork reads only full_attention and sliding_attention layers"
        )
    if sliding and window is None:
        raise ValueError(
            f"{kind} config layer_types marks layers {sliding} sliding_attention with no window "
            "(use_sliding_window false or sliding_window null), which transformers cannot run either"
        )
    window = _masking_window(window, c.get("max_position_embeddings"))
    if window is None or not sliding:
        return None
    if len(sliding) < n_layers:
        raise ValueError(
            f"{kind} config {key}={c.get(key)!r}: layers {sliding} have sliding_window={window} "
            "and the others full attention; meshwork has one attention for every layer "
            "(model.sliding_window), so it cannot load a per-layer mix"
        )
    return window


def _qwen_moe_dense_layers(c: dict[str, Any], n_layers: int) -> list[int]:
    """The layer indices Qwen2-MoE / Qwen3-MoE build with a dense MLP instead of experts, as
    transformers' decoder layer decides: layer i routes to experts iff i is not in
    `mlp_only_layers`, `num_experts` > 0 and (i + 1) % `decoder_sparse_step` == 0."""
    only, step, E = set(c.get("mlp_only_layers") or []), c.get("decoder_sparse_step") or 1, c.get("num_experts", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"{c.get('model_type')} config decoder_sparse_step={step!r}: expected a positive integer")
    return [i for i in range(n_layers) if i in only or not (E > 0 and (i + 1) % step == 0)]


def _deepseek_v3(c: dict[str, Any], need, refuse) -> ModelConfig:
    """DeepSeek-V3 (and its fine-tunes, Kimi K2's layout): MLA attention, DeepSeekMoE with sigmoid
    routing, group-limited top-k and a routed scaling factor, leading dense layers, MTP modules.

    `num_nextn_predict_layers` becomes `mtp.depth` here; the loader (models/hf/__init__.py) sets it
    to 0 when the files hold no MTP weights (transformers itself neither runs nor saves them).
    """
    quant = c.get("quantization_config")
    refuse(
        "quantization_config",
        not quant,
        f"the weights are {(quant or {}).get('quant_method', 'quantized')} block-quantized; meshwork reads "
        "bfloat16/float32 weights: dequantize first (DeepSeek-V3's inference/fp8_cast_bf16.py, or "
        "transformers' FineGrainedFP8Config(dequantize=True) then save_pretrained)",
    )
    refuse("attention_bias", not c.get("attention_bias", False), "meshwork's MLA has no projection biases")
    # Keys of DeepSeek's own config.json (transformers ignores them): anything but V3's choice is V2's.
    refuse("scoring_func", c.get("scoring_func", "sigmoid") == "sigmoid", "DeepSeek-V3 routes by sigmoid scores")
    refuse(
        "topk_method",
        c.get("topk_method", "noaux_tc") == "noaux_tc",
        "DeepSeek-V3 picks by group-limited biased scores (noaux_tc)",
    )
    refuse("moe_layer_freq", c.get("moe_layer_freq", 1) == 1, "every layer after first_k_dense_replace is a MoE layer")
    H, L = need("num_attention_heads"), need("num_hidden_layers")
    theta, rope_scaling = rope_from_hf(c, "deepseek_v3", DEFAULTS["deepseek_v3"][1])
    E, k = need("n_routed_experts"), need("num_experts_per_tok")
    refuse("num_experts_per_tok", 0 < k <= E, f"must be between 1 and n_routed_experts={E}")
    groups, topk_groups = c.get("n_group") or 1, c.get("topk_group") or 1
    refuse("n_group", E % groups == 0, f"must divide n_routed_experts={E}")
    refuse("topk_group", 0 < topk_groups <= groups, f"must be between 1 and n_group={groups}")
    refuse(
        "num_experts_per_tok",
        k <= topk_groups * (E // groups),
        f"exceeds the {topk_groups * (E // groups)} experts of topk_group={topk_groups} groups",
    )
    refuse("qk_rope_head_dim", need("qk_rope_head_dim") % 2 == 0, "RoPE rotates pairs of dims; it must be even")
    dense = min(c.get("first_k_dense_replace") or 0, L)
    refuse(
        "first_k_dense_replace",
        dense < L or not c.get("num_nextn_predict_layers"),
        f"makes all {L} layers dense while num_nextn_predict_layers asks for an MTP layer, which DeepSeek-V3 "
        "builds as a MoE layer past first_k_dense_replace; meshwork does not read that mix",
    )
    moe = MoEConfig(
        n_experts=E,
        top_k=k,
        d_expert=need("moe_intermediate_size"),
        n_shared_experts=c.get("n_shared_experts") or 0,
        router="sigmoid",
        norm_topk_prob=bool(c.get("norm_topk_prob", True)),
        n_groups=groups,
        topk_groups=topk_groups,
        routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
        # Fine-tuning keeps the released selection bias (no aux-loss-free updates) and adds no aux loss.
        aux_loss_coef=0.0,
        z_loss_coef=0.0,
        first_dense_layers=dense,
    )
    mla = MLAConfig(
        q_lora_rank=c.get("q_lora_rank"),
        kv_lora_rank=need("kv_lora_rank"),
        qk_nope_head_dim=need("qk_nope_head_dim"),
        qk_rope_head_dim=need("qk_rope_head_dim"),
        v_head_dim=need("v_head_dim"),
    )
    return ModelConfig(
        kind="moe" if dense < L else "transformer",
        vocab_size=need("vocab_size"),
        d_model=need("hidden_size"),
        n_layers=L,
        n_heads=H,
        n_kv_heads=H,
        d_ff=need("intermediate_size"),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        norm_eps=c.get("rms_norm_eps") or DEFAULTS["deepseek_v3"][0],
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        init_std=c.get("initializer_range", 0.02),
        mla=mla,
        mtp=MTPConfig(depth=c.get("num_nextn_predict_layers", c.get("num_mtp_layers", 0)) or 0),
        moe=moe,
    )


def rope_interleaved(c: dict[str, Any]) -> bool:
    """Whether a DeepSeek-V3 checkpoint's RoPE dims are interleaved pairs (x0, x1), (x2, x3), ...
    (transformers' default) rather than meshwork's halves (i, i + K/2): the loader then permutes the
    rows that produce them."""
    return c.get("model_type") == "deepseek_v3" and bool(c.get("rope_interleave", True))
