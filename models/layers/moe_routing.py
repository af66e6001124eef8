"""MoE routing: choosing each token's X experts and the statistics that keep the choice balanced.

Routers (`cfg.router`), all in float32 whatever the compute dtype:
- "softmax" (Mixtral): top-k of softmax(x W_r); with `norm_topk_prob` the k weights are
  renormalized, which equals a softmax over the k chosen logits (gpt-oss's router, whose logits
  x W_r + b_r carry a bias: `MoEConfig.router_bias`).
- "noisy" (Shazeer et al. 2017): as softmax, on logits + N(0,1) * softplus(x W_noise) * noise_std,
  the noise only when a `noise_key` is passed (training).
- "sigmoid" (DeepSeek-V3): scores sigmoid(x W_r); a selection-only bias (`RouterBias`, state
  moved by `updated_router_bias`, never by the optimizer) picks the experts, optionally limited
  to `topk_groups` of `n_groups` expert groups; the weights are the unbiased scores.

Balancing: the Switch/GShard `load_balancing_loss`, the ST-MoE `router_z_loss`, and the
per-expert `expert_load` that `updated_router_bias` consumes. Shape letters as in
models/layers/moe.py (U expert groups, e one group's experts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

F32 = jnp.float32


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
    grouped_BLUe = choice_BLE.reshape(*choice_BLE.shape[:-1], n_groups, per_group)
    group_score_BLU = top_k(grouped_BLUe, min(2, per_group))[0].sum(-1)
    _, best_groups = top_k(group_score_BLU, topk_groups)
    keep_BLU = jax.nn.one_hot(best_groups, n_groups, dtype=jnp.bool_).any(-2)
    return jnp.where(jnp.repeat(keep_BLU, per_group, axis=-1), choice_BLE, -jnp.inf)


def select_experts(
    logits_BLE: jax.Array,
    *,
    router: str,
    k: int,
    norm_topk_prob: bool = True,
    bias_E: jax.Array | None = None,
    n_groups: int = 1,
    topk_groups: int = 1,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Chooses `k` experts per token (X in the shape letters) from router logits.

    Returns (expert_BLX int32, weight_BLX float32, probs_BLE float32): the chosen experts, best
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
        weight_BLX, expert_BLX = top_k(probs_BLE, k)
    elif router == "sigmoid":
        scores_BLE = jax.nn.sigmoid(logits_BLE)
        choice_BLE = scores_BLE if bias_E is None else scores_BLE + bias_E.astype(F32)
        choice_BLE = _limit_to_groups(lax.stop_gradient(choice_BLE), n_groups, topk_groups)
        _, expert_BLX = top_k(choice_BLE, k)
        weight_BLX = jnp.take_along_axis(scores_BLE, expert_BLX, axis=-1)
        probs_BLE = scores_BLE / scores_BLE.sum(-1, keepdims=True)
    else:
        raise ValueError(f"router {router!r} is not known; use softmax, noisy or sigmoid")
    if norm_topk_prob:
        weight_BLX = weight_BLX / weight_BLX.sum(-1, keepdims=True)
    return expert_BLX.astype(jnp.int32), weight_BLX, probs_BLE


def expert_load(expert_BLX: jax.Array, n_experts: int, across: tuple[str, ...] = ()) -> jax.Array:
    """(E,) fraction of all (token, choice) assignments routed to each expert (sums to 1).

    `across`: manual mesh axes that split the tokens (inside a shard_map, e.g. a pipeline stage's
    data shards); the fraction is then the whole batch's, as everywhere else. So for the means below.
    """
    counts_E = jnp.bincount(expert_BLX.reshape(-1), length=n_experts)
    return token_mean(counts_E.astype(F32) / expert_BLX.size, across)


def token_mean(mean: jax.Array, across: tuple[str, ...]) -> jax.Array:
    """A mean over this device's tokens made the mean over all tokens of the manual axes
    `across` (equal shards, so the mean of the means)."""
    return lax.pmean(mean, across) if across else mean


def load_balancing_loss(probs_BLE: jax.Array, expert_BLX: jax.Array, across: tuple[str, ...] = ()) -> jax.Array:
    """Switch/GShard auxiliary loss E * sum_e f_e * P_e; 1.0 when routing is uniform.

    f_e: fraction of assignments routed to e (no gradient); P_e: mean routing probability of e.
    Both are the whole batch's (`across` as in `expert_load`), so a data-sharded batch gives the
    loss of the unsharded one, not the mean of per-shard losses.

    >>> probs = jnp.full((1, 4, 4), 0.25); experts = jnp.arange(4).reshape(1, 4, 1)
    >>> float(load_balancing_loss(probs, experts))
    1.0
    """
    E = probs_BLE.shape[-1]
    return E * jnp.sum(expert_load(expert_BLX, E, across) * token_mean(probs_BLE.mean(axis=(0, 1)), across))


def router_z_loss(logits_BLE: jax.Array, across: tuple[str, ...] = ()) -> jax.Array:
    """ST-MoE z-loss: mean over tokens of logsumexp(logits)^2, keeping router logits small."""
    return token_mean(jnp.mean(jax.nn.logsumexp(logits_BLE.astype(F32), axis=-1) ** 2), across)
