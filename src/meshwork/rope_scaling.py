"""The RoPE scalings meshwork computes (models/layers/rope.py) and the keys each takes, in
Hugging Face's `rope_scaling` form: here, below the models, so that the config checks a
`model.rope_scaling` before anything is built."""

from __future__ import annotations

from typing import Any

# Per rope_type: (required keys, optional keys) besides rope_type itself.
ROPE_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "dynamic": (("factor", "original_max_position_embeddings"), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"),
    ),
}
# Keys transformers keeps beside the type's own; harmless here (theta is passed separately).
_IGNORED_KEYS = ("rope_type", "type", "rope_theta")


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    """The rope_type of an HF-style scaling dict, checking its keys.

    >>> rope_type_of({"rope_type": "linear", "factor": 2.0})
    'linear'
    """
    if scaling is None:
        return "default"
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type is None:
        raise ValueError(f"rope_scaling={scaling!r} has no 'rope_type'; set one of {sorted(ROPE_KEYS)}")
    if rope_type not in ROPE_KEYS:
        raise ValueError(f"rope_scaling rope_type {rope_type!r} is not implemented; use one of {sorted(ROPE_KEYS)}")
    required, optional = ROPE_KEYS[rope_type]
    for key in required:
        if scaling.get(key) is None:
            raise ValueError(f"rope_scaling={scaling!r}: rope_type {rope_type!r} needs the key {key!r}")
    for key in scaling:
        if key not in required + optional + _IGNORED_KEYS:
            raise ValueError(
                f"rope_scaling={scaling!r}: key {key!r} is not used by rope_type {rope_type!r} "
                f"(it takes {sorted(required + optional)})"
            )
    return rope_type
