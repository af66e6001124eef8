"""Command line for training: parse, validate, call `train()`.

Exit status: 0 done (or stopped at train.stop_after); 2 a user error (bad
config, impossible mesh, missing files, a run.dir of another run), printed
as one line before anything is compiled or written; 3 a non-finite loss
under train.on_nan=stop; 74 the run dir's storage full or read-only (the
previous checkpoint intact); 75 preempted by SIGTERM/SIGINT after saving a
checkpoint, or during start-up before anything was written (run the same
command again to resume).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from meshwork.config import ConfigError, load_config
from meshwork.run.durable import StorageFull
from meshwork.train import interrupts
from meshwork.train.stops import NonFiniteLoss


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train", description="Train a model from a YAML config.")
    p.add_argument("--config", required=True, help="YAML file (may `include:` others)")
    p.add_argument("--dry-run", action="store_true", help="compile the step, print the per-device report, exit")
    p.add_argument("--json", action="store_true", help="with --dry-run: print the report as one JSON object")
    p.add_argument(
        "--graph",
        action="store_true",
        help="with --dry-run: print what XLA fused, scheduled and "
        "replaced in the compiled step (sharding/graph_report.py)",
    )
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="override config values")
    dist = p.add_argument_group("multi-process (jax.distributed); omit all on a single host")
    dist.add_argument(
        "--coordinator-address",
        default=os.environ.get("JAX_COORDINATOR_ADDRESS"),
        help="host:port of process 0 (env JAX_COORDINATOR_ADDRESS)",
    )
    dist.add_argument(
        "--num-processes",
        type=int,
        default=_env_int("JAX_NUM_PROCESSES"),
        help="number of processes (env JAX_NUM_PROCESSES)",
    )
    dist.add_argument(
        "--process-id",
        type=int,
        default=_env_int("JAX_PROCESS_ID"),
        help="this process's id, 0-based (env JAX_PROCESS_ID)",
    )
    dist.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() with JAX's own cluster detection (SLURM, TPU pods, MPI)",
    )
    return p.parse_intermixed_args(argv)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def init_distributed(args: argparse.Namespace) -> None:
    """Starts JAX's distributed runtime when asked to; must run before any jax computation."""
    explicit = (args.coordinator_address, args.num_processes, args.process_id)
    if not args.distributed and all(v is None for v in explicit):
        return
    if not args.distributed and any(v is None for v in explicit):
        raise ConfigError(
            "--coordinator-address, --num-processes and --process-id go together (or use "
            "--distributed for JAX's cluster auto-detection)"
        )
    import jax

    jax.distributed.initialize(*explicit) if not args.distributed else jax.distributed.initialize()


def step_jaxpr(trainer):
    """The jaxpr of a Trainer's train step, traced with the shapes it was compiled for."""
    import jax

    from meshwork.partitioning import abstract_with_shardings

    with trainer.context():
        return jax.make_jaxpr(trainer.make_step(trainer.grad_shardings))(
            abstract_with_shardings(trainer.abstract, trainer.shardings), trainer.batch_abstract()
        )


def graph(cfg, as_json: bool) -> None:
    """--dry-run --graph: compile the step and print its graph report."""
    import json

    from meshwork.sharding.graph_report import format_graph_report, graph_report
    from meshwork.train.trainer import build_trainer, check_runtime

    trainer = build_trainer(cfg, check_runtime(cfg)).compile()
    report = graph_report(trainer.step_fn, step_jaxpr(trainer))
    print(json.dumps(report) if as_json else format_graph_report(report))


def pipeline_lines(cfg) -> str:
    """--dry-run under a pipeline: the schedule table the step runs, its idle fraction and stash
    (the same table the planner reads its bubble from, meshwork.perf.planner_pipeline)."""
    import jax

    from meshwork.perf.planner_layout import layout_from_config
    from meshwork.perf.planner_pipeline import schedule_text

    return schedule_text(layout_from_config(cfg, jax.device_count()))


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        init_distributed(args)
        if args.graph or args.dry_run:  # no guard on these paths: Ctrl-C stops them at once
            interrupts.release()
        if args.graph:
            if not args.dry_run:
                raise ConfigError("--graph goes with --dry-run: python -m train --config FILE --dry-run --graph")
            from meshwork.train.finetune import with_base_model  # train() applies it on the other paths

            graph(with_base_model(cfg), args.json)
            return 0
        from meshwork.train.loop import train  # jax loads only once the config is known to be good
        from meshwork.train.preemption import PREEMPTED_EXIT_STATUS

        # Orbax logs a failed background write (with its traceback) before raising it to the trainer,
        # which reports it in one line or re-raises it whole; its log would only say it twice.
        logging.getLogger("absl").setLevel(logging.CRITICAL)

        summary = train(cfg, dry_run="json" if args.dry_run and args.json else args.dry_run)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteLoss as e:
        print(f"error: {e}", file=sys.stderr)
        return NonFiniteLoss.exit_status
    except StorageFull as e:
        print(f"error: {e}", file=sys.stderr)
        return StorageFull.exit_status
    if args.dry_run:
        if cfg.train.pipeline != "none" and not args.json:
            print(pipeline_lines(cfg))
        return 0
    from meshwork.train.terminal import summary_lines

    print("\n".join(summary_lines(summary, cfg)), flush=True)
    return PREEMPTED_EXIT_STATUS if summary["preempted"] else 0


def run() -> None:
    """The command line's body; train/__main__.py's `main` (the console script) holds Ctrl-C first."""
    try:
        status = main(sys.argv[1:])
    except KeyboardInterrupt:
        # Ctrl-C in a run without a guard (a dry run, several processes) before anything is written:
        # one line instead of a traceback, then the default action, so the shell still sees a process
        # ended by SIGINT.
        print("interrupted; nothing was written", file=sys.stderr, flush=True)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        raise
    if status == StorageFull.exit_status:
        # Orbax's writer threads died mid-write; at interpreter exit their event loops would print
        # more tracebacks. Everything of ours is flushed or fsynced already, so leave without them.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    run()
