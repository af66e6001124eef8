"""DistriFusion (Li et al., 2024): DDIM with the UNet itself split into horizontal patches.

Each of the n devices of mesh axis `axis` owns rows [i H/n, (i+1) H/n) of x_t and
runs every layer of the UNet on its patch only, so it computes about 1/n of the
model. What a layer needs from the other patches (conv halos, GroupNorm
statistics, attention keys/values: `meshwork.diffusion.patch_exchange`) is
exchanged at every step:

    steps 0 .. warmup-1   synchronous: each layer waits for the others' fresh values
                          (the single-device computation, up to float reassociation)
    steps warmup ..       displaced: each layer uses the values the others sent during
                          the previous step, with its own patch fresh, and sends its
                          fresh values for the next step; no layer waits for a collective

The per-layer state is an explicit pytree carried by the sampling loop,
{"000_halo": (top, bottom), "001_norm": ..., "012_kv": ...}; the values gathered
at step k are loop outputs consumed by step k+1 only (`stale_step_dependencies`
checks it on the compiled step).

    graphdef, state = nnx.split(unet)
    fn = jax.tree_util.Partial(apply, graphdef, state)           # as for ddim_sample
    x0 = distrifusion_sample(fn, (8, 16, 16, 1), key, cfg, mesh=make_mesh({"sequence": 4}), warmup=4)

The denoiser must be a meshwork UNet (its layers consult the exchange); any other
`model_fn` is refused, and `patch_parallel_sample` (which exchanges the input only)
serves it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from meshwork.config_sections import DiffusionConfig
from meshwork.diffusion.patch_exchange import PatchExchange, exchanging, sent_bytes
from meshwork.diffusion.sampling import (
    _check_guidance,
    _check_patch_layout,
    _combine,
    _ddim_update,
    _guided,
    _partition,
    _start,
)
from meshwork.diffusion.schedule import ModelFn, alphas_cumprod

F32 = jnp.float32


def denoise_patch(
    model_fn: ModelFn,
    x_own,
    t_B,
    labels,
    *,
    axis: str,
    n: int,
    stale: dict | None,
    guidance_scale=None,
    null_label=None,
) -> tuple[jax.Array, dict]:
    """(prediction on this device's patch, what its layers sent): one patch-parallel UNet call.

    Inside shard_map over `axis`. stale=None: synchronous; else the previous call's sent dict.
    """
    exchange = PatchExchange(axis, n, stale)
    with exchanging(exchange):
        out = _guided(model_fn, x_own, t_B, labels, guidance_scale, null_label).astype(F32)
    if not exchange.fresh and n > 1:
        raise ValueError(
            "distrifusion_sample: the denoiser never consulted the patch exchange, so it is not a "
            "meshwork UNet; use patch_parallel_sample, which exchanges the input only"
        )
    return out, exchange.fresh


# --------------------------------------------------------------------------
# The sampling loop
# --------------------------------------------------------------------------


def _body(
    arrays,
    x_own,
    k_steps,
    t_N,
    prev_N,
    abar,
    labels,
    scale,
    null_label,
    warmup,
    *,
    static,
    axis,
    n,
    batch_axes,
    full_shape,
    prediction,
    clip,
    eta,
    guided,
):
    """Per device: DDIM on its patch, the UNet's per-layer state carried from step to step."""
    model_fn = _combine(static, arrays)
    h = x_own.shape[1]
    row0 = jax.lax.axis_index(axis) * h
    b0 = (jax.lax.axis_index(batch_axes) if batch_axes else 0) * x_own.shape[0]
    update = functools.partial(_ddim_update, prediction=prediction, clip=clip, eta=eta)

    def step(k, x_own, stale):
        t_B = jnp.full((x_own.shape[0],), t_N[k], jnp.int32)
        out, sent = denoise_patch(
            model_fn,
            x_own,
            t_B,
            labels,
            axis=axis,
            n=n,
            stale=stale,
            guidance_scale=scale if guided else None,
            null_label=null_label,
        )
        noise = None
        if eta:  # the full-size draw, sliced: the same z as the single-device sampler's
            z = jax.random.normal(jax.random.fold_in(k_steps, k), full_shape, F32)
            noise = jax.lax.dynamic_slice(z, (b0, row0, 0, 0), x_own.shape)
        return update(x_own, out, t_N[k], prev_N[k], abar, noise), sent

    # The state's structure from an abstract synchronous step; its zeros are never read, since
    # step 0 is synchronous (warmup >= 1). `warmup` is an argument, not a constant: one compile
    # serves every warm-up length.
    shapes = jax.eval_shape(lambda x: step(0, x, None)[1], x_own)
    carry = (x_own, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
    carry = jax.lax.fori_loop(0, warmup, lambda k, c: step(k, c[0], None), carry)
    x_own, _ = jax.lax.fori_loop(warmup, t_N.shape[0], lambda k, c: step(k, *c), carry)
    return x_own


@functools.lru_cache(maxsize=32)
def _program(static, n_arrays, has_labels, *, mesh, axis, batch_axes, **body_kw):
    """The jitted shard_map, memoised so that new weights or keys reuse its compile."""
    b = (batch_axes if len(batch_axes) > 1 else batch_axes[0]) if batch_axes else None
    spec_x, spec_b, rep = PartitionSpec(b, axis), PartitionSpec(b), PartitionSpec()
    body = functools.partial(_body, static=static, axis=axis, n=mesh.shape[axis], batch_axes=batch_axes, **body_kw)
    # check_vma off: the carried state mixes per-device halos and gathered (identical) values,
    # and nothing here is differentiated.
    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=([rep] * n_arrays, spec_x, rep, rep, rep, rep, spec_b if has_labels else None, rep, rep, rep),
        out_specs=spec_x,
        axis_names=frozenset((axis, *batch_axes)),
        check_vma=False,
    )
    return jax.jit(f)


def _setup(
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
    shape, batch_axes = tuple(int(s) for s in shape), tuple(batch_axes)
    _check_guidance(shape, labels, guidance_scale, null_label)
    _check_patch_layout(shape, cfg, mesh, axis, batch_axes, steps, warmup, "distrifusion_sample")
    x_T, k_steps, t_N, prev_N, static, arrays = _start(model_fn, shape, key, cfg, steps, x_T, "distrifusion_sample")
    guided = guidance_scale is not None
    labels = None if labels is None else jnp.asarray(labels, jnp.int32)
    f = _program(
        static,
        len(arrays),
        labels is not None,
        mesh=mesh,
        axis=axis,
        batch_axes=batch_axes,
        full_shape=shape,
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
        jnp.int32(warmup),
    )
    return f, args


def distrifusion_sample(
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
    """DDIM sampling with the UNet split into n = mesh.shape[axis] horizontal patches (see the
    module docstring); returns x_0 (B, H, W, C). Same keywords and noise as `ddim_sample`;
    `warmup` (>= 1) synchronous steps first, warmup = steps is the single-device computation.
    Batch may also be split over `batch_axes`. H / n must be a multiple of 2^(levels - 1).
    One compile per (model, shape, steps, mesh) serves every key, label set and warm-up.

        fn = jax.tree_util.Partial(apply, *nnx.split(unet))     # apply(g, s, x, t, y) = nnx.merge(g, s)(x, t, y)
        distrifusion_sample(fn, (2, 16, 16, 1), key, cfg, mesh=make_mesh({"sequence": 4}), steps=10)
    """
    f, args = _setup(
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


# --------------------------------------------------------------------------
# One denoising step, for measurements and tests
# --------------------------------------------------------------------------


def step_program(
    model_fn: ModelFn,
    shape: Sequence[int],
    *,
    mesh: Mesh,
    axis: str = "sequence",
    synchronous: bool,
    labelled: bool = True,
):
    """(jitted f, static part) of one patch-parallel UNet call on a (B, H, W, C) image split by rows:

        synchronous:  f(arrays, x_BHWC, t_B, labels_B)        -> (out_BHWC, sent)
        stale:        f(arrays, x_BHWC, t_B, labels_B, stale) -> (out_BHWC, sent)

    `sent`/`stale` hold every device's values stacked on a leading axis of size n (the
    per-device halos differ). `arrays = _partition(model_fn)[1]`. Its compiled text and
    cost_analysis are one device's step (`comm_formula`, `stale_step_dependencies`).
    """
    static, arrays = _partition(model_fn)
    n = mesh.shape[axis]
    rows, stacked, rep = PartitionSpec(None, axis), PartitionSpec(axis), PartitionSpec()

    def body(arrays, x_own, t_B, labels, stale=None):
        own = None if stale is None else jax.tree.map(lambda s: s[0], stale)
        out, sent = denoise_patch(_combine(static, arrays), x_own, t_B, labels, axis=axis, n=n, stale=own)
        return out, jax.tree.map(lambda s: s[None], sent)

    specs = ([rep] * len(arrays), rows, rep, rep if labelled else None) + (() if synchronous else (stacked,))
    f = jax.shard_map(
        body, mesh=mesh, in_specs=specs, out_specs=(rows, stacked), axis_names=frozenset((axis,)), check_vma=False
    )
    return jax.jit(f), arrays


def comm_formula(sent_shapes: dict, n: int, itemsize: int = 4) -> dict[str, int]:
    """Bytes one (interior) device sends per denoising step, by kind, from the shapes of a step's
    `sent` values (one device's, without the stacked leading axis):

        halo  every k x k conv:  2 p rows x W x C (one to each neighbour)       collective-permute
        norm  every GroupNorm:   (n-1) x B x G x 2 floats (mean, M2 per group)   all-gather
        kv    every attention:   (n-1)/n x B x L x 2C (its patch's K and V)      all-gather

    >>> comm_formula({"000_halo": ((2, 1, 16, 32), (2, 1, 16, 32)), "001_norm": (4, 2, 8, 2)}, 4)
    {'halo': 8192, 'norm': 384, 'kv': 0, 'total': 8576}
    """
    out = {"halo": 0, "norm": 0, "kv": 0}
    for key, shapes in sent_shapes.items():
        kind = key.split("_", 1)[1]
        for shape in shapes if kind == "halo" else (shapes,):
            out[kind] += sent_bytes(kind, tuple(shape), itemsize, n)
    out["total"] = sum(out.values())
    return out


def stale_step_dependencies(hlo_text: str) -> dict[str, int]:
    """How the collectives of a compiled `step_program` feed its outputs: counts of
    collectives in all, of those the prediction (the first output) depends on, and of
    those the sent state (the other outputs) depends on.

    On a stale step `feeding_output` is 0: the prediction is computed from the local
    patch and the previous step's state only, and every collective's result leaves the
    step as state for the next one, so the exchange can overlap the whole step's compute.
    On a synchronous step every collective feeds the prediction.
    """
    from meshwork.sharding.hlo import COLLECTIVES
    from meshwork.sharding.hlo_parse import callees, parse_module

    comps, entry = parse_module(hlo_text)
    instrs = comps[entry]
    root = list(instrs.values())[-1]

    def is_collective(instr) -> bool:
        ops = [instr.op] + [i.op for c in callees(instr) for i in comps.get(c, {}).values()]
        return any(op.removesuffix("-start") in COLLECTIVES for op in ops)

    def upstream(names) -> set[str]:
        seen, todo = set(), list(names)
        while todo:
            name = todo.pop()
            if name in seen or name not in instrs:
                continue
            seen.add(name)
            todo.extend(instrs[name].operands)
        return seen

    collectives = {name for name, instr in instrs.items() if is_collective(instr)}
    return {
        "collectives": len(collectives),
        "feeding_output": len(collectives & upstream(root.operands[:1])),
        "feeding_sent": len(collectives & upstream(root.operands[1:])),
    }
