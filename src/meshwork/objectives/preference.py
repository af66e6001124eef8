"""Preference objectives: the log-probabilities of sequences under a policy, and the DPO loss.

Pure functions of arrays, with no model in them: the post-training task that uses them computes the
policy's and the reference's logits, turns them into log-probabilities here, and hands those to
`dpo_loss` (or, per token, to `objectives.grpo.grpo_loss`). `dpo_objective`, at the end, is that
task's objective for `train.objective: dpo` (train/task.py `DPOTask`): the policy's forward pass
and the reference's (the LoRA adapters off), or the reference's log-probabilities the batch
carries (precomputed, or from a frozen copy: train/dpo_reference.py), around `dpo_loss`. Each
returns (loss, metrics) like every objective of the package, `metrics["loss"]` the loss itself.

Log-probabilities are computed the way next_token.py computes its cross-entropy
(`optax.softmax_cross_entropy_with_integer_labels`, log p(target) = -cross-entropy) and always in
float32: a sequence's log-probability is a sum over its tokens, which bfloat16 would round away.
A `mask_BL` plays the part of next_token.py's `loss_mask`: 1 where the target counts (the
completion's tokens), 0 elsewhere (the prompt, padding, the first token of the next packed
document).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def token_log_probs(logits_BLV: jax.Array, targets_BL: jax.Array) -> jax.Array:
    """log p(target) at every position, float32 (B, L): the negated per-token cross-entropy of
    next_token.py's `token_cross_entropy`, with the logits in float32."""
    return -optax.softmax_cross_entropy_with_integer_labels(logits_BLV.astype(jnp.float32), targets_BL)


def sequence_log_probs(logits_BLV: jax.Array, targets_BL: jax.Array, mask_BL: jax.Array) -> jax.Array:
    """Sum over the positions where `mask_BL` is 1 of log p(target): float32 (B,). Positions masked
    out contribute exactly 0, whatever their logits."""
    logp_BL = token_log_probs(logits_BLV, targets_BL)
    return jnp.where(mask_BL > 0, logp_BL, 0.0).sum(axis=-1)


def dpo_loss(
    policy_chosen_B: jax.Array,
    policy_rejected_B: jax.Array,
    ref_chosen_B: jax.Array,
    ref_rejected_B: jax.Array,
    *,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[jax.Array, dict]:
    """Direct Preference Optimization (Rafailov et al. 2023, eq. 7), with conservative DPO's label
    smoothing (Mitchell 2023): the arguments are sequence log-probabilities (`sequence_log_probs`)
    of the chosen and rejected completions under the policy and the frozen reference.

        h    = (pi_c - ref_c) - (pi_r - ref_r)
        loss = mean over pairs of  -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)

    as TRL's `DPOTrainer.dpo_loss` computes loss_type "sigmoid" with `label_smoothing` (TRL up to
    0.28; from 0.29 its "sigmoid" ignores label_smoothing, which only its robust, EXO and AOT losses
    read). eps = 0 is plain DPO. The reference's log-probabilities get no gradient.

    Metrics (means over the pairs, as TRL logs them; none carries a gradient): `rewards_chosen`
    beta (pi_c - ref_c), `rewards_rejected` beta (pi_r - ref_r), `reward_margin` the mean of their
    difference, `accuracy` the fraction of pairs whose chosen reward is above the rejected one.
    """
    f32 = jnp.float32
    chosen_B = policy_chosen_B.astype(f32) - jax.lax.stop_gradient(ref_chosen_B.astype(f32))
    rejected_B = policy_rejected_B.astype(f32) - jax.lax.stop_gradient(ref_rejected_B.astype(f32))
    h_B = chosen_B - rejected_B
    losses_B = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(beta * h_B) - label_smoothing * jax.nn.log_sigmoid(
        -beta * h_B
    )
    loss = losses_B.mean()
    reward_c_B = beta * jax.lax.stop_gradient(chosen_B)
    reward_r_B = beta * jax.lax.stop_gradient(rejected_B)
    metrics = {
        "loss": loss,
        "rewards_chosen": reward_c_B.mean(),
        "rewards_rejected": reward_r_B.mean(),
        "reward_margin": (reward_c_B - reward_r_B).mean(),
        "accuracy": (reward_c_B > reward_r_B).astype(f32).mean(),
    }
    return loss, metrics


def adapters_off(params):
    """The reference's trainable parameters under LoRA/QLoRA: every factor zero, so each wrapped
    projection computes x W0 + 0 exactly, the base model (train.dpo.reference=adapters_off). Only
    for LoRA's factors: zeroing another method's parameters is not its base model."""
    return jax.tree.map(jnp.zeros_like, jax.lax.stop_gradient(params))


def dpo_objective(graphdef, *, beta: float, label_smoothing: float = 0.0, reference=adapters_off):
    """loss_fn(params, buffers, batch, noise_key=None) -> (DPO loss, metrics) for train.objective=dpo.

    `batch` holds B pairs (data/preference_pairs.py): `chosen_inputs`, `chosen_targets`,
    `chosen_loss_mask` and the three `rejected_*`, each (B, L). Chosen and rejected rows go through
    the model together as one batch of 2B rows (chosen first), once with the policy's parameters
    (training noise such as LoRA dropout from `noise_key`) and once with `reference(params)` and no
    noise, under stop_gradient: with `adapters_off` the same weights, no second copy; or, when the
    batch carries `chosen_ref_logp`/`rejected_ref_logp` (train.dpo.reference precomputed or
    frozen_copy), those. Both give
    sequence log-probabilities over the reply tokens, and `dpo_loss` the loss and its metrics.
    The model's auxiliary losses (MoE) are not added; the logits are the plain head's (2B, L, V).
    """
    from flax import nnx

    sides = ("chosen", "rejected")

    def loss_fn(params, buffers, batch, noise_key=None):
        inputs_BL, targets_BL, mask_BL = (
            jnp.concatenate([batch[f"{s}_{k}"] for s in sides]) for k in ("inputs", "targets", "loss_mask")
        )
        B = batch["chosen_inputs"].shape[0]
        policy_logits_BLV, _ = nnx.merge(graphdef, params, buffers).apply(inputs_BL, None, noise_key=noise_key)
        policy_B = sequence_log_probs(policy_logits_BLV, targets_BL, mask_BL)
        if "chosen_ref_logp" in batch:  # precomputed once (train/dpo_reference.py): no reference pass
            ref_B = jnp.concatenate([batch[f"{s}_ref_logp"][:, 0] for s in sides])
        else:
            ref_logits_BLV, _ = nnx.merge(graphdef, reference(params), buffers).apply(inputs_BL, None)
            ref_B = jax.lax.stop_gradient(sequence_log_probs(ref_logits_BLV, targets_BL, mask_BL))
        return dpo_loss(policy_B[:B], policy_B[B:], ref_B[:B], ref_B[B:], beta=beta, label_smoothing=label_smoothing)

    return loss_fn
