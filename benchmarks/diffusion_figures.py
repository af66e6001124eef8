"""The Diffusion section's figures: digit-classifier accuracy of samples (real digits,
an untrained UNet, a trained one, with and without guidance) and how far
patch-parallel sampling lands from single-device sampling.

    python benchmarks/diffusion_figures.py                        # trains unet_digits 300 steps first
    python benchmarks/diffusion_figures.py --run-dir runs/unet_digits   # grade an existing run instead

Everything on CPU with 8 simulated devices (training under `dp`; patch-parallel
on 4 of them). Accuracy: `meshwork.evaluation.digit_quality.DigitClassifier`
(logistic regression trained on the real digits) on DDIM samples of the class
asked for, classes cycling 0-9. Patch-parallel: `patch_parallel_sample` with the
image's rows split over 4 devices against `ddim_sample` from the same key, max
|difference| of the final pixels (range [-1, 1]), for 1, 10 and all steps
synchronous.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import pathlib
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from meshwork.config import load_config  # noqa: E402
from meshwork.diffusion import images  # noqa: E402
from meshwork.diffusion.sampling import ddim_sample, patch_parallel_comm_bytes, patch_parallel_sample  # noqa: E402
from meshwork.evaluation.digit_quality import DigitClassifier  # noqa: E402
from meshwork.models.build import build_model  # noqa: E402
from meshwork.sharding.mesh import make_mesh  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _train(run_dir: pathlib.Path, steps: int) -> None:
    from meshwork.train.loop import train

    cfg = load_config(
        ROOT / "configs/unet_digits.yaml",
        [
            f"run.dir={run_dir}",
            f"train.steps={steps}",
            f"checkpoint.every={steps}",
            "log.progress=false",
            "log.tensorboard=false",
            f"log.eval_every={steps}",
        ],
    )
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        summary = train(cfg)
    print(
        f"trained unet_digits {steps} steps in {time.perf_counter() - t0:.0f} s "
        f"(validation loss {summary['val_loss'][steps]:.4f})",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", help="a trained unet_digits run (default: train one in a temporary folder)")
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--num", type=int, default=100, help="samples graded per row")
    ap.add_argument("--steps", type=int, default=50, help="DDIM steps when grading")
    ap.add_argument("--pp-num", type=int, default=10, help="images in the patch-parallel comparison")
    ap.add_argument("--pp-steps", type=int, default=20)
    ap.add_argument("--patch-parallel-only", action="store_true", help="skip the accuracy rows")
    args = ap.parse_args(argv)
    from meshwork.inference.runs import load_run

    t0 = time.perf_counter()
    print(f"jax {jax.__version__}, {jax.device_count()} devices ({jax.devices()[0].platform})", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = pathlib.Path(args.run_dir or tmp)
        if not args.run_dir:
            _train(run_dir, args.train_steps)
        cfg, trained, step = load_run(run_dir)  # EMA weights when the run kept them
    clf = DigitClassifier(cfg.model.unet.sample_size)
    untrained = build_model(cfg)

    print(f"\n| images ({args.num}, DDIM {args.steps} steps) | classifier accuracy |\n|---|---|")
    print(f"| real held-out digits | {clf.real_accuracy():.1%} |")
    rows = (
        (f"samples, untrained model (seed {cfg.run.seed})", untrained, None),
        (f"samples, {step} training steps (EMA)", trained, None),
        (f"samples, {step} training steps (EMA), guidance 2", trained, 2.0),
    )
    for label, model, guidance in rows if not args.patch_parallel_only else ():
        x, y = images.sample_images(model, cfg, num=args.num, steps=args.steps, guidance=guidance)
        print(f"| {label} | {clf.accuracy(x, y):.1%} |", flush=True)

    # Patch-parallel vs one device: the trained model, same key, same labels.
    u = cfg.model.unet
    shape = (args.pp_num, u.sample_size, u.sample_size, u.in_channels)
    labels = jnp.arange(args.pp_num) % (u.num_class_embeds - 1)
    mesh = make_mesh({"sequence": 4}, devices=jax.devices()[:4])
    graphdef, state = nnx.split(trained)
    # The run's weights sit on one device; the patch-parallel program wants them on its mesh, replicated.
    state = jax.device_put(state, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    model_fn = jax.tree_util.Partial(images._apply, graphdef, state)
    key = jax.random.key(0)
    kw = dict(steps=args.pp_steps, labels=labels, clip_sample=1.0)
    ref = np.asarray(ddim_sample(model_fn, shape, key, cfg.model.diffusion, **kw))
    print(
        f"\npatch-parallel on 4 devices, {args.pp_num} images, {args.pp_steps} DDIM steps, trained model; "
        f"max |x_0| = {np.abs(ref).max():.2f}"
    )
    print("| synchronous warm-up steps | max abs difference from one device |\n|---|---|")
    for warmup in (1, 10, args.pp_steps):
        pp = np.asarray(
            patch_parallel_sample(model_fn, shape, key, cfg.model.diffusion, mesh=mesh, warmup=warmup, **kw)
        )
        print(f"| {warmup}{' (all)' if warmup == args.pp_steps else ''} | {np.abs(pp - ref).max():.2g} |", flush=True)
    comm = patch_parallel_comm_bytes(shape, 4)
    print(
        f"bytes each device sends per step: {comm['sent_per_step']:,} = (n-1)/n of one batch of images "
        f"({comm['gathered_bytes']:,} B)"
    )
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
