"""What weight quantization saves and costs on a trained lm_tiny: bytes, validation loss,
and the time of decode-shaped products, for each mode of `models/quantize.py`.

    python benchmarks/quantize.py [--run-dir RUN] [--group-size 32] [--matmul 2048 8192]

Without --run-dir it first trains lm_tiny for --train-steps steps (about a minute
on 2 CPU cores). The validation loss is the trainer's (the same held-out
batches). Times are medians over --repeats calls of jitted programs on one
device: a whole-model forward pass over one new token per sequence (B tokens,
no cache: the projections dominate) and a single D x F projection of B tokens.
Ratios are against float32 in the same run.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from meshwork.config import load_config  # noqa: E402
from meshwork.data import text as data_lib  # noqa: E402
from meshwork.evaluation.lm_loss import validation_loss  # noqa: E402
from meshwork.inference.runs import load_run  # noqa: E402
from meshwork.models.layers.quantized import quantize_weight
from meshwork.models.quantize import MODES, quantize_model, weight_bytes
from meshwork.train.task import make_task  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def median_seconds(f, *args, repeats: int) -> float:
    jax.block_until_ready(f(*args))  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode_forward_seconds(model: nnx.Module, batch: int, repeats: int) -> float:
    gdef, state = nnx.split(model)
    forward = jax.jit(lambda s, t: nnx.merge(gdef, s)(t))
    return median_seconds(forward, state, jnp.zeros((batch, 1), jnp.int32), repeats=repeats)


def projection_seconds(mode: str, d: int, f: int, batch: int, group_size: int, repeats: int) -> float:
    """x (B, 1, D) times a (D, F) weight stored in `mode`'s format (w8a8: its MLP format)."""
    spec = "BLD,DF->BLF"
    kx, kw = jax.random.split(jax.random.key(0))
    x, w = jax.random.normal(kx, (batch, 1, d)), jax.random.normal(kw, (d, f)) * 0.02
    if mode == "none":
        return median_seconds(jax.jit(lambda x, w: jnp.einsum(spec, x, w)), x, w, repeats=repeats)
    q = quantize_weight(w, spec, mode, group_size)
    return median_seconds(jax.jit(lambda x, q: q.matmul(spec, x, jnp.float32)), x, q, repeats=repeats)


def train_quick(run_dir: str, steps: int) -> None:
    from meshwork.train.loop import train

    cfg = load_config(
        ROOT / "configs/lm_tiny.yaml",
        [f"run.dir={run_dir}", f"train.steps={steps}", "log.progress=false", "log.tensorboard=false"],
    )
    train(cfg, devices=jax.devices()[:1])


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", help="a trained LM run (default: train lm_tiny first)")
    p.add_argument("--train-steps", type=int, default=200, help="steps when training a model here")
    p.add_argument("--group-size", type=int, default=32, help="int4 group size")
    p.add_argument("--val-batches", type=int, default=4, help="held-out batches for the loss")
    p.add_argument("--batch", type=int, default=8, help="sequences per decode step")
    p.add_argument(
        "--matmul",
        type=int,
        nargs=2,
        default=(2048, 8192),
        metavar=("D", "F"),
        help="dims of the standalone projection timed",
    )
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run_dir
        if run_dir is None:
            print(f"training lm_tiny for {args.train_steps} steps in {tmp} ...", flush=True)
            train_quick(tmp, args.train_steps)
            run_dir = tmp
        cfg, model, step = load_run(run_dir)
    task = make_task(cfg)
    batches = data_lib.eval_batches(str(task.val), cfg.data.seq_len, cfg.train.global_batch, args.val_batches)
    D, F = args.matmul
    print(
        f"{cfg.run.name} at step {step}; jax {jax.__version__}, {jax.devices()[0].device_kind}, "
        f"{os.cpu_count()} cores; int4 groups of {args.group_size}; val loss over {args.val_batches} x "
        f"{cfg.train.global_batch} x {cfg.data.seq_len} tokens; decode batch {args.batch}"
    )
    print(
        f"| mode | projection bytes | total bytes | projections / f32 | total / f32 | val loss | rise "
        f"| decode fwd ms | vs f32 | {D}x{F} proj ms | vs f32 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    base = {}
    for mode in MODES:
        m = nnx.clone(model)
        quantize_model(m, mode, args.group_size)
        nbytes = weight_bytes(m)
        loss = validation_loss(m, batches)
        t_fwd = decode_forward_seconds(m, args.batch, args.repeats)
        t_mm = projection_seconds(mode, D, F, args.batch, args.group_size, args.repeats)
        if mode == "none":
            base = dict(loss=loss, total=nbytes["total"], fwd=t_fwd, mm=t_mm)
        print(
            f"| {'f32' if mode == 'none' else mode} | {nbytes['projections']:,} | {nbytes['total']:,} "
            f"| {nbytes['projections'] / nbytes['projections_f32']:.3f} | {nbytes['total'] / base['total']:.3f} "
            f"| {loss:.4f} | {loss / base['loss'] - 1:+.2%} | {t_fwd * 1e3:.3f} | x{t_fwd / base['fwd']:.2f} "
            f"| {t_mm * 1e3:.3f} | x{t_mm / base['mm']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
