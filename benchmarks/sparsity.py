"""What magnitude pruning costs a trained lm_tiny, what masked fine-tuning wins back, and what the
compact 2:4 format saves in bytes and costs in time (models/sparsity.py).

    python benchmarks/sparsity.py [--run-dir RUN] [--recover-steps 150] [--recover-lr 3e-4] [--matmul 2048 8192]

Without --run-dir it first trains lm_tiny for --train-steps steps (about a minute
on 2 CPU cores). Validation loss is the trainer's (the same held-out batches)
for: the dense model; 50% unstructured pruning; 2:4 pruning (dense storage with
zeros, and the compact format through the model's own matmul: the same loss);
2:4 plus --recover-steps steps of fine-tuning with the mask re-applied after
every step (the run's data from its start, AdamW at --recover-lr after
--recover-warmup steps, cosine decay); and, as the control that separates
recovery from plain extra training, the dense model fine-tuned the same way.
Times are medians over --repeats calls of jitted programs on one device: a
D x F projection of T tokens with the weight dense, compact 2:4 (rebuilt
inside the program, one dot: what the model uses) and compact 2:4 by gathering
the inputs (no dense weight), and a decode-shaped whole-model forward.
"""

from __future__ import annotations

import argparse
import os
import pathlib
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
from meshwork.models.quantize import weight_bytes
from meshwork.models.sparsity import compact_24, compact_bytes, compact_model, matmul_24_gather, prune_model, sparsity  # noqa: E402
from meshwork.train.sparse_recovery import recover  # noqa: E402
from meshwork.train.task import make_task  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from quantize import median_seconds, train_quick  # noqa: E402  (the same timing and base run)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def with_params(model: nnx.Module, params) -> nnx.Module:
    m = nnx.clone(model)
    nnx.update(m, params)
    return m


def decode_forward_seconds(model: nnx.Module, batch: int, repeats: int) -> float:
    gdef, state = nnx.split(model)
    forward = jax.jit(lambda s, t: nnx.merge(gdef, s)(t))
    return median_seconds(forward, state, jnp.zeros((batch, 1), jnp.int32), repeats=repeats)


def projection_times(d: int, f: int, tokens: int, repeats: int) -> dict[str, float]:
    kx, kw = jax.random.split(jax.random.key(0))
    x, w = jax.random.normal(kx, (tokens, d)), jax.random.normal(kw, (d, f)) * 0.02
    c = compact_24(w, "TD,DF->TF")
    w_pruned = c.densify()
    return {
        "dense": median_seconds(jax.jit(jnp.dot), x, w_pruned, repeats=repeats),
        "compact": median_seconds(jax.jit(lambda x, c: c.matmul("TD,DF->TF", x, jnp.float32)), x, c, repeats=repeats),
        "gather": median_seconds(matmul_24_gather, x, c, repeats=repeats),
    }


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", help="a trained LM run (default: train lm_tiny first)")
    p.add_argument("--train-steps", type=int, default=200, help="steps when training a model here")
    p.add_argument("--fraction", type=float, default=0.5, help="unstructured pruning fraction")
    p.add_argument("--recover-steps", type=int, default=150, help="masked fine-tuning steps after 2:4 pruning")
    p.add_argument("--recover-lr", type=float, default=3e-4, help="peak lr of the fine-tuning")
    p.add_argument("--recover-warmup", type=int, default=10)
    p.add_argument("--no-control", action="store_true", help="skip fine-tuning the dense model as a control")
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
    p.add_argument("--tokens", type=int, nargs="+", default=(1, 8), help="token counts T of the timed projection")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    t_start = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run_dir
        if run_dir is None:
            print(f"training lm_tiny for {args.train_steps} steps in {tmp} ...", flush=True)
            train_quick(tmp, args.train_steps)
            run_dir = tmp
        cfg, model, step = load_run(run_dir)
        ft_cfg = load_config(
            pathlib.Path(run_dir) / "config.yaml",
            [
                f"run.dir={tmp}/recover",
                f"train.steps={args.recover_steps}",
                f"optimizer.lr={args.recover_lr}",
                f"optimizer.warmup_steps={args.recover_warmup}",
                "mesh.data=1",
                "log.progress=false",
                "log.tensorboard=false",
            ],
        )
    task = make_task(cfg)
    batches = data_lib.eval_batches(str(task.val), cfg.data.seq_len, cfg.train.global_batch, args.val_batches)
    devices = jax.devices()[:1]
    print(
        f"{cfg.run.name} at step {step}; jax {jax.__version__}, {jax.devices()[0].device_kind}, "
        f"{os.cpu_count()} cores; val loss over {args.val_batches} x {cfg.train.global_batch} x "
        f"{cfg.data.seq_len} tokens; fine-tuning {args.recover_steps} steps at lr {args.recover_lr} "
        f"(warmup {args.recover_warmup}, cosine)",
        flush=True,
    )

    rows = []
    dense = validation_loss(model, batches)
    rows.append(("dense", 0.0, dense, "float32"))
    params_u, _ = prune_model(model, "unstructured", args.fraction)
    m_u = with_params(model, params_u)
    rows.append((f"{args.fraction:.0%} unstructured", _zeros(m_u), validation_loss(m_u, batches), "dense with zeros"))
    params_24, masks = prune_model(model, "2:4")
    m_24 = with_params(model, params_24)
    loss_24 = validation_loss(m_24, batches)
    rows.append(("2:4", _zeros(m_24), loss_24, "dense with zeros"))
    m_c = nnx.clone(m_24)
    compact_model(m_c)
    loss_c = validation_loss(m_c, batches)
    rows.append(("2:4", 0.5, loss_c, "compact (Sparse24Weight)"))

    t0 = time.perf_counter()
    rec_params, rec_losses = recover(ft_cfg, params_24, masks, devices=devices)
    t_rec = time.perf_counter() - t0
    m_r = with_params(model, rec_params)
    loss_r = validation_loss(m_r, batches)
    rows.append((f"2:4 + {args.recover_steps} masked steps", _zeros(m_r), loss_r, "dense with zeros"))
    loss_ctl = None
    if not args.no_control:
        ctl_params, _ = recover(ft_cfg, nnx.state(model, nnx.Param), {}, devices=devices)
        loss_ctl = validation_loss(with_params(model, ctl_params), batches)
        rows.append((f"dense + {args.recover_steps} steps (control)", 0.0, loss_ctl, "float32"))

    print("\n| model | projection zeros | storage | val loss | vs dense |")
    print("|---|---|---|---|---|")
    for name, zeros, loss, storage in rows:
        print(f"| {name} | {zeros:.1%} | {storage} | {loss:.4f} | {loss - dense:+.4f} ({loss / dense - 1:+.2%}) |")
    print(
        f"\n2:4's loss gap to dense: {loss_24 - dense:+.4f} before fine-tuning; after {args.recover_steps} masked "
        f"steps {loss_r - dense:+.4f} to the dense model it started from"
        + (f", {loss_r - loss_ctl:+.4f} to the dense model fine-tuned the same way (control)" if loss_ctl else "")
        + f". The {args.recover_steps} masked steps took {t_rec:.1f} s (compile included); their train loss went "
        f"{rec_losses[0]:.4f} -> {rec_losses[-1]:.4f}. Compact and dense-with-zeros 2:4 losses differ by "
        f"{abs(loss_c - loss_24):.2e}."
    )

    b_dense, b_c = weight_bytes(model), weight_bytes(m_c)
    D, F = args.matmul
    cb = compact_bytes((D, F), jnp.float32)
    print("\n| bytes | dense f32 | compact 2:4 | ratio |")
    print("|---|---|---|---|")
    print(
        f"| lm_tiny projections | {b_dense['projections']:,} | {b_c['projections']:,} "
        f"| {b_c['projections'] / b_dense['projections']:.5f} |"
    )
    print(f"| lm_tiny all weights | {b_dense['total']:,} | {b_c['total']:,} | {b_c['total'] / b_dense['total']:.4f} |")
    print(
        f"| one {D}x{F} (values + indices) | {cb['dense']:,} | {cb['values']:,} + {cb['indices']:,} "
        f"| {cb['total'] / cb['dense']:.5f} |"
    )

    print(
        f"\n| {D}x{F} projection, T tokens | dense ms | compact (rebuild + dot) ms | vs dense "
        f"| compact (gather) ms | vs dense |"
    )
    print("|---|---|---|---|---|---|")
    for T in args.tokens:
        t = projection_times(D, F, T, args.repeats)
        print(
            f"| T={T} | {t['dense'] * 1e3:.3f} | {t['compact'] * 1e3:.3f} | x{t['compact'] / t['dense']:.2f} "
            f"| {t['gather'] * 1e3:.3f} | x{t['gather'] / t['dense']:.2f} |",
            flush=True,
        )
    f_dense = decode_forward_seconds(model, args.batch, args.repeats)
    f_c = decode_forward_seconds(m_c, args.batch, args.repeats)
    print(
        f"\nlm_tiny decode forward (batch {args.batch}, 1 token): dense {f_dense * 1e3:.3f} ms, compact 2:4 "
        f"{f_c * 1e3:.3f} ms (x{f_c / f_dense:.2f}); whole benchmark {time.perf_counter() - t_start:.0f} s"
    )


def _zeros(model: nnx.Module) -> float:
    """Fraction of the projection weights that are zero (size-weighted)."""
    from meshwork.models.quantize import projection_sites

    sizes = {s.path: s.param.get_value().size for s in projection_sites(model)}
    z = sparsity(model)
    return sum(z[p] * n for p, n in sizes.items()) / sum(sizes.values())


if __name__ == "__main__":
    main(sys.argv[1:])
