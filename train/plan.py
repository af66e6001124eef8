"""Plan a parallel layout without a single device: memory, collectives, step time, MFU.

    python -m train.plan --config configs/llama7b.yaml --hardware h100 --devices 64
    python -m train.plan --config configs/llama7b.yaml --hardware h100 --devices 64 --nodes 8 \\
        --search --out runs/llama7b_plan.yaml train.global_batch=512

Without `--search` it plans the config's own mesh and preset (a -1 mesh axis
takes the remaining devices). With `--search` it ranks every layout that fits
in HBM by predicted step time, says why the best wins, and `--out` writes it
as a config `python -m train --config` runs. The arithmetic is
`meshwork.perf.planner`; bad input prints one line "error: ..." and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from meshwork.config import ConfigError, load_config


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.plan", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="YAML file of the model and batch to plan for")
    p.add_argument("--hardware", required=True, help="accelerator: h100, h200, a100, b200, tpu_v4, tpu_v5e, ...")
    p.add_argument("--devices", type=int, required=True, help="number of accelerators")
    p.add_argument("--nodes", type=int, help="nodes the devices sit in (default: the hardware's devices per node)")
    p.add_argument("--search", action="store_true", help="rank all layouts that fit, best first")
    p.add_argument("--top", type=int, default=5, help="with --search: how many layouts to list")
    p.add_argument("--out", help="with --search: write the best layout as a config YAML here")
    p.add_argument("--efficiency", type=float, default=0.6, help="fraction of peak FLOP/s the matmuls reach")
    p.add_argument(
        "--overlap", type=float, default=0.5, help="fraction of gradient/weight traffic hidden under compute"
    )
    p.add_argument(
        "--algorithm",
        default="auto",
        choices=("auto", "ring", "tree", "hierarchical"),
        help="collective algorithm (auto: fastest per collective)",
    )
    p.add_argument(
        "--accounting",
        default="meshwork",
        choices=("meshwork", "mixed"),
        help="state bytes: meshwork (param_dtype everywhere) or mixed (ZeRO's 2+2+12 per parameter)",
    )
    p.add_argument(
        "--grad-sync",
        default="per_microbatch",
        choices=("per_microbatch", "per_step"),
        help="when gradients are reduced: per microbatch (meshwork) or once per step",
    )
    p.add_argument("--json", action="store_true", help="print the plan(s) as one JSON object")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="override config values")
    return p.parse_intermixed_args(argv)


def _check(args: argparse.Namespace) -> None:
    if args.devices < 1:
        raise ConfigError(f"--devices {args.devices}: give a positive number of accelerators")
    if args.nodes is not None and (args.nodes < 1 or args.devices % args.nodes):
        raise ConfigError(
            f"--devices {args.devices} cannot be split evenly over --nodes {args.nodes}; "
            "use a node count that divides the device count"
        )
    if not 0 < args.efficiency <= 1:
        raise ConfigError(f"--efficiency {args.efficiency}: give a fraction of peak in (0, 1]")
    if not 0 <= args.overlap <= 1:
        raise ConfigError(f"--overlap {args.overlap}: give a fraction in [0, 1]")
    if args.out and not args.search:
        raise ConfigError("--out writes the layout --search finds; add --search")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        _check(args)
        cfg = load_config(args.config, args.overrides)
        from meshwork.perf.hardware import get_hardware
        from meshwork.perf.planner import PlanOptions
        from meshwork.perf.planner_comm import CommOptions

        try:
            hw = get_hardware(args.hardware)
        except ConfigError as e:  # name the flag, as every other error here does
            raise ConfigError(f"--hardware: {e}") from None
        if cfg.train.objective == "grpo" and cfg.train.grpo.placement == "split":
            if args.devices % 2:
                raise ConfigError(
                    f"--devices {args.devices}: train.grpo.placement split gives the trainer and the engine "
                    "half each; give an even count"
                )
            args.devices //= 2  # the trainer's half; the serving engine takes the other
        dpn = args.devices // args.nodes if args.nodes else None
        options = PlanOptions(
            efficiency=args.efficiency,
            overlap=args.overlap,
            algorithm=args.algorithm,
            accounting=args.accounting,
            comm=CommOptions(grad_sync=args.grad_sync),
        )
        return _search(cfg, hw, args, dpn, options) if args.search else _plan_one(cfg, hw, args, dpn, options)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _plan_one(cfg, hw, args, dpn, options) -> int:
    from meshwork.perf.planner import format_plan, layout_from_config, layout_problem, plan

    layout = layout_from_config(cfg, args.devices)
    problem = layout_problem(cfg, layout)
    if problem:
        raise ConfigError(f"{layout.describe()}: {problem}")
    p = plan(cfg, layout, hw, dpn, options)
    engine = _engine(cfg, args.devices)
    if args.json:
        print(json.dumps({**p.to_dict(), **({"engine": engine.to_dict()} if engine else {})}))
    else:
        print("\n".join([format_plan(p), *(engine.lines() if engine else [])]))
    return 0


def _engine(cfg, trainer_devices: int):
    """grpo: the serving engine beside the trainer (perf/planner_engine.py); None otherwise."""
    if cfg.train.objective != "grpo":
        return None
    from meshwork.perf.flops import param_counts
    from meshwork.perf.peft_counts import finetune_params
    from meshwork.perf.planner_engine import engine_plan

    trainable = finetune_params(cfg.model, cfg.finetune) or param_counts(cfg.model)["total"]
    return engine_plan(cfg, trainer_devices, trainable)


def _search(cfg, hw, args, dpn, options) -> int:
    from meshwork.perf.planner import describe_nodes, explain, format_plan, search, write_config

    plans, stats = search(cfg, hw, args.devices, dpn, options)
    if not plans:
        print(
            f"error: none of {stats['considered']} layouts of {cfg.run.name} fits in "
            f"{args.devices} x {hw.name}; add devices, shrink train.global_batch or use a larger accelerator",
            file=sys.stderr,
        )
        return 1
    best = plans[0]
    reasons = explain(best, plans[1:])
    if args.json:
        print(json.dumps({"stats": stats, "reasons": reasons, "plans": [p.to_dict() for p in plans[: args.top]]}))
    else:
        nodes = describe_nodes(-(-args.devices // best.devices_per_node), best.devices_per_node)
        print(
            f"{cfg.run.name} on {args.devices} x {hw.name} ({nodes}): "
            f"{stats['considered']:,} layouts, {stats['invalid']:,} impossible for this model, "
            f"{stats['too_big']:,} too big, {stats['fit']:,} fit"
        )
        print(f"{'#':>2}  {'step s':>8}  {'MFU':>6}  {'GB/dev':>7}  layout")
        for i, p in enumerate(plans[: args.top], 1):
            print(f"{i:>2}  {p.step_time:8.3f}  {p.mfu:6.1%}  {p.memory['total'] / 1e9:7.1f}  {p.layout.describe()}")
        print("why:")
        print("\n".join(f"  {line}" for line in reasons))
        print("\n" + format_plan(best))
    if args.out:
        write_config(
            cfg, best.layout, args.out, [f"planned by python -m train.plan for {args.devices} x {hw.name}", *reasons]
        )
        print(f"wrote {args.out}", file=sys.stderr if args.json else sys.stdout)
    return 0


def run() -> None:
    """Console-script entry point."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    run()
