"""gpt-oss's MoE tensors (transformers' `GptOssMLP`) as meshwork's `MoE` parameters, and back.

Hugging Face keeps one layer's experts as stacked tensors, not one per expert, with the gate and
up projections fused and interleaved along the output axis (gate at even columns, up at odd):

    router.weight               (E, D)       -> router    (D, E)  transposed (an nn.Linear)
    router.bias                 (E,)         -> b_router  (E,)
    experts.gate_up_proj        (E, D, 2F)   -> w_gate, w_up  (E, D, F)  columns 0::2, 1::2
    experts.gate_up_proj_bias   (E, 2F)      -> b_gate, b_up  (E, F)     columns 0::2, 1::2
    experts.down_proj           (E, F, D)    -> w_down    (E, F, D)
    experts.down_proj_bias      (E, D)       -> b_down    (E, D)

Only copies and transposes: both directions are exact to the bit in any dtype. (The released
gpt-oss checkpoints store the expert weights as MXFP4 `*_blocks` / `*_scales`; dequantize them
to these names first.)

    >>> gate_up = np.arange(12, dtype=np.float32).reshape(1, 2, 6)
    >>> w_gate, w_up = split_gate_up(gate_up)
    >>> w_gate[0].tolist(), w_up[0].tolist()
    ([[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]], [[1.0, 3.0, 5.0], [7.0, 9.0, 11.0]])
    >>> bool((fuse_gate_up(w_gate, w_up) == gate_up).all())
    True
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

HF_NAMES = (
    "router.weight",
    "router.bias",
    "experts.gate_up_proj",
    "experts.gate_up_proj_bias",
    "experts.down_proj",
    "experts.down_proj_bias",
)
"""GptOssMLP's tensor names, relative to the layer's `mlp.` (`model.layers.{i}.mlp.` in a checkpoint)."""


def split_gate_up(gate_up: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(gate, up) from Hugging Face's fused last axis of 2F columns, gate at the even ones.

    Works for the weight (E, D, 2F) and the bias (E, 2F) alike; each result is contiguous.
    """
    gate_up = np.asarray(gate_up)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up has an odd last axis {gate_up.shape}; it must hold 2F interleaved columns")
    return np.ascontiguousarray(gate_up[..., 0::2]), np.ascontiguousarray(gate_up[..., 1::2])


def fuse_gate_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """The inverse of `split_gate_up`: (..., F) twice -> (..., 2F), gate at even columns, up at odd."""
    gate, up = np.asarray(gate), np.asarray(up)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {gate.shape} {gate.dtype} and up {up.shape} {up.dtype} must match to be fused")
    return np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])


def moe_params_from_hf(tensors: Mapping[str, np.ndarray], prefix: str = "") -> dict[str, np.ndarray]:
    """meshwork `MoE` parameters (router, b_router, w_gate, w_up, w_down, b_gate, b_up, b_down) from
    one layer's GptOssMLP tensors named `prefix + HF_NAMES[i]` (e.g. prefix "model.layers.0.mlp.").

    The result matches `nnx.to_pure_dict(nnx.state(moe, nnx.Param))` of a `MoE` built with
    router_bias and expert_bias (the MoEConfig of gpt-oss).
    """
    missing = [prefix + n for n in HF_NAMES if prefix + n not in tensors]
    if missing:
        raise KeyError(f"gpt-oss MoE tensors missing: {missing}; expected the names {HF_NAMES} after {prefix!r}")
    t = {n: np.asarray(tensors[prefix + n]) for n in HF_NAMES}
    w_gate, w_up = split_gate_up(t["experts.gate_up_proj"])
    b_gate, b_up = split_gate_up(t["experts.gate_up_proj_bias"])
    return {
        "router": np.ascontiguousarray(t["router.weight"].T),
        "b_router": t["router.bias"],
        "w_gate": w_gate,
        "w_up": w_up,
        "w_down": t["experts.down_proj"],
        "b_gate": b_gate,
        "b_up": b_up,
        "b_down": t["experts.down_proj_bias"],
    }


def moe_params_to_hf(params: Mapping[str, np.ndarray], prefix: str = "") -> dict[str, np.ndarray]:
    """The inverse of `moe_params_from_hf`: GptOssMLP's tensors, contiguous, named `prefix + HF_NAMES[i]`."""
    p = {k: np.asarray(v) for k, v in params.items()}
    hf = {
        "router.weight": np.ascontiguousarray(p["router"].T),
        "router.bias": p["b_router"],
        "experts.gate_up_proj": fuse_gate_up(p["w_gate"], p["w_up"]),
        "experts.gate_up_proj_bias": fuse_gate_up(p["b_gate"], p["b_up"]),
        "experts.down_proj": p["w_down"],
        "experts.down_proj_bias": p["b_down"],
    }
    return {prefix + n: np.ascontiguousarray(hf[n]) for n in HF_NAMES}
