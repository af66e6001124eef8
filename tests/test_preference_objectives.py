"""The DPO and GRPO losses (objectives/preference.py, objectives/grpo.py) against NumPy references
written from the papers' formulas (and TRL's definitions), in float64 with loops over pairs and
tokens: values, metrics and gradients within 1e-5 relative of float32 JAX, every function called
through jax.jit."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshwork.objectives.grpo import group_advantages, grpo_loss
from meshwork.objectives.preference import dpo_loss, sequence_log_probs, token_log_probs

TOL = 1e-5


def max_rel(got, want) -> float:
    """Largest difference relative to the largest magnitude of the reference."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def close(got, want, tol=TOL):
    err = max_rel(got, want)
    assert err <= tol, f"max relative error {err:.3g} > {tol}"


# ---------------------------------------------------------------- NumPy references (float64)


def np_log_softmax(z):
    z = np.asarray(z, np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def np_sequence_log_probs(logits, targets, mask):
    lsm = np_log_softmax(logits)
    B, L = targets.shape
    out = np.zeros(B)
    for b in range(B):
        for t in range(L):
            if mask[b, t]:
                out[b] += lsm[b, t, targets[b, t]]
    return out


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    return math.exp(log_sigmoid(x))


def np_dpo(pc, pr, rc, rr, beta, eps):
    """(loss, metrics, dloss/dpc, dloss/dpr) of the DPO / cDPO loss, pair by pair."""
    B = len(pc)
    losses, rc_, rr_, d_pc = [], [], [], []
    for b in range(B):
        h = (pc[b] - rc[b]) - (pr[b] - rr[b])
        losses.append(-(1 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h))
        rc_.append(beta * (pc[b] - rc[b]))
        rr_.append(beta * (pr[b] - rr[b]))
        d_pc.append((-(1 - eps) * beta * sigmoid(-beta * h) + eps * beta * sigmoid(beta * h)) / B)
    metrics = {
        "loss": np.mean(losses),
        "rewards_chosen": np.mean(rc_),
        "rewards_rejected": np.mean(rr_),
        "reward_margin": np.mean(np.subtract(rc_, rr_)),
        "accuracy": np.mean(np.greater(rc_, rr_)),
    }
    return metrics["loss"], metrics, np.array(d_pc), -np.array(d_pc)


def np_advantages(r, scale=True, eps=1e-4):
    r = np.asarray(r, np.float64)
    out = np.zeros_like(r)
    for u in range(r.shape[0]):
        g = r[u]
        std = g.std(ddof=1) if len(g) > 1 else 0.0
        out[u] = (g - g.mean()) / (std + eps) if scale else g - g.mean()
    return out


def np_grpo(logp, old, ref, adv, mask, eps_low, eps_high, kl_coef, aggregation):
    """(loss, metrics, dloss/dlogp) token by token, from the formulas."""
    B, L = logp.shape
    per_token = np.zeros((B, L))
    grad_token = np.zeros((B, L))  # d per_token / d logp
    ratios, clips, kls = [], [], []
    for b in range(B):
        A = adv[b]
        for t in range(L):
            if not mask[b, t]:
                continue
            ratio = math.exp(logp[b, t] - old[b, t])
            unclipped = ratio * A
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high) * A
            took_clip = clipped < unclipped
            objective = min(unclipped, clipped)
            grad = 0.0 if took_clip else -ratio * A
            kl = 0.0
            if ref is not None:
                d = ref[b, t] - logp[b, t]
                kl = math.exp(d) - d - 1
                kls.append(kl)
            per_token[b, t] = -(objective - kl_coef * kl)
            grad_token[b, t] = grad + kl_coef * (1 - math.exp(ref[b, t] - logp[b, t]) if kl_coef else 0.0)
            ratios.append(ratio)
            clips.append(took_clip)
    n_b = mask.sum(1)
    if aggregation == "token":
        loss = per_token.sum() / max(mask.sum(), 1)
        grad = grad_token / max(mask.sum(), 1)
    else:
        loss = np.mean([per_token[b].sum() / max(n_b[b], 1) for b in range(B)])
        grad = np.stack([grad_token[b] / max(n_b[b], 1) / B for b in range(B)])
    metrics = {"loss": loss, "ratio": np.mean(ratios), "clip_fraction": np.mean(clips), "advantage": np.mean(adv)}
    if ref is not None:
        metrics["kl"] = np.mean(kls)
    return loss, metrics, grad


# ---------------------------------------------------------------- log-probabilities


def test_sequence_log_probs_are_masked_log_softmax_sums():
    rng = np.random.default_rng(0)
    B, L, V = 3, 6, 11
    logits = rng.normal(size=(B, L, V)).astype(np.float32) * 3
    targets = rng.integers(0, V, size=(B, L))
    mask = np.ones((B, L), np.int32)
    mask[0, :2] = 0  # a prompt
    mask[1, 4:] = 0  # padding
    mask[2] = 0  # nothing counts
    logits[1, 5] = np.nan  # a masked position's logits never reach the sum

    @jax.jit
    def f(lg, tg, m):
        return sequence_log_probs(lg, tg, m), token_log_probs(lg, tg)

    seq, tok = f(logits, targets, mask)
    want = np_sequence_log_probs(logits, targets, mask)
    assert seq.dtype == jnp.float32 and seq.shape == (B,) and tok.shape == (B, L)
    close(seq, want)
    assert float(seq[2]) == 0.0
    want_tok = np.take_along_axis(np_log_softmax(logits), targets[..., None], -1)[..., 0]
    close(np.asarray(tok)[mask > 0], want_tok[mask > 0])
    # bfloat16 logits are read in float32
    seq16, _ = f(jnp.asarray(logits[:1, :5], jnp.bfloat16), targets[:1, :5], mask[:1, :5])
    assert seq16.dtype == jnp.float32


# ---------------------------------------------------------------- DPO


@pytest.mark.parametrize("beta,eps", [(0.1, 0.0), (0.5, 0.0), (0.1, 0.2)], ids=["dpo", "dpo-beta0.5", "cdpo"])
def test_dpo_matches_reference_and_analytic_gradient(beta, eps):
    rng = np.random.default_rng(1)
    B = 16
    pc, pr, rc, rr = (-rng.uniform(5, 60, size=B).astype(np.float32) for _ in range(4))
    pc[0], rc[0], pr[0], rr[0] = -20.0, -20.0, -30.0, -30.0  # h = 0: a tie counts as not accurate
    f = jax.jit(functools.partial(dpo_loss, beta=beta, label_smoothing=eps))
    loss, metrics = f(pc, pr, rc, rr)
    want_loss, want_metrics, want_dpc, want_dpr = np_dpo(pc, pr, rc, rr, beta, eps)
    close(loss, want_loss)
    assert set(metrics) == set(want_metrics)
    for k in want_metrics:
        close(metrics[k], want_metrics[k])
    grads = jax.jit(jax.grad(lambda *a: f(*a)[0], argnums=(0, 1, 2, 3)))(pc, pr, rc, rr)
    close(grads[0], want_dpc)
    close(grads[1], want_dpr)
    assert not np.any(grads[2]) and not np.any(grads[3])  # the reference is frozen


def test_dpo_is_stable_for_large_margins():
    big = jnp.array([400.0, -400.0])
    loss, _ = jax.jit(functools.partial(dpo_loss, beta=1.0))(big, -big, jnp.zeros(2), jnp.zeros(2))
    assert np.isfinite(float(loss)) and abs(float(loss) - 800.0 / 2) < 1e-3  # log sigmoid(-800) = -800


def test_dpo_gradient_through_a_linear_policy():
    """logits = x @ W: the gradient of the DPO loss w.r.t. W equals the NumPy chain rule (float64),
    itself checked against central finite differences."""
    rng = np.random.default_rng(2)
    B, L, D, V = 4, 5, 3, 6
    beta, eps = 0.7, 0.1
    xc, xr = (rng.normal(size=(B, L, D)) for _ in range(2))
    tc, tr = (rng.integers(0, V, size=(B, L)) for _ in range(2))
    mc, mr = np.ones((B, L)), np.ones((B, L))
    mc[:, :2] = mr[:, :2] = 0  # the prompt
    mr[0, 4:] = 0  # padding
    w = rng.normal(size=(D, V))
    w_ref = w + 0.3 * rng.normal(size=(D, V))

    def np_loss_and_grad(w):
        def seq(x, t, m, w):
            return np_sequence_log_probs(x @ w, t, m)

        def dseq_dw(x, t, m):  # (B, D, V): sum_t m x_t (onehot(t) - softmax)
            p = np.exp(np_log_softmax(x @ w))
            onehot = np.eye(V)[t]
            return np.einsum("bl,bld,blv->bdv", m, x, onehot - p)

        loss, _, d_pc, d_pr = np_dpo(
            seq(xc, tc, mc, w), seq(xr, tr, mr, w), seq(xc, tc, mc, w_ref), seq(xr, tr, mr, w_ref), beta, eps
        )
        grad = np.einsum("b,bdv->dv", d_pc, dseq_dw(xc, tc, mc)) + np.einsum("b,bdv->dv", d_pr, dseq_dw(xr, tr, mr))
        return loss, grad

    want_loss, want_grad = np_loss_and_grad(w)
    fd = np.zeros_like(w)
    for i in range(D):
        for j in range(V):
            dw = np.zeros_like(w)
            dw[i, j] = 1e-6
            fd[i, j] = (np_loss_and_grad(w + dw)[0] - np_loss_and_grad(w - dw)[0]) / 2e-6
    close(want_grad, fd, 1e-7)  # the reference's chain rule is right

    f32 = np.float32
    xc32, xr32, w_ref32 = xc.astype(f32), xr.astype(f32), w_ref.astype(f32)

    def loss_fn(w):
        def seq(x, t, m, w):
            return sequence_log_probs(x @ w, t, m)

        return dpo_loss(
            seq(xc32, tc, mc, w),
            seq(xr32, tr, mr, w),
            seq(xc32, tc, mc, w_ref32),
            seq(xr32, tr, mr, w_ref32),
            beta=beta,
            label_smoothing=eps,
        )[0]

    loss, grad = jax.jit(jax.value_and_grad(loss_fn))(w.astype(f32))
    close(loss, want_loss)
    close(grad, want_grad)


# ---------------------------------------------------------------- GRPO


def test_group_advantages_match_reference():
    rng = np.random.default_rng(3)
    r = rng.normal(size=(4, 6)).astype(np.float32)
    r[2] = 0.7  # every completion of this prompt scored the same
    r[3] = rng.integers(0, 2, size=6)  # 0/1 correctness rewards
    for scale in (True, False):
        got = np.asarray(jax.jit(functools.partial(group_advantages, scale=scale))(r))
        assert got.dtype == np.float32 and np.all(np.isfinite(got))
        assert np.all(got[2] == 0.0)
        close(got, np_advantages(r, scale))
    one = np.asarray(jax.jit(group_advantages)(r[:, :1]))  # groups of one: std 0, advantage 0
    assert np.all(one == 0.0)


EPS_LOW, EPS_HIGH = 0.2, 0.28
# (ratio, advantage, clipped branch taken) for every region of the clip
CLIP_CASES = [
    (0.5, 1.3, False),  # below 1 - eps, A > 0: ratio A is the smaller
    (0.5, -0.7, True),  # below 1 - eps, A < 0: clipped at 1 - eps
    (0.9, 1.3, False),  # inside
    (0.9, -0.7, False),
    (1.25, 1.3, False),  # above 1 + eps_low but inside clip-higher's 1 + eps_high
    (1.25, -0.7, False),
    (1.5, 1.3, True),  # above 1 + eps_high, A > 0: clipped
    (1.5, -0.7, False),  # above, A < 0: ratio A is the smaller
    (1.5, 0.0, False),  # no advantage, no clip
    (0.5, 0.0, False),
]


def test_grpo_clip_branches():
    f = jax.jit(
        jax.value_and_grad(
            lambda lp, old, a, m: grpo_loss(lp, old, None, a, m, clip_eps=EPS_LOW, clip_eps_high=EPS_HIGH),
            has_aux=True,
        )
    )
    one = np.ones((1, 1), np.float32)
    for ratio, adv, clipped in CLIP_CASES:
        logp, old = one * -1.0, one * (-1.0 - math.log(ratio))
        (loss, metrics), grad = f(logp, old, np.array([adv], np.float32), one)
        want_loss, want_metrics, want_grad = np_grpo(logp, old, None, [adv], one, EPS_LOW, EPS_HIGH, 0.0, "token")
        assert bool(metrics["clip_fraction"]) == clipped == bool(want_metrics["clip_fraction"]), (ratio, adv)
        close(loss, want_loss)
        close(metrics["ratio"], ratio)
        assert float(grad[0, 0]) == pytest.approx(want_grad[0, 0], rel=TOL, abs=1e-7)
        assert (float(grad[0, 0]) == 0.0) == (clipped or adv == 0.0)  # a clipped token sends no gradient

    # all of them in one batch, one token each: the clip fraction counts the clipped ones
    B = len(CLIP_CASES)
    ratios = np.array([c[0] for c in CLIP_CASES])
    logp = np.full((B, 1), -1.0, np.float32)
    old = (logp - np.log(ratios)[:, None]).astype(np.float32)
    adv = np.array([c[1] for c in CLIP_CASES], np.float32)
    (_, metrics), _ = f(logp, old, adv, np.ones((B, 1), np.float32))
    close(metrics["clip_fraction"], sum(c[2] for c in CLIP_CASES) / B)


def grpo_inputs(seed=4, B=6, L=9):
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.05, 4.0, size=(B, L)).astype(np.float32)
    old = (logp + rng.normal(scale=0.3, size=(B, L))).astype(np.float32)  # ratios on all sides of the clip
    ref = (logp + rng.normal(scale=0.5, size=(B, L))).astype(np.float32)
    adv = rng.normal(size=B).astype(np.float32)
    mask = np.ones((B, L), np.float32)
    for b, n in enumerate([9, 7, 4, 1, 0, 6]):  # ragged completions; one row has none
        mask[b, n:] = 0
    mask[5, :2] = 0  # and one whose first tokens are the prompt
    garbage = np.where(np.arange(L) % 2, 100.0, -100.0)  # padding holds garbage: exp(100) overflows
    logp = np.where(mask > 0, logp, garbage).astype(np.float32)
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.04])
@pytest.mark.parametrize("eps_high", [None, EPS_HIGH], ids=["symmetric", "clip-higher"])
def test_grpo_matches_reference(aggregation, kl_coef, eps_high):
    logp, old, ref, adv, mask = grpo_inputs()
    kw = dict(clip_eps=EPS_LOW, clip_eps_high=eps_high, kl_coef=kl_coef, aggregation=aggregation)
    f = jax.jit(jax.value_and_grad(lambda *a: grpo_loss(*a, **kw), argnums=(0, 1, 2, 3), has_aux=True))
    (loss, metrics), (grad, *frozen) = f(logp, old, ref, adv, mask)
    assert not any(np.any(g) for g in frozen)  # old policy, reference and advantages get no gradient
    eh = EPS_LOW if eps_high is None else eps_high
    want_loss, want_metrics, want_grad = np_grpo(logp, old, ref, adv, mask, EPS_LOW, eh, kl_coef, aggregation)
    assert 0 < want_metrics["clip_fraction"] < 1  # the inputs reach both branches
    close(loss, want_loss)
    assert set(metrics) == set(want_metrics)
    for k in ("ratio", "clip_fraction", "kl"):
        close(metrics[k], want_metrics[k])
    assert abs(float(metrics["advantage"]) - want_metrics["advantage"]) < 1e-6
    assert np.all(np.isfinite(grad)) and not np.any(np.asarray(grad)[mask == 0])
    close(grad, want_grad)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_grpo_fresh_rollout_gradient(aggregation, kl_coef):
    """logp == old_logp: every ratio is exactly 1, nothing is clipped, and the gradient per masked
    token is (-A + kl_coef (1 - exp(ref - logp))) / normalizer; with kl_coef 0 no reference is needed."""
    logp, _, ref, adv, mask = grpo_inputs(seed=5)
    ref_arg = ref if kl_coef else None
    kw = dict(kl_coef=kl_coef, aggregation=aggregation)
    f = jax.jit(jax.value_and_grad(lambda lp, old, r, a, m: grpo_loss(lp, old, r, a, m, **kw), has_aux=True))
    (_, metrics), grad = f(logp, logp, ref_arg, adv, mask)
    assert float(metrics["ratio"]) == 1.0 and float(metrics["clip_fraction"]) == 0.0
    assert ("kl" in metrics) == bool(kl_coef)
    if aggregation == "token":
        norm = np.full(mask.shape, mask.sum())
    else:
        norm = np.maximum(mask.sum(1, keepdims=True), 1) * mask.shape[0] * np.ones_like(mask)
    want = (-adv[:, None] + kl_coef * (1 - np.exp(ref.astype(np.float64) - logp))) / norm * mask
    close(grad, want)


def test_grpo_k3_kl():
    logp, old, ref, adv, mask = grpo_inputs(seed=6)
    f = jax.jit(lambda lp, r: grpo_loss(lp, old, r, adv, mask, kl_coef=0.5)[1]["kl"])
    assert float(f(logp, ref)) > 0
    assert float(f(logp, logp)) == 0.0  # the policy is the reference
    # k3 >= 0 token by token, for log-ratios of either sign and any size, and equals its formula
    d = np.linspace(-20.0, 20.0, 81, dtype=np.float32)
    zero, one = jnp.zeros((1, 1)), jnp.ones((1, 1))
    k3 = jax.jit(jax.vmap(lambda d: grpo_loss(zero, zero, d.reshape(1, 1), jnp.zeros(1), one, kl_coef=1.0)[1]["kl"]))(d)
    assert np.all(np.asarray(k3) >= 0) and float(k3[40]) == 0.0
    d64 = d.astype(np.float64)
    close(k3, np.exp(d64) - d64 - 1)


def test_grpo_refuses_bad_arguments():
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="aggregation"):
        grpo_loss(x, x, None, jnp.zeros(2), x, aggregation="tokens")
    with pytest.raises(ValueError, match="ref_logp_BL"):
        grpo_loss(x, x, None, jnp.zeros(2), x, kl_coef=0.04)
