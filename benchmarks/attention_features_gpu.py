"""Soft-capping (Gemma 2), attention sinks (gpt-oss) and sliding windows in the Pallas kernels, on a GPU,
against the XLA reference: max error and time, forward and forward+backward, then decode.

    python3 benchmarks/attention_features_gpu.py --out /tmp/features.json       # GPU, under a minute on an H100
    python3 benchmarks/attention_features_gpu.py --smoke --out /tmp/smoke.json   # CPU, interpret mode, tiny shapes

Not under pytest (tests/conftest.py forces the CPU). Flash attention, bf16, causal, at two shapes:
Gemma 2's (B=2, L=2048, 16 query heads over 8 kv heads of 128, softcap 50, a 1024-token window) and
gpt-oss's (B=1, L=4096, 32 query heads over 4 kv heads of 64, sinks, a 128-token window). Each is
measured forward and forward+backward, the Pallas kernel against `flash_attention_reference` (XLA,
float32 scores in memory), with the kernel without the features beside it (what they cost). Then
decode with sinks and softcap 30 over a bf16 cache of 4096 tokens (32 sequences of 64 query heads
over 8 kv heads of 64): the paged kernel (pages of 16, full and with gpt-oss's 128-token window)
against the gather reference, and the flash-decoding kernel against its reference.

Error: max |kernel - reference| over max |reference|, per output (o; dq, dk, dv and the sinks'
gradient). Time: median ms of a few calls after a warm-up; ratio = reference / kernel (above 1:
the kernel is faster). One line per measurement; --out gets every result as JSON. Measurements
stop starting once --budget seconds have passed (the rest are listed as skipped): the run's
compiles (Triton and XLA, 18 programs) dominate its time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from meshwork.kernels.decode_attention import decode_attention, decode_attention_reference
from meshwork.kernels.flash_attention import flash_attention, flash_attention_reference
from meshwork.kernels.paged_attention import paged_attention, paged_attention_reference

# name: (B, L, H, G, K, features). Features as the models use them; sinks=True: per-head logits drawn below.
FLASH_SHAPES = {
    "gemma2": (2, 2048, 16, 8, 128, dict(softcap=50.0, window=1024)),
    "gpt-oss": (1, 4096, 32, 4, 64, dict(sinks=True, window=128)),
}
SMOKE_FLASH_SHAPES = {
    "gemma2": (1, 96, 4, 2, 32, dict(softcap=50.0, window=48)),
    "gpt-oss": (1, 128, 4, 1, 32, dict(sinks=True, window=32)),
}
# (B, S, H, G, K, page size): decode against a cache of S tokens.
DECODE_SHAPE = (32, 4096, 64, 8, 64, 16)
SMOKE_DECODE_SHAPE = (2, 64, 4, 2, 16, 16)


def time_ms(fn, args, reps: int) -> float:
    """Median ms per call after one warm-up call (which also compiles)."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def max_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def sink_logits(H: int, rng: np.random.Generator) -> jax.Array:
    """Per-head sinks around the scores' logsumexp scale, so they take a visible share of the softmax."""
    return jnp.asarray(rng.uniform(0.0, 4.0, H), jnp.float32)


def flash_step(fn, kw, backward: bool):
    """f(q, k, v, sinks, do): (o,), and with backward (o, dq, dk, dv[, dsinks]); sinks may be None."""

    def attn(q, k, v, sinks):
        return fn(q, k, v, **kw, **({} if sinks is None else {"sinks": sinks}))

    def run(q, k, v, sinks, do):
        if not backward:
            return (attn(q, k, v, sinks),)
        o, vjp = jax.vjp(attn, q, k, v, sinks)
        return tuple(x for x in (o, *vjp(do)) if x is not None)

    return jax.jit(run)


def bench_flash(name, shape, reps, rng, record, out_of_time):
    B, L, H, G, K, feats = shape
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, L, H, K), jnp.bfloat16)
    k, v = (jax.random.normal(keys[i], (B, L, G, K), jnp.bfloat16) for i in (1, 2))
    do = jax.random.normal(keys[3], (B, L, H, K), jnp.bfloat16)
    sinks = sink_logits(H, rng) if feats.get("sinks") else None
    kw = {f: x for f, x in feats.items() if f != "sinks"}
    label = ", ".join(f"{f}={x}" for f, x in feats.items())
    for backward in (False, True):
        what = "fwd+bwd" if backward else "fwd"
        if out_of_time(f"flash {name} {what}"):
            continue
        args = (q, k, v, sinks, do)
        kernel, ref = flash_step(flash_attention, kw, backward), flash_step(flash_attention_reference, kw, backward)
        plain = flash_step(flash_attention, {"window": None}, backward)
        got, want = kernel(*args), ref(*args)
        names = ("o", "dq", "dk", "dv", "dsinks")[: len(want)]
        errs = {n: max_err(a, b) for n, a, b in zip(names, got, want)}
        t_kernel, t_ref = time_ms(kernel, args, reps), time_ms(ref, args, reps)
        t_plain = time_ms(plain, (q, k, v, None, do), reps)
        record(
            dict(
                kind="flash",
                name=name,
                what=what,
                shape=dict(B=B, L=L, H=H, G=G, K=K),
                features=label,
                max_err=errs,
                kernel_ms=t_kernel,
                reference_ms=t_ref,
                ratio=t_ref / t_kernel,
                plain_kernel_ms=t_plain,
            ),
            f"flash {name} {what} B={B} L={L} H={H} G={G} K={K} [{label}]: max_err "
            + " ".join(f"{n} {e:.1e}" for n, e in errs.items())
            + f"  kernel {t_kernel:.3f} ms  xla {t_ref:.3f} ms  ratio {t_ref / t_kernel:.2f}"
            + f"  (kernel, no features, causal: {t_plain:.3f} ms)",
        )


def bench_decode(shape, reps, rng, record, out_of_time):
    B, S, H, G, K, T = shape
    feats = dict(softcap=30.0, sinks=sink_logits(H, rng))
    pages = S // T
    k_pool, v_pool = (jnp.asarray(rng.standard_normal((1 + B * pages, T, G, K)), jnp.bfloat16) for _ in "kv")
    table = jnp.asarray(1 + rng.permutation(B * pages).reshape(B, pages), jnp.int32)
    q = jnp.asarray(rng.standard_normal((B, 1, H, K)), jnp.bfloat16)
    lengths = jnp.asarray(rng.integers(S // 2, S + 1, B), jnp.int32)  # ragged, up to the whole cache
    pos = (lengths - 1)[:, None]
    for window in (None, 128):
        name = f"paged decode window={window}"
        if out_of_time(name):
            continue
        kernel = jax.jit(lambda *a, w=window: paged_attention(*a, window=w, **feats))
        ref = jax.jit(lambda *a, w=window: paged_attention_reference(*a, window=w, **feats))
        args = (q, k_pool, v_pool, table, pos)
        err = max_err(kernel(*args), ref(*args))
        t_kernel, t_ref = time_ms(kernel, args, reps), time_ms(ref, args, reps)
        record(
            dict(
                kind="paged",
                name=name,
                shape=dict(B=B, S=S, H=H, G=G, K=K, T=T),
                features=f"softcap=30.0, sinks=True, window={window}",
                max_err={"o": err},
                kernel_ms=t_kernel,
                reference_ms=t_ref,
                ratio=t_ref / t_kernel,
            ),
            f"{name} B={B} S={S} H={H} G={G} K={K} T={T} [softcap=30.0, sinks=True]: max_err o {err:.1e}  "
            f"kernel {t_kernel:.3f} ms  gather {t_ref:.3f} ms  ratio {t_ref / t_kernel:.2f}",
        )
    if out_of_time("flash-decoding"):
        return
    k, v = (jnp.asarray(rng.standard_normal((B, S, G, K)), jnp.bfloat16) for _ in "kv")
    kernel = jax.jit(lambda *a: decode_attention(*a, **feats))
    ref = jax.jit(lambda *a: decode_attention_reference(*a, **feats))
    args = (q[:, 0], k, v, lengths)
    err = max_err(kernel(*args), ref(*args))
    t_kernel, t_ref = time_ms(kernel, args, reps), time_ms(ref, args, reps)
    record(
        dict(
            kind="decode",
            name="flash-decoding",
            shape=dict(B=B, S=S, H=H, G=G, K=K),
            features="softcap=30.0, sinks=True",
            max_err={"o": err},
            kernel_ms=t_kernel,
            reference_ms=t_ref,
            ratio=t_ref / t_kernel,
        ),
        f"flash-decoding B={B} S={S} H={H} G={G} K={K} [softcap=30.0, sinks=True]: max_err o {err:.1e}  "
        f"kernel {t_kernel:.3f} ms  xla {t_ref:.3f} ms  ratio {t_ref / t_kernel:.2f}",
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (Pallas interpret mode): checks the script")
    p.add_argument("--out", default=None, help="write every result to this JSON file")
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds after which no new measurement starts (default: 40 on GPU, keeping the run under a minute; "
        "none with --smoke)",
    )
    args = p.parse_args()
    if args.budget is None:
        args.budget = float("inf") if args.smoke else 40.0
    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
    elif jax.default_backend() != "gpu":
        raise SystemExit(
            f"attention_features_gpu.py measures a GPU, and the default backend is {jax.default_backend()!r}; "
            "run it on a GPU machine, or pass --smoke for the CPU check"
        )
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    device = jax.devices()[0].device_kind
    results, skipped = [], []
    print(f"device: {device}  jax {jax.__version__}  smoke={args.smoke}", flush=True)

    def record(result, line):
        results.append(result)
        print(line, flush=True)

    def out_of_time(name):
        if time.perf_counter() - t0 > args.budget:
            skipped.append(name)
            print(f"{name}: skipped (past the {args.budget:.0f} s budget)", flush=True)
            return True
        return False

    reps = 2 if args.smoke else 5
    for name, shape in (SMOKE_FLASH_SHAPES if args.smoke else FLASH_SHAPES).items():
        bench_flash(name, shape, reps, rng, record, out_of_time)
    bench_decode(SMOKE_DECODE_SHAPE if args.smoke else DECODE_SHAPE, reps, rng, record, out_of_time)
    total = time.perf_counter() - t0
    print(f"total {total:.1f} s, {len(results)} measurements, {len(skipped)} skipped", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                dict(
                    device=device,
                    jax=jax.__version__,
                    smoke=args.smoke,
                    total_s=total,
                    results=results,
                    skipped=skipped,
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
