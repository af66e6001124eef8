"""Magnitude pruning of a language model's projection weights: unstructured and 2:4.

    cfg, model, step = load_run("runs/lm_tiny")
    params, masks = prune_model(model, "2:4")        # dense params with zeros, and the masks
    nnx.update(model, params)                        # the pruned model (dense storage)
    compact_model(model)                             # in place: 2:4 weights stored compactly
    weight_bytes(model)                              # models/quantize.py's accounting

What is pruned: the projections `models/quantize.py` quantizes (attention
`wq wk wv wo`, the dense SwiGLU's `w_gate w_up w_down`, an untied `lm_head`),
each matrix on its own: a stacked weight's leading `layers` axis is a batch of
matrices, and each layer gets its own threshold.

- "unstructured": in every matrix the `round(fraction * size)` weights of
  smallest |w| are set to zero (ties broken by position, so the count is exact).
- "2:4" (semi-structured, the pattern sparse tensor cores run): in every group
  of 4 consecutive weights along the input dim, the 2 of smallest |w| are zero.
  The input dim is the weight's last contracted one, as for int4 groups: D of
  `wq`/`wk`/`wv`/`w_gate`/`w_up`/`lm_head`, F of `w_down`, head_dim K of `wo`.

`Sparse24Weight` stores a 2:4 weight compactly: the 2 kept values of every
group (the weight's dtype, so half the dense values) and their positions 0..3
in the group as 2-bit indices, 4 to a uint8 byte. Per group of 4 weights that
is 2 values + 4 bits: for float32, 8.5 of 16 bytes, 17/32 = 0.53125 of dense
(values 1/2, indices 1/32); for bfloat16, 4.5 of 8 bytes (indices 1/16).

Its matmul, which `models.layers.params.matmul` dispatches to like a quantized
weight's, rebuilds the layer's dense weight inside the jitted matmul (one layer
at a time under the layer scan, like int4's dequantization) and calls one dot:
on CPU that is the fast way, and XLA has no sparse dot to call instead.
`matmul_24_gather` is the other way, for a 2-D weight: it gathers the inputs
each kept value multiplies and never builds the dense matrix, at the price of
a (tokens, kept values) temporary; it is tested against the dense product and
timed by benchmarks/sparsity.py, not used by the model.

Masked fine-tuning: `apply_masks(params, masks)` zeroes the pruned weights of
a params tree (a model's `nnx.State` or the trainer's `state.params`);
re-applied after every optimizer step it keeps the sparsity pattern fixed while
the kept weights recover (`meshwork.train.sparse_recovery.recover`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from meshwork.models.layers.quantized import contracted_axes, nbytes, parse_spec
from meshwork.models.quantize import projection_sites

METHODS = ("unstructured", "2:4")
GROUP, KEEP = 4, 2  # 2:4: keep 2 of every 4
INDEX_BITS, INDICES_PER_BYTE = 2, 4


def input_axis(spec: str, ndim: int) -> int:
    """The dim of a weight (read as `einsum(spec, x, w)`, maybe with leading stacked axes) that 2:4
    groups run along: its last contracted one, counted from the end (the same with or without layers).

    >>> input_axis("BLHK,HKD->BLD", 4)       # wo (layers, H, K, D): head_dim K
    -2
    """
    _, w_letters, out = parse_spec(spec)
    return contracted_axes(w_letters, out, ndim)[-1] - ndim


# ---------------------------------------------------------------- masks


@functools.partial(jax.jit, static_argnames=("fraction", "lead"))
def unstructured_mask(w: jax.Array, fraction: float = 0.5, lead: int = 0) -> jax.Array:
    """True where `w` is kept: in each matrix (the dims after the first `lead`), the
    `round(fraction * size)` entries of smallest |w| are False, ties broken by position.

    >>> unstructured_mask(jnp.array([[0.1, -3.0], [2.0, 0.0]]), 0.5).tolist()
    [[False, True], [True, False]]
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"pruning fraction {fraction} must be between 0 and 1")
    batch, matrix = w.shape[:lead], w.shape[lead:]
    flat = jnp.abs(w.astype(jnp.float32)).reshape(math.prod(batch), -1)
    n_zero = round(fraction * flat.shape[1])
    order = jnp.argsort(flat, axis=1, stable=True)  # ascending |w|; equal values keep their order
    rank = jnp.argsort(order, axis=1)  # each entry's place in that order
    return (rank >= n_zero).reshape(*batch, *matrix)


def _groups_last(w: jax.Array, axis: int) -> jax.Array:
    """`w` with dim `axis` moved last and split into (groups, 4)."""
    w = jnp.moveaxis(w, axis, -1)
    n = w.shape[-1]
    if n % (GROUP * INDICES_PER_BYTE // KEEP):
        raise ValueError(
            f"2:4 sparsity needs the input dim (axis {axis}, {n}) to be a multiple of 8: groups of 4, "
            f"and the 2-bit indices of 2 groups fill a byte"
        )
    return w.reshape(*w.shape[:-1], n // GROUP, GROUP)


def _check_groups(site) -> None:
    """2:4's shape check, where the weight's path can be named."""
    w = site.param.get_value()
    try:
        jax.eval_shape(functools.partial(_groups_last, axis=input_axis(site.spec, w.ndim)), w)
    except ValueError as e:
        raise ValueError(f"{site.path}: {e}") from None


def _kept_positions(groups: jax.Array) -> jax.Array:
    """(..., groups, 4) -> (..., groups, 2) int32: the positions of the 2 largest |w| in each group, ascending."""
    # Descending |w|, stable: of equal magnitudes the earlier position is kept.
    order = jnp.argsort(-jnp.abs(groups.astype(jnp.float32)), axis=-1, stable=True)
    return jnp.sort(order[..., :KEEP], axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("axis",))
def mask_24(w: jax.Array, axis: int) -> jax.Array:
    """True where `w` is kept under 2:4 sparsity along `axis`: in each group of 4 consecutive
    entries the 2 of largest |w| (of equal ones, the earlier).

    >>> mask_24(jnp.array([[1.0, -4.0, 3.0, 0.5, 0, 0, 2, 2]]), axis=1).astype(int).tolist()
    [[0, 1, 1, 0, 0, 0, 1, 1]]
    """
    groups = _groups_last(w, axis)
    keep = jax.nn.one_hot(_kept_positions(groups), GROUP, dtype=jnp.bool_).any(axis=-2)
    return jnp.moveaxis(keep.reshape(*groups.shape[:-2], -1), -1, axis)


def prune_weight(w: jax.Array, spec: str, method: str, fraction: float = 0.5) -> tuple[jax.Array, jax.Array]:
    """(pruned `w`, its mask) for a projection weight read as `einsum(spec, x, w)`; leading
    stacked axes are separate matrices. `fraction` is used by "unstructured" only (2:4 is 1/2).
    """
    if method not in METHODS:
        raise ValueError(f"pruning method {method!r}; choose one of {', '.join(METHODS)}")
    lead = w.ndim - len(parse_spec(spec)[1])
    mask = unstructured_mask(w, fraction, lead) if method == "unstructured" else mask_24(w, input_axis(spec, w.ndim))
    return jnp.where(mask, w, jnp.zeros((), w.dtype)), mask


def prune_model(model: nnx.Module, method: str = "2:4", fraction: float = 0.5) -> tuple[nnx.State, dict]:
    """Magnitude-prunes the projection weights of `model` (left unchanged): returns the model's
    params (`nnx.State` of its `nnx.Param`s) with the pruned weights dense with zeros, and the
    masks ({weight path: bool array, True = kept}, for `apply_masks`).

    `nnx.update(model, params)` makes the model the pruned one. From a train state:
    `prune_model(nnx.merge(trainer.graphdef, state.params, state.buffers), ...)`.

    >>> from meshwork.config_sections import ModelConfig
    >>> from meshwork.models.transformer import Transformer
    >>> model = Transformer(ModelConfig(vocab_size=16, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1,
    ...                                 d_ff=64), rngs=nnx.Rngs(0))
    >>> params, masks = prune_model(model, "2:4")
    >>> sorted(masks)[:2], float(masks["blocks/mlp/w_up"].mean())
    (['blocks/attn/wk', 'blocks/attn/wo'], 0.5)
    """
    if method not in METHODS:
        raise ValueError(f"pruning method {method!r}; choose one of {', '.join(METHODS)}")
    pruned = nnx.clone(model)
    sites = list(projection_sites(pruned))
    for s in sites:
        w = s.param.get_value()
        if not isinstance(w, jax.Array):
            raise ValueError(f"{s.path} is stored as {type(w).__name__}; prune a model with float weights")
        if method == "2:4":
            _check_groups(s)

    @jax.jit
    def run(weights):  # one program for the whole model
        return [prune_weight(w, s.spec, method, fraction) for w, s in zip(weights, sites)]

    masks = {}
    for s, (w, masks[s.path]) in zip(sites, run([s.param.get_value() for s in sites])):
        s.param.set_value(w)
    return nnx.state(pruned, nnx.Param), masks


def _path_str(path) -> str:
    """A key path of a params tree -> "blocks/attn/wq", as `projection_sites` names weights."""
    keys = (k for k in path if not isinstance(k, jax.tree_util.GetAttrKey))  # a Variable's `.value`
    return "/".join(str(getattr(k, "key", getattr(k, "idx", ""))) for k in keys)


def apply_masks(params, masks: dict):
    """`params` (a tree keyed like the model: an `nnx.State` or nested dicts) with every weight named
    in `masks` multiplied by its mask. Jit it to re-apply masks between training steps.

    >>> apply_masks({"w": jnp.ones(3), "b": jnp.ones(1)}, {"w": jnp.array([True, False, True])})["w"].tolist()
    [1.0, 0.0, 1.0]
    """

    def one(path, leaf):
        mask = masks.get(_path_str(path))
        return leaf if mask is None else jnp.where(mask, leaf, jnp.zeros((), leaf.dtype))

    return jax.tree_util.tree_map_with_path(one, params)


def sparsity(model: nnx.Module) -> dict[str, float]:
    """path -> fraction of zeros, for each projection weight (compact 2:4 ones count as 1/2)."""
    out = {}
    for s in projection_sites(model):
        w = s.param.get_value()
        out[s.path] = 0.5 if isinstance(w, Sparse24Weight) else float(jnp.mean(w == 0))
    return out


# ---------------------------------------------------------------- compact 2:4


def pack_indices(idx: jax.Array) -> jax.Array:
    """int positions 0..3 -> uint8, 4 per byte along the last dim (a multiple of 4): element 4i
    in bits 0-1, 4i+1 in bits 2-3, and so on.

    >>> pack_indices(jnp.array([1, 3, 0, 2])).tolist()
    [141]
    """
    i = idx.astype(jnp.uint8).reshape(*idx.shape[:-1], -1, INDICES_PER_BYTE)
    shifts = jnp.arange(INDICES_PER_BYTE, dtype=jnp.uint8) * INDEX_BITS
    return jnp.bitwise_or.reduce(jnp.left_shift(i, shifts), axis=-1)


def unpack_indices(packed: jax.Array) -> jax.Array:
    """Inverse of `pack_indices`: uint8 -> int32 positions, 4 times as long along the last dim."""
    shifts = jnp.arange(INDICES_PER_BYTE, dtype=jnp.uint8) * INDEX_BITS
    i = jnp.right_shift(packed[..., None], shifts) & 0b11
    return i.reshape(*packed.shape[:-1], -1).astype(jnp.int32)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values", "indices"], meta_fields=["axis"])
@dataclasses.dataclass(frozen=True)
class Sparse24Weight:
    """A 2:4-sparse weight: `values` (the weight's dtype and shape with dim `axis` halved: the 2
    kept values of each group of 4, in position order) and `indices` (uint8, dim `axis` cut to
    an eighth: the kept positions 0..3, 2 bits each, 4 per byte, in the order of `values`).

    `axis` counts from the end, so it names the same dim with or without the layers axis.
    """

    values: jax.Array
    indices: jax.Array
    axis: int
    format = "2:4"

    @property
    def shape(self) -> tuple[int, ...]:
        s = list(self.values.shape)
        s[self.axis] *= GROUP // KEEP
        return tuple(s)

    @property
    def nbytes(self) -> int:
        return nbytes(self)

    def densify(self, dtype: jnp.dtype | None = None) -> jax.Array:
        """The dense weight, zeros included."""
        ax = self.axis % self.values.ndim
        rest = self.values.ndim - ax - 1  # dims after the grouped one: broadcast over, never moved
        shape = self.values.shape
        v = self.values.reshape(*shape[:ax], shape[ax] // KEEP, KEEP, *shape[ax + 1 :])  # (..., groups, 2, ...)
        shifts = (jnp.arange(INDICES_PER_BYTE, dtype=jnp.uint8) * INDEX_BITS).reshape(-1, *(1,) * rest)
        pos = jnp.right_shift(jnp.expand_dims(self.indices, ax + 1), shifts) & 0b11  # (..., bytes, 4, ...)
        pos = pos.reshape(v.shape)
        # Each group: its 2 kept values, each selected into the place its position names (exact, no
        # scatter); two selects added beat a reduction over a one-hot axis by 2x on CPU.
        slots = jnp.arange(GROUP, dtype=jnp.uint8).reshape(-1, *(1,) * rest)
        zero = jnp.zeros((), v.dtype)
        w = sum(
            jnp.where(
                jax.lax.slice_in_dim(pos, k, k + 1, axis=ax + 1) == slots,
                jax.lax.slice_in_dim(v, k, k + 1, axis=ax + 1),
                zero,
            )
            for k in range(KEEP)
        )
        w = w.reshape(self.shape)  # (..., groups, 4, ...) -> (..., n, ...)
        return w if dtype is None else w.astype(dtype)

    def matmul(self, spec: str, x: jax.Array, dtype: jnp.dtype) -> jax.Array:
        if self.values.ndim != len(parse_spec(spec)[1]):
            raise ValueError(
                f"a 2:4 weight of shape {self.shape} read as {spec!r}: a stacked weight must be sliced "
                f"per layer (lax.scan over the layers) before its matmul"
            )
        return jnp.einsum(spec, x, self.densify(dtype))


@functools.partial(jax.jit, static_argnames=("spec",))
def compact_24(w: jax.Array, spec: str) -> Sparse24Weight:
    """The compact 2:4 form of `w` (read as `einsum(spec, x, w)`): its 2 largest |w| of every group
    of 4 along the input dim. `w` need not be pruned already; its pruned form is `.densify()`.

    >>> c = compact_24(jnp.ones((3, 64, 96)), "BLD,DF->BLF")   # 3 layers, D=64, F=96
    >>> c.values.shape, c.indices.shape, c.indices.dtype
    ((3, 32, 96), (3, 8, 96), dtype('uint8'))
    """
    axis = input_axis(spec, w.ndim)
    groups = _groups_last(w, axis)
    pos = _kept_positions(groups)
    values = jnp.take_along_axis(groups, pos, axis=-1)
    values = jnp.moveaxis(values.reshape(*values.shape[:-2], -1), -1, axis)
    indices = jnp.moveaxis(pack_indices(pos.reshape(*pos.shape[:-2], -1)), -1, axis)
    return Sparse24Weight(values, indices, axis)


def compact_bytes(shape: tuple[int, ...], dtype: jnp.dtype) -> dict[str, int]:
    """Bytes of a 2:4 weight of `shape` (input dim last or anywhere: only its size matters) and
    `dtype`: values (half the dense values), indices (2 bits per kept value) and dense.

    >>> compact_bytes((128, 384), jnp.float32)
    {'values': 98304, 'indices': 6144, 'total': 104448, 'dense': 196608}
    """
    n, item = math.prod(shape), jnp.dtype(dtype).itemsize
    values, indices = n // 2 * item, n // 2 * INDEX_BITS // 8
    return {"values": values, "indices": indices, "total": values + indices, "dense": n * item}


def compact_model(model: nnx.Module) -> None:
    """Replaces every projection weight of `model` (in place) by its compact 2:4 form, which the
    model's matmul reads directly. A weight that is not 2:4 sparse yet is pruned to it.
    """
    sites = list(projection_sites(model))
    for s in sites:
        if not isinstance(s.param.get_value(), jax.Array):
            raise ValueError(
                f"{s.path} is stored as {type(s.param.get_value()).__name__}; compact a model with float weights"
            )
        _check_groups(s)

    @jax.jit
    def run(weights):
        return [compact_24(w, s.spec) for w, s in zip(weights, sites)]

    for site, c in zip(sites, run([s.param.get_value() for s in sites])):
        site.param.set_value(c)


@jax.jit
def matmul_24_gather(x_TD: jax.Array, w: Sparse24Weight) -> jax.Array:
    """`x_TD @ w` for a 2-D 2:4 weight (D, F) stored compactly with D its input dim, without building
    the dense (D, F) matrix: each kept value multiplies the input its index points at,
    y[t, f] = sum_k x[t, 4 (k // 2) + idx[k, f]] * values[k, f] over the D/2 kept k (axis `d` below: half of D).
    The gathered inputs are a (T, D/2, F) temporary: cheaper than the dense weight only for T < 2.

    >>> w = compact_24(jnp.eye(8), "TD,DF->TF")
    >>> matmul_24_gather(jnp.arange(8.0)[None], w).tolist()
    [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]]
    """
    if w.values.ndim != 2 or w.axis != -2:
        raise ValueError(
            f"matmul_24_gather takes a 2-D weight (D, F) grouped along D; got values of shape "
            f"{w.values.shape} grouped along axis {w.axis}"
        )
    pos = unpack_indices(w.indices.T).T  # (D/2, F)
    rows = pos + (jnp.arange(pos.shape[0]) // KEEP * GROUP)[:, None]  # the input each kept value reads
    x_TdF = jnp.take(x_TD, rows, axis=1)
    return jnp.einsum("TdF,dF->TF", x_TdF, w.values.astype(x_TD.dtype))
