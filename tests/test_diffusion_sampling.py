"""Diffusion samplers against closed forms on a Gaussian toy, and patch-parallel vs one device.

The toy data distribution is N(mu, sigma^2) per pixel. Then x_t ~ N(sqrt(a) mu, D_t)
with D_t = a sigma^2 + 1 - a, and the optimal noise predictor is linear:

    eps*(x_t, t) = E[eps | x_t] = sqrt(1-a) (x_t - sqrt(a) mu) / D_t

so every sampler step is an affine map whose result can be computed in float64.
"""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from meshwork.config_sections import DiffusionConfig
from meshwork.diffusion import images
from meshwork.diffusion import sampling as ds
from meshwork.diffusion.schedule import alphas_cumprod
from meshwork.sharding.hlo import list_collectives
from meshwork.sharding.mesh import make_mesh

MU, SIGMA = 0.3, 0.5
CFG = DiffusionConfig()
ABAR = np.asarray(alphas_cumprod(CFG), np.float64)  # the samplers' float32 schedule, exactly


def eps_star(x, t, labels=None):
    a = jnp.asarray(ABAR, jnp.float32)[t][:, None, None, None]
    return (x - jnp.sqrt(a) * MU) * jnp.sqrt(1 - a) / (a * SIGMA**2 + 1 - a)


def eps_global(x, t, labels=None, lam=0.5):
    """Not pixel-local: adds a term in each image's mean, so a patch's output depends on the others."""
    a = jnp.asarray(ABAR, jnp.float32)[t][:, None, None, None]
    return eps_star(x, t) + lam * jnp.sqrt(1 - a) * (x.mean(axis=(1, 2, 3), keepdims=True) - jnp.sqrt(a) * MU)


def eps_global_np(x, a, lam=0.5):
    return (x - np.sqrt(a) * MU) * np.sqrt(1 - a) / (a * SIGMA**2 + 1 - a) + lam * np.sqrt(1 - a) * (
        x.mean(axis=(1, 2, 3), keepdims=True) - np.sqrt(a) * MU
    )


def step_abars(steps):
    t = ds.sampling_timesteps(CFG, steps)
    prev = t - CFG.num_train_timesteps // steps
    return ABAR[t], np.where(prev >= 0, ABAR[np.maximum(prev, 0)], 1.0)


def key_and_xT(seed, shape):
    """The key and the x_T the samplers draw from it (their documented split)."""
    key = jax.random.key(seed)
    return key, jax.random.normal(jax.random.split(key)[0], shape)


# --------------------------------------------------------------------------
# Single-device samplers
# --------------------------------------------------------------------------


def test_docstring_examples():
    for module in (ds, images):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_leading_timesteps_and_final_abar():
    assert ds.sampling_timesteps(CFG, 4).tolist() == [750, 500, 250, 0]
    assert ds.sampling_timesteps(CFG).tolist() == list(range(999, -1, -1))
    t, prev = ds._step_table(CFG, 10)
    assert prev[-1] < 0 and np.all(prev[:-1] == t[1:])
    with pytest.raises(ValueError, match="steps=0"):
        ds.sampling_timesteps(CFG, 0)


def test_ddim_eta0_is_deterministic_and_ddim_eta1_is_ddpm():
    shape = (2, 4, 4, 1)
    _, x_T = key_and_xT(0, shape)
    a = ds.ddim_sample(eps_star, shape, jax.random.key(1), CFG, steps=20, x_T=x_T)
    b = ds.ddim_sample(eps_star, shape, jax.random.key(2), CFG, steps=20, x_T=x_T)
    np.testing.assert_array_equal(a, b)
    c = ds.ddim_sample(eps_star, shape, jax.random.key(2), CFG, steps=20, eta=1.0, x_T=x_T)
    assert float(jnp.abs(c - a).max()) > 0.1
    # eta = 1 has DDPM's variance and, given one key, draws the same z: the same numbers.
    d = ds.ddpm_sample(eps_star, shape, jax.random.key(2), CFG, steps=20, x_T=x_T)
    np.testing.assert_allclose(c, d, atol=1e-5)


def test_ddpm_gaussian_moments():
    # 512 images x 64 iid pixels; the standard error of the mean is sigma / 181 = 0.003.
    x = np.asarray(ds.ddpm_sample(eps_star, (512, 8, 8, 1), jax.random.key(3), CFG), np.float64)
    # The exact law of the sampler's output: each step x <- A x + b + sqrt(var) z.
    a, a_prev = step_abars(CFG.num_train_timesteps)
    m, v = 0.0, 1.0
    for at, ap in zip(a, a_prev):
        D = at * SIGMA**2 + 1 - at
        p, q = np.sqrt(at) * SIGMA**2 / D, MU - at * SIGMA**2 * MU / D  # x0_hat = p x + q
        beta = 1 - at / ap
        c0, c1 = np.sqrt(ap) * beta / (1 - at), np.sqrt(1 - beta) * (1 - ap) / (1 - at)
        m, v = (c0 * p + c1) * m + c0 * q, (c0 * p + c1) ** 2 * v + (1 - ap) / (1 - at) * beta
    # fixed_small leaves out Var(x0 | x_t): std 0.4961, not 0.5.
    assert abs(m - MU) < 1e-4 and 0.003 < SIGMA - np.sqrt(v) < 0.005
    n = x.size
    assert abs(x.mean() - m) < 5 * np.sqrt(v / n)
    assert abs(x.std() - np.sqrt(v)) < 5 * np.sqrt(v / (2 * n))
    assert abs(x.mean() - MU) < 0.015 and abs(x.std() - SIGMA) < 0.015


def test_ddim_gaussian_is_the_probability_flow_map():
    shape = (1, 4, 8, 1)
    x_T = jnp.linspace(-3, 3, 32).reshape(shape)
    xT = np.asarray(x_T, np.float64)
    errs = {}
    for steps in (50, 1000):
        x0 = np.asarray(ds.ddim_sample(eps_star, shape, jax.random.key(0), CFG, steps=steps, x_T=x_T))
        a, a_prev = step_abars(steps)
        # One DDIM step on u = x - sqrt(a) mu with eps*: u' = u (sqrt(a a') s^2 + sqrt((1-a)(1-a'))) / D.
        u = xT - np.sqrt(a[0]) * MU
        for at, ap in zip(a, a_prev):
            u = u * (np.sqrt(at * ap) * SIGMA**2 + np.sqrt((1 - at) * (1 - ap))) / (at * SIGMA**2 + 1 - at)
        np.testing.assert_allclose(x0, MU + u, atol=2e-4)
        # The ODE keeps u / sqrt(D) fixed: x_0 = mu + sigma (x_T - sqrt(a_T) mu) / sqrt(D_T), affine in x_T.
        ode = MU + SIGMA * (xT - np.sqrt(a[0]) * MU) / np.sqrt(a[0] * SIGMA**2 + 1 - a[0])
        errs[steps] = np.abs(x0 - ode).max()
    # DDIM is a first-order ODE solver: error ~ 1/S (measured 0.083 at S=50, 0.0045 at S=1000).
    assert errs[1000] < 1e-2 and errs[1000] < errs[50] / 10, errs


def test_v_prediction_matches_epsilon():
    cfg_v = DiffusionConfig(prediction="v")

    def v_star(x, t, labels=None):
        # v = sqrt(a) eps - sqrt(1-a) x0, with x0 = (x - sqrt(1-a) eps) / sqrt(a)  =>  v = (eps - sqrt(1-a) x) / sqrt(a)
        a = jnp.asarray(ABAR, jnp.float32)[t][:, None, None, None]
        return (eps_star(x, t) - jnp.sqrt(1 - a) * x) / jnp.sqrt(a)

    shape = (2, 4, 4, 1)
    key, _ = key_and_xT(4, shape)
    for eta in (0.0, 1.0):
        np.testing.assert_allclose(
            ds.ddim_sample(v_star, shape, key, cfg_v, steps=25, eta=eta),
            ds.ddim_sample(eps_star, shape, key, CFG, steps=25, eta=eta),
            atol=1e-4,
        )


def eps_labelled(x, t, labels):
    return eps_star(x, t) + 0.1 * labels.astype(jnp.float32)[:, None, None, None]


def test_classifier_free_guidance():
    shape, null = (3, 4, 4, 1), 9
    key, _ = key_and_xT(5, shape)
    y = jnp.array([1, 3, 7])
    kw = dict(steps=20)
    cond = ds.ddim_sample(eps_labelled, shape, key, CFG, labels=y, **kw)
    uncond = ds.ddim_sample(eps_labelled, shape, key, CFG, labels=jnp.full_like(y, null), **kw)
    g1 = ds.ddim_sample(eps_labelled, shape, key, CFG, labels=y, guidance_scale=1.0, null_label=null, **kw)
    g0 = ds.ddim_sample(eps_labelled, shape, key, CFG, labels=y, guidance_scale=0.0, null_label=null, **kw)
    np.testing.assert_allclose(g1, cond, atol=1e-5)
    np.testing.assert_allclose(g0, uncond, atol=1e-5)
    assert float(jnp.abs(cond - uncond).max()) > 0.05
    # The model is affine in the label, so scale s acts as the label null + s (y - null).
    g2 = ds.ddpm_sample(eps_labelled, shape, key, CFG, labels=y, guidance_scale=2.0, null_label=null, **kw)
    np.testing.assert_allclose(
        g2, ds.ddpm_sample(eps_labelled, shape, key, CFG, labels=null + 2 * (y - null), **kw), atol=1e-4
    )
    with pytest.raises(ValueError, match="null_label"):
        ds.ddim_sample(eps_labelled, shape, key, CFG, labels=y, guidance_scale=2.0)


def test_params_are_arguments_not_constants():
    shape = (2, 4, 4, 1)

    def scaled(w, x, t, y):
        return w * eps_star(x, t)

    key, _ = key_and_xT(6, shape)
    a = ds.ddim_sample(jax.tree_util.Partial(scaled, jnp.float32(1.0)), shape, key, CFG, steps=10)
    np.testing.assert_allclose(a, ds.ddim_sample(eps_star, shape, key, CFG, steps=10), atol=1e-6)
    n_compiled = ds._sample_loop._cache_size()
    ds.ddim_sample(jax.tree_util.Partial(scaled, jnp.float32(0.5)), shape, key, CFG, steps=10)
    assert ds._sample_loop._cache_size() == n_compiled


# --------------------------------------------------------------------------
# Patch-parallel
# --------------------------------------------------------------------------


def ddim_trajectory_np(x_T, steps):
    """x_k for k = 0..S of single-device DDIM (eta = 0) with eps_global, in float64."""
    a, a_prev = step_abars(steps)
    xs = [np.asarray(x_T, np.float64)]
    for at, ap in zip(a, a_prev):
        x = xs[-1]
        e = eps_global_np(x, at)
        xs.append(np.sqrt(ap) * (x - np.sqrt(1 - at) * e) / np.sqrt(at) + np.sqrt(1 - ap) * e)
    return xs


def staleness_estimate(xs, steps, warmup, n):
    """First-order error of patch-parallel sampling: sum over async steps of |c_k| max |d eps_k|.

    At async step k device i sees x_{k-1} instead of x_k on the other patches, which
    moves the image mean by mean(others(x_{k-1} - x_k)) and eps by lam sqrt(1-a_k) times
    that; a DDIM step passes an eps error to x_{k+1} times c_k = sqrt(1-a') - sqrt(a'/a) sqrt(1-a).
    Later steps' propagation is ignored (it shrinks errors on this toy).
    """
    a, a_prev = step_abars(steps)
    h = xs[0].shape[1] // n
    total = 0.0
    for k in range(warmup, steps):
        d = xs[k - 1] - xs[k]
        worst = 0.0
        for i in range(n):
            others = d.copy()
            others[:, i * h : (i + 1) * h] = 0
            worst = max(worst, np.abs(others.mean(axis=(1, 2, 3))).max())
        c = np.sqrt(1 - a_prev[k]) - np.sqrt(a_prev[k] / a[k]) * np.sqrt(1 - a[k])
        total += abs(c) * 0.5 * np.sqrt(1 - a[k]) * worst
    return total


def test_patch_parallel_local_model_is_exact():
    # A pixel-local denoiser does not read the other patches: staleness cannot matter.
    mesh = make_mesh({"sequence": 4}, devices=jax.devices()[:4])
    shape, null = (2, 8, 4, 1), 9
    key, _ = key_and_xT(7, shape)
    y = jnp.array([2, 5])
    kw = dict(steps=10, eta=1.0, labels=y, guidance_scale=3.0, null_label=null)
    ref = ds.ddim_sample(eps_labelled, shape, key, CFG, **kw)
    pp = ds.patch_parallel_sample(eps_labelled, shape, key, CFG, mesh=mesh, warmup=1, **kw)
    np.testing.assert_allclose(pp, ref, atol=1e-5)
    # Another key (and guidance scale) reuses the compiled program.
    hits = ds._patch_parallel_program.cache_info().hits
    kw["guidance_scale"] = 1.5
    ds.patch_parallel_sample(eps_labelled, shape, jax.random.key(0), CFG, mesh=mesh, warmup=1, **kw)
    assert ds._patch_parallel_program.cache_info().hits == hits + 1


def test_patch_parallel_global_model_error_bound_and_warmup():
    # 4 patches x 2 batch shards on 8 devices.
    mesh = make_mesh({"sequence": 4, "data": 2})
    shape, steps = (4, 16, 16, 1), 20
    key, x_T = key_and_xT(8, shape)
    kw = dict(mesh=mesh, batch_axes=("data",), steps=steps)
    ref = np.asarray(ds.ddim_sample(eps_global, shape, key, CFG, steps=steps))
    xs = ddim_trajectory_np(x_T, steps)
    np.testing.assert_allclose(ref, xs[-1], atol=1e-5)
    errs = {}
    for warmup in (1, 5, 10, 18):
        pp = np.asarray(ds.patch_parallel_sample(eps_global, shape, key, CFG, warmup=warmup, **kw))
        errs[warmup] = np.abs(pp - ref).max()
        bound = 1.5 * staleness_estimate(xs, steps, warmup, 4) + 1e-5
        assert errs[warmup] < bound, (warmup, errs[warmup], bound)
    # Measured (max |x_0| = 1.7): 9.0e-3, 8.0e-3, 6.0e-3, 1.7e-4 against bounds 6.7e-2, 3.7e-2, 1.9e-2, 2.6e-4.
    assert errs[1] > 1e-3, "staleness should be visible with a non-local model"
    assert errs[1] > errs[5] > errs[10] > errs[18]
    # All steps synchronous: the single-device computation, eta > 0 included (same z).
    for eta in (0.0, 1.0):
        pp = ds.patch_parallel_sample(eps_global, shape, key, CFG, warmup=steps, eta=eta, **kw)
        np.testing.assert_allclose(pp, ds.ddim_sample(eps_global, shape, key, CFG, steps=steps, eta=eta), atol=1e-5)


def test_patch_parallel_bytes_per_step_match_hlo():
    mesh = make_mesh({"sequence": 4, "data": 2})
    shape, steps = (4, 16, 8, 2), 12
    hlo = ds.patch_parallel_hlo(
        eps_global, shape, jax.random.key(0), CFG, mesh=mesh, batch_axes=("data",), steps=steps, warmup=3
    )
    comm = ds.patch_parallel_comm_bytes(shape, 4, batch_shards=2)
    assert comm == {"patch_bytes": 2 * 4 * 8 * 2 * 4, "sent_per_step": 3 * 512, "gathered_bytes": 4 * 512}
    colls = list_collectives(hlo)
    assert {c.kind for c in colls} == {"all-gather"}
    # One all-gather per step: the warmup loop's and the async loop's, each x its trip count.
    assert sum(c.multiplier for c in colls) == steps
    for c in colls:
        assert (c.group_size, c.payload_bytes, c.sent_bytes) == (4, comm["gathered_bytes"], comm["sent_per_step"])


def test_patch_parallel_rejects_bad_arguments():
    mesh = make_mesh({"sequence": 4, "data": 2})
    with pytest.raises(ValueError, match="warmup=0"):
        ds.patch_parallel_sample(eps_star, (2, 8, 8, 1), jax.random.key(0), CFG, mesh=mesh, warmup=0)
    with pytest.raises(ValueError, match="height 6"):
        ds.patch_parallel_sample(eps_star, (2, 6, 8, 1), jax.random.key(0), CFG, mesh=mesh)


# --------------------------------------------------------------------------
# Grids
# --------------------------------------------------------------------------


def test_image_grid_and_png(tmp_path):
    gray = np.stack([np.full((4, 5, 1), v) for v in (-1.0, 0.0, 1.0)])
    g = images.image_grid(gray, nrow=2, padding=1)
    assert g.shape == (2 * 5 + 1, 2 * 6 + 1) and g.dtype == np.uint8
    assert g[1, 1] == 0 and g[1, 7] == 128 and g[6, 1] == 255 and g[6, 7] == 0  # last cell: padding
    rgb = np.random.default_rng(0).uniform(-1, 1, (5, 4, 4, 3))
    path = images.save_grid(rgb, tmp_path / "grid.png", nrow=3)
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size == (3 * 6 + 2, 2 * 6 + 2) and im.mode == "RGB"
    with pytest.raises(ValueError, match="C = 1 or 3"):
        images.image_grid(np.zeros((1, 4, 4, 2)))
