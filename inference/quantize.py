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

Formats (each an `nnx.Param` value: a pytree dataclass with `matmul(spec, x, dtype)`):

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
from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.layers.attention import Attention
from models.layers.mlp import SwiGLU
from models.transformer import Block, LMHead
from sharding.rules import Rules, logical_to_spec

F32 = jnp.float32
MODES = ("none", "int8", "int4", "w8a8")
INT8_MAX, INT4_MAX = 127, 7

# module type -> its projection weights and the einsum each is read with (models/layers/*.py).
ATTENTION_SPECS = {"wq": "BLD,DHK->BLHK", "wk": "BLD,DGK->BLGK", "wv": "BLD,DGK->BLGK", "wo": "BLHK,HKD->BLD"}
MLP_SPECS = {"w_gate": "BLD,DF->BLF", "w_up": "BLD,DF->BLF", "w_down": "BLF,FD->BLD"}
HEAD_SPECS = {"lm_head": "BLD,DV->BLV"}


def _parse(spec: str) -> tuple[str, str, str]:
    """'BLD,DF->BLF' -> ('BLD', 'DF', 'BLF')."""
    inputs, out = spec.replace(" ", "").split("->")
    x, w = inputs.split(",")
    return x, w, out


def _contracted_axes(w_letters: str, out: str, ndim: int) -> tuple[int, ...]:
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
        raise ValueError(f"a quantized weight of shape {q.shape} read as {w_letters!r}: a stacked weight must "
                         f"be sliced per layer (lax.scan over the layers) before its matmul")


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
    pairs = values.astype(jnp.int8).reshape(*values.shape[:axis], n // 2, 2, *values.shape[axis + 1:])
    lo, hi = jnp.take(pairs, 0, axis=axis + 1), jnp.take(pairs, 1, axis=axis + 1)
    return jnp.left_shift(hi, 4) | (lo & 0xF)


def unpack_int4(packed: jax.Array, axis: int) -> jax.Array:
    """Inverse of `pack_int4`: int8 bytes -> int8 values in [-8, 7], twice as long along `axis`."""
    axis = axis % packed.ndim
    # Arithmetic shifts of a signed byte sign-extend each nibble.
    lo = jnp.right_shift(jnp.left_shift(packed, 4), 4)
    hi = jnp.right_shift(packed, 4)
    shape = (*packed.shape[:axis], 2 * packed.shape[axis], *packed.shape[axis + 1:])
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
        return _nbytes(self)

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
        _, w_letters, out = _parse(spec)
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
        groups = v.reshape(*v.shape[:ax], self.scales.shape[ax], self.group_size, *v.shape[ax + 1:])
        w = groups.astype(F32) * jnp.expand_dims(self.scales, ax + 1)
        return w.reshape(v.shape).astype(dtype)

    def matmul(self, spec: str, x: jax.Array, dtype: jnp.dtype) -> jax.Array:
        _check_rank(self, _parse(spec)[1])
        return jnp.einsum(spec, x, self.dequantize(dtype))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values", "scales"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class W8A8Weight(Int8Weight):
    """`Int8Weight` whose matmul also quantizes the activations (per token) and multiplies in int8."""

    format = "w8a8"

    def matmul(self, spec: str, x: jax.Array, dtype: jnp.dtype) -> jax.Array:
        x_letters, w_letters, out = _parse(spec)
        _check_rank(self, w_letters)
        x_q, x_scales = quantize_activations(x, tuple(i for i, c in enumerate(x_letters) if c not in out))
        y = jnp.einsum(spec, x_q, self.values, preferred_element_type=jnp.int32)
        x_keep = "".join(c for c in x_letters if c in out)
        x_s = _to_out(x_scales.reshape([n for c, n in zip(x_letters, x_scales.shape) if c in out]), x_keep, out)
        return (y.astype(F32) * x_s * _output_scale(self.scales, w_letters, out)).astype(dtype)


FORMATS = {"int8": Int8Weight, "int4": Int4Weight, "w8a8": W8A8Weight}


def _int4_axis(spec: str, shape: tuple[int, ...], group_size: int, name: str = "weight") -> int:
    """The dim int4 groups and packs (the weight's last contracted one); checks `group_size` fits it."""
    _, w_letters, out = _parse(spec)
    ax = _contracted_axes(w_letters, out, len(shape))[-1]
    n = shape[ax]
    if group_size < 2 or n % group_size or group_size % 2:
        letter = w_letters[ax - (len(shape) - len(w_letters))]
        raise ValueError(f"int4 group_size={group_size} must be even and divide the input dim {letter}={n} "
                         f"of {name} (read as {spec!r}); choose an even divisor of {n}")
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
    _, w_letters, out = _parse(spec)
    contracted = _contracted_axes(w_letters, out, w.ndim)
    w = w.astype(F32)
    if fmt != "int4":
        scales = jnp.max(jnp.abs(w), axis=contracted, keepdims=True) / INT8_MAX
        scales = jnp.where(scales == 0, 1.0, scales)
        values = jnp.clip(jnp.round(w / scales), -INT8_MAX, INT8_MAX).astype(jnp.int8)
        return FORMATS[fmt](values, scales)
    ax = _int4_axis(spec, w.shape, group_size)
    n = w.shape[ax]
    groups = w.reshape(*w.shape[:ax], n // group_size, group_size, *w.shape[ax + 1:])
    scales = jnp.max(jnp.abs(groups), axis=ax + 1, keepdims=True) / INT4_MAX
    scales = jnp.where(scales == 0, 1.0, scales)
    values = jnp.clip(jnp.round(groups / scales), -8, 7).astype(jnp.int8).reshape(w.shape)
    return Int4Weight(pack_int4(values, ax), jnp.squeeze(scales, ax + 1), ax - w.ndim)


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

    >>> from meshwork.config import ModelConfig
    >>> from models.transformer import Transformer
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
            raise ValueError(f"{site.path} is already quantized; quantize a model with float weights "
                             f"(load the run again)")
    fmts = [_format_of(mode, s.kind) for s in sites]

    if mode == "int4":
        for s in sites:  # checked here, where the weight's path can be named
            _int4_axis(s.spec, s.param.get_value().shape, group_size, s.path)

    @jax.jit
    def run(weights):
        return [quantize_weight(w, s.spec, f, group_size) for w, s, f in zip(weights, sites, fmts)]

    for site, q in zip(sites, run([s.param.get_value() for s in sites])):
        site.param.set_value(q)


def _nbytes(value) -> int:
    """Bytes of an array or of a quantized weight's arrays (abstract shapes work too)."""
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(value))


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
            proj += _nbytes(value)
            proj_f32 += 4 * math.prod(value.shape)
        else:
            other += _nbytes(value)
    return {"projections": proj, "projections_f32": proj_f32, "other": other, "total": proj + other}


def validation_loss(model: nnx.Module, batches: list[dict[str, np.ndarray]]) -> float:
    """Mean next-token cross-entropy over `batches`, computed as the trainer's val_loss is
    (train/step.py's loss without auxiliary terms): how much a quantization costs.

    `batches`: e.g. `train.task.make_task(cfg).eval_batches()`, the trainer's own set.
    """
    from train.step import make_loss_fn

    graphdef, params, buffers = nnx.split(model, nnx.Param, ...)
    loss_fn = jax.jit(make_loss_fn(graphdef))
    return float(np.mean([loss_fn(params, buffers, b)[1]["loss"] for b in batches]))


# ---------------------------------------------------------------- sharding


def _fit_sharding(names, shape: tuple[int, ...], mesh: Mesh, rules: Rules) -> NamedSharding:
    """The sharding the logical `names` give, with every dim its mesh axes do not divide replicated."""
    if not names:
        return NamedSharding(mesh, PartitionSpec())
    spec = []
    for axes, n in zip(logical_to_spec(names, rules), shape):
        axes_t = (axes,) if isinstance(axes, str) else tuple(axes or ())
        size = math.prod(mesh.shape[a] for a in axes_t)
        spec.append(axes if axes_t and n % size == 0 else None)
    return NamedSharding(mesh, PartitionSpec(*spec))


def param_shardings(params_state, mesh: Mesh, rules: Rules):
    """NamedShardings for a model's variables, plain or quantized: a tree like `params_state`
    (from `nnx.split` / `nnx.state`) with a NamedSharding in place of every array.

    Each array follows its Variable's logical names (`out_sharding`); the arrays
    of a quantized weight have the float weight's rank, and each of their dims
    inherits the name of the dim it comes from (the packed int4 dim, a dim of
    groups of scales). A dim that its mesh axes do not divide (a scale dim of
    size 1, say) is replicated instead.

    >>> from sharding.mesh import make_mesh
    >>> from sharding.rules import rules_for
    >>> w = nnx.Param(quantize_weight(jnp.ones((2, 8, 4)), "BLD,DF->BLF", "int8"),
    ...               out_sharding=("layers", "embed", "mlp"), eager_sharding=False)
    >>> sh = param_shardings(w, make_mesh({"tensor": 2, "data": -1}), rules_for("tp"))
    >>> sh.get_value().values.spec, sh.get_value().scales.spec
    (P(None, None, 'tensor'), P(None, None, 'tensor'))
    """
    def for_variable(var):
        names = var.get_metadata().get("out_sharding")
        return jax.tree.map(lambda a: _fit_sharding(names, tuple(np.shape(a)), mesh, rules), var)

    return jax.tree.map(for_variable, params_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def describe(model: nnx.Module) -> Mapping[str, str]:
    """path -> format ("float32", "int8", "int4", "w8a8") of each projection weight."""
    out = {}
    for s in projection_sites(model):
        v = s.param.get_value()
        out[s.path] = v.format if isinstance(v, QuantizedWeight) else str(jnp.dtype(v.dtype))
    return out
