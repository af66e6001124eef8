"""Graph insight's headline counts at two shapes: lm_tiny as configured (what
`python -m train --config configs/lm_tiny.yaml --dry-run --graph` prints) and the
suite's tiny shape (what tests/test_graph_report.py asserts), 8 fake CPU devices, dp.

    python benchmarks/graph_counts.py      # ~30 s on 2 cores
"""

from __future__ import annotations

import os
import pathlib
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from meshwork.config import load_config  # noqa: E402
from meshwork.sharding.graph_report import graph_report  # noqa: E402
from meshwork.train.cli import step_jaxpr  # noqa: E402
from meshwork.train.trainer import build_trainer, check_runtime  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = [
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=128",
    "data.seq_len=32",
    "train.global_batch=8",
    "log.progress=false",
    "log.tensorboard=false",
    "log.eval_batches=2",
]  # tests/conftest.py's tiny_overrides


def main() -> None:
    print(f"jax {jax.__version__}, {jax.device_count()} devices, dp")
    print(
        "| shape | jaxpr ops | HLO kernels | kernels / ops | per step: ops / kernels | fusions (ops inside) "
        "| fusion saved of unfused bytes | class FLOPs vs cost_analysis |\n|---|---|---|---|---|---|---|---|"
    )
    for label, extra in (
        ("lm_tiny (d128 x 4, seq 128, batch 16)", []),
        ("tests' tiny (d64 x 2, seq 32, batch 8)", TINY),
    ):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(ROOT / "configs/lm_tiny.yaml", [f"run.dir={tmp}", *extra])
            trainer = build_trainer(cfg, check_runtime(cfg)).compile()
            r = graph_report(trainer.step_fn, step_jaxpr(trainer))
        h, c = r["hlo"], r["cost_analysis"]
        xla = c["flops"] + c["transcendentals"]
        print(
            f"| {label} | {r['jaxpr']['ops']} | {h['kernels']} | {h['kernels'] / r['jaxpr']['ops']:.3f} | "
            f"{r['jaxpr']['per_step']} / {h['kernels_per_step']} | {h['fusions']} ({h['fused_ops']}) | "
            f"{h['saved_bytes'] / h['unfused_bytes']:.1%} | {h['flops_once_per_body'] / xla - 1:+.2%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
