"""Mixture-of-Experts feed-forward layer: routers, GShard capacity, dropless grouped matmul, expert parallelism.

Each token x picks K of E routed experts (SwiGLU MLPs of hidden size F); its output is

    y = routed_scaling_factor * sum_k w_k * expert_{e_k}(x)  +  shared(x) [* sigmoid(x . g)]

Routers (`cfg.router`), all in float32 whatever the compute dtype:
- "softmax" (Mixtral): top-k of softmax(x W_r); with `norm_topk_prob` the k weights are
  renormalized, which equals a softmax over the k chosen logits.
- "noisy" (Shazeer et al. 2017): as softmax, on logits + N(0,1) * softplus(x W_noise) * noise_std,
  the noise only when a `noise_key` is passed (training).
- "sigmoid" (DeepSeek-V3): scores sigmoid(x W_r); a selection-only bias (`RouterBias`, state
  moved by `updated_router_bias`, never by the optimizer) picks the experts, optionally limited
  to `topk_groups` of `n_groups` expert groups; the weights are the unbiased scores.

Dispatch:
- capacity (`cfg.capacity_factor` set): GShard token dropping. A group is one batch row (L
  tokens); each expert takes C = ceil(capacity_factor * L * K / E) assignments per group, admitted
  choice-major (all tokens' 1st choices in sequence order, then all 2nd choices, ...); the rest are
  dropped (that expert's term is skipped; the residual outside the layer carries the token). The
  experts run as one batched matmul over an (E, C) slot buffer.
- dropless (`capacity_factor` null): the (token, choice) assignments are sorted by expert and the
  experts run as one grouped matmul, `jax.lax.ragged_dot`.

Expert parallelism: when the current mesh (`jax.set_mesh`) and rules (`sharding.rules.use_rules`)
split logical `expert` over mesh axes of size > 1, the dispatch runs in `jax.shard_map`: each device
routes its own batch rows, sends every assignment to the device owning its expert with an
all-to-all over the expert axes, runs its E/N local experts, and sends the results back. Routing
and the statistics are computed outside the shard_map on the global arrays, so the semantics (and
the drops) are those of the single-device layer. See `MoE` for the buffer sizes. With the batch
split but not the experts (dp, fsdp) the dispatch runs per device in the same shard_map, with
no exchange, so the token sort stays local rather than being all-gathered by GSPMD.

Dimension letters: B batch, L sequence, D model, E experts, F expert hidden, K choices per token,
C capacity slots per expert and group, T tokens (B*L), A assignments (T*K), S buffer slots,
N devices along the expert axes, G expert groups.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec

from meshwork.config import MoEConfig
from meshwork.models.layers.mlp import SwiGLU
from meshwork.models.layers.params import normal, param
from meshwork.sharding.collectives import hierarchical_all_to_all
from meshwork.sharding.rules import current_rules, split_axes

F32 = jnp.float32
ALL_TO_ALL_IMPLS = ("lax", "hierarchical")


class RouterBias(nnx.Variable):
    """DeepSeek-V3's per-expert selection bias (shape (E,), float32).

    A Variable but not an `nnx.Param`, so `nnx.state(model, nnx.Param)` (what the optimizer
    trains) leaves it out; after each step the trainer moves it with `updated_router_bias`.
    """


def updated_router_bias(bias_E: jax.Array, load_E: jax.Array, rate: float) -> jax.Array:
    """Auxiliary-loss-free balancing (DeepSeek-V3): raise under-loaded experts' bias, lower over-loaded.

    bias + rate * sign(mean(load) - load), over the last axis, so a stack of layers' biases
    (n_layers, E) with their loads (n_layers, E) updates in one call.

    >>> updated_router_bias(jnp.zeros(4), jnp.array([0.4, 0.1, 0.25, 0.25]), 0.01).tolist()
    [-0.009999999776482582, 0.009999999776482582, 0.0, 0.0]
    """
    load_E = jnp.asarray(load_E, F32)
    direction = jnp.sign(load_E.mean(-1, keepdims=True) - load_E)
    return (bias_E + rate * direction).astype(bias_E.dtype)


def capacity_per_group(capacity_factor: float, group_size: int, k: int, n_experts: int) -> int:
    """Slots per expert and group: ceil(capacity_factor * group_size * k / n_experts), k choices per token.

    >>> capacity_per_group(1.0, 16, 2, 8)
    4
    """
    return math.ceil(capacity_factor * group_size * k / n_experts)


# ---------------------------------------------------------------- routing


def top_k(values: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k` over the last axis (values, int32 indices; ties: lower index first), by k argmaxes.

    XLA's SPMD partitioner (seen with jax 0.10.2) all-gathers the operand of `lax.top_k` even
    along a sharded batch dimension, so every device would route the global batch; argmax
    reductions partition along the batch like any elementwise op. k is small (<= 8), so k passes over E cost little.

    >>> top_k(jnp.array([1.0, 3.0, 2.0, 3.0]), 2)[1].tolist()
    [1, 3]
    """
    remaining = values
    picked = []
    for _ in range(k):
        i = jnp.argmax(remaining, axis=-1).astype(jnp.int32)
        picked.append(i)
        remaining = jnp.where(jnp.arange(values.shape[-1]) == i[..., None], -jnp.inf, remaining)
    index = jnp.stack(picked, axis=-1)
    return jnp.take_along_axis(values, index, axis=-1), index


def _limit_to_groups(choice_BLE: jax.Array, n_groups: int, topk_groups: int) -> jax.Array:
    """DeepSeek-V3 group-limited routing: experts outside a token's best groups get -inf.

    A group's score is the sum of its two best choice scores (one, for groups of one expert).
    """
    E = choice_BLE.shape[-1]
    if n_groups == 1 or topk_groups >= n_groups:
        return choice_BLE
    per_group = E // n_groups
    grouped_BLGE = choice_BLE.reshape(*choice_BLE.shape[:-1], n_groups, per_group)
    group_score_BLG = top_k(grouped_BLGE, min(2, per_group))[0].sum(-1)
    _, best_groups = top_k(group_score_BLG, topk_groups)
    keep_BLG = jax.nn.one_hot(best_groups, n_groups, dtype=jnp.bool_).any(-2)
    return jnp.where(jnp.repeat(keep_BLG, per_group, axis=-1), choice_BLE, -jnp.inf)


def select_experts(logits_BLE: jax.Array, *, router: str, k: int, norm_topk_prob: bool = True,
                   bias_E: jax.Array | None = None, n_groups: int = 1,
                   topk_groups: int = 1) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Chooses K experts per token from router logits.

    Returns (expert_BLK int32, weight_BLK float32, probs_BLE float32): the chosen experts, best
    first; their combine weights; and the per-token routing distribution the load-balancing loss
    uses (softmax probabilities; for "sigmoid", the scores normalized per token).
    `bias_E` ("sigmoid" only) shifts the scores for selection, never the weights.

    >>> logits = jnp.log(jnp.array([[[0.1, 0.6, 0.3]]]))
    >>> e, w, _ = select_experts(logits, router="softmax", k=2)
    >>> e.tolist(), [round(v, 3) for v in w[0, 0].tolist()]
    ([[[1, 2]]], [0.667, 0.333])
    """
    logits_BLE = logits_BLE.astype(F32)
    if router in ("softmax", "noisy"):
        probs_BLE = jax.nn.softmax(logits_BLE, axis=-1)
        weight_BLK, expert_BLK = top_k(probs_BLE, k)
    elif router == "sigmoid":
        scores_BLE = jax.nn.sigmoid(logits_BLE)
        choice_BLE = scores_BLE if bias_E is None else scores_BLE + bias_E.astype(F32)
        choice_BLE = _limit_to_groups(lax.stop_gradient(choice_BLE), n_groups, topk_groups)
        _, expert_BLK = top_k(choice_BLE, k)
        weight_BLK = jnp.take_along_axis(scores_BLE, expert_BLK, axis=-1)
        probs_BLE = scores_BLE / scores_BLE.sum(-1, keepdims=True)
    else:
        raise ValueError(f"router {router!r} is not known; use softmax, noisy or sigmoid")
    if norm_topk_prob:
        weight_BLK = weight_BLK / weight_BLK.sum(-1, keepdims=True)
    return expert_BLK.astype(jnp.int32), weight_BLK, probs_BLE


def expert_load(expert_BLK: jax.Array, n_experts: int) -> jax.Array:
    """(E,) fraction of all (token, choice) assignments routed to each expert (sums to 1)."""
    counts_E = jnp.bincount(expert_BLK.reshape(-1), length=n_experts)
    return counts_E.astype(F32) / expert_BLK.size


def load_balancing_loss(probs_BLE: jax.Array, expert_BLK: jax.Array) -> jax.Array:
    """Switch/GShard auxiliary loss E * sum_e f_e * P_e; 1.0 when routing is uniform.

    f_e: fraction of assignments routed to e (no gradient); P_e: mean routing probability of e.

    >>> probs = jnp.full((1, 4, 4), 0.25); experts = jnp.arange(4).reshape(1, 4, 1)
    >>> float(load_balancing_loss(probs, experts))
    1.0
    """
    E = probs_BLE.shape[-1]
    return E * jnp.sum(expert_load(expert_BLK, E) * probs_BLE.mean(axis=(0, 1)))


def router_z_loss(logits_BLE: jax.Array) -> jax.Array:
    """ST-MoE z-loss: mean over tokens of logsumexp(logits)^2, keeping router logits small."""
    return jnp.mean(jax.nn.logsumexp(logits_BLE.astype(F32), axis=-1) ** 2)


def _rank_within(group_A: jax.Array, n_groups: int) -> jax.Array:
    """Each item's rank among the items of its group, in array order: [2, 0, 2, 2] -> [0, 0, 1, 2]."""
    order_A = jnp.argsort(group_A, stable=True)
    counts = jnp.bincount(group_A, length=n_groups)
    starts = jnp.cumsum(counts) - counts
    rank_sorted_A = jnp.arange(group_A.shape[0]) - starts[group_A[order_A]]
    return jnp.zeros_like(group_A).at[order_A].set(rank_sorted_A.astype(group_A.dtype))


def capacity_slots(expert_BLK: jax.Array, n_experts: int, capacity: int) -> jax.Array:
    """GShard capacity rule: each assignment's slot e * C + position, or E * C when dropped.

    Groups are batch rows. Within a row, assignments are admitted choice-major: every token's
    1st choice in sequence order, then every 2nd choice, ...; an expert's first C are kept.

    >>> experts = jnp.array([[[0, 1], [0, 2], [0, 1]]])    # 3 tokens, 2 choices, all want expert 0
    >>> capacity_slots(experts, 3, 2).tolist()             # E*C = 6 means dropped
    [[[0, 2], [1, 4], [6, 3]]]
    """
    B, L, K = expert_BLK.shape
    e_BA = expert_BLK.transpose(0, 2, 1).reshape(B, K * L)  # priority order
    pos_BA = jax.vmap(_rank_within, in_axes=(0, None))(e_BA, n_experts)
    slot_BA = jnp.where(pos_BA < capacity, e_BA * capacity + pos_BA, n_experts * capacity)
    return slot_BA.reshape(B, K, L).transpose(0, 2, 1)


# ---------------------------------------------------------------- expert compute


def _swiglu_dense(x_ESD: jax.Array, w_gate_EDF: jax.Array, w_up_EDF: jax.Array, w_down_EFD: jax.Array) -> jax.Array:
    """Every expert on its own slot buffer: one batched matmul per projection."""
    gate_ESF = jnp.einsum("ESD,EDF->ESF", x_ESD, w_gate_EDF)
    up_ESF = jnp.einsum("ESD,EDF->ESF", x_ESD, w_up_EDF)
    return jnp.einsum("ESF,EFD->ESD", jax.nn.silu(gate_ESF) * up_ESF, w_down_EFD)


def _swiglu_grouped(x_RD: jax.Array, expert_R: jax.Array, w_gate_EDF: jax.Array, w_up_EDF: jax.Array,
                    w_down_EFD: jax.Array) -> jax.Array:
    """Row r through expert expert_R[r] by grouped matmuls; rows with expert >= E give zeros."""
    E = w_gate_EDF.shape[0]
    order_R = jnp.argsort(expert_R, stable=True)
    # Rows past the last group (expert id >= E, padding) are outside every group: ragged_dot
    # leaves them zero.
    sizes_E = jnp.bincount(expert_R, length=E).astype(jnp.int32)
    x_RD = x_RD[order_R]
    h_RF = jax.nn.silu(lax.ragged_dot(x_RD, w_gate_EDF, sizes_E)) * lax.ragged_dot(x_RD, w_up_EDF, sizes_E)
    y_RD = lax.ragged_dot(h_RF, w_down_EFD, sizes_E)
    inverse_R = jnp.zeros_like(order_R).at[order_R].set(jnp.arange(order_R.shape[0], dtype=order_R.dtype))
    return y_RD[inverse_R]


def _exchange(x: jax.Array, axes: tuple[str, ...], split_axis: int, concat_axis: int, impl: str) -> jax.Array:
    """All-to-all over the expert axes (linear device index, first axis major, as PartitionSpec)."""
    if impl == "hierarchical" and len(axes) == 2:
        return hierarchical_all_to_all(x, axes[0], axes[1], split_axis, concat_axis, tiled=True)
    return lax.all_to_all(x, axes[0] if len(axes) == 1 else axes, split_axis, concat_axis, tiled=True)


def _capacity_experts(x_BLD, slot_BLK, weight_BLK, w_gate_EDF, w_up_EDF, w_down_EFD, *, n_experts: int,
                      capacity: int, axes: tuple[str, ...] | None, impl: str) -> jax.Array:
    """Capacity dispatch on this device's rows: slot buffer (B, E, C, D) -> experts -> combine.

    Under expert parallelism the buffer, expert-major (E, B, C, D), is cut along E into N
    pieces of E/N experts, one per device; each device receives (E/N, N*B, C, D): its experts'
    slots from every peer. Fixed size, so the exchange is one plain all-to-all each way.
    """
    B, L, D = x_BLD.shape
    K = slot_BLK.shape[-1]
    E, C = n_experts, capacity
    rows_B11 = jnp.arange(B)[:, None, None]
    # Which token fills each slot (L = none: the zero row appended below).
    token_BS = jnp.full((B, E * C), L, jnp.int32).at[rows_B11, slot_BLK].set(
        jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32)[None, :, None], (B, L, K)), mode="drop")
    x_BLD = jnp.concatenate([x_BLD, jnp.zeros((B, 1, D), x_BLD.dtype)], axis=1)
    x_EBCD = x_BLD[jnp.arange(B)[:, None], token_BS].reshape(B, E, C, D).transpose(1, 0, 2, 3)
    if axes:
        x_EBCD = _exchange(x_EBCD, axes, 0, 1, impl)  # -> (E/N, N*B, C, D)
    E_here, B_here = x_EBCD.shape[:2]
    y_EBCD = _swiglu_dense(x_EBCD.reshape(E_here, B_here * C, D), w_gate_EDF, w_up_EDF,
                           w_down_EFD).reshape(E_here, B_here, C, D)
    if axes:
        y_EBCD = _exchange(y_EBCD, axes, 1, 0, impl)  # -> (E, B, C, D)
    y_BSD = y_EBCD.transpose(1, 0, 2, 3).reshape(B, E * C, D)
    y_BSD = jnp.concatenate([y_BSD, jnp.zeros((B, 1, D), y_BSD.dtype)], axis=1)  # slot E*C: dropped
    y_BLKD = y_BSD[jnp.arange(B)[:, None], slot_BLK.reshape(B, L * K)].reshape(B, L, K, D)
    return jnp.einsum("BLKD,BLK->BLD", y_BLKD, weight_BLK)


def _dropless_experts(x_BLD, expert_BLK, weight_BLK, w_gate_EDF, w_up_EDF, w_down_EFD, *, n_experts: int,
                      axes: tuple[str, ...] | None, impl: str) -> jax.Array:
    """Dropless dispatch on this device's tokens: sort by expert, grouped matmul, unsort, combine.

    Under expert parallelism each device sends N buffers of A = T*K rows (its assignments for
    the devices owning experts [0, E/N), [E/N, 2E/N), ...), each with the expert id of every row
    (id E marks padding). A is the worst case (every local assignment bound for one device), so
    nothing is ever dropped and the result equals the single-device layer, at the price of N
    times the all-to-all bytes and receive memory (N*A rows) of a perfectly balanced exchange.
    """
    B, L, D = x_BLD.shape
    K = expert_BLK.shape[-1]
    T, A = B * L, B * L * K
    x_TD = x_BLD.reshape(T, D)
    expert_A = expert_BLK.reshape(A)
    token_A = jnp.arange(A, dtype=jnp.int32) // K
    if not axes:
        y_AD = _swiglu_grouped(x_TD[token_A], expert_A, w_gate_EDF, w_up_EDF, w_down_EFD)
    else:
        E_here = w_gate_EDF.shape[0]
        N = n_experts // E_here
        dest_A = expert_A // E_here
        slot_A = dest_A * A + _rank_within(dest_A, N)
        token_S = jnp.full((N * A,), T, jnp.int32).at[slot_A].set(token_A)
        expert_S = jnp.full((N * A,), n_experts, jnp.int32).at[slot_A].set(expert_A)
        x_SD = jnp.concatenate([x_TD, jnp.zeros((1, D), x_TD.dtype)])[token_S]
        x_SD = _exchange(x_SD.reshape(N, A, D), axes, 0, 0, impl).reshape(N * A, D)
        expert_S = _exchange(expert_S.reshape(N, A), axes, 0, 0, impl).reshape(N * A)
        # Local expert ids; padding (id E) maps to >= E_here, outside every group.
        local_S = jnp.minimum(expert_S - lax.axis_index(axes) * E_here, E_here)
        y_SD = _swiglu_grouped(x_SD, local_S, w_gate_EDF, w_up_EDF, w_down_EFD)
        y_SD = _exchange(y_SD.reshape(N, A, D), axes, 0, 0, impl).reshape(N * A, D)
        y_AD = y_SD[slot_A]
    y_TD = jnp.einsum("TKD,TK->TD", y_AD.reshape(T, K, D), weight_BLK.reshape(T, K))
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
    batch_axes = split_axes("act_batch", rules, shape)
    expert_axes = split_axes("expert", rules, shape)
    if not set(expert_axes) <= set(batch_axes):
        raise ValueError(f"expert parallelism: the experts are split over {expert_axes} but act_batch only over "
                         f"{batch_axes}; map act_batch to the expert axes too (as the `ep` preset does)")
    n = math.prod(shape[a] for a in expert_axes)
    if n_experts % n:
        raise ValueError(f"expert parallelism: {n_experts} experts cannot be split over mesh axes {expert_axes} "
                         f"of {n} devices; use a number of experts divisible by {n}")
    return (mesh, batch_axes, expert_axes) if batch_axes else None


def _spec_entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _run_experts(body: Callable, x_BLD, routes_BLK, weight_BLK, weights, *, n_experts: int, impl: str):
    """`body` on the whole batch, or per device inside shard_map when the batch is split.

    Data parallelism without expert parallelism goes through shard_map too: the dispatch sorts
    and gathers along the token axis, which GSPMD would otherwise all-gather onto every device.
    """
    layout = _token_layout(n_experts)
    if layout is None:
        return body(x_BLD, routes_BLK, weight_BLK, *weights, axes=None, impl=impl)
    mesh, batch_axes, expert_axes = layout
    parts = math.prod(dict(mesh.shape)[a] for a in batch_axes)
    if x_BLD.shape[0] % parts:
        raise ValueError(f"MoE: batch {x_BLD.shape[0]} is not divisible by the {parts} devices of act_batch "
                         f"axes {batch_axes}; use a batch that is a multiple of {parts}")
    tokens = PartitionSpec(_spec_entry(batch_axes), None, None)
    experts = PartitionSpec(_spec_entry(expert_axes), None, None)
    # Manual over the batch and expert axes only; others (tensor, sequence, ...) stay automatic.
    f = jax.shard_map(functools.partial(body, axes=expert_axes or None, impl=impl), mesh=mesh,
                      in_specs=(tokens, tokens, tokens, experts, experts, experts), out_specs=tokens,
                      axis_names=frozenset(batch_axes))
    return f(x_BLD, routes_BLK, weight_BLK, *weights)


# ---------------------------------------------------------------- the layer


class MoE(nnx.Module):
    """Routed (and optional shared) SwiGLU experts; returns (y_BLD, stats).

    Parameters (names the checkpoint loaders rely on): `router` (D, E) ("embed", "router");
    `noise` (D, E) for router="noisy"; `router_bias` (E,) a `RouterBias` for router="sigmoid";
    `w_gate`, `w_up` (E, D, F) ("expert", "embed", "mlp"), `w_down` (E, F, D) ("expert", "mlp",
    "embed"); `shared` a `SwiGLU` when n_shared_experts > 0; `shared_gate` (D, 1) ("embed", None)
    when shared_expert_gate.

    stats (float32, over the whole global batch, no coefficients applied):
    `aux_loss` (Switch/GShard, 1.0 when balanced), `z_loss`, `load` (E,) share of assignments
    per expert before any drop (sums to 1; feed it to `updated_router_bias`), and
    `dropped_fraction` of assignments dropped by capacity (0 when dropless).

    Expert parallelism (see the module docstring) moves, per device and direction, an
    (E, B_local * C, D) buffer in capacity mode and N * (B_local * L * K) rows of D in dropless
    mode (the no-drop worst case). `all_to_all="hierarchical"` exchanges in two levels
    (`sharding.collectives.hierarchical_all_to_all`) when `expert` maps to two mesh axes, e.g.
    ("data", "expert"): first inside the inner axis, then across the outer one; with one expert
    axis it is the plain `lax.all_to_all`.

    >>> from meshwork.config import MoEConfig
    >>> moe = MoE(8, MoEConfig(n_experts=4, top_k=2, d_expert=16), init_std=0.02, out_std=0.02,
    ...           dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    >>> y, stats = moe(jnp.ones((2, 3, 8)))
    >>> y.shape, stats["load"].shape, float(stats["dropped_fraction"])
    ((2, 3, 8), (4,), 0.0)
    """

    def __init__(self, d_model: int, cfg: MoEConfig, *, init_std: float, out_std: float, dtype: jnp.dtype,
                 param_dtype: jnp.dtype, rngs: nnx.Rngs, all_to_all: str = "lax"):
        D, E, F = d_model, cfg.n_experts, cfg.d_expert
        if cfg.top_k > E:
            raise ValueError(f"MoE: top_k={cfg.top_k} exceeds n_experts={E}; choose top_k <= n_experts")
        if cfg.router == "sigmoid" and (E % cfg.n_groups or cfg.topk_groups > cfg.n_groups
                                        or cfg.top_k > cfg.topk_groups * (E // cfg.n_groups)):
            raise ValueError(f"MoE: {E} experts in n_groups={cfg.n_groups} with topk_groups={cfg.topk_groups} "
                             f"cannot supply top_k={cfg.top_k} experts; groups must divide the experts and "
                             f"topk_groups * experts-per-group must be >= top_k")
        if cfg.shared_expert_gate and not cfg.n_shared_experts:
            raise ValueError("MoE: shared_expert_gate needs a shared expert; set n_shared_experts >= 1")
        if all_to_all not in ALL_TO_ALL_IMPLS:
            raise ValueError(f"MoE: all_to_all={all_to_all!r}; choose one of {ALL_TO_ALL_IMPLS}")
        self.router = param(normal(init_std), rngs.params(), (D, E), param_dtype, ("embed", "router"))
        if cfg.router == "noisy":
            # Zero init as in Shazeer et al.: the noise starts at softplus(0) * noise_std.
            self.noise = param(nnx.initializers.zeros_init(), rngs.params(), (D, E), param_dtype,
                               ("embed", "router"))
        if cfg.router == "sigmoid":
            # float32 whatever param_dtype: it accumulates many tiny updates.
            self.router_bias = RouterBias(jnp.zeros((E,), F32), out_sharding=("router",), eager_sharding=False)
        self.w_gate = param(normal(init_std), rngs.params(), (E, D, F), param_dtype, ("expert", "embed", "mlp"))
        self.w_up = param(normal(init_std), rngs.params(), (E, D, F), param_dtype, ("expert", "embed", "mlp"))
        self.w_down = param(normal(out_std), rngs.params(), (E, F, D), param_dtype, ("expert", "mlp", "embed"))
        if cfg.n_shared_experts:
            self.shared = SwiGLU(D, cfg.d_shared or cfg.n_shared_experts * F, init_std=init_std, out_std=out_std,
                                 dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if cfg.shared_expert_gate:
            self.shared_gate = param(normal(init_std), rngs.params(), (D, 1), param_dtype, ("embed", None))
        self.cfg, self.dtype, self.all_to_all = cfg, dtype, all_to_all

    def router_logits(self, x_BLD: jax.Array) -> jax.Array:
        """x W_r in float32; HIGHEST precision so that top-k does not flip on bf16 passes (TPU)."""
        return jnp.einsum("BLD,DE->BLE", x_BLD.astype(F32), self.router[...].astype(F32),
                          precision=lax.Precision.HIGHEST)

    def __call__(self, x_BLD: jax.Array, *, noise_key: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """noise_key: draws the noisy router's noise (pass one per step in training; None to evaluate)."""
        cfg = self.cfg
        L = x_BLD.shape[1]
        E, K = cfg.n_experts, cfg.top_k
        logits_BLE = self.router_logits(x_BLD)
        gate_logits_BLE = logits_BLE
        if cfg.router == "noisy" and noise_key is not None:
            noise_scale_BLE = cfg.noise_std * jax.nn.softplus(jnp.einsum(
                "BLD,DE->BLE", x_BLD.astype(F32), self.noise[...].astype(F32), precision=lax.Precision.HIGHEST))
            gate_logits_BLE = logits_BLE + jax.random.normal(noise_key, logits_BLE.shape, F32) * noise_scale_BLE
        expert_BLK, weight_BLK, probs_BLE = select_experts(
            gate_logits_BLE, router=cfg.router, k=K, norm_topk_prob=cfg.norm_topk_prob,
            bias_E=self.router_bias[...] if cfg.router == "sigmoid" else None,
            n_groups=cfg.n_groups, topk_groups=cfg.topk_groups)
        stats = {"aux_loss": load_balancing_loss(probs_BLE, expert_BLK),
                 "z_loss": router_z_loss(logits_BLE),
                 "load": expert_load(expert_BLK, E)}

        x_BLD = x_BLD.astype(self.dtype)
        weights = tuple(w[...].astype(self.dtype) for w in (self.w_gate, self.w_up, self.w_down))
        if cfg.capacity_factor is not None:
            C = capacity_per_group(cfg.capacity_factor, L, K, E)
            routes_BLK = capacity_slots(expert_BLK, E, C)
            stats["dropped_fraction"] = jnp.mean((routes_BLK == E * C).astype(F32))
            body = functools.partial(_capacity_experts, n_experts=E, capacity=C)
        else:
            routes_BLK = expert_BLK
            stats["dropped_fraction"] = jnp.zeros((), F32)
            body = functools.partial(_dropless_experts, n_experts=E)
        y_BLD = _run_experts(body, x_BLD, routes_BLK, weight_BLK.astype(self.dtype), weights, n_experts=E,
                             impl=self.all_to_all)
        if cfg.routed_scaling_factor != 1.0:
            y_BLD = y_BLD * cfg.routed_scaling_factor
        if cfg.n_shared_experts:
            shared_BLD = self.shared(x_BLD)
            if cfg.shared_expert_gate:
                gate_BL1 = jax.nn.sigmoid(x_BLD.astype(F32) @ self.shared_gate[...].astype(F32))
                shared_BLD = shared_BLD * gate_BL1.astype(self.dtype)
            y_BLD = y_BLD + shared_BLD
        return y_BLD, stats
