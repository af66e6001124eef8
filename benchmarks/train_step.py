"""Step time of lm_tiny on one device vs 8 (fake CPU) devices under dp and fsdp,
and achieved FLOP/s as a fraction of this machine's measured matmul peak.

    python benchmarks/train_step.py [--steps 30] [key=value ...]
    python benchmarks/train_step.py --mfu      # CPU MFU: lm_tiny and a d512 x 8-layer LM,
                                               # remat on/off, scanned/unrolled, vs the planner
    python benchmarks/train_step.py --matched  # MaxText's tiny Llama (vocab 32000, d 256 x 4,
                                               # seq 256, batch 8, bf16, full remat): tokens/s on
                                               # 1 and 2 devices, loss and remat variants,
                                               # FLOP/s over the bf16 matmul peak, cores busy,
                                               # load average (--shapes matched: that shape alone)
    python benchmarks/train_step.py --profile  # where that step's time goes (perf/step_profile.py),
                                               # also at d 512 x 8, seq 512, on 1 and 2 devices
    python benchmarks/train_step.py --remat    # every train.remat policy at those shapes, 1 device:
                                               # ms/step and temp MiB against the planner's
                                               # activations and recompute

All layouts run in one process, one after another, so the ratios compare like
with like. On a CPU host the 8 "devices" share the same cores: the figures
say how much the sharded program costs over the single-device one, not a
scaling result.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
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
from meshwork.perf.step_profile import profile_steps  # noqa: E402
from meshwork.train.trainer import build_trainer, check_runtime  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYOUTS = {
    "1 device": (1, ["mesh.data=1"]),
    "8 dev dp": (8, ["mesh.data=8", "rules.preset=dp"]),
    "8 dev fsdp": (8, ["mesh.data=1", "mesh.fsdp=8", "rules.preset=fsdp"]),
    "8 dev 2x4 hsdp": (8, ["mesh.data=2", "mesh.fsdp=4", "rules.preset=fsdp"]),
}


def time_layout(n_devices: int, overrides: list[str], steps: int, profile: bool = False):
    """(median seconds per step, FLOPs per step), and with `profile` the traced breakdown of
    `steps` more steps (meshwork.perf.step_profile.StepProfile) as a third element. The compiled
    step's temp bytes (XLA's memory_analysis) are left in LAST_TEMP_BYTES, and the cores the
    process kept busy during the timed steps (CPU seconds over wall seconds) in LAST_CORES_BUSY."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(ROOT / "configs/lm_tiny.yaml", [f"run.dir={tmp}", *overrides])
        devices = jax.devices()[:n_devices]
        files = check_runtime(cfg, devices)
        trainer = build_trainer(cfg, files, devices).compile()
        it = train_iterator(str(files.train), cfg.data.seq_len, cfg.train.global_batch, cfg.run.seed)
        state = trainer.init_state()
        times, cpu_s = [], 0.0
        for i in range(steps + 3):
            batch = trainer.to_device(next(it))
            cpu0, t0 = _cpu_seconds(), time.perf_counter()
            state, metrics = trainer.step_fn(state, batch)
            jax.block_until_ready(metrics)
            if i >= 3:  # warm-up steps excluded
                times.append(time.perf_counter() - t0)
                cpu_s += _cpu_seconds() - cpu0
        LAST_CORES_BUSY[0] = cpu_s / sum(times)
        flops = train_flops_per_token(cfg.model, cfg.data.seq_len) * cfg.train.global_batch * cfg.data.seq_len
        LAST_TEMP_BYTES[0] = trainer.step_fn.memory_analysis().temp_size_in_bytes
        if not profile:
            return statistics.median(times), flops
        holder = {"state": state}

        def step(batch):  # threads the donated state through the traced steps
            holder["state"], metrics = trainer.step_fn(holder["state"], batch)
            return metrics

        batches = [(trainer.to_device(next(it)),) for _ in range(steps)]  # copied in before the trace
        prof = profile_steps(step, batches, trainer.step_fn.as_text(), steps=steps, n_devices=n_devices)
        return statistics.median(times), flops, prof


LAST_TEMP_BYTES = [0]
LAST_CORES_BUSY = [0.0]


def _cpu_seconds() -> float:
    """CPU time of this process, all its threads (XLA's compute pools included), user + system."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


# MaxText's tiny Llama as benchmarks/maxtext_side_by_side.py runs it (bf16 compute, full remat), and
# the larger CPU model of the MFU target (d 512 x 8 layers, seq 512).
MATCHED = [
    "model.vocab_size=32000",
    "model.d_model=256",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.n_kv_heads=4",
    "model.d_ff=1024",
    "data.seq_len=256",
    "train.global_batch=8",
    "train.compute_dtype=bfloat16",
    "train.remat=full",
]
D512 = [
    "model.vocab_size=32000",
    "model.d_model=512",
    "model.n_layers=8",
    "model.n_heads=8",
    "model.n_kv_heads=8",
    "model.d_ff=2048",
    "data.seq_len=512",
    "train.global_batch=8",
    "train.compute_dtype=bfloat16",
    "train.remat=full",
]
ONE = ["mesh.data=1"]
TWO_FSDP = ["mesh.data=1", "mesh.fsdp=2", "rules.preset=fsdp"]
MATCHED_VARIANTS = {  # (devices, overrides) beyond the shape
    "1 device, plain loss": (1, ONE + ["train.loss_chunk=null"]),
    "1 device": (1, ONE),
    "2 devices fsdp, plain loss": (2, TWO_FSDP + ["train.loss_chunk=null"]),
    "2 devices fsdp": (2, TWO_FSDP),
    "2 devices dp": (2, ["mesh.data=2", "rules.preset=dp"]),
    "1 device, remat none": (1, ONE + ["train.remat=none"]),
    "1 device, remat save_qkv_and_out_proj": (1, ONE + ["train.remat=save_qkv_and_out_proj"]),
}


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


SHAPES = {"matched": ("matched (d256 x 4, seq 256)", MATCHED), "d512": ("d512 x 8, seq 512", D512)}


def matched_table(steps: int, overrides: list[str], shapes: list[str]) -> None:
    """Tokens/s of the MaxText-matched shape (and of d 512 x 8), with the load average beside each row.

    "cores busy" is the process's CPU time over the wall time of the timed steps: on a host
    with C cores, n simulated devices can only beat one device by up to C / (one device's
    cores busy), unless the n-device program does less work than the one-device one (time
    both pinned to one core, `taskset -c 0`, to see which).

    The bf16 peak is measured before and after each row and the higher figure taken: on a shared
    host one measurement can read 40% low (214 against 371 GFLOP/s within a minute on
    2026-12-03), which would flatter the fraction."""
    print(
        "| shape | variant | ms/step | tokens/s | model GFLOP/s | bf16 peak GFLOP/s | of bf16 peak | temp MiB "
        "| cores busy | load avg |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape, shape_ov in (SHAPES[s] for s in shapes):
        for name, (n, ov) in MATCHED_VARIANTS.items():
            if n > jax.device_count():
                continue
            before = bf16_peak()
            t, flops = time_layout(n, [*shape_ov, *ov, *overrides], steps)
            peak16 = max(before, bf16_peak())
            tokens = flops / train_flops_per_token(
                load_config(ROOT / "configs/lm_tiny.yaml", [*shape_ov, *overrides]).model,
                int(_value(shape_ov, "data.seq_len")),
            )
            print(
                f"| {shape} | {name} | {t * 1e3:.0f} | {tokens / t:,.0f} | {flops / t / 1e9:.1f} | "
                f"{peak16 / 1e9:.0f} | {flops / t / peak16:.1%} | {LAST_TEMP_BYTES[0] / 2**20:.0f} | "
                f"{LAST_CORES_BUSY[0]:.2f} of {os.cpu_count()} | {load()} |",
                flush=True,
            )


def remat_table(steps: int, overrides: list[str], shapes: list[str]) -> None:
    """Each train.remat policy on one device: the measured step time and compiled temp bytes
    beside what the planner predicts for the same config (the layers' activations, and the
    recomputed FLOPs over the model's). Time and temp are also given over `none`'s."""
    from meshwork.perf.planner import memory, step_flops
    from meshwork.perf.planner_layout import layout_from_config
    from meshwork.perf.planner_remat import POLICIES

    print(
        "| shape | remat | ms/step | x none's time | temp MiB | x none's temp | planned layer activations MiB "
        "| planned recompute / model FLOPs | load avg |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for shape, shape_ov in (SHAPES[s] for s in shapes):
        base = None
        for policy in POLICIES:
            ov = [*shape_ov, *ONE, f"train.remat={policy}", *overrides]
            t, _ = time_layout(1, ov, steps)
            temp = LAST_TEMP_BYTES[0]
            base = base or (t, temp)
            cfg = load_config(ROOT / "configs/lm_tiny.yaml", ov)
            layout = layout_from_config(cfg, 1)
            flops = step_flops(cfg, layout)
            print(
                f"| {shape} | {policy} | {t * 1e3:.0f} | {t / base[0]:.2f} | {temp / 2**20:.0f} | "
                f"{temp / base[1]:.2f} | {memory(cfg, layout)['layers'] / 2**20:.0f} | "
                f"{flops['recompute'] / flops['model']:.1%} | {load()} |",
                flush=True,
            )


def bf16_peak() -> float:
    """The best bf16 x bf16 -> f32 matmul rate of all cores over a few short measurements (1024^3 and 2048^3)."""
    return max(measure_cpu_peak("bfloat16", n=n, repeats=10, accumulate="float32") for n in (1024, 2048, 1024))


def _value(overrides: list[str], key: str) -> str:
    return next(o.split("=", 1)[1] for o in overrides if o.startswith(key + "="))


def profile_table(steps: int, overrides: list[str], shapes: list[str]) -> None:
    """The step-time breakdown of the shapes on 1 and 2 devices (fsdp)."""
    for shape, shape_ov in (SHAPES[s] for s in shapes):
        for name, (n, ov) in (("1 device", (1, ONE)), ("2 devices fsdp", (2, TWO_FSDP))):
            if n > jax.device_count():  # a GPU machine lends one
                continue
            t, _, prof = time_layout(n, [*shape_ov, *ov, *overrides], steps, profile=True)
            print(f"\n### {shape}, {name}: {t * 1e3:.0f} ms/step untraced (load avg {load()})\n")
            print(prof.table())
            print(
                "\nlargest ops: "
                + "; ".join(f"{op} {s * 1e3:.1f} ms ({part}, {kind})" for op, s, part, kind in prof.top_ops[:6]),
                flush=True,
            )


# The two models of the MFU table: lm_tiny as configured, and a CPU-sized LM with long sequences.
MFU_MODELS = {
    "lm_tiny (d128 x 4, seq 128, batch 16)": [],
    "d512 x 8, seq 512, batch 4": [
        "model.d_model=512",
        "model.n_layers=8",
        "model.n_heads=8",
        "model.n_kv_heads=4",
        "model.d_ff=1536",
        "data.seq_len=512",
        "train.global_batch=4",
    ],
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
    print(
        f"measured matmul peak, one device: f32 {peak32 / 1e9:.1f} GFLOP/s, "
        f"bf16 x bf16 -> f32 {peak16 / 1e9:.1f} GFLOP/s"
    )
    print(
        "| model | variant | ms/step | model TFLOP/step | achieved GFLOP/s | MFU (f32 peak) | planner ms/step | measured / planned |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for model_name, model_ov in MFU_MODELS.items():
        for variant, ov in MFU_VARIANTS.items():
            all_ov = ["mesh.data=1", *model_ov, *ov, *overrides]
            t, flops = time_layout(1, all_ov, steps)
            planned = planned_step_time(all_ov, peak32)
            plan = f"{planned * 1e3:.1f} | {t / planned:.2f}" if planned else "- | -"
            print(
                f"| {model_name} | {variant} | {t * 1e3:.1f} | {flops / 1e12:.3f} | {flops / t / 1e9:.1f} | "
                f"{flops / t / peak32:.1%} | {plan} |"
            )


def planned_step_time(overrides: list[str], peak: float) -> float:
    """The planner's step time for the config on one device of this CPU, at its measured
    f32 matmul peak and efficiency 1 (the planner's compute term includes remat's recompute)."""
    from meshwork.perf.hardware import Accelerator
    from meshwork.perf.planner import PlanOptions, plan
    from meshwork.perf.planner_layout import layout_from_config

    cpu = Accelerator(
        name="this cpu",
        peak_flops={"fp32": peak, "bf16": peak},
        hbm_bytes=64e9,
        hbm_bandwidth=20e9,
        intra_node_bandwidth=20e9,
        intra_node_latency=1e-6,
        inter_node_bandwidth=20e9,
        inter_node_latency=1e-6,
        devices_per_node=1,
    )
    cfg = load_config(ROOT / "configs/lm_tiny.yaml", overrides)
    return plan(cfg, layout_from_config(cfg, 1), cpu, 1, PlanOptions(efficiency=1.0)).step_time


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--mfu", action="store_true", help="the CPU MFU table instead of the layout comparison")
    p.add_argument("--matched", action="store_true", help="tokens/s at MaxText's tiny-Llama shape and d512 x 8")
    p.add_argument("--profile", action="store_true", help="the step-time breakdown at those shapes")
    p.add_argument("--remat", action="store_true", help="every remat policy at those shapes, against the planner")
    p.add_argument(
        "--shapes",
        nargs="+",
        choices=sorted(SHAPES),
        default=["matched", "d512"],
        help="the shapes of --matched, --profile and --remat (default both)",
    )
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if args.matched or args.profile or args.remat:
        print(
            f"machine: {jax.devices()[0].device_kind}, {os.cpu_count()} cores; jax {jax.__version__}; "
            f"{date.today()}; load avg before {load()}"
        )
        table = matched_table if args.matched else (profile_table if args.profile else remat_table)
        table(args.steps, args.overrides, args.shapes)
        return
    if args.mfu:
        print(f"machine: {jax.devices()[0].device_kind}, {os.cpu_count()} cores; jax {jax.__version__}; {date.today()}")
        mfu_table(args.steps, args.overrides)
        return
    peak = measure_cpu_peak("float32", n=1024)
    print(
        f"machine: {jax.devices()[0].device_kind}, {os.cpu_count()} cores; measured f32 matmul peak "
        f"{peak / 1e9:.1f} GFLOP/s; jax {jax.__version__}"
    )
    base = None
    for name, (n, ov) in LAYOUTS.items():
        t, flops = time_layout(n, ov + args.overrides, args.steps)
        base = base or t
        print(
            f"{name:>15}: {t * 1e3:7.1f} ms/step  x{base / t:4.2f} vs 1 device  achieved/peak {flops / t / peak:5.1%}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
