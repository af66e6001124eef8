"""Collective matmul: tensor-parallel projections whose all-gather or reduce-scatter
is cut into a ring of `ppermute` steps, each overlapped with a partial matmul.

Under Megatron sequence parallelism (the `sp` preset) each device of the
`tensor` axis (n devices) holds C = L/n tokens of the residual stream. A
tensor-parallel MLP gathers them, multiplies by its columns of the first
weights, and reduce-scatters the product with its rows of the last one:

    plain:  h_BLF = all_gather(x_BCD) @ w_DF      out_BCD = psum_scatter(h_BLF @ w_FD)

and every device waits while each collective runs. Collective matmul (Wang
et al., ASPLOS 2023, "Overlap communication with dependent computation via
decomposition in large deep learning models"; the collective matmul of the
shard_map docs, MaxText and praxis) cuts each into n partial matmuls and n-1
sends around a ring (device i sends to i+1):

- `all_gather_matmul`: in step s device i holds sequence chunk (i - s) mod n.
  It sends that chunk on to i+1 and, in the same step, multiplies it by its
  columns; the send and the matmul read the same chunk and neither needs the
  other, so XLA can run them at once. After n-1 sends every chunk has visited
  every device.
- `matmul_reduce_scatter`: in step s device i adds its partial product of
  chunk (i - s - 1) mod n to the running sum that arrived from i-1 and sends it
  to i+1. The partial product does not depend on the receive (only the add
  does), so it runs while the sum is in flight. The sum that reaches device i
  in step n-1 is chunk i's, complete.

Bytes: each device sends n-1 chunks of 1/n of the gathered (or summed) tensor
of S bytes, (n-1)/n * S, which is exactly what a ring all-gather or
reduce-scatter sends: the decomposition hides the transfer behind compute, it
does not shrink it (`sharding/hlo.py` reads the same bytes from both programs).
Autodiff transposes each `ppermute` into one around the ring the other way, so
the backward pass of one ring is the other kind of ring: a step with these has
collective-permutes where the plain one has all-gathers and reduce-scatters.
The overlap pays off where collectives run asynchronously (GPU, TPU); the CPU
backend runs them synchronously, so there the rings only prove the structure.

    >>> from meshwork.sharding.mesh import make_mesh
    >>> mesh = make_mesh({"data": 2, "tensor": 4})
    >>> x = jnp.ones((2, 8, 16)); w_gate = w_up = jnp.ones((16, 32)); w_down = jnp.ones((32, 16))
    >>> y = jax.jit(lambda *a: tp_mlp(*a, mesh=mesh))(x, w_gate, w_up, w_down)
    >>> y.shape, y.sharding.spec
    ((2, 8, 16), P('data', 'tensor'))
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from meshwork.sharding.shard_map_util import vary_like


def _ring(n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)]


def all_gather_matmul(x_BCD: jax.Array, w_DF, axis_name: str, *, collective: bool = True):
    """`all_gather(x_BCD, axis_name, along the sequence) @ w_DF` -> (B, n*C, F).

    Call inside `jax.shard_map`. x_BCD is this device's chunk of C tokens of a
    sequence split over `axis_name`; w_DF its columns of a column-parallel
    weight. `w_DF` may also be a tuple of weights that share the gathered x
    (SwiGLU's gate and up): one ring, one product per weight, a tuple back.
    `collective=False` is the plain all-gather, for reference.

    >>> from meshwork.sharding.mesh import make_mesh
    >>> mesh = make_mesh({"tensor": -1}); tensor = PartitionSpec(None, "tensor")
    >>> f = jax.shard_map(lambda x, w: all_gather_matmul(x, w, "tensor"), mesh=mesh,
    ...                   in_specs=(tensor, tensor), out_specs=PartitionSpec(None, None, "tensor"))
    >>> x, w = jnp.ones((1, 16, 4)), jnp.ones((4, 16))
    >>> bool((jax.jit(f)(x, w) == x @ w).all())
    True
    """
    n = lax.axis_size(axis_name)
    product = lambda x, w: jnp.einsum("BCD,DF->BCF", x, w)  # noqa: E731
    if not collective or n == 1:
        x_BLD = lax.all_gather(x_BCD, axis_name, axis=1, tiled=True)
        return jax.tree.map(lambda w: product(x_BLD, w), w_DF)
    me = lax.axis_index(axis_name)
    B, C, _ = x_BCD.shape
    # A weight replicated over the batch axes is used in n products; marking it
    # batch-varying once makes its gradient one sum over the batch, not n.
    w_DF = vary_like(w_DF, x_BCD)
    out = jax.tree.map(lambda w: jnp.zeros((B, n * C, w.shape[1]), jnp.result_type(x_BCD, w)), w_DF)
    chunk_BCD = x_BCD
    for s in range(n):
        # The send is issued before the product of the chunk it carries; the
        # last chunk has nowhere left to go.
        next_BCD = lax.ppermute(chunk_BCD, axis_name, _ring(n)) if s < n - 1 else None
        start = ((me - s) % n) * C
        out = jax.tree.map(lambda o, w: lax.dynamic_update_slice_in_dim(o, product(chunk_BCD, w), start, 1), out, w_DF)
        chunk_BCD = next_BCD
    return out


def matmul_reduce_scatter(h_BLF: jax.Array, w_FD: jax.Array, axis_name: str, *, collective: bool = True) -> jax.Array:
    """`psum_scatter(h_BLF @ w_FD, axis_name, along the sequence)` -> (B, L/n, D).

    Call inside `jax.shard_map`. h_BLF holds the whole sequence and this
    device's F/n hidden features; w_FD its rows of a row-parallel weight. The
    result is this device's sequence chunk of the sum over `axis_name`.
    Partial sums travel in the product's dtype, as psum_scatter's would.
    `collective=False` is the plain reduce-scatter, for reference.

    >>> from meshwork.sharding.mesh import make_mesh
    >>> mesh = make_mesh({"tensor": -1})
    >>> f = jax.shard_map(lambda h, w: matmul_reduce_scatter(h, w, "tensor"), mesh=mesh,
    ...                   in_specs=(PartitionSpec(None, None, "tensor"), PartitionSpec("tensor")),
    ...                   out_specs=PartitionSpec(None, "tensor"))
    >>> h, w = jnp.ones((1, 16, 16)), jnp.ones((16, 4))
    >>> bool((jax.jit(f)(h, w) == h @ w).all())
    True
    """
    n = lax.axis_size(axis_name)
    product = lambda h, w: jnp.einsum("BCF,FD->BCD", h, w)  # noqa: E731
    if h_BLF.shape[1] % n:
        raise ValueError(
            f"matmul_reduce_scatter: sequence length {h_BLF.shape[1]} is not divisible by the "
            f"{n} devices of {axis_name!r}; pad the sequence to a multiple of {n}"
        )
    if not collective or n == 1:
        return lax.psum_scatter(product(h_BLF, w_FD), axis_name, scatter_dimension=1, tiled=True)
    me = lax.axis_index(axis_name)
    C = h_BLF.shape[1] // n
    w_FD = vary_like(w_FD, h_BLF)  # one gradient sum over the batch axes (see all_gather_matmul)
    sum_BCD = None
    for s in range(n):
        # The running sum is sent on before this step's product, which does not wait for it.
        arrived_BCD = lax.ppermute(sum_BCD, axis_name, _ring(n)) if s else None
        part_BCD = product(lax.dynamic_slice_in_dim(h_BLF, ((me - s - 1) % n) * C, C, 1), w_FD)
        sum_BCD = part_BCD if s == 0 else arrived_BCD + part_BCD
    return sum_BCD


def tp_mlp(
    x_BLD: jax.Array,
    w_gate_DF: jax.Array,
    w_up_DF: jax.Array,
    w_down_FD: jax.Array,
    mesh: Mesh | AbstractMesh,
    *,
    collective: bool = True,
    axis_name: str = "tensor",
    batch_axes: Sequence[str] = ("data", "fsdp"),
) -> jax.Array:
    """SwiGLU MLP, down(silu(x W_gate) * (x W_up)), under Megatron TP + SP, on global arrays.

    x_BLD's sequence is split over `axis_name` (and its batch over the
    `batch_axes` the mesh has); W_gate and W_up are column-parallel, W_down
    row-parallel over `axis_name`. The result is split like x_BLD. One ring
    gathers x for both W_gate and W_up, as the plain version gathers it once;
    `collective=False` uses `all_gather` / `psum_scatter` instead.

    >>> from meshwork.sharding.mesh import make_mesh
    >>> mesh = make_mesh({"tensor": -1})
    >>> x, w = jnp.ones((1, 8, 4)), jnp.full((4, 8), 0.1)
    >>> a, b = (jax.jit(lambda *a: tp_mlp(*a, mesh, collective=c))(x, w, w, w.T) for c in (True, False))
    >>> bool(jnp.allclose(a, b))
    True
    """
    batch = tuple(a for a in batch_axes if a in mesh.axis_names)
    seq = PartitionSpec(batch or None, axis_name, None)
    column, row = PartitionSpec(None, axis_name), PartitionSpec(axis_name, None)

    def body(x_BCD, w_gate_DF, w_up_DF, w_down_FD):
        gate_BLF, up_BLF = all_gather_matmul(x_BCD, (w_gate_DF, w_up_DF), axis_name, collective=collective)
        return matmul_reduce_scatter(jax.nn.silu(gate_BLF) * up_BLF, w_down_FD, axis_name, collective=collective)

    f = jax.shard_map(body, mesh=mesh, in_specs=(seq, column, column, row), out_specs=seq)
    return f(x_BLD, w_gate_DF, w_up_DF, w_down_FD)
