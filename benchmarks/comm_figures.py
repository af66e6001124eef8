"""The Communication section's figures, on the test model of tests/test_comm.py
(lm_tiny at the suite's tiny shape, 8 fake CPU devices, dp, global batch 8).

    python benchmarks/comm_figures.py                 # everything, ~10 min on 2 cores
    python benchmarks/comm_figures.py --only bytes drift
    python benchmarks/comm_figures.py --steps 40      # one column of the loss table

Prints three markdown tables:
- bytes: what each device sends per step under each compression, read from the
  compiled step's HLO, as a fraction of exact data parallelism's;
- losses: validation loss after 40 and after 100 steps (separate runs: the
  cosine schedule depends on train.steps), with and without error feedback;
- drift: error feedback's defining property, as tests/test_comm.py checks it:
  20 steps of gradients with a persistent rank-3 trend plus per-replica noise;
  ||sum of applied means - sum of true means|| / ||sum of true means||.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import pathlib
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from meshwork.config import load_config  # noqa: E402
from meshwork.sharding.hlo import collective_summary  # noqa: E402
from meshwork.train.loop import train  # noqa: E402
from meshwork.train.trainer import build_trainer, check_runtime  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The suite's tiny model (tests/conftest.py, tiny_overrides) and tests/test_comm.py's layout.
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
]
DP = ["mesh.data=8", "rules.preset=dp", "checkpoint.every=1000"]
OPTIONS = {
    "exact DP": [],
    "bf16": ["comm.compression=bf16"],
    "int8": ["comm.compression=int8"],
    "int8, no error feedback": ["comm.compression=int8", "comm.error_feedback=false"],
    "PowerSGD r=1": ["comm.compression=powersgd", "comm.rank=1"],
    "PowerSGD r=1, no error feedback": ["comm.compression=powersgd", "comm.rank=1", "comm.error_feedback=false"],
    "PowerSGD r=2": ["comm.compression=powersgd", "comm.rank=2"],
    "PowerSGD r=4": ["comm.compression=powersgd", "comm.rank=4"],
    "PowerSGD r=4, no error feedback": ["comm.compression=powersgd", "comm.rank=4", "comm.error_feedback=false"],
    "stale gradients": ["comm.stale_gradients=true"],
    "DiLoCo H=4 (outer lr 0.7, momentum 0.9)": ["comm.local_steps=4"],
    "DiLoCo H=4, plain averaging (outer lr 1, momentum 0)": [
        "comm.local_steps=4",
        "comm.outer_lr=1.0",
        "comm.outer_momentum=0.0",
    ],
}
BYTES = [
    "exact DP",
    "bf16",
    "int8",
    "PowerSGD r=1",
    "PowerSGD r=2",
    "PowerSGD r=4",
    "DiLoCo H=4 (outer lr 0.7, momentum 0.9)",
]


def _cfg(run_dir, name: str, steps: int):
    return load_config(
        ROOT / "configs/lm_tiny.yaml",
        [f"run.dir={run_dir}", *TINY, f"train.steps={steps}", *DP, f"log.eval_every={steps}", *OPTIONS[name]],
    )


def _sent(trainer) -> float:
    """Bytes each device sends per step, all collectives (ring algorithms)."""
    return sum(v["bytes"] for v in collective_summary(trainer.step_fn.as_text()).values())


def bytes_table() -> None:
    print("| option | bytes sent per device per step | vs exact DP's step | vs a ring all-reduce of the gradients |")
    print("|---|---|---|---|")
    base = None
    for name in BYTES:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = _cfg(tmp, name, 40)
            trainer = build_trainer(cfg, check_runtime(cfg)).compile()
            sent = _sent(trainer)
            grads = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.abstract.params))
        if "DiLoCo" in name:
            sent /= 4  # the parameter all-reduce sits in the sync branch, taken once per H = 4 steps
        base = base or sent
        ring = 2 * (8 - 1) / 8 * grads
        print(
            f"| {name} | {sent:,.0f} | {sent / base:.4f} = 1/{base / sent:.2f} | {sent / ring:.4f} = "
            f"1/{ring / sent:.2f} |",
            flush=True,
        )
    print(
        "(DiLoCo: the sync branch's bytes / H. The last column is the ratio tests/test_comm.py checks; "
        "exact DP's step also all-reduces a few metric scalars.)"
    )


def loss_table(steps_list: list[int]) -> None:
    print("| option | " + " | ".join(f"val loss after {s} steps" for s in steps_list) + " |")
    print("|---|" + "---|" * len(steps_list))
    for name in OPTIONS:
        cells = []
        for steps in steps_list:
            with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
                cells.append(f"{train(_cfg(tmp, name, steps))['val_loss'][steps]:.4f}")  # its progress lines dropped
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def drift_table() -> None:
    """tests/test_comm.py::test_error_feedback_keeps_the_sum_of_sent_gradients_on_track, printed."""
    from meshwork.sharding.mesh import make_mesh
    from meshwork.train.comm_drift import sum_drift

    mesh = make_mesh({"data": 8})
    print("| compression | drift with error feedback | without | ratio |")
    print("|---|---|---|---|")
    for compression in ("powersgd", "int8"):
        cfg = load_config(ROOT / "configs/lm_tiny.yaml", [f"comm.compression={compression}", "comm.rank=1"])
        drift = sum_drift(cfg, mesh)
        name = "PowerSGD r=1" if compression == "powersgd" else "int8"
        print(f"| {name} | {drift[True]:.2%} | {drift[False]:.2%} | x{drift[False] / drift[True]:.1f} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=["bytes", "losses", "drift"], default=["bytes", "drift", "losses"])
    ap.add_argument("--steps", nargs="+", type=int, default=[40, 100])
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    print(f"jax {jax.__version__}, {jax.device_count()} devices ({jax.devices()[0].platform})\n")
    for part in args.only:
        {"bytes": bytes_table, "drift": drift_table, "losses": lambda: loss_table(args.steps)}[part]()
        print()
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
