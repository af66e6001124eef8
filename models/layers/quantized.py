"""Quantized weight formats: what an `nnx.Param` holds in place of a float projection weight.

Each format is an `nnx.Param` value: a pytree dataclass with `matmul(spec, x, dtype)`):

- `Int8Weight` ("int8"): int8 values, symmetric, one float32 scale per output
  channel (absmax over the contracted dims / 127). `scales` has the weight's
  rank with the contracted dims of size 1. The dot reads the int8 values
  converted to the compute dtype (exact: |q| <= 127) and the scales multiply
  its output. On GPU XLA can fuse the convert into the dot; on CPU it writes
  the converted copy of the layer's weight first, which makes weight-only
  formats slower there than float32 (benchmarks/quantize.py).
- `Int4Weight` ("int4"): values in [-8, 7], two per byte (int8) along the
  weight's last contracted dim, element 2i in the low nibble and 2i+1 in the
  high one, so a contiguous slice of bytes is a contiguous slice of values and
  the packed dim can be split over a mesh like the original. One float32 scale
  per group of `group_size` consecutive inputs of that dim and per output
  channel (absmax / 7). For `wo` (H, K, D) that dim is head_dim K, so the group
  size must divide head_dim as well as d_model and d_ff. Unpacking (two shifts) and the multiply by the scales
  happen inside the jitted matmul, per layer inside the scan: on GPU XLA can
  fuse them into the dot's operand; on CPU the one layer's dequantized weight is
  a temporary. Either way the stored weight stays 4-bit.
- `W8A8Weight` ("w8a8", MLP only): int8 weights as `Int8Weight`; the
  activations are quantized on the fly, one scale per token (absmax over the
  contracted dim / 127), and the product is an int8 x int8 dot accumulated in
  int32, rescaled by both scales in float32. Attention and the head use
  `Int8Weight` in this mode.

Memory, per projection of n float32 values with C contracted inputs per output
channel: float32 4n bytes; int8 n + 4n/C (a quarter, plus the scales); int4
n/2 + 4n/group_size (an eighth, plus the scales: with the default group of 32
that is another 1/32 of the f32 size, so 5/32 of it in all).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

F32 = jnp.float32
INT8_MAX, INT4_MAX = 127, 7


def parse_spec(spec: str) -> tuple[str, str, str]:
    """'BLD,DF->BLF' -> ('BLD', 'DF', 'BLF')."""
    inputs, out = spec.replace(" ", "").split("->")
    x, w = inputs.split(",")
    return x, w, out


def contracted_axes(w_letters: str, out: str, ndim: int) -> tuple[int, ...]:
    """Axes of a weight (possibly with leading stacked axes) that the einsum contracts."""
    lead = ndim - len(w_letters)
    if lead < 0:
        raise ValueError(f"a weight of rank {ndim} cannot be read as {w_letters!r}")
    return tuple(lead + i for i, c in enumerate(w_letters) if c not in out)


def _to_out(s: jax.Array, letters: str, out: str) -> jax.Array:
    """Reshapes `s`, whose dims are `letters` (each in `out`), to broadcast against an `out` array."""
    order = sorted(range(len(letters)), key=lambda i: out.index(letters[i]))
    s = jnp.transpose(s, order)
    return s.reshape([s.shape[order.index(letters.index(c))] if c in letters else 1 for c in out])


def _check_rank(q: QuantizedWeight, w_letters: str) -> None:
    if q.scales.ndim != len(w_letters):
        raise ValueError(
            f"a quantized weight of shape {q.shape} read as {w_letters!r}: a stacked weight must "
            f"be sliced per layer (lax.scan over the layers) before its matmul"
        )


def _output_scale(scales: jax.Array, w_letters: str, out: str) -> jax.Array:
    """Per-output-channel scales (contracted dims of size 1), arranged to multiply the einsum output."""
    keep = "".join(c for c in w_letters if c in out)
    return _to_out(scales.reshape([n for c, n in zip(w_letters, scales.shape) if c in out]), keep, out)


# ---------------------------------------------------------------- int4 packing


def pack_int4(values: jax.Array, axis: int) -> jax.Array:
    """int8 values in [-8, 7] -> int8 bytes, two per byte along `axis` (even length):
    element 2i in the low nibble, 2i+1 in the high nibble.

    >>> v = jnp.array([-8, 7, 0, -1], jnp.int8)
    >>> bool((unpack_int4(pack_int4(v, 0), 0) == v).all())
    True
    """
    axis = axis % values.ndim
    n = values.shape[axis]
    if n % 2:
        raise ValueError(f"int4 packing needs an even length along axis {axis}, got {n}")
    pairs = values.astype(jnp.int8).reshape(*values.shape[:axis], n // 2, 2, *values.shape[axis + 1 :])
    lo, hi = jnp.take(pairs, 0, axis=axis + 1), jnp.take(pairs, 1, axis=axis + 1)
    return jnp.left_shift(hi, 4) | (lo & 0xF)


def unpack_int4(packed: jax.Array, axis: int) -> jax.Array:
    """Inverse of `pack_int4`: int8 bytes -> int8 values in [-8, 7], twice as long along `axis`."""
    axis = axis % packed.ndim
    # Arithmetic shifts of a signed byte sign-extend each nibble.
    lo = jnp.right_shift(jnp.left_shift(packed, 4), 4)
    hi = jnp.right_shift(packed, 4)
    shape = (*packed.shape[:axis], 2 * packed.shape[axis], *packed.shape[axis + 1 :])
    return jnp.stack([lo, hi], axis=axis + 1).reshape(shape)


# ---------------------------------------------------------------- the formats


class QuantizedWeight:
    """Common helpers; subclasses are frozen pytree dataclasses holding arrays."""

    format = ""

    def matmul(self, spec: str, x: jax.Array, dtype: jnp.dtype) -> jax.Array:
        raise NotImplementedError

    def dequantize(self, dtype: jnp.dtype = F32) -> jax.Array:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Stored bytes: values and scales."""
        return nbytes(self)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the float weight this stands for."""
        return tuple(self.values.shape)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values", "scales"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Int8Weight(QuantizedWeight):
    """int8 `values` (the weight's shape) and float32 `scales` (contracted dims of size 1)."""

    values: jax.Array
    scales: jax.Array
    format = "int8"

    def dequantize(self, dtype: jnp.dtype = F32) -> jax.Array:
        return (self.values.astype(F32) * self.scales).astype(dtype)

    def matmul(self, spec: str, x: jax.Array, dtype: jnp.dtype) -> jax.Array:
        _, w_letters, out = parse_spec(spec)
        _check_rank(self, w_letters)
        if any(c not in out and n != 1 for c, n in zip(w_letters, self.scales.shape)):
            return jnp.einsum(spec, x, self.dequantize(dtype))  # read along other dims than it was quantized for
        y = jnp.einsum(spec, x, self.values.astype(dtype), preferred_element_type=F32)
        return (y * _output_scale(self.scales, w_letters, out)).astype(dtype)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values", "scales"], meta_fields=["axis"])
@dataclasses.dataclass(frozen=True)
class Int4Weight(QuantizedWeight):
    """Packed int4 `values` (int8, the weight's shape with dim `axis` halved) and float32
    `scales` (the weight's shape with dim `axis` cut to its number of groups).

    `axis` counts from the end, so it names the same dim with or without the layers axis.
    """

    values: jax.Array
    scales: jax.Array
    axis: int
    format = "int4"

    @property
    def shape(self) -> tuple[int, ...]:
        s = list(self.values.shape)
        s[self.axis] *= 2
        return tuple(s)

    @property
    def group_size(self) -> int:
        return self.shape[self.axis] // self.scales.shape[self.axis]

    def dequantize(self, dtype: jnp.dtype = F32) -> jax.Array:
        v = unpack_int4(self.values, self.axis)
        ax = self.axis % v.ndim
        groups = v.reshape(*v.shape[:ax], self.scales.shape[ax], self.group_size, *v.shape[ax + 1 :])
        w = groups.astype(F32) * jnp.expand_dims(self.scales, ax + 1)
        return w.reshape(v.shape).astype(dtype)

    def matmul(self, spec: str, x: jax.Array, dtype: jnp.dtype) -> jax.Array:
        _check_rank(self, parse_spec(spec)[1])
        return jnp.einsum(spec, x, self.dequantize(dtype))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values", "scales"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class W8A8Weight(Int8Weight):
    """`Int8Weight` whose matmul also quantizes the activations (per token) and multiplies in int8."""

    format = "w8a8"

    def matmul(self, spec: str, x: jax.Array, dtype: jnp.dtype) -> jax.Array:
        x_letters, w_letters, out = parse_spec(spec)
        _check_rank(self, w_letters)
        x_q, x_scales = quantize_activations(x, tuple(i for i, c in enumerate(x_letters) if c not in out))
        y = jnp.einsum(spec, x_q, self.values, preferred_element_type=jnp.int32)
        x_keep = "".join(c for c in x_letters if c in out)
        x_s = _to_out(x_scales.reshape([n for c, n in zip(x_letters, x_scales.shape) if c in out]), x_keep, out)
        return (y.astype(F32) * x_s * _output_scale(self.scales, w_letters, out)).astype(dtype)


FORMATS = {"int8": Int8Weight, "int4": Int4Weight, "w8a8": W8A8Weight}


def int4_axis(spec: str, shape: tuple[int, ...], group_size: int, name: str = "weight") -> int:
    """The dim int4 groups and packs (the weight's last contracted one); checks `group_size` fits it."""
    _, w_letters, out = parse_spec(spec)
    ax = contracted_axes(w_letters, out, len(shape))[-1]
    n = shape[ax]
    if group_size < 2 or n % group_size or group_size % 2:
        letter = w_letters[ax - (len(shape) - len(w_letters))]
        raise ValueError(
            f"int4 group_size={group_size} must be even and divide the input dim {letter}={n} "
            f"of {name} (read as {spec!r}); choose an even divisor of {n}"
        )
    return ax


def quantize_activations(x: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """(int8 values, float32 scales with `axes` of size 1): symmetric, absmax over `axes` / 127."""
    x = x.astype(F32)
    scales = jnp.max(jnp.abs(x), axis=axes, keepdims=True) / INT8_MAX
    scales = jnp.where(scales == 0, 1.0, scales)  # an all-zero row stays zero
    return jnp.clip(jnp.round(x / scales), -INT8_MAX, INT8_MAX).astype(jnp.int8), scales


@functools.partial(jax.jit, static_argnames=("spec", "fmt", "group_size"))
def quantize_weight(w: jax.Array, spec: str, fmt: str, group_size: int = 32) -> QuantizedWeight:
    """`w` (read as `einsum(spec, x, w)`, possibly with leading stacked axes) in format `fmt`.

    Scales are per output channel (int8, w8a8) or per group of `group_size` inputs along the
    last contracted dim and per output channel (int4); leading stacked axes are kept.

    >>> q = quantize_weight(jnp.ones((4, 64, 8)), "BLD,DF->BLF", "int4")   # 4 layers, D=64, F=8
    >>> q.values.shape, q.scales.shape
    ((4, 32, 8), (4, 2, 8))
    """
    if fmt not in FORMATS:
        raise ValueError(f"weight format {fmt!r}; choose one of {', '.join(FORMATS)}")
    _, w_letters, out = parse_spec(spec)
    contracted = contracted_axes(w_letters, out, w.ndim)
    w = w.astype(F32)
    if fmt != "int4":
        scales = jnp.max(jnp.abs(w), axis=contracted, keepdims=True) / INT8_MAX
        scales = jnp.where(scales == 0, 1.0, scales)
        values = jnp.clip(jnp.round(w / scales), -INT8_MAX, INT8_MAX).astype(jnp.int8)
        return FORMATS[fmt](values, scales)
    ax = int4_axis(spec, w.shape, group_size)
    n = w.shape[ax]
    groups = w.reshape(*w.shape[:ax], n // group_size, group_size, *w.shape[ax + 1 :])
    scales = jnp.max(jnp.abs(groups), axis=ax + 1, keepdims=True) / INT4_MAX
    scales = jnp.where(scales == 0, 1.0, scales)
    values = jnp.clip(jnp.round(groups / scales), -8, 7).astype(jnp.int8).reshape(w.shape)
    return Int4Weight(pack_int4(values, ax), jnp.squeeze(scales, ax + 1), ax - w.ndim)


def nbytes(value) -> int:
    """Bytes of an array or of a quantized weight's arrays (abstract shapes work too)."""
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(value))
