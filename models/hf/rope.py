"""RoPE settings between a Hugging Face config.json and meshwork's
(`rope_theta`, `rope_scaling`), for models/layers/rope.py.

transformers 5 writes `rope_parameters` (rope_type, rope_theta and the type's
keys); earlier versions wrote `rope_theta` and `rope_scaling` (with `type` or
`rope_type`). When both dicts are present transformers 5 uses `rope_scaling`,
and so does `rope_from_hf`.
"""

from __future__ import annotations

from typing import Any

from meshwork.rope_scaling import ROPE_KEYS, rope_type_of

SUPPORTED_ROPE_TYPES = tuple(ROPE_KEYS)


def rope_from_hf(hf_config: dict[str, Any], kind: str, default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) of a Hugging Face config.json dict; scaling is None for plain RoPE.

    The scaling dict holds exactly the keys rope.py reads. `original_max_position_embeddings`
    is filled in where transformers fills it: from `max_position_embeddings` when
    llama3/yarn omit it, and always from `max_position_embeddings` for dynamic
    (transformers' dynamic NTK grows past that length). Raises ValueError naming
    the key for a rope_type meshwork does not implement (longrope, mrope, ...),
    a missing key, or partial_rotary_factor != 1.

    >>> rope_from_hf({"rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}}, "llama", 1e4)
    (500000.0, {'rope_type': 'linear', 'factor': 2.0})
    >>> rope_from_hf({"rope_theta": 1e6, "rope_scaling": None}, "qwen2", 1e4)
    (1000000.0, None)
    """
    c = hf_config
    key = "rope_scaling" if c.get("rope_scaling") else "rope_parameters"
    p = dict(c.get(key) or {})
    if any(isinstance(v, dict) for v in p.values()):
        raise ValueError(
            f"{kind} config {key}={p!r}: per-layer-type RoPE parameters are not implemented; "
            "meshwork uses one RoPE for every layer"
        )
    partial = p.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if partial is not None and partial != 1.0:
        raise ValueError(f"{kind} config partial_rotary_factor={partial}: meshwork rotates the whole head_dim")
    theta = float(p.get("rope_theta") or c.get("rope_theta") or default_theta)
    rope_type = p.get("rope_type", p.get("type")) or "default"
    if "mrope_section" in p or "mrope" in str(rope_type):
        raise ValueError(f"{kind} config {key}={p!r}: multimodal RoPE (mrope_section) is not implemented")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{kind} config {key}={p!r}: rope_type {rope_type!r} is not implemented; "
            f"meshwork reads {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None

    def need(name: str) -> Any:
        if p.get(name) is None:
            raise ValueError(f"{kind} config {key}={p!r}: rope_type {rope_type!r} needs the key {name!r}")
        return p[name]

    def max_positions(why: str) -> int:
        if c.get("max_position_embeddings") is None:
            raise ValueError(
                f"{kind} config has no 'max_position_embeddings', which rope_type {rope_type!r} "
                f"needs {why}; add it to config.json"
            )
        return int(c["max_position_embeddings"])

    scaling: dict[str, Any] = {"rope_type": rope_type}
    if rope_type == "dynamic":
        # transformers' dynamic NTK ignores any original_max_position_embeddings: the model's
        # max_position_embeddings is the length past which the base grows.
        scaling["factor"] = float(need("factor"))
        scaling["original_max_position_embeddings"] = max_positions("as the length the base starts growing at")
    elif rope_type in ("llama3", "yarn"):
        original = p.get("original_max_position_embeddings")
        if original is None:
            original = max_positions("when original_max_position_embeddings is omitted")
        factor = p.get("factor")
        if factor is None and rope_type == "yarn":  # DeepSeek-V3's form: the ratio of the two lengths
            factor = max_positions("when factor is omitted") / original
        if factor is None:
            need("factor")
        scaling["factor"] = float(factor)
        scaling["original_max_position_embeddings"] = int(original)
        if rope_type == "llama3":
            scaling["low_freq_factor"] = float(need("low_freq_factor"))
            scaling["high_freq_factor"] = float(need("high_freq_factor"))
        else:
            for name in ROPE_KEYS["yarn"][1]:
                if p.get(name) is not None:
                    scaling[name] = bool(p[name]) if name == "truncate" else float(p[name])
    else:
        scaling["factor"] = float(need("factor"))
    return theta, scaling


def rope_to_hf(theta: float, scaling: dict[str, Any] | None) -> dict[str, Any]:
    """The config.json keys for meshwork's (rope_theta, rope_scaling), in both forms.

    transformers 5 reads `rope_parameters`; earlier versions `rope_theta` and
    `rope_scaling` (transformers 5 also reads `rope_scaling`, ahead of
    `rope_parameters`, so the two agree). For rope_type "dynamic" it also sets
    `max_position_embeddings` to the original context, the length transformers'
    dynamic NTK grows from: merge this dict after the other keys.

    >>> rope_to_hf(10000.0, None)
    {'rope_theta': 10000.0, 'rope_parameters': {'rope_type': 'default', 'rope_theta': 10000.0}}
    >>> rope_to_hf(5e5, {"rope_type": "linear", "factor": 2.0})["rope_scaling"]
    {'rope_type': 'linear', 'factor': 2.0}
    """
    theta = float(theta)
    rope_type = rope_type_of(scaling)  # raises ValueError for an unknown type or a missing key
    if rope_type == "default":
        return {"rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    required, optional = ROPE_KEYS[rope_type]
    keys = {k: scaling[k] for k in required + optional if scaling.get(k) is not None}
    out: dict[str, Any] = {"rope_theta": theta}
    if rope_type == "dynamic":
        out["max_position_embeddings"] = int(keys.pop("original_max_position_embeddings"))
    out["rope_parameters"] = {"rope_type": rope_type, "rope_theta": theta, **keys}
    out["rope_scaling"] = {"rope_type": rope_type, **keys}
    return out
