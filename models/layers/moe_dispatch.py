"""MoE dispatch and combine: sending each token's assignments to its experts and weighting the results back.

- capacity (`cfg.capacity_factor` set): GShard token dropping. A group is one batch row (L
  tokens); each expert takes Q = ceil(capacity_factor * L * X / E) assignments per group, admitted
  choice-major (all tokens' 1st choices in sequence order, then all 2nd choices, ...); the rest are
  dropped (that expert's term is skipped; the residual outside the layer carries the token). The
  experts run as one batched matmul over an (E, Q) slot buffer.
- dropless (`capacity_factor` null): the (token, choice) assignments are sorted by expert and the
  experts run as one grouped matmul, `jax.lax.ragged_dot`.

An expert is act(x W_g [+ b_g], x W_u [+ b_u]) W_d [+ b_d]: `swiglu`, or gpt-oss's
`clamped_swiglu` with its per-expert biases (`Experts`), the same on every path.

Expert parallelism: when the current mesh (`jax.set_mesh`) and rules (`sharding.rules.use_rules`)
split logical `expert` over mesh axes of size > 1, the dispatch runs in `jax.shard_map`: each device
routes its own batch rows, sends every assignment to the device owning its expert with an
all-to-all over the expert axes, runs its E/N local experts, and sends the results back. Routing
and the statistics are computed outside the shard_map on the global arrays, so the semantics (and
the drops) are those of the single-device layer. See `MoE` for the buffer sizes. With the batch
split but not the experts (dp, fsdp) the dispatch runs per device in the same shard_map, with
no exchange, so the token sort stays local rather than being all-gathered by GSPMD.

Shape letters: docs/architecture.md#shape-letters (X choices per token, Q capacity, Z buffer slots).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from meshwork.sharding.all_to_all_algorithms import hierarchical_all_to_all
from meshwork.sharding.parallel import current_rules
from meshwork.sharding.rules import compiler_axes, manual_axes, split_axes

ALL_TO_ALL_IMPLS = ("lax", "hierarchical")


def capacity_per_group(capacity_factor: float, group_size: int, k: int, n_experts: int) -> int:
    """Slots per expert and group: ceil(capacity_factor * group_size * k / n_experts), k choices per token.

    >>> capacity_per_group(1.0, 16, 2, 8)
    4
    """
    return math.ceil(capacity_factor * group_size * k / n_experts)


def _rank_within(group_A: jax.Array, n_groups: int) -> jax.Array:
    """Each item's rank among the items of its group, in array order: [2, 0, 2, 2] -> [0, 0, 1, 2]."""
    order_A = jnp.argsort(group_A, stable=True)
    counts = jnp.bincount(group_A, length=n_groups)
    starts = jnp.cumsum(counts) - counts
    rank_sorted_A = jnp.arange(group_A.shape[0]) - starts[group_A[order_A]]
    return jnp.zeros_like(group_A).at[order_A].set(rank_sorted_A.astype(group_A.dtype))


def capacity_slots(expert_BLX: jax.Array, n_experts: int, capacity: int) -> jax.Array:
    """GShard capacity rule: each assignment's slot e * Q + position, or E * Q when dropped.

    Groups are batch rows. Within a row, assignments are admitted choice-major: every token's
    1st choice in sequence order, then every 2nd choice, ...; an expert's first Q are kept.

    >>> experts = jnp.array([[[0, 1], [0, 2], [0, 1]]])    # 3 tokens, 2 choices, all want expert 0
    >>> capacity_slots(experts, 3, 2).tolist()             # E*Q = 6 means dropped
    [[[0, 2], [1, 4], [6, 3]]]
    """
    B, L, X = expert_BLX.shape
    e_BA = expert_BLX.transpose(0, 2, 1).reshape(B, X * L)  # priority order
    pos_BA = jax.vmap(_rank_within, in_axes=(0, None))(e_BA, n_experts)
    slot_BA = jnp.where(pos_BA < capacity, e_BA * capacity + pos_BA, n_experts * capacity)
    return slot_BA.reshape(B, X, L).transpose(0, 2, 1)


# ---------------------------------------------------------------- expert compute


class Experts(NamedTuple):
    """The routed experts' weights as the dispatch bodies take them: all E, or this device's E/N
    under expert parallelism, every field split along its leading expert axis. The biases
    (gpt-oss) are None, empty pytree nodes, when the experts have none. The bodies take the
    activation apart, as `act(gate, up) -> h`: `swiglu` or a partial of `clamped_swiglu`."""

    w_gate_EDF: jax.Array
    w_up_EDF: jax.Array
    w_down_EFD: jax.Array
    b_gate_EF: jax.Array | None = None
    b_up_EF: jax.Array | None = None
    b_down_ED: jax.Array | None = None


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up (Shazeer 2020)."""
    return jax.nn.silu(gate) * up


def clamped_swiglu(gate: jax.Array, up: jax.Array, *, limit: float, alpha: float) -> jax.Array:
    """gpt-oss's gated activation: the gate clamped from above and the up projection on both sides
    at `limit`, the gate through x * sigmoid(alpha * x), the up projection shifted by one.

    >>> round(float(clamped_swiglu(jnp.array(9.0), jnp.array(-9.0), limit=7.0, alpha=1.702)), 2)  # (-7+1) * 7
    -42.0
    """
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def _experts_dense(x_EZD: jax.Array, experts: Experts, act: Callable) -> jax.Array:
    """Every expert on its own slot buffer: one batched matmul per projection. Empty slots (zero
    rows) come out as the biases' image, never read back."""
    gate_EZF = jnp.einsum("EZD,EDF->EZF", x_EZD, experts.w_gate_EDF)
    up_EZF = jnp.einsum("EZD,EDF->EZF", x_EZD, experts.w_up_EDF)
    if experts.b_gate_EF is not None:
        gate_EZF = gate_EZF + experts.b_gate_EF[:, None, :]
        up_EZF = up_EZF + experts.b_up_EF[:, None, :]
    y_EZD = jnp.einsum("EZF,EFD->EZD", act(gate_EZF, up_EZF), experts.w_down_EFD)
    if experts.b_down_ED is not None:
        y_EZD = y_EZD + experts.b_down_ED[:, None, :]
    return y_EZD


def _experts_grouped(x_AD: jax.Array, expert_A: jax.Array, experts: Experts, act: Callable) -> jax.Array:
    """Row a through expert expert_A[a] by grouped matmuls; rows with expert >= E (padding) are
    never read (without biases they come out zero)."""
    E = experts.w_gate_EDF.shape[0]
    order_A = jnp.argsort(expert_A, stable=True)
    # Rows past the last group (expert id >= E, padding) are outside every group: ragged_dot
    # leaves them zero.
    sizes_E = jnp.bincount(expert_A, length=E).astype(jnp.int32)
    x_AD = x_AD[order_A]
    gate_AF = lax.ragged_dot(x_AD, experts.w_gate_EDF, sizes_E)
    up_AF = lax.ragged_dot(x_AD, experts.w_up_EDF, sizes_E)

    def row_bias(b_EX: jax.Array) -> jax.Array:
        # Each sorted row's expert's bias; padding rows get zeros (a finite activation, no NaN
        # that a zero cotangent times it could carry into the biases' gradients).
        return jnp.take(b_EX, expert_A[order_A], axis=0, mode="fill", fill_value=0)

    if experts.b_gate_EF is not None:
        gate_AF, up_AF = gate_AF + row_bias(experts.b_gate_EF), up_AF + row_bias(experts.b_up_EF)
    y_AD = lax.ragged_dot(act(gate_AF, up_AF), experts.w_down_EFD, sizes_E)
    if experts.b_down_ED is not None:
        y_AD = y_AD + row_bias(experts.b_down_ED)
    inverse_A = jnp.zeros_like(order_A).at[order_A].set(jnp.arange(order_A.shape[0], dtype=order_A.dtype))
    return y_AD[inverse_A]


def _exchange(x: jax.Array, axes: tuple[str, ...], split_axis: int, concat_axis: int, impl: str) -> jax.Array:
    """All-to-all over the expert axes (linear device index, first axis major, as PartitionSpec)."""
    if impl == "hierarchical" and len(axes) == 2:
        return hierarchical_all_to_all(x, axes[0], axes[1], split_axis, concat_axis, tiled=True)
    return lax.all_to_all(x, axes[0] if len(axes) == 1 else axes, split_axis, concat_axis, tiled=True)


def capacity_experts(
    x_BLD,
    slot_BLX,
    weight_BLX,
    experts: Experts,
    *,
    n_experts: int,
    capacity: int,
    act: Callable = swiglu,
    axes: tuple[str, ...] | None,
    impl: str,
) -> jax.Array:
    """Capacity dispatch on this device's rows: slot buffer (B, E, Q, D) -> experts -> combine.

    Under expert parallelism the buffer, expert-major (E, B, Q, D), is cut along E into N
    pieces of E/N experts, one per device; each device receives (E/N, N*B, Q, D): its experts'
    slots from every peer. Fixed size, so the exchange is one plain all-to-all each way.
    """
    B, L, D = x_BLD.shape
    X = slot_BLX.shape[-1]
    E, Q = n_experts, capacity
    rows_B11 = jnp.arange(B)[:, None, None]
    # Which token fills each slot (L = none: the zero row appended below).
    token_BZ = (
        jnp.full((B, E * Q), L, jnp.int32)
        .at[rows_B11, slot_BLX]
        .set(jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32)[None, :, None], (B, L, X)), mode="drop")
    )
    x_BLD = jnp.concatenate([x_BLD, jnp.zeros((B, 1, D), x_BLD.dtype)], axis=1)
    x_EBQD = x_BLD[jnp.arange(B)[:, None], token_BZ].reshape(B, E, Q, D).transpose(1, 0, 2, 3)
    if axes:
        x_EBQD = _exchange(x_EBQD, axes, 0, 1, impl)  # -> (E/N, N*B, Q, D)
    E_here, B_here = x_EBQD.shape[:2]
    y_EBQD = _experts_dense(x_EBQD.reshape(E_here, B_here * Q, D), experts, act).reshape(E_here, B_here, Q, D)
    if axes:
        y_EBQD = _exchange(y_EBQD, axes, 1, 0, impl)  # -> (E, B, Q, D)
    y_BZD = y_EBQD.transpose(1, 0, 2, 3).reshape(B, E * Q, D)
    y_BZD = jnp.concatenate([y_BZD, jnp.zeros((B, 1, D), y_BZD.dtype)], axis=1)  # slot E*Q: dropped
    y_BLXD = y_BZD[jnp.arange(B)[:, None], slot_BLX.reshape(B, L * X)].reshape(B, L, X, D)
    return jnp.einsum("BLXD,BLX->BLD", y_BLXD, weight_BLX)


def dropless_experts(
    x_BLD,
    expert_BLX,
    weight_BLX,
    experts: Experts,
    *,
    n_experts: int,
    act: Callable = swiglu,
    axes: tuple[str, ...] | None,
    impl: str,
) -> jax.Array:
    """Dropless dispatch on this device's tokens: sort by expert, grouped matmul, unsort, combine.

    Under expert parallelism each device sends N buffers of A = T*X rows (its assignments for
    the devices owning experts [0, E/N), [E/N, 2E/N), ...), each with the expert id of every row
    (id E marks padding). A is the worst case (every local assignment bound for one device), so
    nothing is ever dropped and the result equals the single-device layer, at the price of N
    times the all-to-all bytes and receive memory (N*A rows) of a perfectly balanced exchange.
    """
    B, L, D = x_BLD.shape
    X = expert_BLX.shape[-1]
    T, A = B * L, B * L * X
    x_TD = x_BLD.reshape(T, D)
    expert_A = expert_BLX.reshape(A)
    token_A = jnp.arange(A, dtype=jnp.int32) // X
    if not axes:
        y_AD = _experts_grouped(x_TD[token_A], expert_A, experts, act)
    else:
        E_here = experts.w_gate_EDF.shape[0]
        N = n_experts // E_here
        dest_A = expert_A // E_here
        slot_A = dest_A * A + _rank_within(dest_A, N)
        token_Z = jnp.full((N * A,), T, jnp.int32).at[slot_A].set(token_A)
        expert_Z = jnp.full((N * A,), n_experts, jnp.int32).at[slot_A].set(expert_A)
        x_ZD = jnp.concatenate([x_TD, jnp.zeros((1, D), x_TD.dtype)])[token_Z]
        x_ZD = _exchange(x_ZD.reshape(N, A, D), axes, 0, 0, impl).reshape(N * A, D)
        expert_Z = _exchange(expert_Z.reshape(N, A), axes, 0, 0, impl).reshape(N * A)
        # Local expert ids; padding (id E) maps to >= E_here, outside every group.
        local_Z = jnp.minimum(expert_Z - lax.axis_index(axes) * E_here, E_here)
        y_ZD = _experts_grouped(x_ZD, local_Z, experts, act)
        y_ZD = _exchange(y_ZD.reshape(N, A, D), axes, 0, 0, impl).reshape(N * A, D)
        y_AD = y_ZD[slot_A]
    y_TD = jnp.einsum("TXD,TX->TD", y_AD.reshape(T, X, D), weight_BLX.reshape(T, X))
    return y_TD.reshape(B, L, D)


def _token_layout(n_experts: int) -> tuple[object, tuple[str, ...], tuple[str, ...]] | None:
    """(mesh, batch axes, expert axes) splitting `act_batch` / `expert` in the current mesh and rules.

    None without a mesh or rules, or when neither is split (one device's worth of work).
    """
    rules = current_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty:
        return None
    shape = dict(mesh.shape)
    # Batch axes already manual here (a pipeline stage's data shards) split nothing more.
    batch_axes = compiler_axes(split_axes("act_batch", rules, shape))
    expert_axes = split_axes("expert", rules, shape)
    if not set(expert_axes) <= set(batch_axes):
        raise ValueError(
            f"expert parallelism: the experts are split over {expert_axes} but act_batch only over "
            f"{batch_axes}; map act_batch to the expert axes too (as the `ep` preset does)"
        )
    if batch_axes and manual_axes():
        # Inside a shard_map already (a pipeline stage): the partitioner (Shardy) refuses a nested
        # one manual over the batch axes the enclosing one left it, so the compiler dispatches
        # the tokens itself there; expert parallelism needs the nested exchange.
        if expert_axes:
            raise ValueError(
                f"expert parallelism inside a pipeline stage is not supported (experts split over "
                f"{expert_axes}); drop ep from rules.preset or set train.pipeline=none"
            )
        return None
    n = math.prod(shape[a] for a in expert_axes)
    if n_experts % n:
        raise ValueError(
            f"expert parallelism: {n_experts} experts cannot be split over mesh axes {expert_axes} "
            f"of {n} devices; use a number of experts divisible by {n}"
        )
    return (mesh, batch_axes, expert_axes) if batch_axes else None


def _spec_entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def run_experts(body: Callable, x_BLD, routes_BLX, weight_BLX, experts: Experts, *, n_experts: int, impl: str):
    """`body` on the whole batch, or per device inside shard_map when the batch is split.

    Data parallelism without expert parallelism goes through shard_map too: the dispatch sorts
    and gathers along the token axis, which GSPMD would otherwise all-gather onto every device.
    Every expert weight and bias is split along its leading expert axis.
    """
    layout = _token_layout(n_experts)
    if layout is None:
        return body(x_BLD, routes_BLX, weight_BLX, experts, axes=None, impl=impl)
    mesh, batch_axes, expert_axes = layout
    parts = math.prod(dict(mesh.shape)[a] for a in batch_axes)
    if x_BLD.shape[0] % parts:
        raise ValueError(
            f"MoE: batch {x_BLD.shape[0]} is not divisible by the {parts} devices of act_batch "
            f"axes {batch_axes}; use a batch that is a multiple of {parts}"
        )
    tokens = PartitionSpec(_spec_entry(batch_axes), None, None)
    # One spec for every leaf of `experts` (weights and biases): the leading axis split, the rest whole.
    by_expert = PartitionSpec(_spec_entry(expert_axes))
    # Manual over the batch and expert axes only; others (tensor, sequence, ...) stay automatic.
    f = jax.shard_map(
        functools.partial(body, axes=expert_axes or None, impl=impl),
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, by_expert),
        out_specs=tokens,
        axis_names=frozenset(batch_axes),
    )
    return f(x_BLD, routes_BLX, weight_BLX, experts)
