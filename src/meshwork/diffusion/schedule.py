"""DDPM (Ho et al., 2020): noise schedules, the forward process, the training loss, one reverse step.

Notation: beta_t for t = 0..T-1 is the schedule, alpha_t = 1 - beta_t and
abar_t = prod_{s<=t} alpha_s the signal level left at step t. The forward
process and the two training targets are

    x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps            eps ~ N(0, I)
    v   = sqrt(abar_t) eps - sqrt(1 - abar_t) x_0            (Salimans & Ho, 2022)

Everything here is a pure function of arrays and a `DiffusionConfig`, and
matches diffusers' DDPMScheduler (checked by tests/test_unet.py against golden
values it wrote). `t` may be a scalar or one timestep per example (B,).

    >>> cfg = DiffusionConfig(num_train_timesteps=10)
    >>> abar = alphas_cumprod(cfg)
    >>> x_t = add_noise(jnp.ones((2, 4, 4, 1)), jnp.zeros((2, 4, 4, 1)), jnp.array([0, 9]), abar)
    >>> x_t.shape
    (2, 4, 4, 1)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from meshwork.config_sections import DiffusionConfig

ModelFn = Callable[[jax.Array, jax.Array, jax.Array | None], jax.Array]
F32 = jnp.float32


def _betas64(cfg: DiffusionConfig) -> np.ndarray:
    T = cfg.num_train_timesteps
    if cfg.schedule == "linear":
        return np.linspace(cfg.beta_start, cfg.beta_end, T, dtype=np.float64)
    # Cosine: abar(s) = f(s) / f(0), f(s) = cos^2((s/T + 0.008) / 1.008 * pi/2); beta_t = 1 - f(t+1)/f(t),
    # capped at 0.999 so the last steps keep a sliver of signal (Nichol & Dhariwal, 2021).
    f = lambda s: np.cos((s / T + 0.008) / 1.008 * np.pi / 2) ** 2  # noqa: E731
    s = np.arange(T, dtype=np.float64)
    return np.minimum(1.0 - f(s + 1) / f(s), 0.999)


def betas(cfg: DiffusionConfig) -> jax.Array:
    """beta_t, t = 0..T-1, float32: "linear" is linspace(beta_start, beta_end, T) (diffusers'
    "linear"); "cosine" is Nichol & Dhariwal's (diffusers' "squaredcos_cap_v2"; beta_start/end unused).

    >>> betas(DiffusionConfig(num_train_timesteps=3, beta_start=0.1, beta_end=0.3)).tolist()
    [0.10000000149011612, 0.20000000298023224, 0.30000001192092896]
    """
    return jnp.asarray(_betas64(cfg), F32)


def alphas_cumprod(cfg: DiffusionConfig) -> jax.Array:
    """abar_t = prod_{s<=t} (1 - beta_s), float32 (computed in float64, then rounded once)."""
    return jnp.asarray(np.cumprod(1.0 - _betas64(cfg)), F32)


def _at(abar: jax.Array, t: jax.Array, ndim: int) -> jax.Array:
    """abar[t] shaped to broadcast against an (B, ...) array of rank `ndim`."""
    a = jnp.asarray(abar, F32)[jnp.asarray(t)]
    return a.reshape(a.shape + (1,) * (ndim - a.ndim)) if a.ndim else a


def add_noise(x0: jax.Array, noise: jax.Array, t: jax.Array, alphas_cumprod: jax.Array) -> jax.Array:
    """x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) noise (diffusers' DDPMScheduler.add_noise)."""
    a = _at(alphas_cumprod, t, x0.ndim)
    return jnp.sqrt(a) * x0 + jnp.sqrt(1.0 - a) * noise


def v_target(x0: jax.Array, noise: jax.Array, t: jax.Array, alphas_cumprod: jax.Array) -> jax.Array:
    """v = sqrt(abar_t) noise - sqrt(1 - abar_t) x0 (diffusers' DDPMScheduler.get_velocity)."""
    a = _at(alphas_cumprod, t, x0.ndim)
    return jnp.sqrt(a) * noise - jnp.sqrt(1.0 - a) * x0


def predicted_x0(
    model_output: jax.Array, x_t: jax.Array, t: jax.Array, alphas_cumprod: jax.Array, prediction: str = "epsilon"
) -> jax.Array:
    """x0 implied by the model's output at x_t:
    epsilon: (x_t - sqrt(1 - abar_t) eps) / sqrt(abar_t);  v: sqrt(abar_t) x_t - sqrt(1 - abar_t) v."""
    a = _at(alphas_cumprod, t, x_t.ndim)
    if prediction == "epsilon":
        return (x_t - jnp.sqrt(1.0 - a) * model_output) / jnp.sqrt(a)
    if prediction == "v":
        return jnp.sqrt(a) * x_t - jnp.sqrt(1.0 - a) * model_output
    raise ValueError(f"prediction={prediction!r}; choose epsilon or v")


def diffusion_loss(
    model_fn: ModelFn, x0: jax.Array, key: jax.Array, labels: jax.Array | None, cfg: DiffusionConfig
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The DDPM "simple" objective: E_{t, eps} || model(x_t, t, labels) - target ||^2.

    t ~ U{0..T-1} per example, eps ~ N(0, I), x_t = add_noise(x0, eps, t);
    target = eps (cfg.prediction "epsilon") or v (cfg.prediction "v"). The
    mean is over every element, in float32. `model_fn(x_t, t_B, labels_B)` is
    e.g. the UNet itself; label dropout for guidance is the caller's choice.
    Returns (loss, {"mse": loss}).
    """
    t_key, noise_key = jax.random.split(key)
    abar = alphas_cumprod(cfg)
    x0 = x0.astype(F32)
    t_B = jax.random.randint(t_key, (x0.shape[0],), 0, cfg.num_train_timesteps)
    noise = jax.random.normal(noise_key, x0.shape, F32)
    x_t = add_noise(x0, noise, t_B, abar)
    target = noise if cfg.prediction == "epsilon" else v_target(x0, noise, t_B, abar)
    pred = model_fn(x_t, t_B, labels).astype(F32)
    loss = jnp.mean(jnp.square(pred - target))
    return loss, {"mse": loss}


def ddpm_step(
    model_output: jax.Array,
    t: jax.Array,
    x_t: jax.Array,
    key: jax.Array | None,
    alphas_cumprod: jax.Array,
    *,
    prev_t: jax.Array | None = None,
    prediction: str = "epsilon",
    clip_sample: bool = True,
    clip_sample_range: float = 1.0,
    noise: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One ancestral step x_t -> x_{t'}, t' = prev_t (default t - 1); returns (x_prev, x0_pred).

    With a = abar_t, a' = abar_{t'} (1 when t' < 0), beta = 1 - a / a':

        x0   = predicted_x0(model_output, x_t, t), clipped to +-clip_sample_range if clip_sample
        mean = sqrt(a') beta / (1 - a) x0 + sqrt(a / a') (1 - a') / (1 - a) x_t
        x'   = mean + sqrt(var) z  (t > 0 only),  var = max((1 - a') / (1 - a) beta, 1e-20)

    i.e. the posterior q(x_{t'} | x_t, x0) with its own variance (diffusers'
    DDPMScheduler.step with variance_type "fixed_small"; its defaults are
    clip_sample=True, clip_sample_range=1.0, no thresholding, as here). z is
    N(0, I) from `key`, or `noise` when given (tests pass diffusers' draw).
    prev_t: the next timestep of a shortened schedule (e.g. t - T/S for S steps).
    """
    prev_t = jnp.asarray(t) - 1 if prev_t is None else jnp.asarray(prev_t)
    x_t = x_t.astype(F32)
    model_output = model_output.astype(F32)
    a = _at(alphas_cumprod, t, x_t.ndim)
    a_prev = jnp.where(prev_t >= 0, jnp.asarray(alphas_cumprod, F32)[jnp.maximum(prev_t, 0)], 1.0)
    a_prev = a_prev.reshape(a_prev.shape + (1,) * (x_t.ndim - a_prev.ndim)) if a_prev.ndim else a_prev
    beta = 1.0 - a / a_prev
    x0 = predicted_x0(model_output, x_t, t, alphas_cumprod, prediction)
    if clip_sample:
        x0 = jnp.clip(x0, -clip_sample_range, clip_sample_range)
    mean = (jnp.sqrt(a_prev) * beta / (1.0 - a)) * x0 + (jnp.sqrt(1.0 - beta) * (1.0 - a_prev) / (1.0 - a)) * x_t
    var = jnp.maximum((1.0 - a_prev) / (1.0 - a) * beta, 1e-20)
    if noise is None:
        if key is None:
            raise ValueError("ddpm_step: pass a PRNG key (or the noise itself) for the step's random part")
        noise = jax.random.normal(key, x_t.shape, F32)
    t_pos = jnp.asarray(t) > 0
    t_pos = t_pos.reshape(t_pos.shape + (1,) * (x_t.ndim - t_pos.ndim)) if t_pos.ndim else t_pos
    return mean + jnp.where(t_pos, jnp.sqrt(var), 0.0) * noise, x0
