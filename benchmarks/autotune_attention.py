"""Autotune flash attention's launch parameters per shape, and test whether a static cost orders the search well.

    python benchmarks/autotune_attention.py [--seq 4096] [--head-dims 64 128] [--causal both] [--cache FILE]
    python benchmarks/autotune_attention.py --quick                     # CPU interpret mode, tiny grid
    python benchmarks/autotune_attention.py --static-only --backend gpu  # rank only: lowers for cuda, no device

For each shape, every candidate (block_q, block_kv, and on GPU Triton's
num_warps / num_stages; plus the kernel's own defaults) is traced, given a
static cost, compiled and timed (--objective: forward+backward by default,
since one block_q/block_kv pair drives all three kernels). The winner goes to
the tuning cache (meshwork.kernels.tuning), and the script reports how many
timed trials a search needs to reach the best candidate when it tries them in
the static order, against the mean over --random-orders shuffles (seeded).
Every candidate is timed, so both counts are exact for this run.

The static measure costs no device time. From the traced program it reads
each pallas_call's kernel jaxpr and counts, per execution of each loop level,
the MMA FLOPs (with each dot's M, which sets how many warps it can feed),
vector element-ops (transcendentals apart), bytes loaded from refs, live
loop-carried values and the largest tile; the kernel's own block-range
functions give how often each level runs (causal block skipping included),
and the Triton warps/stages come from the traced compiler params. A per-
backend model turns the counts into seconds:
  gpu  shared memory = stages x bytes loaded per inner step + prologue loads
       (over the per-block limit: infeasible), registers per thread from live
       values, blocks per SM from both, wave quantization, and
       max(MMA + vector + loop overhead, HBM) (summed when stages = 1);
  cpu  the Pallas interpreter: a cost per grid step, per block byte copied,
       per op and per element (fitted on this repo's CPU host);
  tpu  0.35 us per grid step plus a roofline; VMEM over the scoped limit is
       infeasible.
The constants are rough public figures and guesses; the trial counts and the
rank correlation printed below are what say whether the model is worth using.
On GPU the lowered Triton calls are also read back (num_warps / num_stages in
the custom call) to check the candidate reached the kernel.

Why count the jaxpr rather than the lowered text: on GPU the kernel reaches
the lowered module as an opaque Triton bytecode blob, and its op count hardly
moves with the block sizes (the same ops run on differently shaped tiles);
the tile shapes, which the jaxpr carries, are what change the cost.

GPU runs: candidates compile in --compile-workers threads (8; use 1 if XLA
misbehaves), then run one at a time. Candidates the model calls infeasible
are still compiled (their failure tests the model) unless --skip-infeasible.
Pass --cache to keep the tuned file (e.g. under a directory that is kept).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

# The parts, beside this file: autotune_search.py (candidates, search statistics), autotune_kernel_counts.py
# (work counted from the kernel jaxprs), autotune_cost_model.py (counts -> seconds), autotune_trials.py (one
# shape: trace, cost, time, report, record). This file is the command line and the loop over shapes.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from autotune_search import GRIDS, QUICK_GRIDS, candidates  # noqa: E402
from autotune_trials import tune_shape  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick",
        action="store_true",
        help="CPU check: one tiny causal GQA shape, 3x3 block grid, plus a static-only GPU ranking",
    )
    p.add_argument("--backend", choices=["gpu", "tpu", "cpu"], default=None, help="default: JAX's default backend")
    p.add_argument("--static-only", action="store_true", help="cost and rank without compiling or timing")
    p.add_argument("--seq", type=int, nargs="+", default=[4096], help="L = S values")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--causal", choices=["both", "true", "false"], default="both")
    p.add_argument("--batch-tokens", type=int, default=16384, help="B = max(1, batch_tokens // S)")
    p.add_argument("--d-model", type=int, default=2048, help="H = d_model // K")
    p.add_argument("--gqa", type=int, default=1, help="query heads per kv head")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--objective", choices=["fwd", "fwd+bwd"], default="fwd+bwd")
    for name in ("block_q", "block_kv", "num_warps", "num_stages"):
        p.add_argument(
            f"--{name.replace('_', '-')}", type=int, nargs="+", default=None, help=f"override the grid's {name} values"
        )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--random-orders", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=0.05, help="'near best' = within this fraction")
    p.add_argument("--compile-workers", type=int, default=None, help="threads compiling (default: 8 on GPU, else 1)")
    p.add_argument("--show", type=int, default=8, help="rows printed per shape, in static order")
    p.add_argument("--cache", default=None, help="tuning cache file (default: $MESHWORK_TUNING_CACHE or ~/.cache)")
    p.add_argument("--no-write", dest="write_cache", action="store_false", help="do not record winners")
    p.add_argument(
        "--skip-infeasible",
        action="store_true",
        help="do not compile candidates the static model rules out (they count as failed trials)",
    )
    p.add_argument("--max-seconds", type=float, default=None, help="start no new shape after this long")
    p.add_argument("--json", default=None, help="write every candidate's figures to this file")
    return p.parse_args(argv)


def shapes(args) -> list[dict]:
    out = []
    for causal in {"both": [False, True], "true": [True], "false": [False]}[args.causal]:
        for K in args.head_dims:
            for S in args.seq:
                H = max(1, args.d_model // K)
                out.append(
                    dict(B=max(1, args.batch_tokens // S), L=S, S=S, H=H, G=max(1, H // args.gqa), K=K, causal=causal)
                )
    return out


def run(args, grid) -> list[dict]:
    args.backend = args.backend or jax.default_backend()
    platform = {"gpu": "cuda"}.get(args.backend, args.backend) if args.static_only else None
    try:
        args.device_kind = jax.devices(args.backend)[0].device_kind
    except RuntimeError:
        if not args.static_only:
            raise SystemExit(f"no {args.backend} device here; pass --static-only to rank without timing") from None
        args.device_kind = {"gpu": "NVIDIA H100 (assumed)", "tpu": "TPU v5 lite (assumed)"}.get(args.backend, "cpu")
    if args.compile_workers is None:
        args.compile_workers = 8 if args.backend == "gpu" else 1
    grid = {k: tuple(getattr(args, k) or v) for k, v in grid[args.backend].items()}
    cands = candidates(grid)
    print(
        f"backend {args.backend} ({'static only' if args.static_only else 'timed'}), device "
        f"{args.device_kind!r}, jax {jax.__version__}; grid {grid} + defaults",
        flush=True,
    )
    results, t0 = [], time.perf_counter()
    for shape in shapes(args):
        if args.max_seconds and time.perf_counter() - t0 > args.max_seconds:
            print(f"stopped: --max-seconds {args.max_seconds:g} spent", flush=True)
            break
        results.append(tune_shape(shape, args, platform, cands))
    timed = [r["stats"] for r in results if "stats" in r]
    if timed:
        sums = {k: sum(s[k] for s in timed) for k in timed[0] if k.startswith(("static_", "random_"))}
        near = f"within {args.tolerance:.0%}"
        print(
            f"\nsummary over {len(timed)} shapes: trials to reach the best: static {sums['static_best']}, "
            f"random {sums['random_best']:.1f}; to reach {near}: static {sums[f'static_{near}']}, "
            f"random {sums[f'random_{near}']:.1f}; median Spearman {np.median([s['spearman'] for s in timed]):.2f}",
            flush=True,
        )
    return results


def main(argv: list[str]) -> None:
    args = parse(argv)
    results = []
    if args.quick:
        # One tiny causal shape timed in interpret mode, then the GPU path (cuda lowering, warps/stages
        # injection, the GPU model) exercised statically, so a first run on a GPU meets no surprise there.
        # L = 384 is no power of two (padding) and H/G = 2 (GQA); not a shape the CPU model was fitted on.
        args.seq, args.head_dims, args.causal, args.d_model, args.batch_tokens = [384], [32], "true", 64, 384
        args.gqa = 2
        args.repeats, args.random_orders = min(args.repeats, 5), min(args.random_orders, 100)
        results += run(args, QUICK_GRIDS)
        if args.backend != "gpu":
            gpu_args = argparse.Namespace(
                **{
                    **vars(args),
                    "backend": "gpu",
                    "static_only": True,
                    "compile_workers": None,
                    "head_dims": [64],
                    "seq": [1024],
                }
            )
            results += run(gpu_args, QUICK_GRIDS)
    else:
        results = run(args, GRIDS)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main(sys.argv[1:])
