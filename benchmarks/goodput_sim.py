"""Goodput under failures, three recovery modes, by replaying failure traces; and one real run killed by kill -9.

    python benchmarks/goodput_sim.py                 # the table, then mode (a) for real (2-4 min on 2 cores)
    python benchmarks/goodput_sim.py --real-modes persistent fast elastic    # all three for real (6-9 min)
    python benchmarks/goodput_sim.py --no-real-run   # the table only (3 s)

Part 1, the table. For 1,000, 10,000 and 100,000 devices that each fail once in 100 days
(reliability.cluster_mttf: a failure every 144, 14.4 and 1.44 minutes), a seeded Poisson trace of
`--days` of wall time is replayed (meshwork.perf.goodput_sim) against three recovery modes:
(a) persistent: restart the process, restore the persistent tier; (b) fast: restart the process,
restore a fast tier (host RAM or local disk, replicated to a peer); (c) elastic: no restart, the
survivors reshard from the fast tier, recompile and run on fewer devices until a replacement joins.
Checkpoint intervals are Daly's (reliability.daly_interval) for each mode's write cost.

The costs are assumptions, every one a flag (seconds):
  step 10: a large LM's step (a few seconds to tens of seconds at these scales).
  persistent checkpoint 60 (blocking), startup 60, compile 30, persistent restore 60: the 1-minute
      checkpoint and ~2-minute restart of reliability.py's 10,000-GPU example, with the restart
      split into process launch + rendezvous, a compile served by the persistent compilation
      cache, and reading back what took a minute to write.
  fast copy 2, fast restore 5: a device-to-host copy of a shard and its read back from host RAM
      or a peer; fast-tier loss probability 0.01 per failure (the copy's peer fails too).
  elastic: reshard 10 + recompile 30 (a new mesh; the compile cache misses), rejoin 10 (the full
      mesh's executable is still cached), 8 devices (one host) lost per failure, replaced after
      600 s, all shards roll back to the last fast copy (rollback 1: synchronous training waits
      for the lost shards to redo their steps; 0 would mean their state lives on in replicas).
  Scaling to large N: every cost is held constant in N (weak scaling: each device writes and
  reads its own shard in parallel, the compile is per-device). That is optimistic for the
  persistent tier (a shared filesystem's bandwidth does not grow with N) and for restarts
  (scheduling and rendezvous grow with N), so the table flatters mode (a) at 100,000 devices.

Part 2, the agreement with real runs killed by kill -9, is benchmarks/goodput_real_runs.py (run
from here unless --no-real-run).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys
import time

import numpy as np

from meshwork.perf.goodput_sim import MODES, failure_trace, scenario, simulate
from meshwork.perf.reliability import cluster_mttf, goodput

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from goodput_real_runs import KEYS as REAL_KEYS  # noqa: E402
from goodput_real_runs import LOG_EVERY, elastic_run, real_run


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, status 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive(kind):
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return v

    return parse


def non_negative(text):
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return v


def fraction(text):
    v = non_negative(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text!r}")
    return v


def parse_args(argv):
    p = Parser(prog="goodput_sim.py", description=__doc__.split("\n")[0])
    g = p.add_argument_group("the table")
    g.add_argument("--devices", type=positive(int), nargs="+", default=[1_000, 10_000, 100_000])
    g.add_argument("--mttf-days", type=positive(float), default=100.0, help="per-device MTTF")
    g.add_argument("--days", type=positive(float), default=30.0, help="wall time of each simulated trace")
    g.add_argument("--seeds", type=positive(int), default=3, help="traces per cell (seeds 0..n-1), averaged")
    g.add_argument("--step", type=positive(float), default=10.0)
    g.add_argument("--persistent-cost", type=non_negative, default=60.0)
    g.add_argument("--fast-cost", type=non_negative, default=2.0)
    g.add_argument("--startup", type=non_negative, default=60.0)
    g.add_argument("--compile", type=non_negative, default=30.0)
    g.add_argument("--restore-persistent", type=non_negative, default=60.0)
    g.add_argument("--restore-fast", type=non_negative, default=5.0)
    g.add_argument("--reshard", type=non_negative, default=10.0)
    g.add_argument("--recompile", type=non_negative, default=30.0)
    g.add_argument("--rejoin", type=non_negative, default=10.0)
    g.add_argument("--replacement-time", type=non_negative, default=600.0)
    g.add_argument("--group", type=positive(int), default=8, help="devices an elastic run loses per failure")
    g.add_argument("--fast-loss-prob", type=fraction, default=0.01)
    g.add_argument("--rollback", type=fraction, default=1.0)
    g.add_argument(
        "--table-every",
        type=positive(int),
        default=None,
        help="persistent checkpoint interval in steps (default: Daly's, per mode and scale)",
    )
    g.add_argument(
        "--table-fast-every",
        type=positive(int),
        default=None,
        help="fast-tier interval in steps (default: Daly's, per scale)",
    )
    r = p.add_argument_group("the real run")
    r.add_argument("--no-real-run", action="store_true")
    r.add_argument("--steps", type=positive(int), default=6000)
    r.add_argument("--every", type=positive(int), default=400, help="persistent checkpoint interval, steps")
    r.add_argument(
        "--real-modes",
        nargs="+",
        choices=MODES,
        default=["persistent"],
        help="the modes run for real; fast needs checkpoint.fast_every, elastic train.elastic",
    )
    r.add_argument(
        "--replacement-real",
        type=positive(float),
        default=None,
        help="elastic: seconds until lost devices return (default: half the MTTF)",
    )
    r.add_argument("--fast-every", type=positive(int), default=100, help="the fast tier's interval in the real run")
    r.add_argument(
        "--run-mttf",
        type=positive(float),
        default=None,
        help="mean seconds between kills (default: a third of the run's wall time without failures)",
    )
    r.add_argument(
        "--kills",
        type=positive(int),
        default=4,
        help="at most this many kills (the trace's first ones), so that a slow machine still finishes",
    )
    r.add_argument("--seed", type=int, default=7, help="seed of the kill trace")
    r.add_argument("--log", type=pathlib.Path, default=None, help="write the launches' stamped lines and rows here")
    r.add_argument("--max-wall", type=positive(float), default=400.0, help="give up after this many seconds")
    args = p.parse_args(argv)
    if args.every % LOG_EVERY:
        p.error(f"--every must be a multiple of log.every={LOG_EVERY}, got {args.every}")
    if args.fast_every % LOG_EVERY or args.every % args.fast_every:
        p.error(
            f"--fast-every must be a multiple of {LOG_EVERY} that divides --every={args.every}, got {args.fast_every}"
        )
    return args


def costs(args) -> dict:
    return {
        "device_mttf": args.mttf_days * 86400,
        "step_time": args.step,
        "persistent_cost": args.persistent_cost,
        "fast_cost": args.fast_cost,
        "startup": args.startup,
        "compile_": args.compile,
        "restore_persistent": args.restore_persistent,
        "restore_fast": args.restore_fast,
        "reshard": args.reshard,
        "recompile": args.recompile,
        "rejoin": args.rejoin,
        "replacement_time": args.replacement_time,
        "group": args.group,
        "fast_loss_prob": args.fast_loss_prob,
        "rollback": args.rollback,
    }


def table(args) -> None:
    c = costs(args)
    horizon = args.days * 86400
    print(
        f"# Part 1: simulated goodput, device MTTF {args.mttf_days:g} days, {args.days:g} days of wall time "
        f"per trace, mean of {args.seeds} seeds"
    )
    print(
        "# cost assumptions (s, constant in N; see the docstring): "
        + ", ".join(f"{k}={v:g}" for k, v in c.items() if k != "device_mttf")
    )
    print(
        "| devices | cluster MTTF | mode | recovery s | ckpt every (steps) | fast every | failures "
        "| goodput | Daly closed form |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    figures = {}
    for n in args.devices:
        m = cluster_mttf(c["device_mttf"], n)
        traces = [failure_trace(m, horizon, seed=k) for k in range(args.seeds)]
        for mode in MODES:
            s = scenario(mode, n_devices=n, every=args.table_every, fast_every=args.table_fast_every, **c)
            runs = [simulate(s, t, horizon=horizon, seed=k) for k, t in enumerate(traces)]
            g = float(np.mean([r.goodput for r in runs]))
            recovery = s.recovery_cost if mode == "persistent" else s.fast_recovery_cost
            closed = (
                f"{goodput(s.every * s.step_time, s.checkpoint_cost, m, s.recovery_cost):.3f}"
                if mode == "persistent"
                else ""
            )
            print(
                f"| {n:,} | {m / 60:.1f} min | {mode} | {recovery:g} | {s.every or '-'} | {s.fast_every or '-'} "
                f"| {np.mean([r.failures for r in runs]):.0f} | {g:.3f} | {closed} |"
            )
            figures[f"goodput[{mode},{n}]"] = g
    print(" ".join(f"{k}={v:.4f}" for k, v in figures.items()))


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    table(args)
    if not args.no_real_run:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the trainer in flight is killed too
        unit_trace = failure_trace(1.0, 1e3, seed=args.seed)[: args.kills]
        for mode in args.real_modes:
            if mode == "elastic":
                elastic_run(args, unit_trace)
            else:
                real_run(args, unit_trace, args.fast_every if mode == "fast" else None)
        print(" ".join(f"{k}={v:.4f}" for k, v in REAL_KEYS.items()))
    print(f"benchmark wall time {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
