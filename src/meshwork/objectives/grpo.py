"""Group Relative Policy Optimization (DeepSeekMath, Shao et al. 2024) as TRL's `GRPOTrainer`
computes it: group-normalized advantages and the clipped, per-token policy-gradient loss with a k3
KL penalty to a reference. Pure functions of arrays: the rollouts, the rewards and the three sets of
per-token log-probabilities (`objectives.preference.token_log_probs` of the policy now, of the
policy that sampled, of the reference) come from the task that uses them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

AGGREGATIONS = ("token", "sequence")


def group_advantages(rewards_UN: jax.Array, *, scale: bool = True, eps: float = 1e-4) -> jax.Array:
    """Advantages of U groups (one per prompt) of N sampled completions each, float32 (U, N):

        A = (r - mean over the group) / (std over the group + eps)

    with the sample standard deviation (Bessel's n - 1), as TRL's `GRPOTrainer` normalizes with
    `scale_rewards="group"` (trl/trainer/utils.py `nanstd`) and its 1e-4; a group of one
    completion has std 0 there and here. `scale=False`: the mean-centred rewards alone (Dr. GRPO,
    TRL's `scale_rewards="none"`). A group whose rewards are all equal gets advantages exactly 0
    (no NaN, no rounding residue of the mean divided by eps).
    """
    r_UN = rewards_UN.astype(jnp.float32)
    centred_UN = r_UN - r_UN.mean(axis=1, keepdims=True)
    centred_UN = jnp.where((r_UN == r_UN[:, :1]).all(axis=1, keepdims=True), 0.0, centred_UN)
    if not scale:
        return centred_UN
    n = r_UN.shape[1]
    std_U1 = jnp.std(r_UN, axis=1, ddof=1, keepdims=True) if n > 1 else jnp.zeros_like(r_UN[:, :1])
    return centred_UN / (std_U1 + eps)


def grpo_loss(
    logp_BL: jax.Array,
    old_logp_BL: jax.Array,
    ref_logp_BL: jax.Array | None,
    advantages_B: jax.Array,
    mask_BL: jax.Array,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_coef: float = 0.0,
    aggregation: str = "token",
) -> tuple[jax.Array, dict]:
    """The GRPO loss of B completions (rows of the groups, flattened) of length L, per token:

        ratio     = exp(logp - old_logp)
        objective = min(ratio A, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) A)
        kl        = exp(ref - logp) - (ref - logp) - 1          (Schulman's k3 estimator, >= 0)
        loss      = -(objective - kl_coef kl)

    as TRL's `GRPOTrainer._compute_loss` (importance_sampling_level "token", `epsilon` /
    `epsilon_high`, `beta` = kl_coef). `clip_eps_high` None: the symmetric clip; larger than
    clip_eps: DAPO's clip-higher. `old_logp_BL`, `ref_logp_BL` and `advantages_B` get no gradient.
    kl_coef 0 (a Python number) drops the KL term, and `ref_logp_BL` may then be None.

    `aggregation` over the tokens where `mask_BL` is 1 (the completion's):
    - "token": the sum over all of them / their number in the batch (DAPO; TRL's "bnpo", and
      its "dapo" when the batch is the whole step);
    - "sequence": the mean over sequences of each sequence's mean (the paper's; TRL's "grpo").

    Metrics (no gradient; means over the masked tokens, as TRL's `global_masked_mean`): `ratio`;
    `clip_fraction`, the tokens where the clipped branch is the minimum (ratio < 1 - clip_eps with
    A < 0, or ratio > 1 + clip_eps_high with A > 0: TRL's "clip_ratio/region_mean"); `kl`, where
    `ref_logp_BL` is given (whatever kl_coef); `advantage`, the mean over the B completions.
    Positions masked out contribute nothing and cannot overflow, whatever they hold.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, not {aggregation!r}")
    use_kl = not (isinstance(kl_coef, (int, float)) and kl_coef == 0)
    if use_kl and ref_logp_BL is None:
        raise ValueError("kl_coef is not 0: ref_logp_BL is needed for the KL term")
    eps_low = clip_eps
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high

    f32 = jnp.float32
    sg = jax.lax.stop_gradient
    on_BL = mask_BL > 0
    mask_BL = on_BL.astype(f32)
    logp_BL = logp_BL.astype(f32)
    a_B1 = sg(advantages_B.astype(f32))[:, None]

    ratio_BL = jnp.exp(jnp.where(on_BL, logp_BL - sg(old_logp_BL.astype(f32)), 0.0))
    low_BL = (ratio_BL < 1.0 - eps_low) & (a_B1 < 0)
    high_BL = (ratio_BL > 1.0 + eps_high) & (a_B1 > 0)
    clipped_BL = low_BL | high_BL  # where min(ratio A, clip(ratio) A) is the clipped term
    objective_BL = jnp.where(clipped_BL, jnp.clip(ratio_BL, 1.0 - eps_low, 1.0 + eps_high), ratio_BL) * a_B1

    kl_BL = None
    if ref_logp_BL is not None:
        d_BL = jnp.where(on_BL, sg(ref_logp_BL.astype(f32)) - logp_BL, 0.0)
        kl_BL = jnp.exp(d_BL) - d_BL - 1.0
    per_token_BL = -objective_BL
    if use_kl:
        per_token_BL = per_token_BL + kl_coef * kl_BL

    tokens = jnp.maximum(mask_BL.sum(), 1.0)
    if aggregation == "token":
        loss = (per_token_BL * mask_BL).sum() / tokens
    else:
        loss = ((per_token_BL * mask_BL).sum(-1) / jnp.maximum(mask_BL.sum(-1), 1.0)).mean()

    def masked_mean(x_BL):
        return (sg(x_BL).astype(f32) * mask_BL).sum() / tokens

    metrics = {
        "loss": loss,
        "ratio": masked_mean(ratio_BL),
        "clip_fraction": masked_mean(clipped_BL),
        "advantage": a_B1.mean(),
    }
    if kl_BL is not None:
        metrics["kl"] = masked_mean(kl_BL)
    return loss, metrics


def grpo_objective(
    graphdef,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_coef: float = 0.0,
    aggregation: str = "token",
):
    """loss_fn(params, buffers, batch, noise_key=None) -> (GRPO loss, metrics) for train.objective=grpo.

    `batch` holds B completions (train/rollouts.py), each one row of L positions: `inputs`,
    `targets`, `loss_mask` (1 where the target is a completion token), `old_logp` (the sampling
    policy's log-probability of each target, the engine's), `ref_logp` (the reference's; zeros
    with kl_coef 0) and `advantages` (each completion's, repeated along its row). The policy's per-token log-probabilities come from one
    forward pass (training noise such as LoRA dropout from `noise_key`), then `grpo_loss`.
    """
    from flax import nnx

    from meshwork.objectives.preference import token_log_probs

    def loss_fn(params, buffers, batch, noise_key=None):
        logits_BLV, _ = nnx.merge(graphdef, params, buffers).apply(batch["inputs"], None, noise_key=noise_key)
        logp_BL = token_log_probs(logits_BLV, batch["targets"])
        return grpo_loss(
            logp_BL,
            batch["old_logp"],
            batch["ref_logp"] if kl_coef else None,
            batch["advantages"][:, 0],
            batch["loss_mask"],
            clip_eps=clip_eps,
            clip_eps_high=clip_eps_high,
            kl_coef=kl_coef,
            aggregation=aggregation,
        )

    return loss_fn
