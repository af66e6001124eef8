"""What Muon adds to a train step: ms/step of AdamW, Muon gather and Muon sharded on each layout,
and Muon's ratio to AdamW on the same layout, all in one process.

    python3 benchmarks/optimizer_step.py [--steps 20] [--layouts "1 device" "8 dev fsdp"] [key=value ...]
    python3 benchmarks/optimizer_step.py --layouts "1 device" model.d_model=1024 model.n_layers=8 \\
        model.n_heads=8 model.n_kv_heads=8 model.d_ff=4096 data.seq_len=512   # a GPU-sized step

Overrides apply to configs/lm_tiny.yaml. On a CPU host the 8 "devices" share the same cores, so
the sharded layouts' times say what the extra collectives and the padding cost there, not how a
cluster scales; on one device the two variants are the same program (nothing is split).
"""

from __future__ import annotations

import argparse
import sys

from train_step import LAYOUTS, time_layout

LAYOUTS = {
    **LAYOUTS,
    "8 dev fsdp+tp 2x2x2": (8, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "rules.preset=fsdp+tp"]),
}
OPTIMIZERS = {
    "adamw": ["optimizer.name=adamw"],
    "muon gather": ["optimizer.name=muon", "optimizer.muon.newton_schulz=gather"],
    "muon sharded": ["optimizer.name=muon", "optimizer.muon.newton_schulz=sharded"],
}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layouts", nargs="+", default=["1 device", "8 dev fsdp", "8 dev fsdp+tp 2x2x2"])
    p.add_argument("overrides", nargs="*", help="key=value overrides of configs/lm_tiny.yaml")
    args = p.parse_args(argv)
    unknown = [name for name in args.layouts if name not in LAYOUTS]
    if unknown:
        print(f"error: no layout {unknown[0]!r}; choose from {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    print("| layout | optimizer | ms/step | vs adamw |\n|---|---|---|---|")
    for layout in args.layouts:
        n_devices, mesh = LAYOUTS[layout]
        base = None
        for name, opt in OPTIMIZERS.items():
            seconds = time_layout(n_devices, [*mesh, *opt, *args.overrides], args.steps)[0]
            base = base or seconds
            print(f"| {layout} | {name} | {seconds * 1e3:.1f} | {seconds / base:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
