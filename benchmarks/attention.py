"""Attention throughput and memory: our Pallas flash attention vs jax.nn.dot_product_attention (XLA, cuDNN).

    python benchmarks/attention.py [--seq 1024 4096] [--head-dims 128] [--causal true] [--passes fwd]
    python benchmarks/attention.py --quick     # tiny shapes, CPU interpret mode: checks the script runs

Every implementation runs in one process on the same inputs, so the printed
ratios compare like with like. Shapes follow the FlashAttention-2 paper's
sweep: B*S = --batch-tokens (16K) and H*K = --d-model (2048), bf16, MHA
unless --gqa. The Pallas kernel uses its DEFAULT_BLOCKS unless --tuned reads
the autotune cache (meshwork.kernels.tuning).

FLOPs (the same count for every implementation, whatever it really executes):
forward = 4*B*H*L*S*K (two L x S x K matmuls), halved when causal; backward =
2.5 x forward (five matmuls: the recomputed Q K^T, dV, dP, dQ, dK), so
forward+backward = 3.5 x forward -- the FlashAttention-2 convention.

Memory: `temp` is the compiled program's scratch (`memory_analysis()`):
O(S) for the flash kernel, O(S^2) for XLA's attention, which materializes the
scores. On GPU `peak` is the device allocator's high-water mark, which JAX
cannot reset: a value is this config's own peak only when the config raised
it; otherwise it prints as "<=" the earlier mark. Configurations whose
compiled footprint exceeds the device memory are skipped, not run.

This file also holds the measuring helpers benchmarks/autotune_attention.py
imports (timing, FLOP count, inputs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from meshwork.kernels import flash_attention as fa
from meshwork.kernels import tuning
from meshwork.perf.hardware import accelerator_for_device_kind, measure_cpu_peak, table_dtype

# Backward FLOPs per forward FLOP (see the module docstring).
BWD_FLOPS_FACTOR = 2.5


# --------------------------------------------------------------------------
# Helpers shared with autotune_attention.py
# --------------------------------------------------------------------------


def attention_flops(B: int, H: int, L: int, S: int, K: int, causal: bool, backward: bool) -> float:
    """Useful FLOPs of one attention call (forward, or forward+backward), by the convention above.

    >>> attention_flops(1, 1, 1024, 1024, 64, causal=True, backward=False) == 4 * 1024 * 1024 * 64 / 2
    True
    """
    fwd = 4.0 * B * H * L * S * K / (2 if causal else 1)
    return fwd * (1 + BWD_FLOPS_FACTOR) if backward else fwd


def make_inputs(B, L, S, H, G, K, dtype, seed=0):
    """(q, k, v, do): normal inputs and an output cotangent for the backward pass."""
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    return (
        jax.random.normal(kq, (B, L, H, K), dtype),
        jax.random.normal(kk, (B, S, G, K), dtype),
        jax.random.normal(kv, (B, S, G, K), dtype),
        jax.random.normal(kd, (B, L, H, K), dtype),
    )


def step(attn, backward: bool):
    """fn(q, k, v, do): attn's output, and with backward=True also (dq, dk, dv) for the cotangent do."""

    def fwd(q, k, v, do):
        del do
        return attn(q, k, v)

    def fwd_bwd(q, k, v, do):
        o, vjp = jax.vjp(attn, q, k, v)
        return (o, *vjp(do))

    return fwd_bwd if backward else fwd


def time_call(compiled, args, *, repeats: int = 10, min_sample_s: float = 0.02) -> float:
    """Median seconds per call of a compiled function; each sample runs enough calls to last min_sample_s."""
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))  # warm-up: first-run allocations, autotuning in XLA
    first = time.perf_counter() - t0
    inner = max(1, min(1000, math.ceil(min_sample_s / max(first, 1e-6))))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = compiled(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def temp_bytes(compiled) -> int | None:
    """Scratch bytes of a compiled program, None where the backend does not say."""
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 -- memory_analysis is optional per backend and version
        return None


def device_memory(device) -> tuple[int | None, int | None]:
    """(allocator high-water mark, allocatable bytes) of a device, None where not reported (CPU)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001
        stats = {}
    return stats.get("peak_bytes_in_use"), stats.get("bytes_limit")


def peak_flops(dtype: str, device) -> tuple[float, str]:
    """Peak FLOP/s of `device` for dtype: the hardware table, or a measured matmul on CPU."""
    if device.platform == "cpu":
        return measure_cpu_peak("float32", n=512), "measured f32 matmul"
    acc = accelerator_for_device_kind(device.device_kind)
    if acc is None:
        return float("nan"), "unknown device"
    return acc.peak_flops[table_dtype(dtype)], f"{acc.name} table"


# --------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------

IMPLS = ("pallas", "xla", "cudnn")


def attention_fn(impl: str, causal: bool, kwargs: dict):
    if impl == "pallas":
        return lambda q, k, v: fa.flash_attention(q, k, v, causal=causal, **kwargs)
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)


def measure(impl, causal, backward, args, *, backend, tuned, repeats, device) -> dict:
    """One cell: seconds (or why it was skipped), compiled temp bytes, device high-water mark."""
    # Tuned flash_attention kwargs (blocks, and on GPU num_warps / num_stages); {} when untuned.
    kwargs = tuning.tuned_blocks(args[0], args[1], causal, backend) if impl == "pallas" and tuned else {}
    cell = (
        {
            "blocks": {n: v for n, v in kwargs.items() if n in ("block_q", "block_kv")},
            "num_warps": kwargs.get("num_warps"),
            "num_stages": kwargs.get("num_stages"),
        }
        if impl == "pallas"
        else {}
    )
    try:
        lowered = jax.jit(step(attention_fn(impl, causal, kwargs), backward)).trace(*args).lower()
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 -- e.g. cuDNN rejecting a shape: report it and go on
        return {**cell, "skip": f"compile failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}"}
    cell["temp"] = temp_bytes(compiled)
    before, limit = device_memory(device)
    need = (cell["temp"] or 0) + sum(a.nbytes for a in args)
    if limit and need > 0.95 * limit:
        return {**cell, "skip": f"needs {need / 2**30:.1f} GiB, the device has {limit / 2**30:.1f}"}
    try:
        cell["seconds"] = time_call(compiled, args, repeats=repeats)
    except Exception as e:  # noqa: BLE001 -- out of memory at run time
        return {**cell, "skip": f"run failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}"}
    after, _ = device_memory(device)
    if after is not None:  # this config's own peak only if it raised the mark
        cell["peak"], cell["peak_is_own"] = after, before is None or after > before
    return cell


def fmt_bytes(n, own=True):
    if n is None:
        return "-"
    unit, div = next((u, d) for u, d in (("G", 2**30), ("M", 2**20), ("K", 2**10), ("B", 1)) if n >= d or d == 1)
    return f"{'' if own else '<='}{n / div:.3g}{unit}"


def print_growth(growth: dict, label: str) -> None:
    """Scratch per sequence (temp / B) from the shortest to the longest S: x(S ratio) is O(S), its square O(S^2).

    Per sequence, because B shrinks as S grows (B*S is fixed): the total
    scratch of an O(S) kernel stays flat, an O(S^2) one grows like S.
    """
    parts, span = [], None
    for impl, points in growth.items():
        known = [(s, t) for s, t in points if t]
        if len(known) >= 2:
            (s0, t0), (s1, t1) = known[0], known[-1]
            span = (s0, s1)
            parts.append(f"{impl} x{t1 / t0:.1f}")
    if parts:
        r = span[1] / span[0]
        print(
            f"  temp per sequence, S {span[0]} -> {span[1]} ({label}): {', '.join(parts)}   "
            f"[O(S) would be x{r:.0f}, O(S^2) x{r * r:.0f}]",
            flush=True,
        )


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes (S 128, 256; K 64; d_model 128): a CPU check")
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--causal", choices=["both", "true", "false"], default="both")
    p.add_argument("--passes", nargs="+", choices=["fwd", "fwd+bwd"], default=["fwd", "fwd+bwd"])
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--batch-tokens", type=int, default=16384, help="B = max(1, batch_tokens // S)")
    p.add_argument("--d-model", type=int, default=2048, help="H = d_model // K")
    p.add_argument("--gqa", type=int, default=1, help="query heads per kv head")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--tuned", action="store_true", help="Pallas launch parameters from the autotune cache")
    p.add_argument("--cache", default=None, help=f"the cache --tuned reads (default: ${tuning.ENV_VAR} or ~/.cache)")
    p.add_argument("--max-seconds", type=float, default=None, help="start no new shape after this long")
    p.add_argument("--json", default=None, help="also write every cell to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.seq, args.head_dims, args.d_model, args.batch_tokens, args.repeats = [128, 256], [64], 128, 256, 3
    if args.cache:
        os.environ[tuning.ENV_VAR] = args.cache

    device, backend = jax.devices()[0], jax.default_backend()
    impls = [i for i in args.impls if i != "cudnn" or backend == "gpu"]
    peak, peak_src = peak_flops(args.dtype, device)
    print(
        f"machine: {device.device_kind}, backend {backend}, jax {jax.__version__}, {os.cpu_count()} cores; "
        f"{args.dtype}; B*S = {args.batch_tokens} tokens, H*K = {args.d_model}, H/G = {args.gqa}; "
        f"peak {peak / 1e12:.2f} TFLOP/s ({peak_src})"
    )
    print(
        f"FLOPs: forward 4*B*H*L*S*K (/2 causal), fwd+bwd {1 + BWD_FLOPS_FACTOR} x forward. Pallas: "
        f"{'interpret mode' if backend == 'cpu' else 'compiled'}, "
        f"{'launch parameters from the tuning cache' if args.tuned else 'DEFAULT_BLOCKS'}. "
        f"temp = compiled scratch; peak = device high-water mark ('<=': set by an earlier config)"
    )
    if "cudnn" in args.impls and "cudnn" not in impls:
        print(f"cudnn: skipped (it needs an NVIDIA GPU; this run's backend is {backend})")
    others = [i for i in impls if i != "pallas"] if "pallas" in impls else []
    print(
        f"\n{'causal':>6} {'K':>4} {'S':>6} {'B':>3} {'H':>3} {'pass':>8} | TFLOP/s "
        + " ".join(f"{i:>7}" for i in impls)
        + " | "
        + " ".join(f"{'pallas/' + i:>13}" for i in others)
        + " | temp/peak "
        + " ".join(f"{i:>13}" for i in impls),
        flush=True,
    )

    cells, t_start = [], time.perf_counter()
    for causal in {"both": [False, True], "true": [True], "false": [False]}[args.causal]:
        for K in args.head_dims:
            for pass_ in args.passes:
                growth = {}
                for S in args.seq:
                    if args.max_seconds and time.perf_counter() - t_start > args.max_seconds:
                        print(f"stopped: --max-seconds {args.max_seconds:g} spent", flush=True)
                        return finish(cells, args.json)
                    B, H = max(1, args.batch_tokens // S), max(1, args.d_model // K)
                    G = max(1, H // args.gqa)
                    inputs = make_inputs(B, S, S, H, G, K, jnp.dtype(args.dtype))
                    flops = attention_flops(B, H, S, S, K, causal, pass_ == "fwd+bwd")
                    row = {
                        impl: measure(
                            impl,
                            causal,
                            pass_ == "fwd+bwd",
                            inputs,
                            backend=backend,
                            tuned=args.tuned,
                            repeats=args.repeats,
                            device=device,
                        )
                        for impl in impls
                    }
                    del inputs
                    tf = {i: flops / c["seconds"] / 1e12 if "seconds" in c else None for i, c in row.items()}
                    for impl, cell in row.items():
                        cells.append(
                            dict(
                                causal=causal,
                                K=K,
                                S=S,
                                B=B,
                                H=H,
                                G=G,
                                passes=pass_,
                                impl=impl,
                                flops=flops,
                                tflops=tf[impl],
                                **cell,
                            )
                        )
                        growth.setdefault(impl, []).append((S, cell.get("temp") and cell["temp"] / B))
                    rates = " ".join(f"{tf[i]:7.2f}" if tf[i] else f"{'skip':>7}" for i in impls)
                    ratio = " ".join(
                        f"{tf['pallas'] / tf[i]:13.2f}" if tf["pallas"] and tf[i] else f"{'-':>13}" for i in others
                    )
                    mem = " ".join(
                        f"{fmt_bytes(c.get('temp'))}/{fmt_bytes(c.get('peak'), c.get('peak_is_own', True))}".rjust(13)
                        for c in row.values()
                    )
                    print(
                        f"{str(causal):>6} {K:>4} {S:>6} {B:>3} {H:>3} {pass_:>8} |         {rates} | {ratio} | "
                        f"          {mem}",
                        flush=True,
                    )
                    for impl, cell in row.items():
                        if "skip" in cell:
                            print(f"    {impl} skipped: {cell['skip']}", flush=True)
                print_growth(growth, f"causal={causal}, K={K}, {pass_}")
    finish(cells, args.json)


def finish(cells: list, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "cells": cells}, f, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
