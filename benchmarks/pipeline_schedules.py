"""The pipeline schedules meshwork runs, drawn and counted from their tables.

    python3 benchmarks/pipeline_schedules.py --out docs/pipeline_schedules.png   # a few seconds

Draws every schedule of `sharding/pipeline_schedules.py` (gpipe, 1f1b, interleaved
with 2 virtual stages, zb-h1) for P=4 stages
and M=8 microbatches as a time x stage chart, one panel per schedule: each
cell one time step of one stage, coloured by what it runs (forward,
backward, backward-input, backward-weight, idle) and numbered with its
microbatch. Then prints, per schedule and M in {4, 8, 16}, the idle fraction
(`idle_fraction`), the time steps, the stage inputs a stage keeps
(`stash_size`) and the output cotangents it keeps (`cotangent_stash_size`)
as a Markdown table: what benchmarks/RESULTS.md quotes, and
the same numbers the planner (`meshwork.perf.planner_pipeline`) charges.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

from meshwork.perf.planner_pipeline import schedule_table
from meshwork.sharding import pipeline_schedules as pipeline

KINDS = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))  # (kind, virtual stages)
# (op constant in sharding/pipeline_schedules.py, legend, colour); ops this checkout lacks are skipped.
OPS = (
    ("IDLE", "idle", "#f2f2f2"),
    ("FWD", "forward", "#4c9be8"),
    ("BWD", "backward", "#e8834c"),
    ("BWD_INPUT", "backward (input)", "#e8b04c"),
    ("BWD_WEIGHT", "backward (weight)", "#9b6ad6"),
)


def available() -> list[tuple[str, int]]:
    """The (kind, virtual stages) of KINDS that this checkout's sharding/pipeline_schedules.py knows."""
    return [(kind, v) for kind, v in KINDS if kind in pipeline.SCHEDULES]


def label(kind: str, v: int) -> str:
    return f"{kind} (v={v})" if v > 1 else kind


def rows(P: int = 4, microbatches: tuple[int, ...] = (4, 8, 16)) -> list[dict]:
    """Idle fraction, time steps and stash per available schedule and M."""
    out = []
    for kind, v in available():
        for M in microbatches:
            table = schedule_table(kind, P, M, v)
            out.append(
                {
                    "schedule": label(kind, v),
                    "P": P,
                    "M": M,
                    "steps": table.n_steps,
                    "idle": pipeline.idle_fraction(table),
                    "gpipe_formula": (P - 1) / (M + P - 1),
                    "stash": pipeline.stash_size(table),
                    "cotangents": pipeline.cotangent_stash_size(table),
                }
            )
    return out


def markdown(table_rows: list[dict]) -> str:
    lines = [
        "| schedule | P | M | time steps | idle fraction | (P-1)/(M+P-1) | stage inputs kept | cotangents kept |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in table_rows:
        lines.append(
            f"| {r['schedule']} | {r['P']} | {r['M']} | {r['steps']} | {r['idle']:.1%} | "
            f"{r['gpipe_formula']:.1%} | {r['stash']} | {r['cotangents']} |"
        )
    return "\n".join(lines)


def draw(out: pathlib.Path, P: int = 4, M: int = 8) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    kinds = available()
    tables = [schedule_table(kind, P, M, v) for kind, v in kinds]
    ops = [(getattr(pipeline, name), legend, colour) for name, legend, colour in OPS if hasattr(pipeline, name)]
    colour_of = {code: colour for code, _, colour in ops}
    width = max(t.n_steps for t in tables)
    fig, axes = plt.subplots(
        len(tables), 1, figsize=(0.3 * width + 1.5, 1.25 * P * len(tables) / 4 + 1.0), squeeze=False
    )
    for ax, (kind, v), table in zip(axes[:, 0], kinds, tables):
        chunk = getattr(table, "chunk", None)  # interleaved: which of a stage's v model chunks a cell runs
        for t in range(table.n_steps):
            for s in range(P):
                op, m = int(table.op[t, s]), int(table.mb[t, s])
                shade = 0.55 if chunk is not None and int(np.asarray(chunk)[t, s]) % 2 else 1.0
                ax.add_patch(
                    plt.Rectangle(
                        (t, s),
                        1,
                        1,
                        facecolor=colour_of.get(op, "#cccccc"),
                        alpha=shade,
                        edgecolor="white",
                        linewidth=0.8,
                    )
                )
                if m >= 0 and op != pipeline.IDLE:
                    ax.text(t + 0.5, s + 0.5, str(m), ha="center", va="center", fontsize=6.5)
        ax.set_xlim(0, width)
        ax.set_ylim(P, 0)
        ax.set_yticks(np.arange(P) + 0.5, [f"stage {s}" for s in range(P)], fontsize=7)
        ax.set_xticks(np.arange(0, width + 1, 5), [str(i) for i in range(0, width + 1, 5)], fontsize=7)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        pale = ", pale cells: chunk 1" if v > 1 else ""
        ax.set_title(
            f"{label(kind, v)}: {table.n_steps} time steps, idle {pipeline.idle_fraction(table):.1%}, "
            f"stash {pipeline.stash_size(table)}{pale}",
            fontsize=8.5,
            loc="left",
        )
    axes[-1, 0].set_xlabel(
        "time step: one operation of one microbatch on one stage (on one model chunk under "
        "interleaved, whose steps are 1/v as long)",
        fontsize=7.5,
    )
    fig.legend(
        handles=[Patch(facecolor=c, label=legend) for _, legend, c in ops],
        loc="upper right",
        ncol=len(ops),
        fontsize=7,
        frameon=False,
    )
    fig.suptitle(
        f"Pipeline schedules, P={P} stages, M={M} microbatches (numbers: microbatch)", fontsize=9, x=0.01, ha="left"
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/pipeline_schedules.png"))
    args = p.parse_args()
    draw(args.out)
    print(
        f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB); schedules: "
        + ", ".join(label(k, v) for k, v in available())
    )
    print(markdown(rows()))


if __name__ == "__main__":
    main()
