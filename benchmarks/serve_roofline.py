"""The serving engine's decode step against the memory-bandwidth roofline, per attention path.

    python3 benchmarks/serve_roofline.py                          # lm_tiny-sized, CPU
    python3 benchmarks/serve_roofline.py --batches 1 16 64 --prompt-len 128 --steps 64 \\
        model.d_model=2048 model.n_layers=16 model.n_heads=16 model.n_kv_heads=8 model.d_ff=5632 \\
        train.compute_dtype=bfloat16 train.param_dtype=bfloat16     # the 756M model (gpu_suite.sh)

A decode step must read every weight once and each sequence's cached keys and
values; at the device's read bandwidth that bounds it from below
(benchmarks/generate.py's `roofline`, the bandwidth measured in this process: the larger
of jax's sum and every core summing its share with numpy).
Here the step is the one `Server` (src/meshwork/engine/serving.py) runs: greedy rows,
`--dispatch` decode steps per device call, the paged KV cache read in place by
the C++ kernel on the CPU (`xla`: attention=xla, kernels/cpu_paged_attention.py,
with the projection weights packed for the C++ matmul kernel as `serve` packs
them, models/pack.py; `unpacked`: the same with XLA's own dots), by XLA after
gathering each row's pages (`gather`: XLA's dots and both kernels switched off,
what other platforms' attention=xla does) or by the Pallas paged-attention
kernel (`pallas`: attention=pallas).
The decode time per step is the run with --steps new tokens minus the same run
with one (the prefill), over steps - 1: best of --repeats after a compiling
run. Prints, per path and batch, ms per step, tokens/s and the fraction of the
roofline reached, against the read at the start and (the median over rounds) against
an all-core read taken in each round beside its steps; random weights (a step's cost
does not depend on them).

With `--slots S`, the server has S slots whatever the batch (as a server started with
`--slots S` serves fewer requests than it could), and each row is measured twice in
the same process: computing the running requests (the default) and every slot
(`Server(fixed_batch=True)`, what every dispatch did before), with their ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_overhead import decode_step_s, serve_once  # noqa: E402
from generate import all_core_read_bandwidth, measure_bandwidth, roofline, weights_read_per_step  # noqa: E402

from meshwork.config import ConfigError, load_config  # noqa: E402
from meshwork.engine.kv_cache import cache_bytes_per_token  # noqa: E402
from meshwork.engine.serving import Server  # noqa: E402
from meshwork.kernels import cpu_paged_attention  # noqa: E402
from meshwork.models.build import build_model  # noqa: E402
from meshwork.models.pack import pack_for_cpu_decode  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = ("xla", "unpacked", "gather", "pallas")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--dispatch", type=int, default=8, help="decode steps per device call")
    ap.add_argument(
        "--impls",
        default="xla,gather,pallas",
        help="paths: xla (CPU kernels), unpacked (no matmul kernel), gather (no CPU kernel), pallas (paged kernel)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--slots", type=int, default=None, help="the server's slots (default: the batch)")
    ap.add_argument("--bandwidth-mib", type=int, default=1024, help="array size of the bandwidth measurement")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value (on configs/lm_tiny.yaml)")
    args = ap.parse_args(argv)
    impls = args.impls.split(",")
    for name, value in (
        ("--steps", args.steps),
        ("--prompt-len", args.prompt_len),
        ("--dispatch", args.dispatch),
        ("--repeats", args.repeats),
        *(("--batches", b) for b in args.batches),
        *((("--slots", args.slots),) if args.slots is not None else ()),
    ):
        if value < (2 if name == "--steps" else 1):
            ap.error(f"{name} {value}: too small (--steps needs 2, the rest 1)")
    if bad := [i for i in impls if i not in PATHS]:
        ap.error(f"--impls: {bad[0]!r} is not a path; use {', '.join(PATHS)}")
    try:
        configs = {
            impl: load_config(
                os.path.join(ROOT, "configs/lm_tiny.yaml"),
                [*args.overrides, f"model.attention={'pallas' if impl == 'pallas' else 'xla'}"],
            )
            for impl in impls
        }
    except ConfigError as e:
        ap.error(str(e))

    # The roofline takes the larger of two reads: jax's sum, and every core summing its share
    # (the matmul kernel splits its reads over the cores, so a one-thread read would flatter it).
    one_sum = measure_bandwidth(args.bandwidth_mib * 2**20)
    all_cores = all_core_read_bandwidth(args.bandwidth_mib * 2**20)
    bandwidth = max(one_sum, all_cores)
    print(
        f"{jax.devices()[0].device_kind}: measured read bandwidth {bandwidth / 1e9:.1f} GB/s (jax's sum "
        f"{one_sum / 1e9:.1f}, every core summing its share {all_cores / 1e9:.1f})",
        flush=True,
    )
    if args.slots is not None and max(args.batches) > args.slots:
        ap.error(f"--slots {args.slots}: fewer than the largest batch ({max(args.batches)}); use at least that")
    modes = ["running rows", "every slot"] if args.slots is not None else ["running rows"]
    print(
        "| attention | batch | slots | rows computed | ms/step | tok/s | steps/dispatch | roofline tok/s | of roofline "
        "| of the read beside it |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for impl in impls:
        # Programs are traced at their first call, inside the context: `gather` keeps XLA's gather.
        with cpu_paged_attention.disabled() if impl == "gather" else contextlib.nullcontext():
            measure(impl, configs[impl], args, modes, bandwidth)
    return 0


def measure(impl, cfg, args, modes, bandwidth) -> None:
    """Prints one attention path's rows, for each batch."""
    model = build_model(cfg)
    total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if impl == "xla":
        pack_for_cpu_decode(model)
    per_token = cache_bytes_per_token(model.cfg, model.dtype)
    for B in args.batches:
        slots = args.slots or B
        max_len = args.prompt_len + args.steps + 16
        servers = {
            mode: Server(
                model,
                slots=slots,
                page_size=16,
                max_len=max_len,
                n_pages=slots * -(-max_len // 16) + 1,
                steps_per_dispatch=args.dispatch,
                fixed_batch=mode == "every slot",
            )
            for mode in modes
        }
        rng = np.random.default_rng(0)
        for server in servers.values():
            serve_once(server, B, args.prompt_len, args.steps, "warm", rng)  # compiles
            serve_once(server, B, args.prompt_len, 1, "warm1", rng)
        # The modes take turns, so a disturbance of the shared machine hits them alike.
        # Each round also reads the memory with every core, right beside its steps: what other
        # processes on a shared host leave moves by a third within minutes, and the fraction of the
        # read beside a step follows that where the read at the start of the run cannot.
        runs, reads = {mode: [] for mode in modes}, []
        for r in range(args.repeats):
            for mode, server in servers.items():
                runs[mode].append(decode_step_s(server, B, args, r))
            reads.append(all_core_read_bandwidth(args.bandwidth_mib * 2**20, repeats=3))
        bound = roofline(
            weights_read_per_step(model, total, B), per_token, B, args.prompt_len + args.steps / 2, bandwidth
        )
        for mode in modes:
            step_s, per_dispatch = min(s for s, _ in runs[mode]), runs[mode][0][1]
            rows = max(servers[mode].batch_sizes)
            tok_s = B / step_s
            beside = np.median([bound["bytes_per_step"] / s / bw for (s, _), bw in zip(runs[mode], reads)])
            print(
                f"| {impl} | {B} | {slots} | {rows} ({mode}) | {step_s * 1e3:.3f} | {tok_s:,.0f} | "
                f"{per_dispatch:.2f} | {bound['ceiling_tok_s']:,.0f} | {tok_s / bound['ceiling_tok_s']:.1%} | "
                f"{beside:.1%} |",
                flush=True,
            )
        if len(modes) == 2:
            ratio = min(s for s, _ in runs["every slot"]) / min(s for s, _ in runs["running rows"])
            print(f"|  |  |  | every slot / running rows: {ratio:.2f}x the step time |  |  |  |  |  |  |", flush=True)
        del servers


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
