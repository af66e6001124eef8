"""Planner: the model's weights and the piece of each that one device holds.

`model_weights` mirrors models/ (a test checks it against the real abstract
state): every trainable array, its shape and the logical name of each
dimension. Under a `Layout` a weight is cut by the mesh axes its logical names
map to, per role: parameters by the "params" rules, gradients by "grads",
Adam's two moments by "opt_state" (`shard_size`). `token_axes` names the axes
over which its gradient is summed.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from meshwork.config import ConfigError
from meshwork.config_sections import ModelConfig
from meshwork.perf.planner_layout import Layout


@dataclasses.dataclass(frozen=True)
class Weight:
    """One trainable array: its shape, the logical name of each dimension, and
    what kind of tokens reach it ("dense", "norm": the residual stream that
    Megatron-SP splits, "expert": routed tokens, "embedding": a lookup)."""

    path: str
    shape: tuple[int, ...]
    names: tuple[str | None, ...]
    kind: str = "dense"

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def scanned(self) -> bool:
        """Stacked along `layers` and applied by the layer scan."""
        return "layers" in self.names


def _block_weights(m: ModelConfig, prefix: str, n: int, moe: bool, linear: bool = False) -> list[Weight]:
    D, H, G, K = m.d_model, m.n_heads, m.n_kv_heads, m.resolved_head_dim
    Q = 2 * K if m.attention_output_gate else K  # Qwen3-Next's q_proj also makes the output gate
    L = ("layers",)
    w = [Weight(f"{prefix}.attn_norm.scale", (n, D), L + ("embed",), "norm")]
    if linear:
        w += _linear_attention_weights(m, prefix, n)
    elif m.mla is not None:
        w += _mla_weights(m, prefix, n)
    else:
        w += [
            Weight(f"{prefix}.attn.wq", (n, D, H, Q), L + ("embed", "heads", "head_dim")),
            Weight(f"{prefix}.attn.wk", (n, D, G, K), L + ("embed", "kv_heads", "head_dim")),
            Weight(f"{prefix}.attn.wv", (n, D, G, K), L + ("embed", "kv_heads", "head_dim")),
            Weight(f"{prefix}.attn.wo", (n, H, K, D), L + ("heads", "head_dim", "embed")),
        ]
    attention = m.mla is None and not linear
    if m.attention_out_bias and attention:
        w.append(Weight(f"{prefix}.attn.bo", (n, D), L + ("embed",)))
    if m.attention_sinks and attention:
        w.append(Weight(f"{prefix}.attn.sinks", (n, H), L + ("heads",)))
    if m.sandwich_norm:
        w += [
            Weight(f"{prefix}.{name}.scale", (n, D), L + ("embed",), "norm")
            for name in ("attn_out_norm", "mlp_out_norm")
        ]
    if m.qkv_bias and attention:
        w += [
            Weight(f"{prefix}.attn.bq", (n, H, K), L + ("heads", "head_dim")),
            Weight(f"{prefix}.attn.bk", (n, G, K), L + ("kv_heads", "head_dim")),
            Weight(f"{prefix}.attn.bv", (n, G, K), L + ("kv_heads", "head_dim")),
        ]
    if m.qk_norm and attention:
        # Reached by every token of every head: its gradient sums over the batch, sequence and head splits,
        # which the "dense" kind counts as the batch and sequence axes (head_dim-sized: negligible).
        w += [
            Weight(f"{prefix}.attn.q_norm.scale", (n, K), L + ("head_dim",)),
            Weight(f"{prefix}.attn.k_norm.scale", (n, K), L + ("head_dim",)),
        ]
    w.append(Weight(f"{prefix}.mlp_norm.scale", (n, D), L + ("embed",), "norm"))
    if not moe:
        F = m.d_ff
        return w + [
            Weight(f"{prefix}.mlp.w_gate", (n, D, F), L + ("embed", "mlp")),
            Weight(f"{prefix}.mlp.w_up", (n, D, F), L + ("embed", "mlp")),
            Weight(f"{prefix}.mlp.w_down", (n, F, D), L + ("mlp", "embed")),
        ]
    e = m.moe
    E, F = e.n_experts, e.d_expert
    w.append(Weight(f"{prefix}.moe.router", (n, D, E), L + ("embed", "router")))
    if e.router_bias:
        w.append(Weight(f"{prefix}.moe.b_router", (n, E), L + ("router",)))
    if e.router == "noisy":
        w.append(Weight(f"{prefix}.moe.noise", (n, D, E), L + ("embed", "router")))
    w += [
        Weight(f"{prefix}.moe.w_gate", (n, E, D, F), L + ("expert", "embed", "mlp"), "expert"),
        Weight(f"{prefix}.moe.w_up", (n, E, D, F), L + ("expert", "embed", "mlp"), "expert"),
        Weight(f"{prefix}.moe.w_down", (n, E, F, D), L + ("expert", "mlp", "embed"), "expert"),
    ]
    if e.expert_bias:  # gpt-oss
        w += [
            Weight(f"{prefix}.moe.b_gate", (n, E, F), L + ("expert", "mlp"), "expert"),
            Weight(f"{prefix}.moe.b_up", (n, E, F), L + ("expert", "mlp"), "expert"),
            Weight(f"{prefix}.moe.b_down", (n, E, D), L + ("expert", "embed"), "expert"),
        ]
    if e.n_shared_experts:
        S = e.d_shared or e.n_shared_experts * F
        w += [
            Weight(f"{prefix}.moe.shared.w_gate", (n, D, S), L + ("embed", "mlp")),
            Weight(f"{prefix}.moe.shared.w_up", (n, D, S), L + ("embed", "mlp")),
            Weight(f"{prefix}.moe.shared.w_down", (n, S, D), L + ("mlp", "embed")),
        ]
    if e.shared_expert_gate:
        w.append(Weight(f"{prefix}.moe.shared_gate", (n, D, 1), L + ("embed", None)))
    return w


def _mla_weights(m: ModelConfig, prefix: str, n: int) -> list[Weight]:
    """models/layers/mla.py's weights: the (low-rank) query projection, the joint latent and RoPE-key
    projection with the latent's norm, the latent's up-projection to keys and values, the output."""
    a, D, H, L = m.mla, m.d_model, m.n_heads, ("layers",)
    Dq = a.qk_nope_head_dim + a.qk_rope_head_dim
    w = []
    if a.q_lora_rank:
        Rq = a.q_lora_rank
        w += [
            Weight(f"{prefix}.attn.wq_a", (n, D, Rq), L + ("embed", "q_lora")),
            Weight(f"{prefix}.attn.q_norm.scale", (n, Rq), L + ("q_lora",)),
            Weight(f"{prefix}.attn.wq_b", (n, Rq, H, Dq), L + ("q_lora", "heads", "head_dim")),
        ]
    else:
        w.append(Weight(f"{prefix}.attn.wq", (n, D, H, Dq), L + ("embed", "heads", "head_dim")))
    R = a.kv_lora_rank
    return w + [
        Weight(f"{prefix}.attn.wkv_a", (n, D, R + a.qk_rope_head_dim), L + ("embed", "kv_lora")),
        Weight(f"{prefix}.attn.kv_norm.scale", (n, R), L + ("kv_lora",)),
        Weight(
            f"{prefix}.attn.wkv_b", (n, R, H, a.qk_nope_head_dim + a.v_head_dim), L + ("kv_lora", "heads", "head_dim")
        ),
        Weight(f"{prefix}.attn.wo", (n, H, a.v_head_dim, D), L + ("heads", "head_dim", "embed")),
    ]


def _mtp_weights(m: ModelConfig) -> list[Weight]:
    """models/mtp.py's modules, one unstacked block each (the kind of the model's last layer)."""
    from meshwork.perf.flops import mtp_block_is_moe

    D, moe = m.d_model, mtp_block_is_moe(m)
    w = []
    for k in range(m.mtp.depth):
        p = f"mtp.{k}"
        w += [
            Weight(f"{p}.embed_norm.scale", (D,), ("embed",), "norm"),
            Weight(f"{p}.hidden_norm.scale", (D,), ("embed",), "norm"),
            Weight(f"{p}.proj", (2 * D, D), (None, "embed")),
        ]
        for b in _block_weights(m, f"{p}.block", 1, moe=moe):  # one block: drop the layers dimension
            w.append(dataclasses.replace(b, shape=b.shape[1:], names=b.names[1:]))
        w.append(Weight(f"{p}.out_norm.scale", (D,), ("embed",), "norm"))
    return w


def _linear_attention_weights(m: ModelConfig, prefix: str, n: int) -> list[Weight]:
    """A Gated DeltaNet layer's weights (models/layers/gated_deltanet.py), fused as the checkpoint keeps them."""
    la, D, L = m.linear_attention, m.d_model, ("layers",)
    G, H, Kk, Kv, W = la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim, la.conv_kernel
    R = H // G
    return [
        Weight(f"{prefix}.attn.w_qkvz", (n, D, G, 2 * Kk + 2 * R * Kv), L + ("embed", "linear_k_heads", None)),
        Weight(f"{prefix}.attn.w_ba", (n, D, G, 2 * R), L + ("embed", "linear_k_heads", None)),
        Weight(f"{prefix}.attn.conv", (n, W, 2 * G * Kk + H * Kv), L + ("conv_kw", None)),
        Weight(f"{prefix}.attn.A_log", (n, H), L + ("linear_heads",)),
        Weight(f"{prefix}.attn.dt_bias", (n, H), L + ("linear_heads",)),
        Weight(f"{prefix}.attn.norm.scale", (n, Kv), L + ("head_dim",)),
        Weight(f"{prefix}.attn.wo", (n, H, Kv, D), L + ("linear_heads", "head_dim", "embed")),
    ]


def model_weights(m: ModelConfig) -> tuple[Weight, ...]:
    """Every trainable weight of meshwork's Transformer / MoETransformer for `m`,
    with the logical names models/ gives it (checked against the real model by
    tests/test_planner.py).

    >>> [w.path for w in model_weights(ModelConfig())][:3]
    ['embed.table', 'blocks.attn_norm.scale', 'blocks.attn.wq']
    """
    if m.kind == "unet":
        raise ConfigError("model.kind: the planner models language models (transformer, moe), not unet")
    return _model_weights(m.model_dump_json())


@functools.lru_cache(maxsize=64)
def _model_weights(model_json: str) -> tuple[Weight, ...]:
    m = ModelConfig.model_validate_json(model_json)
    D, V = m.d_model, m.vocab_size
    w = [Weight("embed.table", (V, D), ("vocab", "embed"), "embedding")]
    if m.kind == "moe":
        for run in m.layer_runs():  # models/moe.py's stacks, one per run of one kind
            w += _block_weights(m, run.name, run.count, moe=run.moe, linear=run.linear)
    else:
        w += _block_weights(m, "blocks", m.n_layers, moe=False)
    w.append(Weight("head.final_norm.scale", (D,), ("embed",), "norm"))
    if not m.tie_embeddings:
        w.append(Weight("head.lm_head", (D, V), ("embed", "vocab")))
    return tuple(w + _mtp_weights(m))


def shard_size(weight: Weight, layout: Layout, role: str = "params") -> int:
    """Elements of `weight` one device holds under `role`'s rules (uneven splits round up)."""
    sizes = layout.sizes
    return math.prod(
        -(-dim // math.prod(sizes[a] for a in axes))
        for dim, axes in zip(weight.shape, layout.weight_split(weight, role))
    )


def indivisible(weights: tuple[Weight, ...], layout: Layout) -> str | None:
    """The first weight dimension that its mesh axes do not divide evenly, described; else None."""
    sizes = layout.sizes
    for role in ("params", "grads", "opt_state"):
        for w in weights:
            for dim, name, axes in zip(w.shape, w.names, layout.weight_split(w, role)):
                ways = math.prod(sizes[a] for a in axes)
                if dim % ways:
                    return f"{w.path} dimension {name}={dim} over {'x'.join(axes)}={ways}"
    return None


def token_axes(weight: Weight, layout: Layout) -> tuple[str, ...]:
    """Mesh axes over which different tokens reach `weight`, so its gradient is
    summed over them: the batch axes and context parallelism's sequence axes;
    for norm scales also the axes Megatron-SP splits the residual stream over;
    for experts not the axes that split the experts (tokens travel to them).

    >>> from meshwork.perf.planner_layout import make_layout
    >>> w = model_weights(ModelConfig())[2]          # blocks.attn.wq
    >>> token_axes(w, make_layout(data=2, fsdp=2, tensor=2))
    ('data', 'fsdp')
    """
    axes = list(layout.split("act_batch"))
    axes += [a for a in layout.split("act_seq") if a not in axes]
    if weight.kind == "norm":
        axes += [a for a in layout.split("act_norm_seq") if a not in axes]
    if weight.kind == "expert":
        routed = layout.split("expert")
        axes = [a for a in axes if a not in routed]
    return tuple(axes)
