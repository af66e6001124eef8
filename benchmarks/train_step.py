"""Step time of lm_tiny on one device vs 8 (fake CPU) devices under dp and fsdp,
and achieved FLOP/s as a fraction of this machine's measured matmul peak.

    python benchmarks/train_step.py [--steps 30] [key=value ...]
    python benchmarks/train_step.py --mfu      # CPU MFU: lm_tiny and a d512 x 8-layer LM,
                                               # remat on/off, scanned/unrolled, vs the planner

All layouts run in one process, one after another, so the ratios compare like
with like. On a CPU host the 8 "devices" share the same cores: the figures
say how much the sharded program costs over the single-device one, not a
scaling result.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time
from datetime import date

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from meshwork.config import load_config  # noqa: E402
from meshwork.data.text import train_iterator  # noqa: E402
from meshwork.perf.flops import train_flops_per_token  # noqa: E402
from meshwork.perf.hardware import measure_cpu_peak  # noqa: E402
from meshwork.train.loop import Trainer, check_runtime  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYOUTS = {
    "1 device": (1, ["mesh.data=1"]),
    "8 dev dp": (8, ["mesh.data=8", "rules.preset=dp"]),
    "8 dev fsdp": (8, ["mesh.data=1", "mesh.fsdp=8", "rules.preset=fsdp"]),
    "8 dev 2x4 hsdp": (8, ["mesh.data=2", "mesh.fsdp=4", "rules.preset=fsdp"]),
}


def time_layout(n_devices: int, overrides: list[str], steps: int) -> tuple[float, float]:
    """(median seconds per step, FLOPs per step)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(ROOT / "configs/lm_tiny.yaml", [f"run.dir={tmp}", *overrides])
        devices = jax.devices()[:n_devices]
        files = check_runtime(cfg, devices)
        trainer = Trainer(cfg, files, devices)
        it = train_iterator(str(files.train), cfg.data.seq_len, cfg.train.global_batch, cfg.run.seed)
        state = trainer.init_state()
        times = []
        for i in range(steps + 3):
            batch = trainer.to_device(next(it))
            t0 = time.perf_counter()
            state, metrics = trainer.step_fn(state, batch)
            jax.block_until_ready(metrics)
            if i >= 3:  # warm-up steps excluded
                times.append(time.perf_counter() - t0)
        flops = train_flops_per_token(cfg.model, cfg.data.seq_len) * cfg.train.global_batch * cfg.data.seq_len
        return statistics.median(times), flops


# The two models of the MFU table: lm_tiny as configured, and a CPU-sized LM with long sequences.
MFU_MODELS = {
    "lm_tiny (d128 x 4, seq 128, batch 16)": [],
    "d512 x 8, seq 512, batch 4": ["model.d_model=512", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=4",
                                   "model.d_ff=1536", "data.seq_len=512", "train.global_batch=4"],
}
MFU_VARIANTS = {
    "scan, no remat": ["train.remat=none", "train.scan_layers=true"],
    "scan, full remat": ["train.remat=full", "train.scan_layers=true"],
    "unrolled, no remat": ["train.remat=none", "train.scan_layers=false"],
    "unrolled, full remat": ["train.remat=full", "train.scan_layers=false"],
}


def mfu_table(steps: int, overrides: list[str]) -> None:
    """Achieved model FLOP/s of one-device training steps over the measured matmul peak, next to
    the planner's predicted step time for the same config on this CPU."""
    peak32, peak16 = measure_cpu_peak("float32"), measure_cpu_peak("bfloat16", accumulate="float32")
    print(f"measured matmul peak, one device: f32 {peak32 / 1e9:.1f} GFLOP/s, "
          f"bf16 x bf16 -> f32 {peak16 / 1e9:.1f} GFLOP/s")
    print("| model | variant | ms/step | model TFLOP/step | achieved GFLOP/s | MFU (f32 peak) | planner ms/step | measured / planned |")
    print("|---|---|---|---|---|---|---|---|")
    for model_name, model_ov in MFU_MODELS.items():
        for variant, ov in MFU_VARIANTS.items():
            all_ov = ["mesh.data=1", *model_ov, *ov, *overrides]
            t, flops = time_layout(1, all_ov, steps)
            planned = planned_step_time(all_ov, peak32)
            plan = f"{planned * 1e3:.1f} | {t / planned:.2f}" if planned else "- | -"
            print(f"| {model_name} | {variant} | {t * 1e3:.1f} | {flops / 1e12:.3f} | {flops / t / 1e9:.1f} | "
                  f"{flops / t / peak32:.1%} | {plan} |")


def planned_step_time(overrides: list[str], peak: float) -> float:
    """The planner's step time for the config on one device of this CPU, at its measured
    f32 matmul peak and efficiency 1 (the planner's compute term includes remat's recompute)."""
    from meshwork.perf.hardware import Accelerator
    from meshwork.perf.planner import PlanOptions, plan
    from meshwork.perf.planner_layout import layout_from_config

    cpu = Accelerator(name="this cpu", peak_flops={"fp32": peak, "bf16": peak}, hbm_bytes=64e9,
                      hbm_bandwidth=20e9, intra_node_bandwidth=20e9, intra_node_latency=1e-6,
                      inter_node_bandwidth=20e9, inter_node_latency=1e-6, devices_per_node=1)
    cfg = load_config(ROOT / "configs/lm_tiny.yaml", overrides)
    return plan(cfg, layout_from_config(cfg, 1), cpu, 1, PlanOptions(efficiency=1.0)).step_time


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--mfu", action="store_true", help="the CPU MFU table instead of the layout comparison")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if args.mfu:
        print(f"machine: {jax.devices()[0].device_kind}, {os.cpu_count()} cores; jax {jax.__version__}; "
              f"{date.today()}")
        mfu_table(args.steps, args.overrides)
        return
    peak = measure_cpu_peak("float32", n=1024)
    print(f"machine: {jax.devices()[0].device_kind}, {os.cpu_count()} cores; measured f32 matmul peak "
          f"{peak / 1e9:.1f} GFLOP/s; jax {jax.__version__}")
    base = None
    for name, (n, ov) in LAYOUTS.items():
        t, flops = time_layout(n, ov + args.overrides, args.steps)
        base = base or t
        print(f"{name:>15}: {t * 1e3:7.1f} ms/step  x{base / t:4.2f} vs 1 device  "
              f"achieved/peak {flops / t / peak:5.1%}")


if __name__ == "__main__":
    main(sys.argv[1:])
