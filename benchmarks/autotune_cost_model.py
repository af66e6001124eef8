"""The autotuner's static cost: per-backend models (gpu, cpu, tpu) turning counted kernel work into seconds.

What each model charges, and why the constants are only rough, is told in
autotune_attention.py's docstring (its --help).
"""

from __future__ import annotations

import math
import os
import sys

from meshwork.perf.hardware import accelerator_for_device_kind, table_dtype

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from autotune_kernel_counts import Kernel, level_runs  # noqa: E402

# Data-sheet figures (dense bf16 peak comes from meshwork.perf.hardware). clock is a
# sustained boost clock; ITER_CYCLES is a guess at one inner-loop step's fixed
# cost (loop, barriers, pipeline bookkeeping) per program.
GPU_SPECS = {
    "H200": dict(sms=132, smem_sm=228 << 10, smem_block=227 << 10, hbm=4.8e12, clock=1.75e9),
    "H100": dict(sms=132, smem_sm=228 << 10, smem_block=227 << 10, hbm=3.35e12, clock=1.75e9),
    "A100": dict(sms=108, smem_sm=164 << 10, smem_block=163 << 10, hbm=2.0e12, clock=1.41e9),
}
ITER_CYCLES = 200
REGS_PER_SM, MAX_REGS, MAX_WARPS_PER_SM = 65536, 255, 64
# Pallas interpreter on XLA:CPU: fitted (non-negative least squares on relative
# error) to 58 timed candidates of four small shapes on the 2-core CPU host of
# 2026-12; matmul FLOPs and loop bytes got zero weight, since the interpreter is
# overhead-bound at these sizes. The --quick shape is not one of the four.
CPU = dict(per_program=43e-6, per_block_byte=0.15e-9, per_op=0.16e-6, per_elem=0.12e-9)
TPU = dict(per_step=0.35e-6, per_iter=0.05e-6, peak=197e12, hbm=819e9, vmem=32 << 20)


def gpu_spec(device_kind: str) -> tuple[str, dict]:
    for name, spec in GPU_SPECS.items():
        if name.lower() in device_kind.lower():
            return name, spec
    return "H100", GPU_SPECS["H100"]  # the static-only default on a host without a GPU


def gpu_cost(kernels: list[Kernel], device_kind: str, dtype: str) -> tuple[float, dict]:
    """Estimated seconds on an NVIDIA GPU, and the resource figures behind it (of the costliest kernel)."""
    name, spec = gpu_spec(device_kind)
    peaks = accelerator_for_device_kind(name).peak_flops
    peak = peaks.get(table_dtype(dtype), peaks["bf16"])
    vector_rate = spec["sms"] * 128 * spec["clock"]  # FP32 lanes per SM x clock
    total, worst = 0.0, {}
    for kn in kernels:
        warps, stages = kn.num_warps or 4, kn.num_stages or 2
        threads = 32 * warps
        deepest = max(kn.levels)
        inner = kn.levels[deepest]
        prologue = sum(lv.load_bytes for d, lv in kn.levels.items() if d < deepest)
        smem = stages * inner.load_bytes + prologue
        # Nested loops carry the same accumulators (dK/dV's head loop and its inner loop): max, not sum.
        live = max(lv.carried_words for lv in kn.levels.values()) + max(lv.max_tile_words for lv in kn.levels.values())
        regs = live / threads + 32
        spill = max(0.0, regs - MAX_REGS) / MAX_REGS
        by_regs = REGS_PER_SM // (min(regs, MAX_REGS) * threads)
        per_sm = int(min(spec["smem_sm"] // max(smem, 1), by_regs, MAX_WARPS_PER_SM // warps, 32))
        facts = dict(smem_kib=smem / 1024, regs=regs, blocks_per_sm=per_sm)
        if smem > spec["smem_block"] or per_sm < 1:
            return math.inf, dict(facts, infeasible=f"{kn.kind}: {smem / 1024:.0f} KiB shared memory")
        mma = vec = mem = iters = 0.0
        for depth, lv in kn.levels.items():
            runs = level_runs(kn, depth)
            mma += runs * sum(f / min(1.0, m / (16 * warps)) for f, m in lv.dots) / peak
            vec += runs * (lv.elems + 3 * lv.transcendental) / vector_rate
            mem += runs * (lv.load_bytes + lv.store_bytes) / spec["hbm"]
            iters += runs * ITER_CYCLES / spec["clock"] if depth else 0.0
        programs = kn.executions[0]
        slots = spec["sms"] * per_sm
        wave_eff = programs / (math.ceil(programs / slots) * slots)
        latency = min(1.0, per_sm * warps / 8) ** 0.5  # too few resident warps hide too little latency
        compute = mma + vec + iters / per_sm / spec["sms"]
        t = (max(compute, mem) if stages > 1 else compute + mem) / (wave_eff * latency) * (1 + 2 * spill)
        total += t
        if not worst or t > worst["t"]:
            worst = dict(facts, t=t)
    worst.pop("t", None)
    return total, worst


def cpu_cost(kernels: list[Kernel]) -> tuple[float, dict]:
    """Estimated seconds under the Pallas interpreter on CPU: overheads per program, op and element dominate."""
    total = 0.0
    for kn in kernels:  # each grid step slices every block out of its operand and writes the outputs back
        total += kn.executions[0] * (CPU["per_program"] + kn.block_bytes * CPU["per_block_byte"])
        for depth, lv in kn.levels.items():
            total += level_runs(kn, depth) * (lv.ops * CPU["per_op"] + lv.elems * CPU["per_elem"])
    return total, {}


def tpu_cost(kernels: list[Kernel]) -> tuple[float, dict]:
    """Estimated seconds on a TPU: per-step overhead plus a roofline; blocks past scoped VMEM are infeasible."""
    total = 0.0
    for kn in kernels:
        if 2 * kn.block_bytes > TPU["vmem"]:  # double-buffered blocks
            return math.inf, dict(infeasible=f"{kn.kind}: {2 * kn.block_bytes / 2**20:.0f} MiB VMEM")
        flops = sum(level_runs(kn, d) * lv.flops for d, lv in kn.levels.items())
        moved = sum(level_runs(kn, d) * (lv.load_bytes + lv.store_bytes) for d, lv in kn.levels.items())
        iters = sum(level_runs(kn, d) for d in kn.levels if d)
        total += (
            kn.executions[0] * TPU["per_step"] + iters * TPU["per_iter"] + max(flops / TPU["peak"], moved / TPU["hbm"])
        )
    return total, {}


def static_cost(kernels, backend, device_kind, dtype) -> tuple[float, dict]:
    if backend == "gpu":
        return gpu_cost(kernels, device_kind, dtype)
    return tpu_cost(kernels) if backend == "tpu" else cpu_cost(kernels)
