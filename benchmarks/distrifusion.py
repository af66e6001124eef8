"""DistriFusion (the UNet split into patches) against single-device DDIM: per-device FLOPs
and bytes sent per denoising step from the compiled programs, and sample quality.

    python benchmarks/distrifusion.py --run-dir RUN      # a trained unet_digits run
    python benchmarks/distrifusion.py                    # trains unet_digits 300 steps first
    python benchmarks/distrifusion.py --run-dir RUN --costs-only

CPU with 8 simulated devices. Per step:

- FLOPs: `cost_analysis()` of one denoising step, the UNet on one device vs one
  device's share of the stale patch-parallel step (`distrifusion.step_program`).
  Formula: F_n = (F_1 - F_rep) / n + F_rep, with F_rep the time-embedding MLP and
  every resnet's time projection, which act on the (B, T) embedding and run whole
  on every device; convolutions compute only their patch's output rows (the halo
  rows are inputs, not outputs), attention only its patch's queries against all keys.
- Bytes: what one interior device sends per step, read from the compiled step's
  collectives (`sharding.hlo.collective_summary`), against `distrifusion.comm_formula`:
  2 halo rows per 3x3 conv, (n-1) x (mean, M2) per group per GroupNorm, (n-1)/n of
  the image's K and V per attention layer. For reference, exchanging every layer's
  whole activation ((n-1)/n of it, the reference implementation's all-gather) is printed too.
- Quality: `--num` images (classes cycling 0-9), DDIM `--steps`, 4 devices; mean and max
  |x - x_single| for several warm-ups and all steps synchronous, and the digit classifier's
  accuracy (`meshwork.evaluation.digit_quality`), against one-device DDIM from the same key;
  the input-only `patch_parallel_sample` at the same warm-up, for comparison.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.extend  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from meshwork.diffusion import distrifusion as df  # noqa: E402
from meshwork.diffusion.images import _apply, sample_images  # noqa: E402
from meshwork.diffusion.sampling import patch_parallel_sample  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from diffusion_figures import _train  # noqa: E402  (the same unet_digits run when none is given)

from meshwork.evaluation.digit_quality import DigitClassifier  # noqa: E402
from meshwork.models.unet import ResnetBlock, TimeEmbedding  # noqa: E402
from meshwork.sharding.hlo import collective_summary  # noqa: E402
from meshwork.sharding.mesh import make_mesh  # noqa: E402


def replicated_flops(model, batch: int) -> int:
    """2 B d_in d_out of every dense layer on the time embedding: computed whole on every device."""
    dense = []
    for _, node in nnx.iter_graph(model):
        if isinstance(node, TimeEmbedding):
            dense += [node.linear_1, node.linear_2]
        elif isinstance(node, ResnetBlock):
            dense.append(node.time_emb_proj)
    return sum(2 * batch * d.kernel[...].size for d in dense)


def _taps(size: int, k: int, stride: int, pad: tuple[int, int]) -> tuple[int, int]:
    """(taps on real positions, taps on padding) summed over the output positions of one spatial dim."""
    real = padded = 0
    for o in range((size + sum(pad) - k) // stride + 1):
        for d in range(k):
            i = o * stride + d - pad[0]
            real, padded = (real + 1, padded) if 0 <= i < size else (real, padded + 1)
    return real, padded


def halo_flops(fn, *args) -> int:
    """FLOPs of the conv taps that fall on the image's zero padding rows in the one-device program.

    XLA's cost analysis skips taps on padding; on patches those rows are halo rows (data,
    zeros only at the image's top and bottom), so the n devices together compute them too.
    """
    total = 0

    def walk(jaxpr):
        nonlocal total
        for eqn in jaxpr.eqns:
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)
            if eqn.primitive.name != "conv_general_dilated":
                continue
            lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            dn, (sh, sw), (ph, pw) = (
                eqn.params["dimension_numbers"],
                eqn.params["window_strides"],
                eqn.params["padding"],
            )
            b, c_in, h, w = (lhs[i] for i in dn.lhs_spec)
            c_out, _, kh, kw = (rhs[i] for i in dn.rhs_spec)
            total += 2 * b * c_in * c_out * _taps(h, kh, sh, ph)[1] * _taps(w, kw, sw, pw)[0]

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return total


def step_costs(model, cfg, n: int, batch: int) -> dict:
    """FLOPs and bytes of one denoising step, one device vs one of n patch devices."""
    u = cfg.model.unet
    shape = (batch, u.sample_size, u.sample_size, u.in_channels)
    x, t, y = jnp.zeros(shape), jnp.full((batch,), 500), jnp.arange(batch) % 10
    graphdef, state = nnx.split(model)
    fn = jax.tree_util.Partial(_apply, graphdef, state)
    single = jax.jit(lambda f, x, t, y: f(x, t, y)).lower(fn, x, t, y).compile().cost_analysis()["flops"]
    mesh = make_mesh({"sequence": n}, devices=jax.devices()[:n])
    sync, arrays = df.step_program(fn, shape, mesh=mesh, synchronous=True)
    arrays = jax.device_put(arrays, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    sent = jax.eval_shape(sync, arrays, x, t, y)[1]
    sync_flops = sync.lower(arrays, x, t, y).compile().cost_analysis()["flops"]
    stale, _ = df.step_program(fn, shape, mesh=mesh, synchronous=False)
    compiled = stale.lower(arrays, x, t, y, sent).compile()
    hlo = compiled.as_text()
    comm = collective_summary(hlo)
    one_device = {
        k: jax.tree.map(lambda s: s.shape[1:], v, is_leaf=lambda s: hasattr(s, "shape")) for k, v in sent.items()
    }
    rep, halo = replicated_flops(model, batch), halo_flops(fn, x, t, y)
    return {
        "single": single,
        "device": compiled.cost_analysis()["flops"],
        "device_sync": sync_flops,
        "formula": (single - rep + halo) / n + rep,
        "rep": rep,
        "halo": halo,
        "hlo_bytes": comm["all-gather"]["bytes"] + comm["collective-permute"]["bytes"],
        "formula_bytes": df.comm_formula(one_device, n),
        "deps": df.stale_step_dependencies(hlo),
        "all_gather_everything": _all_gather_everything(one_device, n),
    }


def _all_gather_everything(shapes: dict, n: int, itemsize: int = 4) -> int:
    """Bytes per step if every exchanged layer all-gathered its whole activation (square images)."""
    total = 0
    for key, s in shapes.items():
        kind = key.split("_", 1)[1]
        if kind == "halo":
            B, _, W, C = s[0]
            total += (n - 1) * B * W * W * C * itemsize // n
        elif kind == "kv":
            total += (n - 1) * int(np.prod(s)) * itemsize // n
    return total


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", help="a trained unet_digits run (default: train one in a temporary folder)")
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--num", type=int, default=100, help="images compared")
    ap.add_argument("--steps", type=int, default=50, help="DDIM steps")
    ap.add_argument("--warmups", type=int, nargs="+", default=[1, 4, 10])
    ap.add_argument("--cost-batch", type=int, default=8, help="batch of the FLOPs and bytes step")
    ap.add_argument("--costs-only", action="store_true", help="skip the quality rows")
    args = ap.parse_args(argv)
    from meshwork.inference.runs import load_run

    t0 = time.perf_counter()
    print(f"jax {jax.__version__}, {jax.device_count()} devices ({jax.devices()[0].platform})", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = pathlib.Path(args.run_dir or tmp)
        if not args.run_dir:
            _train(run_dir, args.train_steps)
        cfg, model, step = load_run(run_dir)

    print(
        f"\none denoising step, batch {args.cost_batch}, {cfg.model.unet.sample_size}px; per-device FLOPs "
        "(cost_analysis) and bytes sent (HLO)"
    )
    print(
        "| n | FLOPs 1 device | FLOPs per device, stale step | ratio | synchronous step ratio | formula (F1-Frep+Fhalo)/n+Frep | bytes sent (HLO) | formula "
        "(halo + norm + kv) | all-gather every layer | collectives feeding the step's output |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in (2, 4):
        c = step_costs(model, cfg, n, args.cost_batch)
        fb = c["formula_bytes"]
        print(
            f"| {n} | {c['single']:,.0f} | {c['device']:,.0f} | {c['device'] / c['single']:.3f} | "
            f"{c['device_sync'] / c['single']:.3f} | "
            f"{c['formula']:,.0f} ({c['formula'] / c['single']:.3f}) | {c['hlo_bytes']:,} | {fb['total']:,} "
            f"({fb['halo']:,} + {fb['norm']:,} + {fb['kv']:,}) | {c['all_gather_everything']:,} | "
            f"{c['deps']['feeding_output']} of {c['deps']['collectives']} |",
            flush=True,
        )
    print(
        f"F_rep (time-embedding dense layers, whole on every device) = {c['rep']:,} "
        f"({c['rep'] / c['single']:.2%} of F1); F_halo (conv taps on the image's padding rows, which the "
        f"patches compute as halo rows) = {c['halo']:,} ({c['halo'] / c['single']:.2%} of F1)"
    )
    if args.costs_only:
        return

    clf = DigitClassifier(cfg.model.unet.sample_size)
    kw = dict(num=args.num, steps=args.steps)
    ref, y = sample_images(model, cfg, **kw)
    print(
        f"\n{args.num} images, DDIM {args.steps} steps, {step} training steps (EMA), 4 devices; "
        f"one device: classifier {clf.accuracy(ref, y):.1%}"
    )
    print(
        "| warm-up steps | mean abs diff | max abs diff | classifier | input-only patch_parallel_sample: mean abs "
        "diff | classifier |\n|---|---|---|---|---|---|"
    )
    mesh = make_mesh({"sequence": 4}, devices=jax.devices()[:4])
    graphdef, state = nnx.split(model)
    fn = jax.device_put(
        jax.tree_util.Partial(_apply, graphdef, state), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    )
    for warmup in (*args.warmups, args.steps):
        x, _ = sample_images(model, cfg, patch_parallel=4, warmup=warmup, **kw)
        row = (
            f"| {warmup}{' (all)' if warmup == args.steps else ''} | {np.abs(x - ref).mean():.2e} | "
            f"{np.abs(x - ref).max():.2e} | {clf.accuracy(x, y):.1%} |"
        )
        if warmup != args.steps:
            pp = np.asarray(
                patch_parallel_sample(
                    fn,
                    ref.shape,
                    jax.random.key(0),
                    cfg.model.diffusion,
                    mesh=mesh,
                    steps=args.steps,
                    warmup=warmup,
                    labels=jnp.asarray(y),
                    clip_sample=1.0,
                )
            )
            row += f" {np.abs(pp - ref).mean():.2e} | {clf.accuracy(pp, y):.1%} |"
        else:
            row += " | |"
        print(row, flush=True)
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
