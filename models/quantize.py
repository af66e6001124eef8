"""Post-training quantization of a language model's projection weights: int8, int4, w8a8.

    cfg, model, step = load_run("runs/lm_tiny")
    quantize_model(model, "int4")           # in place; the model runs as before
    weight_bytes(model)                     # {"projections": ..., "other": ..., "total": ...}

What is quantized: the projections every model reads through
`models.layers.params.matmul`: attention `wq`, `wk`, `wv`, `wo`, the dense
SwiGLU's `w_gate`, `w_up`, `w_down` and the untied `lm_head`. The embedding
table (also the output projection when tied), norms, biases, and in MoE models
(models/moe.py) the routers and all experts, routed and shared, stay in their
float dtype; an MoE model's attention and head are quantized like a dense one's.
Stacked layers keep their leading `layers` axis in every quantized array
(the layer scan slices each leaf), and every scale is per layer.

The weight formats themselves (int8, int4, w8a8: storage, matmul, bytes) are
`meshwork.models.layers.quantized`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from meshwork.models.layers.attention import Attention
from meshwork.models.layers.mlp import SwiGLU
from meshwork.models.layers.quantized import QuantizedWeight, int4_axis, nbytes, quantize_weight
from meshwork.models.transformer import Block, LMHead

# module type -> its projection weights and the einsum each is read with (models/layers/*.py).
ATTENTION_SPECS = {"wq": "BLD,DHK->BLHK", "wk": "BLD,DGK->BLGK", "wv": "BLD,DGK->BLGK", "wo": "BLHK,HKD->BLD"}
MLP_SPECS = {"w_gate": "BLD,DF->BLF", "w_up": "BLD,DF->BLF", "w_down": "BLF,FD->BLD"}
HEAD_SPECS = {"lm_head": "BLD,DV->BLV"}
MODES = ("none", "int8", "int4", "w8a8")


# ---------------------------------------------------------------- models


@dataclasses.dataclass(frozen=True)
class Site:
    """One projection weight of a model: where it is, how it is read, and its role."""

    path: str
    param: nnx.Param
    spec: str
    kind: str  # "attention", "mlp" or "head"


def projection_sites(model: nnx.Module) -> Iterator[Site]:
    """The projection weights `quantize_model` handles (see the module docstring for the choice)."""
    for path, node in nnx.iter_graph(model):
        prefix = "/".join(map(str, path))
        groups = []
        if isinstance(node, Attention):
            groups.append(("attention", node, ATTENTION_SPECS))
        if isinstance(node, Block) and isinstance(getattr(node, "mlp", None), SwiGLU):
            groups.append(("mlp", node.mlp, MLP_SPECS))  # MoE shared experts are SwiGLUs too: not these
        if isinstance(node, LMHead) and not node.tied:
            groups.append(("head", node, HEAD_SPECS))
        for kind, module, specs in groups:
            sub = prefix + ("/mlp" if kind == "mlp" else "")
            for name, spec in specs.items():
                yield Site(f"{sub}/{name}".lstrip("/"), getattr(module, name), spec, kind)


def _format_of(mode: str, kind: str) -> str:
    if mode == "w8a8":
        return "w8a8" if kind == "mlp" else "int8"
    return mode


def quantize_model(model: nnx.Module, mode: str, group_size: int = 32) -> None:
    """Replaces the projection weights of `model` (in place) by their `mode` quantization.

    mode: "none" (leave as is), "int8", "int4" (groups of `group_size` inputs) or "w8a8"
    (MLP weights and activations int8, other projections int8 weight-only). The
    quantization runs as one jitted program.

    >>> from meshwork.config_sections import ModelConfig
    >>> from meshwork.models.transformer import Transformer
    >>> model = Transformer(ModelConfig(vocab_size=16, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1,
    ...                                 d_ff=64), rngs=nnx.Rngs(0))
    >>> before = weight_bytes(model)
    >>> quantize_model(model, "int4")
    >>> q = model.blocks.attn.wq.get_value()      # (layers, D, H, K) = (2, 64, 2, 32)
    >>> type(q).__name__, q.values.shape, q.scales.shape
    ('Int4Weight', (2, 32, 2, 32), (2, 2, 2, 32))
    >>> weight_bytes(model)["projections"] == before["projections"] // 8 + before["projections"] // 32
    True
    """
    if mode not in MODES:
        raise ValueError(f"quantization mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "none":
        return
    sites = list(projection_sites(model))
    for site in sites:
        if isinstance(site.param.get_value(), QuantizedWeight):
            raise ValueError(
                f"{site.path} is already quantized; quantize a model with float weights (load the run again)"
            )
    fmts = [_format_of(mode, s.kind) for s in sites]

    if mode == "int4":
        for s in sites:  # checked here, where the weight's path can be named
            int4_axis(s.spec, s.param.get_value().shape, group_size, s.path)

    @jax.jit
    def run(weights):
        return [quantize_weight(w, s.spec, f, group_size) for w, s, f in zip(weights, sites, fmts)]

    for site, q in zip(sites, run([s.param.get_value() for s in sites])):
        site.param.set_value(q)


def weight_bytes(model: nnx.Module) -> dict[str, int]:
    """Bytes of the model's weights: `projections` (quantized or not, scales included),
    `projections_f32` (what those would take in float32), `other` (every other variable:
    embedding, norms, biases, experts, buffers) and `total` (projections + other).
    See `quantize_model` for an example.
    """
    sites = {id(s.param): s for s in projection_sites(model)}
    proj = proj_f32 = other = 0
    for _, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Variable):
            continue
        value = node.get_value()
        if id(node) in sites:
            proj += nbytes(value)
            proj_f32 += 4 * math.prod(value.shape)
        else:
            other += nbytes(value)
    return {"projections": proj, "projections_f32": proj_f32, "other": other, "total": proj + other}


def describe(model: nnx.Module) -> Mapping[str, str]:
    """path -> format ("float32", "int8", "int4", "w8a8") of each projection weight."""
    out = {}
    for s in projection_sites(model):
        v = s.param.get_value()
        out[s.path] = v.format if isinstance(v, QuantizedWeight) else str(jnp.dtype(v.dtype))
    return out
