"""AdamW vs Muon at equal tokens: each optimizer at its own tuned learning rate, validation loss curves.

    python3 benchmarks/optimizers.py [--configs lm_tiny moe_tiny] [--steps 400] [--out runs/optimizers]

For each config, trains with optimizer.name=adamw and =muon over a small learning-rate sweep
(the same steps, batch and data order, so the same tokens), keeps each optimizer's best
learning rate by final validation loss, prints a markdown table of every run (final and
best-run curves) and draws the best runs' validation curves into docs/muon_vs_adamw.png.
Each run is `python3 -m train` in a subprocess into --out/CONFIG_OPTIMIZER_LR; its metrics.jsonl
is what is read. A run already finished there is not trained again (the trainer's own resume), so
widening a sweep trains only the new rates; the wall time is the run's own (`time_wall_s`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Each optimizer's sweep brackets its best rate (the best is not at an end of its own sweep).
SWEEP = {"adamw": (1e-3, 3e-3, 1e-2), "muon": (1e-3, 3e-3, 1e-2, 3e-2)}


def val_curve(run_dir: pathlib.Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]


def wall_time(run_dir: pathlib.Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return sum(r["time_wall_s"] for r in rows if "time_wall_s" in r)


def train(config: str, optimizer: str, lr: float, steps: int, out: pathlib.Path) -> tuple[list, float]:
    run_dir = out / f"{config}_{optimizer}_{lr:g}"
    overrides = [
        f"optimizer.name={optimizer}",
        f"optimizer.lr={lr}",
        f"train.steps={steps}",
        f"run.dir={run_dir}",
        f"log.eval_every={max(steps // 8, 1)}",
        f"checkpoint.every={steps}",
    ]
    cmd = [sys.executable, "-m", "train", "--config", str(ROOT / "configs" / f"{config}.yaml"), *overrides]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return val_curve(run_dir), wall_time(run_dir)


def plot(best: dict, path: pathlib.Path, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(best), figsize=(5 * len(best), 3.6), squeeze=False)
    for ax, (config, runs) in zip(axes[0], best.items(), strict=True):
        for optimizer, (lr, curve) in runs.items():
            steps_, losses = zip(*curve[1:], strict=True)  # step 0 is the untrained model
            ax.plot(steps_, losses, marker="o", label=f"{optimizer} (lr {lr:g})")
        ax.set_title(f"{config}: validation loss, same tokens")
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss (nats/byte)")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path} ({steps} steps per run)")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=["lm_tiny", "moe_tiny"])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "runs" / "optimizers")
    p.add_argument("--figure", type=pathlib.Path, default=ROOT / "docs" / "muon_vs_adamw.png")
    args = p.parse_args(argv)
    best: dict[str, dict] = {}
    print("| config | optimizer | lr | final val loss | best val loss | wall s |\n|---|---|---|---|---|---|")
    for config in args.configs:
        best[config] = {}
        for optimizer, lrs in SWEEP.items():
            for lr in lrs:
                curve, wall = train(config, optimizer, lr, args.steps, args.out)
                final = curve[-1][1]
                print(
                    f"| {config} | {optimizer} | {lr:g} | {final:.4f} | {min(v for _, v in curve):.4f} | {wall:.0f} |"
                )
                if optimizer not in best[config] or final < best[config][optimizer][1][-1][1]:
                    best[config][optimizer] = (lr, curve)
    for config, runs in best.items():
        for optimizer, (lr, curve) in runs.items():
            points = ", ".join(f"{s}: {v:.3f}" for s, v in curve)
            print(f"{config} {optimizer} best lr {lr:g}: {points}")
    plot(best, args.figure, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
