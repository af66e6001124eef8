"""Command line for training: parse, validate, call `train()`.

User errors (bad config, impossible mesh, missing files) print one line and
exit with status 2 before anything is compiled or written.
"""

from __future__ import annotations

import argparse
import sys

from meshwork.config import ConfigError, load_config


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train", description="Train a model from a YAML config.")
    p.add_argument("--config", required=True, help="YAML file (may `include:` others)")
    p.add_argument("--dry-run", action="store_true", help="compile the step, print the per-device report, exit")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="override config values")
    return p.parse_intermixed_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        from train.loop import train  # jax loads only once the config is known to be good

        summary = train(cfg, dry_run=args.dry_run)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.dry_run:
        vals = summary["val_loss"]
        val = f", validation loss {vals[max(vals)]:.4f} at step {max(vals)}" if vals else ""
        print(f"at step {summary['last_step']} of {cfg.train.steps}{val}; run dir {summary['run_dir']}")
    return 0
