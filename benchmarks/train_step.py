"""Step time of lm_tiny on one device vs 8 (fake CPU) devices under dp and fsdp,
and achieved FLOP/s as a fraction of this machine's measured matmul peak.

    python benchmarks/train_step.py [--steps 30] [key=value ...]

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

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from meshwork.config import load_config  # noqa: E402
from meshwork.data import train_iterator  # noqa: E402
from meshwork.flops import train_flops_per_token  # noqa: E402
from meshwork.hardware import measure_cpu_peak  # noqa: E402
from train.loop import Trainer, check_runtime  # noqa: E402

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


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
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
