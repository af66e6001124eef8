"""Packing a language model's projection weights for the CPU matmul kernel, for serving on one CPU.

    model, tokenizer, stops = load_lm("runs/lm_tiny", None)
    pack_for_cpu_decode(model)       # in place: wq ... w_down, lm_head as PackedWeight; returns how many

Decode on the CPU reads every projection weight once per step, and XLA:CPU's one-thread dot reads
it at about half of what both cores can (kernels/cpu_matmul.py). Packed, the same products run
the C++ kernel on every thread, for decode steps and prefill chunks alike; the values are those of
the plain weights (up to summation order). The weights packed are the ones
quantization reads (models/quantize.py `projection_sites`), float32 only: quantized, LoRA-wrapped
or bf16 projections and the MoE experts stay as they are. Packing is for inference: the kernel
has no gradient, so do not train a packed model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshwork.kernels import cpu_matmul
from meshwork.models.layers.packed import pack_weight
from meshwork.models.quantize import projection_sites


def unsupported_reason(model: nnx.Module) -> str | None:
    """Why packing would not help `model` here (None: it would): the kernel runs on one CPU device,
    float32 weights and computation."""
    if jax.default_backend() != "cpu":
        return f"the default backend is {jax.default_backend()}, not cpu"
    if jnp.dtype(getattr(model, "dtype", jnp.float32)) != jnp.float32:
        return f"the model computes in {jnp.dtype(model.dtype)}; the kernel is float32"
    return cpu_matmul.unavailable_reason()


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
    run = jax.jit(lambda weights: [pack_weight(w, s.spec) for w, s in zip(weights, sites)])
    for site, packed in zip(sites, run([s.param.get_value() for s in sites])):
        site.param.set_value(packed)
    return len(sites)
