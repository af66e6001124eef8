"""Are two training runs numerically the same? Compares their metrics.jsonl row by row.

    python3 benchmarks/compare_runs.py RUN_A RUN_B [--steps 100] [--keys loss grad_norm lr val_loss]

Prints, for each compared key, how many rows matched bit for bit (the JSON floats are
the float32 values written by the trainer, so equal text means equal bits) and the
largest absolute difference; exits 1 if any compared value differs, 2 on bad input.
Timing columns (step_time_s, tokens_per_s, mfu, goodput, ...) are not compared: they
measure the machine, not the computation. Used to show that a refactor changed nothing
(e.g. the same `python3 -m train --config configs/lm_tiny.yaml` before and after).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

DETERMINISTIC = ("loss", "grad_norm", "lr", "val_loss", "nonfinite", "data_index")


def read_rows(run_dir: pathlib.Path) -> dict[int, dict]:
    """step -> the merged metrics of that step (a step may have a training row and an eval row)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass the run.dir of a training run")
    rows: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows.setdefault(row["step"], {}).update(row)
    return rows


def compare(a: dict[int, dict], b: dict[int, dict], keys: tuple[str, ...], max_step: int | None):
    """{key: (rows compared, rows bit-equal, max |a - b|)} over the steps both runs logged."""
    steps = sorted(s for s in set(a) & set(b) if max_step is None or s <= max_step)
    out = {}
    for key in keys:
        pairs = [(a[s][key], b[s][key]) for s in steps if key in a[s] and key in b[s]]
        diffs = [abs(float(x) - float(y)) if not (isinstance(x, float) and math.isnan(x)) else 0.0 for x, y in pairs]
        out[key] = (len(pairs), sum(x == y for x, y in pairs), max(diffs, default=0.0))
    return steps, out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_a", type=pathlib.Path)
    p.add_argument("run_b", type=pathlib.Path)
    p.add_argument("--steps", type=int, default=None, help="compare steps <= this (default: all)")
    p.add_argument("--keys", nargs="+", default=list(DETERMINISTIC))
    args = p.parse_args(argv)
    try:
        a, b = read_rows(args.run_a), read_rows(args.run_b)
    except (FileNotFoundError, json.JSONDecodeError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    steps, result = compare(a, b, tuple(args.keys), args.steps)
    if not steps:
        print("error: the two runs share no logged step", file=sys.stderr)
        return 2
    print(f"{len(steps)} logged steps in common ({steps[0]}..{steps[-1]})")
    same = True
    for key, (n, equal, worst) in result.items():
        if n:
            print(f"  {key:<10} {equal}/{n} bit-equal, max |diff| {worst:.3g}")
            same &= equal == n
    print("identical" if same else "DIFFERENT")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
