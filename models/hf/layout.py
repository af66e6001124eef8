"""Where each meshwork parameter lives in a Hugging Face checkpoint: names, shapes, layouts.

`hf_layout` is the one table that the loaders (`models.hf`) and the export
(`inference.hf_export`) both follow; `HFTensor` turns one parameter from the
file's layout into meshwork's and back. Also here: the dtype names config.json
uses, and the shape checks and pure dicts of parameter trees both sides share.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from meshwork.config_sections import ModelConfig
from meshwork.models.hf.gemma import GEMMA_TYPES, gemma_layer
from meshwork.models.hf.gpt_oss import gpt_oss_moe
from meshwork.models.hf.qwen3_next import linear_attention_tensors

if TYPE_CHECKING:
    from meshwork.models.hf.files import TensorReader

# numpy dtype -> config.json's torch_dtype / dtype name.
HF_DTYPE_NAMES = {
    np.dtype(np.float32): "float32",
    np.dtype(ml_dtypes.bfloat16): "bfloat16",
    np.dtype(np.float16): "float16",
}


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One meshwork parameter of one layer and the checkpoint tensor(s) holding it.

    `name` may contain "{e}": then the file has one tensor per expert (`experts`
    of them), stacked on meshwork's leading expert axis. `read` and `write_into` are
    each other's inverse, so the loader and `inference.hf_export` share this one
    description of the layout. With `columns`, several parameters share one file
    tensor (gpt-oss's fused, interleaved gate_up_proj), each reading and writing its
    columns of it.

    >>> t = HFTensor("q_proj.weight", shape=(64, 4, 24), hf_shape=(96, 64), linear=True)
    >>> t.write(np.zeros(t.shape, np.float32))["q_proj.weight"].shape
    (96, 64)
    >>> gate, up = (HFTensor("gate_up", (2, 3), (2, 6), columns=(c, 2)) for c in (0, 1))
    >>> tensors = {}
    >>> gate.write_into(tensors, np.zeros((2, 3))); up.write_into(tensors, np.ones((2, 3)))
    >>> tensors["gate_up"][0].tolist()
    [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    """

    name: str
    shape: tuple[int, ...]
    """meshwork's shape (with the leading expert axis, if any; without the layers axis)."""
    hf_shape: tuple[int, ...]
    """The shape in the file (of one expert's tensor)."""
    linear: bool = False
    """An nn.Linear weight: (out, in) in the file, (in, ..., out) in meshwork."""
    experts: int = 0
    rows: tuple[int, ...] | None = None
    """A linear weight whose output rows meshwork keeps in another order: meshwork's row m is the
    file's row rows[m] (DeepSeek's interleaved RoPE pairs as meshwork's halves)."""
    buffer: bool = False
    """Not a trained parameter but a model buffer (DeepSeek-V3's expert selection bias, a RouterBias)."""
    columns: tuple[int, int] | None = None
    """(start, step): meshwork's array is the file tensor's last-axis columns start, start + step, ...
    (`file[..., start::step]`; gpt-oss's gate at (0, 2), up at (1, 2)); the parameters sharing the
    file tensor together write all of its columns. Only for a tensor stored as meshwork keeps it
    (not `linear`, no `rows`)."""

    def __post_init__(self):
        if self.columns is not None and (self.linear or self.rows is not None):
            raise ValueError(f"{self.name}: columns of a linear or row-permuted tensor are not implemented")

    def names(self) -> list[str]:
        return [self.name.format(e=e) for e in range(self.experts)] if self.experts else [self.name]

    def read(self, t: TensorReader) -> np.ndarray:
        """meshwork's array, from the tensor(s) in the file (a view of what `t` read, where possible)."""
        parts = [t.get(n, self.hf_shape) for n in self.names()]
        if self.columns is not None:
            start, step = self.columns
            parts = [x[..., start::step] for x in parts]
        if self.rows is not None:
            parts = [x[np.asarray(self.rows)] for x in parts]
        parts = [(x.T if self.linear else x).reshape(self.shape[1:] if self.experts else self.shape) for x in parts]
        return np.stack(parts) if self.experts else parts[0]

    def write(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """The file's tensor(s), contiguous, holding meshwork's array `x` (not for `columns`: `write_into`)."""
        if self.columns is not None:
            raise ValueError(f"{self.name} holds only some columns of its file tensor; use write_into")

        def one(x: np.ndarray) -> np.ndarray:
            x = x.reshape(self.hf_shape[::-1]).T if self.linear else x.reshape(self.hf_shape)
            return np.ascontiguousarray(x[np.argsort(self.rows)] if self.rows is not None else x)

        parts = [one(x[e]) for e in range(self.experts)] if self.experts else [one(x)]
        return dict(zip(self.names(), parts, strict=True))

    def write_into(self, tensors: dict[str, np.ndarray], x: np.ndarray) -> None:
        """Adds the file's tensor(s) holding `x` to `tensors`; with `columns`, fills this parameter's
        columns of a file tensor that `tensors` holds (made, in x's dtype, by the first to write)."""
        if self.columns is None:
            tensors.update(self.write(x))
            return
        start, step = self.columns
        for e, name in enumerate(self.names()):
            whole = tensors.setdefault(name, np.zeros(self.hf_shape, x.dtype))
            part = x[e] if self.experts else x
            whole[..., start::step] = part.reshape(whole[..., start::step].shape)


def _linear(
    name: str, d_out: int, d_in: int, shape: tuple[int, ...] | None = None, experts: int = 0, rows=None
) -> HFTensor:
    return HFTensor(name, (experts,) * bool(experts) + (shape or (d_in, d_out)), (d_out, d_in), True, experts, rows)


def _vector(name: str, shape: tuple[int, ...]) -> HFTensor:
    return HFTensor(name, shape, (math.prod(shape),))


def _swiglu(prefix: str, D: int, F: int, names=("gate_proj", "up_proj", "down_proj"), experts: int = 0) -> dict:
    gate, up, down = names
    return {
        "w_gate": _linear(f"{prefix}{gate}.weight", F, D, experts=experts),
        "w_up": _linear(f"{prefix}{up}.weight", F, D, experts=experts),
        "w_down": _linear(f"{prefix}{down}.weight", D, F, experts=experts),
    }


def _halves(width: int, start: int, rope: int) -> list[int]:
    """Row order that turns the `rope` interleaved RoPE rows (pairs 2m, 2m + 1) after `start` of a
    `width`-row block into halves (all evens, then all odds), leaving the other rows in place."""
    return (
        list(range(start)) + [start + 2 * m for m in range(rope // 2)] + [start + 2 * m + 1 for m in range(rope // 2)]
    )


def _mla(cfg: ModelConfig, a: str, interleaved: bool) -> dict[str, Any]:
    """DeepSeek-V3's MLA projections (models/layers/mla.py); `interleaved`: the file's RoPE rows are pairs."""
    m, D, H = cfg.mla, cfg.d_model, cfg.n_heads
    R, Dr, Dq = m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim + m.qk_rope_head_dim
    q_rows = [h * Dq + r for h in range(H) for r in _halves(Dq, m.qk_nope_head_dim, Dr)] if interleaved else None
    kv_rows = _halves(R + Dr, R, Dr) if interleaved else None
    if m.q_lora_rank:
        attn = {
            "wq_a": _linear(a + "q_a_proj.weight", m.q_lora_rank, D),
            "q_norm": {"scale": _vector(a + "q_a_layernorm.weight", (m.q_lora_rank,))},
            "wq_b": _linear(a + "q_b_proj.weight", H * Dq, m.q_lora_rank, (m.q_lora_rank, H, Dq), rows=q_rows),
        }
    else:
        attn = {"wq": _linear(a + "q_proj.weight", H * Dq, D, (D, H, Dq), rows=q_rows)}
    return attn | {
        "wkv_a": _linear(a + "kv_a_proj_with_mqa.weight", R + Dr, D, rows=kv_rows),
        "kv_norm": {"scale": _vector(a + "kv_a_layernorm.weight", (R,))},
        "wkv_b": _linear(
            a + "kv_b_proj.weight", H * (m.qk_nope_head_dim + m.v_head_dim), R, (R, H, Dq - Dr + m.v_head_dim)
        ),
        "wo": _linear(a + "o_proj.weight", D, H * m.v_head_dim, (H, m.v_head_dim, D)),
    }


def _gqa(cfg: ModelConfig, a: str) -> dict[str, Any]:
    """Grouped-query attention's projections (with Qwen2's biases, Qwen3's q/k norms, gpt-oss's
    output bias and sinks)."""
    D, H, G, K = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
    Q = 2 * K if cfg.attention_output_gate else K  # Qwen3-Next: each head's [query, gate]
    # HF's projection outputs are head-major (head h owns rows h*K .. h*K+K-1).
    attn = {
        "wq": _linear(a + "q_proj.weight", H * Q, D, (D, H, Q)),
        "wk": _linear(a + "k_proj.weight", G * K, D, (D, G, K)),
        "wv": _linear(a + "v_proj.weight", G * K, D, (D, G, K)),
        "wo": _linear(a + "o_proj.weight", D, H * K, (H, K, D)),
    }
    if cfg.qkv_bias:
        attn |= {
            "bq": _vector(a + "q_proj.bias", (H, K)),
            "bk": _vector(a + "k_proj.bias", (G, K)),
            "bv": _vector(a + "v_proj.bias", (G, K)),
        }
    if cfg.attention_out_bias:
        attn["bo"] = _vector(a + "o_proj.bias", (D,))
    if cfg.attention_sinks:  # one logit per query head
        attn["sinks"] = _vector(a + "sinks", (H,))
    if cfg.qk_norm:  # Qwen3: one scale over head_dim, shared by the heads
        attn |= {
            "q_norm": {"scale": _vector(a + "q_norm.weight", (K,))},
            "k_norm": {"scale": _vector(a + "k_norm.weight", (K,))},
        }
    return attn


def _layer(cfg: ModelConfig, model_type: str, i: int, *, moe: bool, interleaved: bool = True) -> dict[str, Any]:
    p, a, D = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", cfg.d_model
    if model_type in GEMMA_TYPES:
        return gemma_layer(cfg, i, _vector, _gqa) | {"mlp": _swiglu(p + "mlp.", D, cfg.d_ff)}
    if i in cfg.linear_layers:  # Qwen3-Next's Gated DeltaNet layers
        attention = linear_attention_tensors(cfg, p + "linear_attn.", _linear, _vector, HFTensor)
    else:
        attention = _mla(cfg, a, interleaved) if cfg.mla is not None else _gqa(cfg, a)
    layer = {
        "attn_norm": {"scale": _vector(p + "input_layernorm.weight", (D,))},
        "attn": attention,
        "mlp_norm": {"scale": _vector(p + "post_attention_layernorm.weight", (D,))},
    }
    if not moe:
        return layer | {"mlp": _swiglu(p + "mlp.", D, cfg.d_ff)}
    if model_type == "gpt_oss":
        return layer | {"moe": gpt_oss_moe(cfg, p + "mlp.", HFTensor)}
    m = cfg.moe
    if model_type == "mixtral":
        q, names = p + "block_sparse_moe.", ("w1", "w3", "w2")  # w1: gate, w3: up, w2: down
    else:
        q, names = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
    experts = {"router": _linear(q + "gate.weight", m.n_experts, D)}
    if model_type == "deepseek_v3":
        experts["router_bias"] = HFTensor(
            q + "gate.e_score_correction_bias", (m.n_experts,), (m.n_experts,), buffer=True
        )
    experts |= _swiglu(q + "experts.{e}.", D, m.d_expert, names, experts=m.n_experts)
    if m.n_shared_experts:
        shared = "shared_experts." if model_type == "deepseek_v3" else "shared_expert."
        experts["shared"] = _swiglu(q + shared, D, m.d_shared or m.n_shared_experts * m.d_expert)
    if m.shared_expert_gate:
        experts["shared_gate"] = _linear(q + "shared_expert_gate.weight", 1, D)  # (D, 1)
    return layer | {"moe": experts}


def _mtp(cfg: ModelConfig, model_type: str, j: int, interleaved: bool) -> dict[str, Any]:
    """DeepSeek-V3's MTP module j, stored as layer n_layers + j (its copies of the embedding and head,
    `embed_tokens` and `shared_head.head`, are the model's own: `MTP_SHARED_COPIES`)."""
    i, D = cfg.n_layers + j, cfg.d_model
    p = f"model.layers.{i}."
    moe = cfg.kind == "moe" and cfg.moe.layer_runs(cfg.n_layers)[-1].moe
    return {
        "embed_norm": {"scale": _vector(p + "enorm.weight", (D,))},
        "hidden_norm": {"scale": _vector(p + "hnorm.weight", (D,))},
        "proj": _linear(p + "eh_proj.weight", D, 2 * D),
        "block": _layer(cfg, model_type, i, moe=moe, interleaved=interleaved),
        "out_norm": {"scale": _vector(p + "shared_head.norm.weight", (D,))},
    }


def mtp_shared_copies(cfg: ModelConfig) -> dict[str, str]:
    """{file tensor: the model tensor it copies} for the MTP modules' embedding and head copies."""
    out = {}
    for j in range(cfg.mtp.depth):
        p = f"model.layers.{cfg.n_layers + j}."
        out[p + "embed_tokens.weight"] = "model.embed_tokens.weight"
        out[p + "shared_head.head.weight"] = "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
    return out


def split_buffers(layout: Any) -> tuple[Any, Any]:
    """(the layout's parameters, its buffers): two trees of the same nesting, empty branches dropped."""

    def part(tree: Any, buffers: bool) -> Any:
        if isinstance(tree, list):
            kept = [part(t, buffers) for t in tree]
            return kept if kept and kept[0] else None
        if isinstance(tree, HFTensor):
            return tree if tree.buffer == buffers else None
        kept = {k: part(v, buffers) for k, v in tree.items()}
        return {k: v for k, v in kept.items() if v} or None

    return part(layout, False) or {}, part(layout, True) or {}


def hf_layout(cfg: ModelConfig, model_type: str, interleaved: bool = True) -> dict[str, Any]:
    """Where each parameter of the model `cfg` describes lives in a `model_type` checkpoint.

    A tree shaped like the model's parameters (`nnx.to_pure_dict(nnx.state(model,
    nnx.Param))`) with `HFTensor` leaves, except that a stacked group of layers
    ("blocks"; in a MoE model each run of `MoEConfig.layer_runs`: "dense_blocks",
    "moe_blocks", or "dense_blocks_0", "moe_blocks_1", ... for interleaved dense layers)
    is a list of per-layer trees, numbered as the file's layers. The loaders in
    `models.hf` and `inference.hf_export.export_hf` all follow this one table.

    >>> from meshwork.models.hf import load_hf_config
    >>> cfg = load_hf_config("tests/fixtures/hf/llama")
    >>> hf_layout(cfg, "llama")["blocks"][1]["attn"]["wq"].name
    'model.layers.1.self_attn.q_proj.weight'
    """
    D, V = cfg.d_model, cfg.vocab_size
    layout: dict[str, Any] = {
        "embed": {"table": HFTensor("model.embed_tokens.weight", (V, D), (V, D))},
        "head": {"final_norm": {"scale": _vector("model.norm.weight", (D,))}},
    }
    if not cfg.tie_embeddings:
        layout["head"]["lm_head"] = _linear("lm_head.weight", V, D)
    if cfg.mtp.depth:
        layout["mtp"] = {j: _mtp(cfg, model_type, j, interleaved) for j in range(cfg.mtp.depth)}
    if cfg.kind == "transformer":
        layout["blocks"] = [_layer(cfg, model_type, i, moe=False, interleaved=interleaved) for i in range(cfg.n_layers)]
        return layout
    for run in cfg.layer_runs():
        layout[run.name] = [
            _layer(cfg, model_type, i, moe=run.moe, interleaved=interleaved)
            for i in range(run.start, run.start + run.count)
        ]
    return layout


def layout_shapes(layout: dict[str, Any]) -> dict[str, Any]:
    """The parameter shapes (ShapeDtypeStructs, float32) a layout implies, layers stacked."""

    def shapes(part: Any) -> Any:
        if isinstance(part, list):
            return jax.tree.map(lambda s: jax.ShapeDtypeStruct((len(part), *s.shape), jnp.float32), part[0])
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), part)

    return {key: shapes(part) for key, part in layout.items()}


def map_in_order(fn, tree: Any) -> Any:
    """jax.tree.map over nested dicts, but in insertion order (so errors name the first tensor)."""
    return {k: map_in_order(fn, v) for k, v in tree.items()} if isinstance(tree, dict) else fn(tree)


def layout_leaves(tree: Any) -> list[HFTensor]:
    """The HFTensors of one layout entry (a tree, or a list of per-layer trees), in order."""
    out: list[HFTensor] = []
    map_in_order(out.append, {str(i): part for i, part in enumerate(tree)} if isinstance(tree, list) else tree)
    return out


def as_pure_dict(tree: Any) -> Any:
    """Nested Mappings (e.g. an nnx.State of shardings) as plain nested dicts."""
    return {k: as_pure_dict(v) for k, v in tree.items()} if isinstance(tree, Mapping) else tree


def check_tree(expected: dict[str, Any], got: dict[str, Any]) -> None:
    """Raises ValueError listing how `got`'s leaf shapes differ from `expected`'s (missing,
    unexpected and mis-shaped leaves), e.g. a parameter tree against a model's."""
    want = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(expected)}
    have = {jax.tree_util.keystr(k): np.shape(v) for k, v in jax.tree_util.tree_leaves_with_path(got)}
    problems = [f"missing {k}" for k in want.keys() - have.keys()]
    problems += [f"unexpected {k}" for k in have.keys() - want.keys()]
    problems += [f"{k}: {have[k]} vs model {want[k]}" for k in want.keys() & have.keys() if have[k] != want[k]]
    if problems:
        raise ValueError(f"parameters do not fit the model ({len(problems)} differences): {sorted(problems)[:5]}")
