"""Rotary position embeddings (Su et al., 2021), in the "rotate half" layout
used by Llama and Hugging Face, so their weights load without permutation.

Scaled variants (`scaling`, Hugging Face's `rope_scaling` dict) follow
transformers' `modeling_rope_utils` step for step, in float32 as it does, so
checkpoints trained with them give transformers' logits:

  linear   every frequency divided by `factor` (positions / factor)
  llama3   Llama 3.1's band smoothing: long wavelengths divided by `factor`,
           short ones kept, a linear blend in between
  dynamic  dynamic NTK: the base grows with the call's sequence length
           (max position + 1) once it passes `original_max_position_embeddings`
  yarn     YaRN: a ramp between interpolated and extrapolated frequencies, and
           cos/sin multiplied by an attention factor (0.1 ln(factor) + 1 by default)

tests/test_rope_scaling.py compares against transformers' own numbers
(tests/fixtures/make_rope_golden.py).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshwork.rope_scaling import rope_type_of


def rope_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None = None, seq_len: int | jax.Array | None = None
) -> tuple[np.ndarray | jax.Array, float]:
    """Inverse frequencies (head_dim // 2,) float32 and the cos/sin scale, as transformers computes them.

    `seq_len` (max position + 1 of the call, may be traced) matters only for
    rope_type "dynamic"; None means no longer than the original context. The
    frequencies are a numpy constant except for "dynamic" with a traced seq_len:
    numpy's float32 arithmetic rounds as torch's does (XLA's CPU division can
    differ by an ulp, which position 40 turns into ~1e-6 in cos).

    >>> inv_freq, scale = rope_frequencies(8, 10000.0, {"rope_type": "linear", "factor": 4.0})
    >>> inv_freq.shape, float(inv_freq[0]), scale
    ((4,), 0.25, 1.0)
    """
    rope_type = rope_type_of(scaling)
    dim = head_dim
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    # theta ** exponents rounded once to float32 (numpy's float32 pow is off by up to 2 ulps, torch's by 1).
    pos_freqs = (np.float64(theta) ** exponents.astype(np.float64)).astype(np.float32)
    inv_freq = 1.0 / pos_freqs
    if rope_type == "default":
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, factor, scaling), 1.0
    if rope_type == "dynamic":
        return _dynamic_ntk(
            exponents, dim, theta, factor, int(scaling["original_max_position_embeddings"]), seq_len
        ), 1.0
    return _yarn(pos_freqs, dim, theta, factor, scaling)


def _llama3(inv_freq: np.ndarray, factor: float, s: dict[str, Any]) -> np.ndarray:
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_context = int(s["original_max_position_embeddings"])
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    # torch evaluates `scalar / tensor` as reciprocal(tensor) * scalar; so do we, to round alike.
    wavelen = (1 / inv_freq) * (2 * math.pi)
    # Long wavelengths (beyond the old context / low) are interpolated by `factor`, short ones kept.
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = ((1 / wavelen) * old_context - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled)


def _dynamic_ntk(
    exponents: np.ndarray, dim: int, theta: float, factor: float, original: int, seq_len: int | jax.Array | None
) -> jax.Array:
    # transformers recomputes from seq_len = max(position_ids) + 1, never below the original context,
    # in float32 (seq_len is a tensor there); at or below it the base is theta itself.
    seq = jnp.maximum(jnp.asarray(original if seq_len is None else seq_len), original).astype(jnp.float32)
    base = theta * ((factor * seq / original) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base**exponents)


def _yarn(pos_freqs: np.ndarray, dim: int, theta: float, factor: float, s: dict[str, Any]) -> tuple[np.ndarray, float]:
    original = int(s["original_max_position_embeddings"])

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:  # DeepSeek's form: the ratio cancels when both are equal
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = inv_freq_interpolation * (1 - extrapolation) + inv_freq_extrapolation * extrapolation
    return inv_freq, float(attention_factor)


def rope_cos_sin(
    positions_BL: jax.Array, head_dim: int, theta: float, scaling: dict[str, Any] | None = None
) -> tuple[jax.Array, jax.Array]:
    """cos and sin (B, L, head_dim // 2) float32 at `positions_BL`, scaled as transformers scales them.

    transformers' cos/sin repeat these twice along the last axis ("rotate half").
    rope_type "dynamic" takes its sequence length from max(positions_BL) + 1, as
    transformers does for each forward call.

    >>> cos, sin = rope_cos_sin(jnp.arange(3)[None], 8, 10000.0)
    >>> cos.shape
    (1, 3, 4)
    """
    seq_len = None
    if rope_type_of(scaling) == "dynamic":
        seq_len = jnp.max(positions_BL) + 1
    inv_freq, scale = rope_frequencies(head_dim, theta, scaling, seq_len)
    angles_BLk = positions_BL[..., None].astype(jnp.float32) * inv_freq
    cos, sin = jnp.cos(angles_BLk), jnp.sin(angles_BLk)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos, sin


def apply_rope(
    x_BLHK: jax.Array, positions_BL: jax.Array, theta: float, scaling: dict[str, Any] | None = None
) -> jax.Array:
    """Rotates pairs (i, i + K/2) of the last dimension by position-dependent angles.

    `scaling` is Hugging Face's rope_scaling dict (None: plain RoPE). With
    rope_type "dynamic" the frequencies depend on max(positions_BL) + 1, so a
    KV-cache decode step rotates its new key with frequencies the cached keys
    did not use; transformers does the same.
    """
    cos, sin = rope_cos_sin(positions_BL, x_BLHK.shape[-1], theta, scaling)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHK.dtype)
