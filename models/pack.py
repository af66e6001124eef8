"""Packing a language model's projection weights for the CPU matmul kernel, for serving on one CPU.

    model, tokenizer, stops = load_lm("runs/lm_tiny", None)
    pack_for_cpu_decode(model)       # in place: wq ... w_down, lm_head as PackedWeight; returns how many

Decode on the CPU reads every projection weight once per step, and XLA:CPU's one-thread dot reads
it at about half of what both cores can (kernels/cpu_matmul.py). Packed, the same products run
the C++ kernel on every thread, for decode steps and prefill chunks alike; the values are those of
the plain weights (up to summation order). The weights packed are the ones
quantization reads (models/quantize.py `projection_sites`), float32 only: quantized, LoRA-wrapped
or bf16 projections and the MoE experts stay as they are. A head tied to the embedding gets its
own packed copy of the table, transposed, and stops being tied: the lookup keeps the table, so the
model holds V x D more floats but a decode step reads no more, and the head (as large as the
layers together in a small model with a large vocabulary) no longer runs XLA's one-thread dot.
Packing is for inference: the kernel has no gradient, so do not train a packed model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshwork.kernels import cpu_matmul
from meshwork.models.layers.packed import pack_weight
from meshwork.models.quantize import HEAD_SPECS, projection_sites
from meshwork.models.transformer import LMHead


def unsupported_reason(model: nnx.Module) -> str | None:
    """Why packing would not help `model` here (None: it would): the kernel runs on one CPU device,
    float32 weights and computation."""
    if jax.default_backend() != "cpu":
        return f"the default backend is {jax.default_backend()}, not cpu"
    if jnp.dtype(getattr(model, "dtype", jnp.float32)) != jnp.float32:
        return f"the model computes in {jnp.dtype(model.dtype)}; the kernel is float32"
    return cpu_matmul.unavailable_reason()


def _tied_heads(model: nnx.Module) -> list[LMHead]:
    """The model's float32 heads that read the embedding table as their projection."""
    table = getattr(getattr(model, "embed", None), "table", None)
    if table is None or table.get_value().dtype != jnp.float32:
        return []
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, LMHead) and node.tied]


def pack_for_cpu_decode(model: nnx.Module) -> int:
    """Packs `model`'s float32 projection weights in place (see the module docstring) where
    `unsupported_reason` is None, and returns how many it packed (0 where it is not None)."""
    if unsupported_reason(model) is not None:
        return 0
    sites = [
        s
        for s in projection_sites(model)
        if isinstance(s.param.get_value(), jax.Array) and s.param.get_value().dtype == jnp.float32
    ]
    heads = _tied_heads(model)
    head_spec = HEAD_SPECS["lm_head"]

    @jax.jit
    def run(weights, table_VD):
        packed = [pack_weight(w, s.spec) for w, s in zip(weights, sites)]
        return packed, pack_weight(table_VD.T, head_spec) if heads else None

    packed, head_DV = run([s.param.get_value() for s in sites], model.embed.table.get_value() if heads else None)
    for site, weight in zip(sites, packed):
        site.param.set_value(weight)
    for head in heads:  # one LMHead, shared where an MTP module projects through it too
        head.lm_head, head.tied = nnx.Param(head_DV), False
    return len(sites) + len(heads)
