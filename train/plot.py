"""python -m train.plot RUN_DIR [--out FILE]: loss curves from metrics.jsonl as a PNG (and, for GRPO, reward.png)."""

from __future__ import annotations

import argparse
import pathlib
import sys

from meshwork.run.metrics import read_metrics


def plot_run(run_dir: str | pathlib.Path, out: str | pathlib.Path | None = None) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, title = read_metrics(run_dir), pathlib.Path(run_dir).name
    out = pathlib.Path(out or pathlib.Path(run_dir) / "loss.png")
    curves = (("loss", "train loss", False), ("val_loss", "validation loss", True))
    plot_curves(rows, curves, "cross-entropy (nats/token)", title, out, plt)
    if any("reward" in r or "val_reward" in r for r in rows):  # GRPO: sampled batches and held-out greedy answers
        curves = (("reward", "rollout batch (sampled)", False), ("val_reward", "held-out (greedy)", True))
        plot_curves(rows, curves, "mean reward", title, out.with_name("reward.png"), plt)
    loads = [(r["step"], r["load"], r.get("load_cv")) for r in rows if "load" in r]
    if loads:
        plot_expert_load(loads, out.with_name("expert_load.png"), plt)
    return out


def plot_curves(rows: list[dict], curves, ylabel: str, title: str, out: pathlib.Path, plt) -> pathlib.Path:
    """One line per (metrics key, label, marked) of `curves` over the steps that logged it."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label, marked in curves:
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), marker="o" if marked else None, markersize=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_expert_load(loads, out: pathlib.Path, plt) -> pathlib.Path:
    """Each expert's share of routed tokens over steps (averaged over MoE layers),
    and the per-layer coefficient of variation: the imbalance the aux loss fights."""
    steps = [s for s, _, _ in loads]
    fig, (ax, ax_cv) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for e, share in enumerate(zip(*(load for _, load, _ in loads))):
        ax.plot(steps, share, linewidth=1, label=f"expert {e}")
    ax.axhline(1 / len(loads[0][1]), color="black", linestyle="--", linewidth=1, label="balanced")
    ax.set_ylabel("share of routed tokens")
    ax.legend(fontsize=7, ncol=4)
    ax.grid(alpha=0.3)
    if loads[0][2] is not None:
        ax_cv.plot(steps, [cv for _, _, cv in loads])
    ax_cv.set_ylabel("load CV (per layer, mean)")
    ax_cv.set_xlabel("step")
    ax_cv.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m train.plot", description=__doc__)
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="PNG path (default RUN_DIR/loss.png)")
    args = p.parse_args(argv)
    if not (pathlib.Path(args.run_dir) / "metrics.jsonl").is_file():
        print(f"error: {args.run_dir}/metrics.jsonl not found; pass the run.dir of a training run", file=sys.stderr)
        return 2
    print(plot_run(args.run_dir, args.out))
    return 0


def run() -> None:
    """Console-script entry point."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    run()
