"""Diffusion samplers: DDPM, DDIM, classifier-free guidance, and patch-parallel DDIM.

(Image grids and sampling a trained run's UNet: meshwork.diffusion.images; the UNet
itself split into patches, DistriFusion: meshwork.diffusion.distrifusion.)

Every sampler drives a generic denoiser

    model_fn(x_t_BHWC, t_B, labels_B | None) -> prediction_BHWC

whose output is epsilon or v as `DiffusionConfig.prediction` says. Notation,
with abar_t = prod_{s<=t} (1 - beta_s) the cumulative signal level:

    x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps,         eps ~ N(0, I)
    v   = sqrt(abar_t) eps - sqrt(1 - abar_t) x_0           (v-prediction)

Sampling visits N timesteps t_0 > t_1 > ... > t_{N-1} = 0 with "leading"
spacing (diffusers' default): t_k = (N-1-k) * (T // N), T the training timesteps; the step
from t_k goes to t_k - T // N, where abar = 1 once below 0 (`set_alpha_to_one`). The whole
loop is one `lax.fori_loop` under `jax.jit`, so it compiles once per
(model, shape, step count), whatever the key, labels or guidance scale.

Weights as jit arguments, not constants: pass `model_fn` as a pytree, e.g.
`jax.tree_util.Partial(apply_fn, params)`; its array leaves become arguments of
the compiled loop (new weights reuse the compile) and its other leaves (the
function) key the compile cache. A plain closure also works but bakes the
arrays it captures into the program as constants, and a new closure object
compiles anew. For an NNX model, with a module-level
`def unet_apply(graphdef, state, x, t, y): return nnx.merge(graphdef, state)(x, t, y)`:

    graphdef, state = nnx.split(unet)
    model_fn = jax.tree_util.Partial(unet_apply, graphdef, state)   # one compile for any state

    >>> cfg = DiffusionConfig(num_train_timesteps=100)
    >>> eps0 = lambda x, t, y: jnp.zeros_like(x)
    >>> ddim_sample(eps0, (2, 4, 4, 1), jax.random.key(0), cfg, steps=10).shape
    (2, 4, 4, 1)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from meshwork.config_sections import DiffusionConfig
from meshwork.diffusion.schedule import ModelFn, alphas_cumprod, ddpm_step, predicted_x0

F32 = jnp.float32


# --------------------------------------------------------------------------
# Schedule and one step (the schedule and the DDPM step are meshwork.diffusion.schedule's)
# --------------------------------------------------------------------------


def sampling_timesteps(cfg: DiffusionConfig, steps: int | None = None) -> np.ndarray:
    """The S timesteps visited, descending, with "leading" spacing t_k = (S-1-k) * (T // S).

    >>> sampling_timesteps(DiffusionConfig(num_train_timesteps=1000), 4).tolist()
    [750, 500, 250, 0]
    """
    T = cfg.num_train_timesteps
    steps = T if steps is None else int(steps)
    if not 1 <= steps <= T:
        raise ValueError(f"sampling: steps={steps} must be in [1, num_train_timesteps={T}]")
    return (np.arange(steps)[::-1] * (T // steps)).astype(np.int32)


def _step_table(cfg: DiffusionConfig, steps: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(t_N, prev_N): each step's timestep and the one it steps to (negative on the last step)."""
    t = sampling_timesteps(cfg, steps)
    return t, t - np.int32(cfg.num_train_timesteps // len(t))


def _abar_pair(abar, t, prev_t):
    """(abar_t, abar_prev), abar_prev = 1 below t = 0 (diffusers' set_alpha_to_one)."""
    return abar[t], jnp.where(prev_t >= 0, abar[jnp.maximum(prev_t, 0)], 1.0)


def _ddpm_update(x_t, out, t, prev_t, abar, noise, *, prediction, clip, eta=None):
    """Ancestral step: the Gaussian posterior q(x_prev | x_t, x0_hat) with "fixed_small" variance
    (`meshwork.diffusion.schedule.ddpm_step`). With a = abar_t, a' = abar_prev, beta = 1 - a / a':
        mean = sqrt(a') beta / (1-a) x0_hat + sqrt(a / a') (1-a') / (1-a) x_t
        var  = (1-a') / (1-a) beta            (no noise on the last step)
    """
    x, _ = ddpm_step(
        out,
        t,
        x_t,
        None,
        abar,
        prev_t=prev_t,
        prediction=prediction,
        clip_sample=clip is not None,
        clip_sample_range=1.0 if clip is None else clip,
        noise=noise,
    )
    return x


def _ddim_update(x_t, out, t, prev_t, abar, noise, *, prediction, clip, eta):
    """DDIM step (Song et al. eq. 12), with a = abar_t, a' = abar_prev:
        x_prev = sqrt(a') x0_hat + sqrt(1 - a' - sigma^2) eps_hat + sigma z,
        sigma  = eta sqrt((1-a')/(1-a)) sqrt(1 - a/a').
    eta = 0: deterministic (the probability-flow ODE, discretised); eta = 1: the same
    distribution as the DDPM step, and the same numbers given the same z.
    eps_hat = out (epsilon) or sqrt(1-a) x_t + sqrt(a) v (v); `clip` clips x0_hat only,
    as diffusers' clip_sample, and eps_hat stays the model's.
    """
    a, a_prev = _abar_pair(abar, t, prev_t)
    x0 = predicted_x0(out, x_t, t, abar, prediction)
    eps = out if prediction == "epsilon" else jnp.sqrt(1 - a) * x_t + jnp.sqrt(a) * out
    if clip is not None:
        x0 = jnp.clip(x0, -clip, clip)
    sigma = eta * jnp.sqrt((1 - a_prev) / (1 - a) * (1 - a / a_prev))
    x = jnp.sqrt(a_prev) * x0 + jnp.sqrt(jnp.maximum(1 - a_prev - sigma**2, 0.0)) * eps
    return x + sigma * noise if eta else x


def _guided(model_fn: ModelFn, x, t_B, labels, scale, null_label):
    """Model output, with classifier-free guidance out = u + s (c - u) when `scale` is given.

    The conditional and unconditional passes run as one batch of 2B. Guidance is
    applied to the raw output; epsilon and v are both affine in it for fixed x_t,
    so guiding v is the same as guiding eps.
    """
    if scale is None:
        return model_fn(x, t_B, labels)
    both = model_fn(
        jnp.concatenate([x, x]),
        jnp.concatenate([t_B, t_B]),
        jnp.concatenate([labels, jnp.full_like(labels, null_label)]),
    )
    cond, uncond = jnp.split(both, 2)
    return uncond + scale * (cond - uncond)


# --------------------------------------------------------------------------
# Jitted loop, weights as arguments
# --------------------------------------------------------------------------


def _is_array(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray))


def _partition(model_fn):
    """(static, arrays): `model_fn`'s pytree split into a hashable part and its array leaves."""
    leaves, treedef = jax.tree.flatten(model_fn)
    static = tuple(None if _is_array(l) else l for l in leaves)
    return (treedef, static), [l for l in leaves if _is_array(l)]


def _combine(static, arrays):
    treedef, leaves = static
    it = iter(arrays)
    return jax.tree.unflatten(treedef, [next(it) if l is None else l for l in leaves])


def _noise_key(key):
    """(key for x_T, key whose fold_in(., k) draws step k's noise): shared by every sampler,
    so that DDPM, DDIM(eta=1) and the patch-parallel sampler see the same z given one key."""
    k_init, k_steps = jax.random.split(key)
    return k_init, k_steps


@functools.partial(jax.jit, static_argnames=("static", "update", "prediction", "clip", "eta", "guided"))
def _sample_loop(
    arrays, x_T, k_steps, t_N, prev_N, abar, labels, scale, null_label, *, static, update, prediction, clip, eta, guided
):
    model_fn = _combine(static, arrays)
    step = functools.partial(
        _ddpm_update if update == "ddpm" else _ddim_update, prediction=prediction, clip=clip, eta=eta
    )

    def body(k, x):
        t_B = jnp.full((x.shape[0],), t_N[k], jnp.int32)
        out = _guided(model_fn, x, t_B, labels, scale if guided else None, null_label).astype(F32)
        noise = None
        if eta or update == "ddpm":
            noise = jax.random.normal(jax.random.fold_in(k_steps, k), x.shape, F32)
        return step(x, out, t_N[k], prev_N[k], abar, noise)

    return jax.lax.fori_loop(0, t_N.shape[0], body, x_T.astype(F32))


def _check_guidance(shape, labels, guidance_scale, null_label):
    if guidance_scale is not None and labels is None:
        raise ValueError(
            "sampling: guidance_scale needs labels (the conditional pass); pass labels=... "
            "or drop guidance_scale for unconditional sampling"
        )
    if guidance_scale is not None and null_label is None:
        raise ValueError(
            "sampling: guidance_scale needs null_label, the class id the model was trained with "
            "for 'no label' (e.g. num_class_embeds - 1)"
        )
    if labels is not None and jnp.shape(labels) != (shape[0],):
        raise ValueError(f"sampling: labels shape {jnp.shape(labels)} must be (batch,) = ({shape[0]},)")


def _start(model_fn, shape, key, cfg, steps, x_T, who: str):
    """What every sampler begins with: x_T (drawn from `key` unless given), the key for
    the steps' noise, the timestep table, and the model split into static part and arrays."""
    k_init, k_steps = _noise_key(key)
    if x_T is None:
        x_T = jax.random.normal(k_init, shape, F32)
    elif tuple(x_T.shape) != shape:
        raise ValueError(f"{who}: x_T shape {tuple(x_T.shape)} must equal shape {shape}")
    t_N, prev_N = _step_table(cfg, steps)
    static, arrays = _partition(model_fn)
    return x_T, k_steps, t_N, prev_N, static, arrays


def _sample(model_fn, shape, key, cfg, steps, *, update, eta, labels, guidance_scale, null_label, x_T, clip_sample):
    shape = tuple(int(s) for s in shape)
    _check_guidance(shape, labels, guidance_scale, null_label)
    x_T, k_steps, t_N, prev_N, static, arrays = _start(model_fn, shape, key, cfg, steps, x_T, "sampling")
    guided = guidance_scale is not None
    return _sample_loop(
        arrays,
        x_T,
        k_steps,
        t_N,
        prev_N,
        alphas_cumprod(cfg),
        None if labels is None else jnp.asarray(labels, jnp.int32),
        jnp.float32(guidance_scale if guided else 0.0),
        jnp.int32(null_label if guided else 0),
        static=static,
        update=update,
        prediction=cfg.prediction,
        clip=None if clip_sample is None else float(clip_sample),
        eta=float(eta),
        guided=guided,
    )


def ddpm_sample(
    model_fn: ModelFn,
    shape: Sequence[int],
    key: jax.Array,
    cfg: DiffusionConfig,
    *,
    labels: jax.Array | None = None,
    guidance_scale: float | None = None,
    null_label: int | None = None,
    steps: int | None = None,
    x_T: jax.Array | None = None,
    clip_sample: float | None = None,
) -> jax.Array:
    """DDPM ancestral sampling (Ho et al.) with "fixed_small" variance; returns x_0 (float32).

    x_T ~ N(0, I) from `key` (or `x_T`), then for each timestep
    x_prev = posterior_mean(x_t, x0_hat) + sqrt(beta_tilde) z (see `_ddpm_update`).
    `steps` (default T) takes every (T // steps)-th timestep, as diffusers' DDPMScheduler.
    `labels` (B,) int conditions the model; with `guidance_scale` s the output is
    u + s (c - u), u from `null_label`. `clip_sample`: clip x0_hat to [-c, c]; diffusers'
    DDPMScheduler defaults to 1.0 for images in [-1, 1], None (no clip) here.

    >>> cfg = DiffusionConfig(num_train_timesteps=50)
    >>> x = ddpm_sample(lambda x, t, y: jnp.zeros_like(x), (1, 2, 2, 1), jax.random.key(0), cfg)
    >>> x.shape, x.dtype
    ((1, 2, 2, 1), dtype('float32'))
    """
    return _sample(
        model_fn,
        shape,
        key,
        cfg,
        steps,
        update="ddpm",
        eta=1.0,
        labels=labels,
        guidance_scale=guidance_scale,
        null_label=null_label,
        x_T=x_T,
        clip_sample=clip_sample,
    )


def ddim_sample(
    model_fn: ModelFn,
    shape: Sequence[int],
    key: jax.Array,
    cfg: DiffusionConfig,
    *,
    steps: int = 50,
    eta: float = 0.0,
    labels: jax.Array | None = None,
    guidance_scale: float | None = None,
    null_label: int | None = None,
    x_T: jax.Array | None = None,
    clip_sample: float | None = None,
) -> jax.Array:
    """DDIM sampling (Song et al.) over `steps` leading-spaced timesteps; returns x_0 (float32).

    eta = 0 is deterministic: x_0 depends on x_T only, not on `key`. eta = 1 with the
    same key reproduces `ddpm_sample(..., steps=steps)`. Guidance and clipping as there.

    >>> cfg = DiffusionConfig(num_train_timesteps=100)
    >>> x_T = jnp.ones((1, 2, 2, 1))
    >>> a = ddim_sample(lambda x, t, y: 0 * x, x_T.shape, jax.random.key(0), cfg, steps=5, x_T=x_T)
    >>> b = ddim_sample(lambda x, t, y: 0 * x, x_T.shape, jax.random.key(1), cfg, steps=5, x_T=x_T)
    >>> bool((a == b).all())
    True
    """
    return _sample(
        model_fn,
        shape,
        key,
        cfg,
        steps,
        update="ddim",
        eta=eta,
        labels=labels,
        guidance_scale=guidance_scale,
        null_label=null_label,
        x_T=x_T,
        clip_sample=clip_sample,
    )


# --------------------------------------------------------------------------
# Patch-parallel DDIM (DistriFusion)
# --------------------------------------------------------------------------


def patch_parallel_comm_bytes(
    shape: Sequence[int], n_patches: int, *, batch_shards: int = 1, dtype=jnp.float32
) -> dict[str, int]:
    """What each device exchanges per sampling step in `patch_parallel_sample`.

    A device owns a patch of B/batch_shards x H/n x W x C elements (`patch_bytes`) and
    all-gathers it over the n patch devices once per step: it sends its patch to the
    n-1 others (directly, or by forwarding n-1 patches round a ring; the same count)
    and receives theirs. Guidance does not double it: the cond and uncond passes
    share x_t. Per step, per device:

        sent = received = (n - 1) * (B / batch_shards) * (H / n) * W * C * itemsize

    >>> patch_parallel_comm_bytes((2, 16, 16, 1), 4)
    {'patch_bytes': 512, 'sent_per_step': 1536, 'gathered_bytes': 2048}
    """
    B, H, W, C = shape
    patch = (B // batch_shards) * (H // n_patches) * W * C * jnp.dtype(dtype).itemsize
    return {"patch_bytes": patch, "sent_per_step": (n_patches - 1) * patch, "gathered_bytes": n_patches * patch}


def _patch_parallel_body(
    arrays,
    x_own,
    k_steps,
    t_N,
    prev_N,
    abar,
    labels,
    scale,
    null_label,
    *,
    static,
    axis,
    batch_axes,
    full_shape,
    warmup,
    prediction,
    clip,
    eta,
    guided,
):
    """Per device: the sampling loop on this device's patch (rows idx*h .. idx*h+h)."""
    model_fn = _combine(static, arrays)
    h = x_own.shape[1]
    row0 = jax.lax.axis_index(axis) * h
    b0 = (jax.lax.axis_index(batch_axes) if batch_axes else 0) * x_own.shape[0]
    update = functools.partial(_ddim_update, prediction=prediction, clip=clip, eta=eta)

    def denoise_own(k, x_own, context):
        # The model sees the full image [stale others | fresh own] and only this
        # device's rows of its output are kept.
        x_in = jax.lax.dynamic_update_slice_in_dim(context, x_own, row0, axis=1)
        t_B = jnp.full((x_in.shape[0],), t_N[k], jnp.int32)
        out = _guided(model_fn, x_in, t_B, labels, scale if guided else None, null_label).astype(F32)
        out = jax.lax.dynamic_slice_in_dim(out, row0, h, axis=1)
        noise = None
        if eta:
            # The full-size draw, sliced, keeps z identical to the single-device sampler's.
            z = jax.random.normal(jax.random.fold_in(k_steps, k), full_shape, F32)
            noise = jax.lax.dynamic_slice(z, (b0, row0, 0, 0), x_own.shape)
        return update(x_own, out, t_N[k], prev_N[k], abar, noise)

    def gather(x_own):
        return jax.lax.all_gather(x_own, axis, axis=1, tiled=True)

    def sync_step(k, carry):
        # Warmup: wait for this step's patches, so every device sees the fresh x_t.
        x_own, _ = carry
        fresh = gather(x_own)
        return denoise_own(k, x_own, fresh), fresh

    def async_step(k, carry):
        x_own, stale = carry
        # Nothing below consumes `sent` this step, so XLA may overlap the
        # all-gather with the model; it becomes next step's stale context.
        sent = gather(x_own)
        return denoise_own(k, x_own, stale), sent

    stale0 = jnp.zeros((x_own.shape[0], h * jax.lax.axis_size(axis), *x_own.shape[2:]), F32)
    stale0 = jax.lax.pcast(stale0, (axis, *batch_axes), to="varying")
    carry = jax.lax.fori_loop(0, warmup, sync_step, (x_own, stale0))
    x_own, _ = jax.lax.fori_loop(warmup, t_N.shape[0], async_step, carry)
    return x_own


def _check_patch_layout(shape, cfg, mesh, axis, batch_axes, steps, warmup, who):
    """The checks both patch-parallel samplers (this file's and meshwork.diffusion.distrifusion's) make:
    the mesh has the axes, the patches and batch shards divide the image and batch, and warmup is a step."""
    missing = [a for a in (axis, *batch_axes) if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"{who}: mesh axes {missing} are not in the mesh {tuple(mesh.axis_names)}")
    n, nb = mesh.shape[axis], math.prod(mesh.shape[a] for a in batch_axes)
    if shape[1] % n or shape[0] % nb:
        raise ValueError(
            f"{who}: height {shape[1]} must be divisible by mesh axis {axis!r} (size {n}) and batch "
            f"{shape[0]} by {batch_axes} (size {nb}); change the shape or mesh"
        )
    if not 1 <= warmup <= len(sampling_timesteps(cfg, steps)):
        raise ValueError(
            f"{who}: warmup={warmup} must be in [1, steps={steps}]; the first step is always "
            "synchronous since no previous activations exist yet"
        )


def _patch_parallel_setup(
    model_fn,
    shape,
    key,
    cfg,
    *,
    mesh,
    axis="sequence",
    batch_axes=(),
    steps=50,
    eta=0.0,
    warmup=4,
    labels=None,
    guidance_scale=None,
    null_label=None,
    x_T=None,
    clip_sample=None,
):
    """(jitted program, its arguments) for `patch_parallel_sample` and `patch_parallel_hlo`."""
    shape = tuple(int(s) for s in shape)
    _check_guidance(shape, labels, guidance_scale, null_label)
    batch_axes = tuple(batch_axes)
    _check_patch_layout(shape, cfg, mesh, axis, batch_axes, steps, warmup, "patch_parallel_sample")
    x_T, k_steps, t_N, prev_N, static, arrays = _start(model_fn, shape, key, cfg, steps, x_T, "patch_parallel_sample")
    guided = guidance_scale is not None
    labels = None if labels is None else jnp.asarray(labels, jnp.int32)
    f = _patch_parallel_program(
        static,
        len(arrays),
        labels is not None,
        mesh=mesh,
        axis=axis,
        batch_axes=batch_axes,
        full_shape=shape,
        warmup=int(warmup),
        prediction=cfg.prediction,
        clip=None if clip_sample is None else float(clip_sample),
        eta=float(eta),
        guided=guided,
    )
    args = (
        arrays,
        x_T.astype(F32),
        k_steps,
        t_N,
        prev_N,
        alphas_cumprod(cfg),
        labels,
        jnp.float32(guidance_scale if guided else 0.0),
        jnp.int32(null_label if guided else 0),
    )
    return f, args


@functools.lru_cache(maxsize=32)
def _patch_parallel_program(static, n_arrays, has_labels, *, mesh, axis, batch_axes, **body_kw):
    """The jitted shard_map, memoised so that a second call with new weights or keys reuses its compile."""
    b = (batch_axes if len(batch_axes) > 1 else batch_axes[0]) if batch_axes else None
    spec_x, spec_b, rep = PartitionSpec(b, axis), PartitionSpec(b), PartitionSpec()
    body = functools.partial(_patch_parallel_body, static=static, axis=axis, batch_axes=batch_axes, **body_kw)
    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=([rep] * n_arrays, spec_x, rep, rep, rep, rep, spec_b if has_labels else None, rep, rep),
        out_specs=spec_x,
        axis_names=frozenset((axis, *batch_axes)),
    )
    return jax.jit(f)


def patch_parallel_sample(
    model_fn: ModelFn,
    shape: Sequence[int],
    key: jax.Array,
    cfg: DiffusionConfig,
    *,
    mesh: Mesh,
    axis: str = "sequence",
    batch_axes: Sequence[str] = (),
    steps: int = 50,
    eta: float = 0.0,
    warmup: int = 4,
    labels: jax.Array | None = None,
    guidance_scale: float | None = None,
    null_label: int | None = None,
    x_T: jax.Array | None = None,
    clip_sample: float | None = None,
) -> jax.Array:
    """DDIM sampling with the image split into n horizontal patches over mesh axis `axis`
    (DistriFusion, Li et al. 2024, displaced patch parallelism); returns x_0 (B, H, W, C).

    Device i owns rows [i H/n, (i+1) H/n) of x_t. At step k it runs the denoiser on
    [x_{k-1} of the other patches | x_k of its own] -- the others are one step stale --
    keeps rows i of the output and takes its own DDIM step. Its fresh patch x_k is
    all-gathered during step k (nothing waits for it) and used as context at step k+1:
    the exchange is hidden behind compute. The first `warmup` steps (>= 1) are
    synchronous: gather first, then denoise on the fresh full x_k, which is the
    single-device computation. warmup = steps reproduces `ddim_sample` with the
    same key; a denoiser that looks at each pixel alone is unaffected by staleness.
    Batch may also be split over `batch_axes`. Per-step bytes: `patch_parallel_comm_bytes`.

    What is exchanged. The full method runs the UNet itself on the patch: every
    conv needs a halo of neighbouring rows, every self-attention the keys/values of
    all patches, every GroupNorm the statistics of the whole image, so each layer's
    halos, K/V and group statistics are exchanged, stale by one step, asynchronously,
    and each device computes only its 1/n of every layer: that is
    `meshwork.diffusion.distrifusion.distrifusion_sample`, for meshwork's UNet. This
    generic version works for any `model_fn`: the only activation it can see is the
    input x_t, so that is what it exchanges (one image per step, the smallest
    message), but each device then runs the whole denoiser on the whole image: it
    shows the staleness and communication pattern, not the 1/n compute.

    >>> from meshwork.sharding.mesh import make_mesh
    >>> mesh = make_mesh({"sequence": 4, "data": -1})
    >>> cfg = DiffusionConfig(num_train_timesteps=100)
    >>> f = lambda x, t, y: x - x.mean(axis=(1, 2, 3), keepdims=True)
    >>> patch_parallel_sample(f, (2, 8, 8, 1), jax.random.key(0), cfg, mesh=mesh, steps=10).shape
    (2, 8, 8, 1)
    """
    f, args = _patch_parallel_setup(
        model_fn,
        shape,
        key,
        cfg,
        mesh=mesh,
        axis=axis,
        batch_axes=batch_axes,
        steps=steps,
        eta=eta,
        warmup=warmup,
        labels=labels,
        guidance_scale=guidance_scale,
        null_label=null_label,
        x_T=x_T,
        clip_sample=clip_sample,
    )
    return f(*args)


def patch_parallel_hlo(model_fn: ModelFn, shape: Sequence[int], key: jax.Array, cfg: DiffusionConfig, **kwargs) -> str:
    """Optimized HLO text of the program `patch_parallel_sample` runs with these arguments (same
    keywords, same defaults), e.g. for `sharding.hlo.collective_summary`: its all-gather bytes
    are steps x `patch_parallel_comm_bytes(...)["sent_per_step"]`."""
    f, args = _patch_parallel_setup(model_fn, shape, key, cfg, **kwargs)
    return f.lower(*args).compile().as_text()
