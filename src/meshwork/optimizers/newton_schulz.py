"""Muon's Newton-Schulz orthogonalization of stacks of matrices, on one device or sharded two ways.

The iteration (Jordan et al., 2024) maps X (normalized to Frobenius norm 1) to
a X + b (X Xᵀ) X + c (X Xᵀ)² X = a X + X (b XᵀX + c (XᵀX)²), five times, pushing every singular
value toward 1 while keeping the singular vectors: the update is ~ U Vᵀ of the momentum.

When the matrix is split over devices (FSDP's rows, tensor parallelism's columns), there are two
ways to run it (config `optimizer.muon.newton_schulz`):

- gather: every matrix is assembled whole on one owner device, iterated there, and sent back.
  Matrices of the same block shape are batched; all-to-alls over the mesh axes that split the
  rows and columns hand each device 1/n of the batch whole, and each device that holds a copy
  (data parallelism, or an axis that splits neither dimension) takes its own 1/n of that, so the
  owners are spread round-robin over every device that holds a piece or a copy (the batch is
  padded with zero matrices to a multiple of n). The results are all-gathered over the copies
  and all-to-all'ed back. Per device: a few passes over the momentum's bytes, and 1/n of the
  iterations' FLOPs.
- sharded: every device iterates on its own block. The Gram product is taken over the split
  dimension and all-reduced (Xᵀ X when the rows are split, X Xᵀ when the columns are); when both
  are split, the dimension split over fewer devices is all-gathered first. Per device and step:
  an all-reduce of a (side x side) Gram matrix per iteration, and every holder of the matrix
  computes that Gram's square, the same on all of them.

Which one moves fewer bytes depends on the shapes: the planner (perf/planner_optimizer.py) counts
both, and tests/test_planner_optimizer.py holds its counts to the compiled HLO. Under FSDP the
split side is usually the short one (embed), so the sharded variant's Gram is the long side
squared: llama7b on 64 H100s plans 542.6 GB sent per step per device for it against gather's
1.11 GB. It pays where the split side is the long one (tensor parallelism's MLP and heads).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from meshwork.optimizers.matrices import MatrixLayout

COEFFS = (3.4445, -4.775, 2.0315)  # the quintic's a, b, c (Jordan et al.; optax.contrib.muon's too)
EPS = 1e-7
VARIANTS = ("gather", "sharded")
SCOPE = "newton_schulz"


def newton_schulz(x_kmn: jax.Array, steps: int) -> jax.Array:
    """The orthogonalized stack of whole matrices x_kmn (k matrices, m x n), on one device. The
    Gram matrix is taken over the longer side, so it is min(m, n) square."""
    if x_kmn.shape[1] > x_kmn.shape[2]:
        return jnp.swapaxes(newton_schulz(jnp.swapaxes(x_kmn, 1, 2), steps), 1, 2)
    return _iterate(x_kmn, steps, lambda s: s, gram_of_rows=False)


def _iterate(x, steps: int, reduce, *, gram_of_rows: bool):
    """The iteration on x (k, m, n), with `reduce` summing partial sums over the devices that split
    the contracted side. gram_of_rows: G = Xᵀ X (n x n, contracting the rows) and X <- aX + X(bG + cG²);
    else G = X Xᵀ (m x m) and X <- aX + (bG + cG²)X."""
    a, b, c = COEFFS
    x = x / (jnp.sqrt(reduce(jnp.sum(jnp.square(x), axis=(1, 2), keepdims=True))) + EPS)
    for _ in range(steps):
        if gram_of_rows:
            gram = reduce(jnp.swapaxes(x, 1, 2) @ x)
            x = a * x + x @ (b * gram + c * gram @ gram)
        else:
            gram = reduce(x @ jnp.swapaxes(x, 1, 2))
            x = a * x + (b * gram + c * gram @ gram) @ x
    return x


@dataclasses.dataclass(frozen=True)
class Placement:
    """A matrix stack's layout and the mesh axes (of size > 1) that split its batch, rows and columns."""

    layout: MatrixLayout
    spec: PartitionSpec
    rows: tuple[str, ...]
    cols: tuple[str, ...]
    copies: tuple[str, ...]
    """Mesh axes that split none of its dimensions: each device along them holds the same block."""

    @property
    def splits(self) -> tuple[str, ...]:
        return self.rows + self.cols

    def block(self, shape: Sequence[int], mesh_shape: Mapping[str, int]) -> tuple[int, int, int]:
        """(matrices, rows, columns) of the block one device holds of a weight of global `shape`."""
        split = [d // axes_size(_axes(s), mesh_shape) for d, s in zip(shape, self.spec, strict=True)]
        return self.layout.shape(split)


def _axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, one name, or a tuple; PartitionSpec keeps ("a",) as "a")."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def placement(
    layout: MatrixLayout, shape: Sequence[int], spec: PartitionSpec, mesh_shape: Mapping[str, int]
) -> Placement:
    """The Placement of a weight of global `shape` laid out by `spec` on a mesh of `mesh_shape`.
    Raises ValueError when a row or column dimension other than the first of its group is split
    (its block would not be a contiguous block of the flattened matrix)."""
    spec = PartitionSpec(*tuple(spec) + (None,) * (len(shape) - len(spec)))
    dims = [tuple(a for a in _axes(s) if mesh_shape[a] > 1) for s in spec]
    first_row, first_col = layout.n_batch, layout.n_batch + layout.n_rows
    for d in range(first_row, len(shape)):
        if dims[d] and d not in (first_row, first_col):
            raise ValueError(f"dimension {d} of a {tuple(shape)} matrix stack is split ({spec}); Muon needs it whole")
    used = {a for axes in dims for a in axes}
    copies = tuple(a for a, n in mesh_shape.items() if n > 1 and a not in used)
    return Placement(layout, PartitionSpec(*(d or None for d in dims)), dims[first_row], dims[first_col], copies)


def axes_size(axes: Sequence[str], mesh_shape: Mapping[str, int]) -> int:
    """Devices along `axes` together."""
    return math.prod(mesh_shape[a] for a in axes)


def orthogonalize(values: list[jax.Array], placements: list[Placement], variant: str, steps: int) -> list[jax.Array]:
    """Each of `values` (a stack of matrices laid out as its placement says) orthogonalized, on
    the current mesh (`jax.set_mesh`) by `variant` ("gather" or "sharded")."""
    if variant not in VARIANTS:
        raise ValueError(f"newton_schulz={variant!r}; choose one of {', '.join(VARIANTS)}")
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or all(not p.splits and not p.copies for p in placements):
        return [_whole(v, p.layout, steps) for v, p in zip(values, placements, strict=True)]
    mesh_shape = dict(mesh.shape)
    run = _gathered if variant == "gather" else _sharded
    specs = [p.spec for p in placements]
    # The scope names this part of the compiled step: the dry run reads its collectives by it.
    with jax.named_scope(SCOPE):
        return jax.shard_map(
            lambda *blocks: run(list(blocks), placements, steps, mesh_shape),
            mesh=mesh,
            in_specs=tuple(specs),
            out_specs=specs,
            check_vma=False,
        )(*values)


def _whole(value: jax.Array, layout: MatrixLayout, steps: int) -> jax.Array:
    return newton_schulz(value.reshape(layout.shape(value.shape)), steps).reshape(value.shape)


def _sharded(blocks, placements, steps, mesh_shape):
    return [_sharded_one(x, p, steps, mesh_shape) for x, p in zip(blocks, placements, strict=True)]


def _sharded_one(block: jax.Array, p: Placement, steps: int, mesh_shape) -> jax.Array:
    x = block.reshape(p.layout.shape(block.shape))
    rows, cols = p.rows, p.cols
    gathered = None  # (dimension of x, its axes): split both ways, the side split over fewer devices is gathered
    if rows and cols:
        gathered = (1, rows) if axes_size(rows, mesh_shape) < axes_size(cols, mesh_shape) else (2, cols)
        x = jax.lax.all_gather(x, gathered[1], axis=gathered[0], tiled=True)
        rows, cols = (() if gathered[0] == 1 else rows), (() if gathered[0] == 2 else cols)
    if rows or cols:
        split = rows or cols
        x = _iterate(x, steps, lambda s: jax.lax.psum(s, split), gram_of_rows=bool(rows))
    else:
        x = newton_schulz(x, steps)
    if gathered is not None:
        dim, axes = gathered
        n = x.shape[dim] // axes_size(axes, mesh_shape)
        x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axes) * n, n, axis=dim)
    return x.reshape(block.shape)


def _gathered(blocks, placements, steps, mesh_shape):
    """Matrices of the same block shape and placement go through the owners together."""
    groups: dict[tuple, list[int]] = {}
    for i, (x, p) in enumerate(zip(blocks, placements, strict=True)):
        _, r, c = p.layout.shape(x.shape)
        groups.setdefault((r, c, p.rows, p.cols, p.copies), []).append(i)
    out = list(blocks)
    for (_, _, rows, cols, copies), members in groups.items():
        stacks = [blocks[i].reshape(placements[i].layout.shape(blocks[i].shape)) for i in members]
        done = _through_owners(jnp.concatenate(stacks), rows, cols, copies, steps, mesh_shape)
        start = 0
        for i, stack in zip(members, stacks, strict=True):
            out[i] = done[start : start + stack.shape[0]].reshape(blocks[i].shape)
            start += stack.shape[0]
    return out


def _through_owners(x, rows, cols, copies, steps, mesh_shape):
    """x (k, rows block, columns block): every matrix assembled on its owner, iterated, sent back."""
    n = axes_size(rows + cols + copies, mesh_shape)
    k = x.shape[0]
    x = jnp.pad(x, ((0, -k % n), (0, 0), (0, 0)))
    # The minor axis of a dimension first: its blocks are the adjacent ones.
    for axes, dim in ((rows, 1), (cols, 2)):
        for axis in reversed(axes):
            x = jax.lax.all_to_all(x, axis, split_axis=0, concat_axis=dim, tiled=True)
    if copies:
        share = x.shape[0] // axes_size(copies, mesh_shape)
        x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(copies) * share, share, axis=0)
    x = newton_schulz(x, steps)
    if copies:
        x = jax.lax.all_gather(x, copies, axis=0, tiled=True)
    for axes, dim in ((cols, 2), (rows, 1)):
        for axis in axes:
            x = jax.lax.all_to_all(x, axis, split_axis=dim, concat_axis=0, tiled=True)
    return x[:k]
