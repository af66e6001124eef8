"""Each parallelism preset on lm_tiny over 8 (fake CPU) devices: what the report
reads from the compiled step, next to the textbook formula.

    python benchmarks/parallelism_table.py > table.md

Prints a markdown table: per-device state bytes (params + grads + Adam) as a
multiple of the parameter bytes 4P, the formula, and the collectives per step
with the bytes each device sends (ring algorithms), from `sharding/report.py`.
"""

from __future__ import annotations

import os
import pathlib
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from meshwork.config import load_config  # noqa: E402
from meshwork.train.state import param_count  # noqa: E402
from meshwork.train.trainer import build_trainer, check_runtime  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
N = 8
ROWS = [
    # name, overrides, what it shards, state formula in units of 4P bytes (params + grads + Adam = 4 units)
    ("dp", ["mesh.data=8"], "nothing (batch only)", "4"),
    ("zero1", ["mesh.data=8"], "Adam moments", "2 + 2/N"),
    ("zero2", ["mesh.data=8"], "moments, gradients", "1 + 3/N"),
    ("fsdp", ["mesh.data=1", "mesh.fsdp=8"], "params, grads, moments", "4/N"),
    ("fsdp", ["mesh.data=2", "mesh.fsdp=4"], "same, over fsdp=4 (HSDP)", "4/4"),
    ("tp", ["mesh.data=4", "mesh.tensor=2"], "heads, MLP, vocab over tensor", "~4/2"),
    ("sp", ["mesh.data=4", "mesh.tensor=2"], "tp + residual stream over sequence", "~4/2"),
    ("cp", ["mesh.data=2", "mesh.sequence=4"], "activations over sequence", "4"),
    ("fsdp+tp", ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], "params over fsdp and tensor", "~4/4"),
    (
        "dp",
        ["mesh.stage=4", "mesh.data=2", "model.n_layers=4", "train.pipeline=1f1b", "train.microbatches=4"],
        "layers over stage (1F1B)",
        "~4/4 of layers",
    ),
    (
        "dp",
        [
            "mesh.stage=4",
            "mesh.data=2",
            "model.n_layers=4",
            "train.pipeline=1f1b",
            "train.microbatches=4",
            "model.kind=moe",
            "model.moe.n_experts=4",
            "model.moe.top_k=2",
        ],
        "MoE layers over stage (1F1B)",
        "~4/4 of layers",
    ),
]


def main() -> None:
    print(
        "| preset | mesh | shards | state / 4P measured | formula | all-reduce | all-gather | reduce-scatter "
        "| all-to-all | collective-permute | temp MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for preset, overrides, shards, formula in ROWS:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(ROOT / "configs/lm_tiny.yaml", [f"run.dir={tmp}", f"rules.preset={preset}", *overrides])
            trainer = build_trainer(cfg, check_runtime(cfg)).compile()
            rep = trainer.report_dict()
        full_param_bytes = 4 * param_count(trainer.abstract)
        state = rep["state"]["total"] / full_param_bytes
        mesh = " x ".join(f"{k}={v}" for k, v in trainer.mesh.shape.items() if v > 1)
        cells = [
            f"{c['count']} / {c['bytes'] / 2**20:.2f} MiB" if c["count"] else "-" for c in rep["collectives"].values()
        ]
        name = preset if "pipeline" not in " ".join(overrides) else "dp+pp (1f1b)"
        name = f"{name}, MoE" if "model.kind=moe" in overrides else name
        print(
            f"| {name} | {mesh} | {shards} | {state:.3f} | {formula} | "
            + " | ".join(cells)
            + f" | {rep['temp_bytes'] / 2**20:.1f} |"
        )


if __name__ == "__main__":
    main()
