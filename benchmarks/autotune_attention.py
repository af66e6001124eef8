"""Autotune flash attention's launch parameters per shape, and test whether a static cost orders the search well.

    python benchmarks/autotune_attention.py [--seq 4096] [--head-dims 64 128] [--causal both] [--cache FILE]
    python benchmarks/autotune_attention.py --quick                     # CPU interpret mode, tiny grid
    python benchmarks/autotune_attention.py --static-only --backend gpu  # rank only: lowers for cuda, no device

For each shape, every candidate (block_q, block_kv, and on GPU Triton's
num_warps / num_stages; plus the kernel's own defaults) is traced, given a
static cost, compiled and timed (--objective: forward+backward by default,
since one block_q/block_kv pair drives all three kernels). The winner goes to
the tuning cache (meshwork.kernels.tuning), and the script reports how many
timed trials a search needs to reach the best candidate when it tries them in
the static order, against the mean over --random-orders shuffles (seeded).
Every candidate is timed, so both counts are exact for this run.

The static measure costs no device time. From the traced program it reads
each pallas_call's kernel jaxpr and counts, per execution of each loop level,
the MMA FLOPs (with each dot's M, which sets how many warps it can feed),
vector element-ops (transcendentals apart), bytes loaded from refs, live
loop-carried values and the largest tile; the kernel's own block-range
functions give how often each level runs (causal block skipping included),
and the Triton warps/stages come from the traced compiler params. A per-
backend model turns the counts into seconds:
  gpu  shared memory = stages x bytes loaded per inner step + prologue loads
       (over the per-block limit: infeasible), registers per thread from live
       values, blocks per SM from both, wave quantization, and
       max(MMA + vector + loop overhead, HBM) (summed when stages = 1);
  cpu  the Pallas interpreter: a cost per grid step, per block byte copied,
       per op and per element (fitted on this repo's CPU host);
  tpu  0.35 us per grid step plus a roofline; VMEM over the scoped limit is
       infeasible.
The constants are rough public figures and guesses; the trial counts and the
rank correlation printed below are what say whether the model is worth using.
On GPU the lowered Triton calls are also read back (num_warps / num_stages in
the custom call) to check the candidate reached the kernel.

Why count the jaxpr rather than the lowered text: on GPU the kernel reaches
the lowered module as an opaque Triton bytecode blob, and its op count hardly
moves with the block sizes (the same ops run on differently shaped tiles);
the tile shapes, which the jaxpr carries, are what change the cost.

GPU runs: candidates compile in --compile-workers threads (8; use 1 if XLA
misbehaves), then run one at a time. Candidates the model calls infeasible
are still compiled (their failure tests the model) unless --skip-infeasible.
Pass --cache to keep the tuned file (e.g. under a directory that is kept).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import itertools
import json
import math
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention import attention_flops, make_inputs, step, time_call  # noqa: E402

from meshwork.perf.hardware import accelerator_for_device_kind, table_dtype  # noqa: E402
from meshwork.kernels import flash_attention as fa  # noqa: E402
from meshwork.kernels import tuning  # noqa: E402

# --------------------------------------------------------------------------
# Candidates
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One launch configuration; None leaves the choice to the kernel (all None: its defaults)."""
    block_q: int | None = None
    block_kv: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def config(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def label(self) -> str:
        short = {"block_q": "bq", "block_kv": "bk", "num_warps": "warps", "num_stages": "stages"}
        return " ".join(f"{short[k]}={v}" for k, v in self.config().items()) or "defaults"


# The real grid per backend; --quick replaces it. GPU: Triton tiles are powers
# of two >= 16; warps 4/8 and 1-3 pipeline stages cover what FlashAttention-2
# style kernels use on Ampere/Hopper. TPU: the key block is a lane dim (x128).
GRIDS = {
    "gpu": dict(block_q=(32, 64, 128, 256), block_kv=(32, 64, 128), num_warps=(4, 8), num_stages=(1, 2, 3)),
    "tpu": dict(block_q=(128, 256, 512, 1024), block_kv=(128, 256, 512, 1024)),
    "cpu": dict(block_q=(32, 64, 128, 256), block_kv=(32, 64, 128, 256)),
}
QUICK_GRIDS = {
    "gpu": dict(block_q=(64, 128), block_kv=(32, 64), num_warps=(4, 8), num_stages=(2, 3)),
    "tpu": dict(block_q=(128, 256), block_kv=(128, 256)),
    "cpu": dict(block_q=(32, 64, 128), block_kv=(32, 64, 128)),
}


def candidates(grid: dict) -> list[Candidate]:
    """The kernel's defaults first, then the grid's product."""
    names = list(grid)
    return [Candidate()] + [Candidate(**dict(zip(names, values))) for values in itertools.product(*grid.values())]


# --------------------------------------------------------------------------
# Static measure: counts from the kernel jaxprs
# --------------------------------------------------------------------------

TRANSCENDENTAL = {"exp", "exp2", "log", "log1p", "tanh", "logistic", "rsqrt", "sqrt"}
LOADS, STORES = {"get", "load"}, {"swap", "store", "addupdate"}
LOOPS = {"while", "scan"}


@dataclasses.dataclass
class Level:
    """Work of one execution of a loop level's body (level 0: the program outside any loop)."""
    dots: list = dataclasses.field(default_factory=list)  # (flops, M) per dot_general
    elems: float = 0.0          # vector element-ops, transcendentals included
    transcendental: float = 0.0
    load_bytes: float = 0.0
    store_bytes: float = 0.0
    ops: int = 0                # jaxpr equations: the interpreter pays per op
    carried_words: float = 0.0  # 4-byte words carried by loops that start at this level
    max_tile_words: float = 0.0

    @property
    def flops(self) -> float:
        return sum(f for f, _ in self.dots)


@dataclasses.dataclass
class Kernel:
    kind: str                 # "fwd" | "dq" | "dkdv" | "?"
    levels: dict              # depth -> Level
    executions: list          # depth -> how many times that level's body runs, over the whole grid
    block_bytes: float        # bytes of all ref blocks one program sees (inputs and outputs)
    num_warps: int | None
    num_stages: int | None
    blocks: tuple             # (block_q, block_kv) this kernel runs with


def _size(aval) -> int:
    return int(np.prod(aval.shape)) if hasattr(aval, "shape") else 1


def _words(aval) -> float:
    dtype = getattr(aval, "dtype", None)
    return _size(aval) * (np.dtype(dtype).itemsize if dtype is not None else 4) / 4


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for x in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(x, "eqns"):
                yield x
            elif hasattr(getattr(x, "jaxpr", None), "eqns"):
                yield x.jaxpr


def _count(jaxpr, levels: dict, depth: int) -> None:
    level = levels.setdefault(depth, Level())
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        outs = [v.aval for v in eqn.outvars]
        if name in LOOPS:
            level.carried_words += sum(_words(a) for a in outs)
            for sub in _subjaxprs(eqn):
                _count(sub, levels, depth + 1)
            continue
        subs = list(_subjaxprs(eqn))
        if subs:  # jit, pjit, closed_call, custom_jvp: count the body where it runs
            for sub in subs:
                _count(sub, levels, depth)
            continue
        level.ops += 1
        level.max_tile_words = max([level.max_tile_words] + [_words(a) for a in outs])
        if name == "dot_general":
            lhs = eqn.invars[0].aval
            (contract, _), (batch, _) = eqn.params["dimension_numbers"]
            k = int(np.prod([lhs.shape[d] for d in contract]))
            m = int(np.prod([lhs.shape[d] for d in range(lhs.ndim) if d not in contract and d not in batch]))
            level.dots.append((2.0 * _size(outs[0]) * k, m))
        elif name in LOADS:
            level.load_bytes += sum(_words(a) * 4 for a in outs)
        elif name in STORES:
            level.store_bytes += sum(_words(eqn.invars[i].aval) * 4 for i in range(1, min(2, len(eqn.invars))))
        else:
            n = sum(_size(a) for a in outs)
            level.elems += n
            if name in TRANSCENDENTAL:
                level.transcendental += n


def _pallas_calls(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        else:
            for sub in _subjaxprs(eqn):
                yield from _pallas_calls(sub)


def _kind(eqn, index: int) -> str:
    text = " ".join(str(eqn.params.get(k, "")) for k in ("name", "name_and_src_info", "metadata", "debug"))
    for kind in ("dkdv", "dq", "fwd"):
        if f"flash_attention_{kind}" in text:
            return kind
    return ("fwd", "dq", "dkdv")[index] if index < 3 else "?"  # the order _forward/_backward call them in


def _launch_params(compiler_params) -> tuple[int | None, int | None]:
    """num_warps / num_stages from a pallas_call's compiler params, whatever container this JAX uses."""
    if isinstance(compiler_params, dict):
        for value in compiler_params.values():
            found = _launch_params(value)
            if found != (None, None):
                return found
        return compiler_params.get("num_warps"), compiler_params.get("num_stages")
    return getattr(compiler_params, "num_warps", None), getattr(compiler_params, "num_stages", None)


def _executions(kind: str, cfg, B: int, H: int, G: int) -> list[float]:
    """How often each loop level runs over the grid, from the kernel's own block-range functions."""
    b = cfg.blocks
    try:  # a few small integer ops: keep them off the accelerator
        host = jax.devices("cpu")[0]
    except RuntimeError:
        host = None
    with jax.default_device(host):
        if kind in ("fwd", "dq"):
            bq, bk = (b.q, b.kv) if kind == "fwd" else (b.bwd_q, b.bwd_kv)
            starts = np.arange(cfg.padded_q_len // bq, dtype=np.int32) * bq
            lo, hi = fa._kv_block_range(cfg, starts, bq, bk)
            trips = np.maximum(np.broadcast_to(np.asarray(hi), starts.shape) - np.asarray(lo), 0)
            return [B * H * len(starts), B * H * float(trips.sum())]
        bq, bk = b.bwd_q, b.bwd_kv
        starts = np.arange(cfg.padded_kv_len // bk, dtype=np.int32) * bk
        lo, hi = fa._q_block_range(cfg, starts, bq, bk)
        trips = np.maximum(np.broadcast_to(np.asarray(hi), starts.shape) - np.asarray(lo), 0)
        programs = B * G * len(starts)
        return [programs, programs * cfg.rep, B * G * cfg.rep * float(trips.sum())]


def kernels_of(traced, shape: dict, cand: Candidate, backend: str) -> list[Kernel]:
    """The flash-attention kernels in a traced program, with their counted work."""
    B, L, S, H, G, K = (shape[k] for k in "BLSHGK")
    cfg = fa._plan((B, L, H, K), (B, S, G, K), causal=shape["causal"], scale=None, window=None, segmented=False,
                   block_q=cand.block_q, block_kv=cand.block_kv, backend=backend, interpret=None)
    out = []
    for i, eqn in enumerate(_pallas_calls(traced.jaxpr.jaxpr)):
        kind = _kind(eqn, i)
        levels: dict = {}
        body = eqn.params["jaxpr"]
        _count(body, levels, 0)
        execs = _executions(kind, cfg, B, H, G) if kind != "?" else [float(np.prod(eqn.params["grid_mapping"].grid))]
        warps, stages = _launch_params(eqn.params.get("compiler_params"))
        warps, stages = warps or cand.num_warps, stages or cand.num_stages  # a JAX that hides them: trust the ask
        blocks = (cfg.blocks.q, cfg.blocks.kv) if kind == "fwd" else (cfg.blocks.bwd_q, cfg.blocks.bwd_kv)
        out.append(Kernel(kind, levels, execs, sum(_words(v.aval) * 4 for v in body.invars), warps, stages, blocks))
    return out


def _runs(kernel: Kernel, depth: int) -> float:
    # A level deeper than the block-range model knows (the kernel grew a loop) runs as often as the deepest known.
    return kernel.executions[min(depth, len(kernel.executions) - 1)]


# --------------------------------------------------------------------------
# Static measure: per-backend cost models
# --------------------------------------------------------------------------

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
            runs = _runs(kn, depth)
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
            total += _runs(kn, depth) * (lv.ops * CPU["per_op"] + lv.elems * CPU["per_elem"])
    return total, {}


def tpu_cost(kernels: list[Kernel]) -> tuple[float, dict]:
    """Estimated seconds on a TPU: per-step overhead plus a roofline; blocks past scoped VMEM are infeasible."""
    total = 0.0
    for kn in kernels:
        if 2 * kn.block_bytes > TPU["vmem"]:  # double-buffered blocks
            return math.inf, dict(infeasible=f"{kn.kind}: {2 * kn.block_bytes / 2**20:.0f} MiB VMEM")
        flops = sum(_runs(kn, d) * lv.flops for d, lv in kn.levels.items())
        moved = sum(_runs(kn, d) * (lv.load_bytes + lv.store_bytes) for d, lv in kn.levels.items())
        iters = sum(_runs(kn, d) for d in kn.levels if d)
        total += kn.executions[0] * TPU["per_step"] + iters * TPU["per_iter"] + max(flops / TPU["peak"],
                                                                                   moved / TPU["hbm"])
    return total, {}


def static_cost(kernels, backend, device_kind, dtype) -> tuple[float, dict]:
    if backend == "gpu":
        return gpu_cost(kernels, device_kind, dtype)
    return tpu_cost(kernels) if backend == "tpu" else cpu_cost(kernels)


def triton_launches(lowered_text: str) -> list[tuple[int, int]]:
    """(num_warps, num_stages) of every Triton custom call in a lowered module's text."""
    out = []
    for line in lowered_text.splitlines():
        if "xla.gpu.triton" in line:
            w, s = re.search(r"num_warps = (\d+)", line), re.search(r"num_stages = (\d+)", line)
            out.append((int(w.group(1)) if w else None, int(s.group(1)) if s else None))
    return out


# --------------------------------------------------------------------------
# Search statistics
# --------------------------------------------------------------------------

def trials_to_reach(order, times, tol: float = 0.0) -> int:
    """Timed trials, in `order`, until one within (1 + tol) x the best time (1-based)."""
    target = min(times) * (1 + tol)
    return next(i for i, c in enumerate(order, 1) if times[c] <= target)


def random_trials(times, tol: float, n_orders: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    return float(np.mean([trials_to_reach(rng.permutation(len(times)), times, tol) for _ in range(n_orders)]))


def spearman(a, b) -> float:
    """Rank correlation of two finite sequences (ties broken by position: fine for a report)."""
    if len(a) < 3:
        return float("nan")
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


# --------------------------------------------------------------------------
# One shape
# --------------------------------------------------------------------------

@dataclasses.dataclass
class Trial:
    cand: Candidate
    static: float
    facts: dict
    lowered: object = None
    compiled: object = None
    seconds: float = math.inf
    error: str | None = None


def prepare(cands, shape, args, platform: str | None) -> list[Trial]:
    """Trace, cost and lower every candidate; drop those that resolve to the same launch.

    platform: lower for this platform without its device (static-only), or
    None to lower for this host's default device, to compile and time.
    """
    backend = args.backend
    dtype = jnp.dtype(args.dtype)
    B, L, S, H, G, K = (shape[k] for k in "BLSHGK")
    specs = [jax.ShapeDtypeStruct(s, dtype) for s in ((B, L, H, K), (B, S, G, K), (B, S, G, K), (B, L, H, K))]
    trials, seen = [], set()
    for cand in cands:
        def attn(q, k, v, c=cand):
            return fa.flash_attention(q, k, v, causal=shape["causal"], block_q=c.block_q, block_kv=c.block_kv,
                                      num_warps=c.num_warps, num_stages=c.num_stages, backend=backend)
        traced = jax.jit(step(attn, args.objective == "fwd+bwd")).trace(*specs)
        try:
            kernels = kernels_of(traced, shape, cand, backend)
            launch = tuple((kn.kind, kn.blocks, kn.num_warps, kn.num_stages) for kn in kernels)
            cost, facts = static_cost(kernels, backend, args.device_kind, args.dtype)
        except Exception as e:  # noqa: BLE001 -- JAX internals moved: still time everything, in grid order
            kernels, launch, cost, facts = [], cand, math.inf, dict(static="unavailable")
            if not getattr(args, "warned", False):
                print(f"WARNING: no static measure ({type(e).__name__}: {e}); candidates run in grid order",
                      flush=True)
                args.warned = True
        if launch in seen:
            continue
        seen.add(launch)
        trial = Trial(cand, cost, facts)
        try:
            trial.lowered = traced.lower(lowering_platforms=(platform,)) if platform else traced.lower()
        except Exception as e:  # noqa: BLE001 -- a candidate the backend's lowering rejects
            trial.error = f"lowering: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        if backend == "gpu" and trial.lowered is not None:
            found = triton_launches(trial.lowered.as_text())
            wrong = [(w, st) for w, st in found if cand.num_warps not in (None, w) or cand.num_stages not in (None, st)]
            if not found or wrong:
                raise RuntimeError(f"{cand.label()}: the lowered Triton calls run (warps, stages) {found}; the "
                                   f"flash_attention(num_warps=, num_stages=) no longer reach the kernel")
        if args.skip_infeasible and math.isinf(cost) and kernels:
            trial.lowered, trial.error = None, "not timed: statically infeasible"
        trials.append(trial)
    return trials


def compile_all(trials, workers: int) -> None:
    def compile_one(t):
        try:
            t.compiled = t.lowered.compile()
        except Exception as e:  # noqa: BLE001 -- e.g. out of shared memory: a failed trial, not a crash
            t.error = f"compile: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    todo = [t for t in trials if t.lowered is not None]
    if workers > 1:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            list(pool.map(compile_one, todo))
    else:
        for t in todo:
            compile_one(t)


def time_trials(trials, shape, args) -> None:
    """Compile every lowered candidate (in threads: compiling releases the GIL) and time them one by one."""
    compile_all(trials, args.compile_workers)
    inputs = make_inputs(*(shape[k] for k in "BLSHGK"), jnp.dtype(args.dtype))
    for t in trials:
        if t.compiled is not None:
            try:
                t.seconds = time_call(t.compiled, inputs, repeats=args.repeats)
            except Exception as e:  # noqa: BLE001 -- a launch the device refuses: a failed trial
                t.error = f"run: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        t.compiled = t.lowered = None  # free the executables as we go


def print_trials(trials, order, best, shape, args) -> None:
    """The first --show candidates in static order, plus the measured best and the defaults."""
    flops = attention_flops(shape["B"], shape["H"], shape["L"], shape["S"], shape["K"], shape["causal"],
                            args.objective == "fwd+bwd")
    print(f"{'static#':>7} {'est ms':>9} {'meas ms':>9} {'TFLOP/s':>8}  candidate  [static model's resource figures]")
    for i in order[:args.show] + [i for i in (best, 0) if i not in order[:args.show]]:
        t = trials[i]
        facts = " ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in t.facts.items())
        measured = f"{t.seconds * 1e3:9.3f} {flops / t.seconds / 1e12:8.2f}" if math.isfinite(t.seconds) \
            else f"{'-':>9} {'-':>8}"
        print(f"{order.index(i) + 1:>7} {t.static * 1e3:9.3f} {measured}  {t.cand.label()}  [{facts}]"
              + (" <- best" if i == best and not args.static_only else "") + (f"  ({t.error})" if t.error else ""))


def search_stats(trials, order, args) -> dict:
    """Trials to reach the best (and near-best) in static order vs random orders; rank correlation."""
    times = [t.seconds for t in trials]
    best = int(np.argmin(times))
    stats = dict(n=len(trials), best=trials[best].cand.config(), best_s=times[best], default_s=times[0])
    for tol in (0.0, args.tolerance):
        tag = "best" if tol == 0 else f"within {tol:.0%}"
        stats[f"static_{tag}"] = trials_to_reach(order, times, tol)
        stats[f"random_{tag}"] = random_trials(times, tol, args.random_orders, args.seed)
        print(f"trials to reach {tag}: static order {stats[f'static_{tag}']}, random order "
              f"{stats[f'random_{tag}']:.1f} (mean of {args.random_orders} orders, seed {args.seed})")
    both = [i for i, t in enumerate(trials) if math.isfinite(t.seconds) and math.isfinite(t.static)]
    stats["spearman"] = spearman([trials[i].static for i in both], [times[i] for i in both])
    print(f"best {trials[best].cand.label()}: {times[best] * 1e3:.3f} ms, x{times[0] / times[best]:.2f} vs defaults; "
          f"Spearman(static, measured) = {stats['spearman']:.2f} over {len(both)} candidates", flush=True)
    return stats


def tune_shape(shape, args, platform, cands) -> dict:
    """Trace, cost, (compile and time) every candidate of one shape; record the winner."""
    key = tuning.shape_key(L=shape["L"], S=shape["S"], K=shape["K"], dtype=args.dtype, causal=shape["causal"])
    t0 = time.perf_counter()
    trials = prepare(cands, shape, args, platform)
    print(f"\n== {key}  (L {shape['L']}, S {shape['S']}, B {shape['B']}, H {shape['H']}, G {shape['G']}); "
          f"objective {args.objective}; {len(trials)} distinct candidates, "
          f"{sum(math.isinf(t.static) for t in trials)} statically infeasible; traced, costed and lowered in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    order = sorted(range(len(trials)), key=lambda i: (trials[i].static, i))
    if not args.static_only:
        time_trials(trials, shape, args)
    timed = any(math.isfinite(t.seconds) for t in trials)
    best = int(np.argmin([t.seconds for t in trials])) if timed else order[0]
    print_trials(trials, order, best, shape, args)
    result = dict(key=key, shape=shape, candidates=[
        dict(config=t.cand.config(), static_s=t.static, seconds=t.seconds, facts=t.facts,
             static_rank=order.index(i) + 1, error=t.error) for i, t in enumerate(trials)])
    if args.static_only:
        return result
    if not timed:
        print("no candidate ran; nothing recorded", flush=True)
        return result
    result["stats"] = search_stats(trials, order, args)
    if args.write_cache:
        config = trials[best].cand.config()
        path = tuning.record(args.device_kind, key, config, path=args.cache, measured=dict(
            ms=trials[best].seconds * 1e3, default_ms=trials[0].seconds * 1e3, objective=args.objective,
            candidates=len(trials), shape={k: shape[k] for k in "BLSHGK"},
            date=datetime.date.today().isoformat(), jax=jax.__version__))
        print(f"recorded {args.device_kind!r} {key} -> {config or 'defaults'} in {path}", flush=True)
    return result


# --------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------

def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="CPU check: one tiny causal GQA shape, 3x3 block grid, plus a static-only GPU ranking")
    p.add_argument("--backend", choices=["gpu", "tpu", "cpu"], default=None, help="default: JAX's default backend")
    p.add_argument("--static-only", action="store_true", help="cost and rank without compiling or timing")
    p.add_argument("--seq", type=int, nargs="+", default=[4096], help="L = S values")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--causal", choices=["both", "true", "false"], default="both")
    p.add_argument("--batch-tokens", type=int, default=16384, help="B = max(1, batch_tokens // S)")
    p.add_argument("--d-model", type=int, default=2048, help="H = d_model // K")
    p.add_argument("--gqa", type=int, default=1, help="query heads per kv head")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--objective", choices=["fwd", "fwd+bwd"], default="fwd+bwd")
    for name in ("block_q", "block_kv", "num_warps", "num_stages"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, nargs="+", default=None,
                       help=f"override the grid's {name} values")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--random-orders", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=0.05, help="'near best' = within this fraction")
    p.add_argument("--compile-workers", type=int, default=None, help="threads compiling (default: 8 on GPU, else 1)")
    p.add_argument("--show", type=int, default=8, help="rows printed per shape, in static order")
    p.add_argument("--cache", default=None, help="tuning cache file (default: $MESHWORK_TUNING_CACHE or ~/.cache)")
    p.add_argument("--no-write", dest="write_cache", action="store_false", help="do not record winners")
    p.add_argument("--skip-infeasible", action="store_true",
                   help="do not compile candidates the static model rules out (they count as failed trials)")
    p.add_argument("--max-seconds", type=float, default=None, help="start no new shape after this long")
    p.add_argument("--json", default=None, help="write every candidate's figures to this file")
    return p.parse_args(argv)


def shapes(args) -> list[dict]:
    out = []
    for causal in {"both": [False, True], "true": [True], "false": [False]}[args.causal]:
        for K in args.head_dims:
            for S in args.seq:
                H = max(1, args.d_model // K)
                out.append(dict(B=max(1, args.batch_tokens // S), L=S, S=S, H=H, G=max(1, H // args.gqa), K=K,
                                causal=causal))
    return out


def run(args, grid) -> list[dict]:
    args.backend = args.backend or jax.default_backend()
    platform = {"gpu": "cuda"}.get(args.backend, args.backend) if args.static_only else None
    try:
        args.device_kind = jax.devices(args.backend)[0].device_kind
    except RuntimeError:
        if not args.static_only:
            raise SystemExit(f"no {args.backend} device here; pass --static-only to rank without timing")
        args.device_kind = {"gpu": "NVIDIA H100 (assumed)", "tpu": "TPU v5 lite (assumed)"}.get(args.backend, "cpu")
    if args.compile_workers is None:
        args.compile_workers = 8 if args.backend == "gpu" else 1
    grid = {k: tuple(getattr(args, k) or v) for k, v in grid[args.backend].items()}
    cands = candidates(grid)
    print(f"backend {args.backend} ({'static only' if args.static_only else 'timed'}), device "
          f"{args.device_kind!r}, jax {jax.__version__}; grid {grid} + defaults", flush=True)
    results, t0 = [], time.perf_counter()
    for shape in shapes(args):
        if args.max_seconds and time.perf_counter() - t0 > args.max_seconds:
            print(f"stopped: --max-seconds {args.max_seconds:g} spent", flush=True)
            break
        results.append(tune_shape(shape, args, platform, cands))
    timed = [r["stats"] for r in results if "stats" in r]
    if timed:
        sums = {k: sum(s[k] for s in timed) for k in timed[0] if k.startswith(("static_", "random_"))}
        near = f"within {args.tolerance:.0%}"
        print(f"\nsummary over {len(timed)} shapes: trials to reach the best: static {sums['static_best']}, "
              f"random {sums['random_best']:.1f}; to reach {near}: static {sums[f'static_{near}']}, "
              f"random {sums[f'random_{near}']:.1f}; median Spearman {np.median([s['spearman'] for s in timed]):.2f}",
              flush=True)
    return results


def main(argv: list[str]) -> None:
    args = parse(argv)
    results = []
    if args.quick:
        # One tiny causal shape timed in interpret mode, then the GPU path (cuda lowering, warps/stages
        # injection, the GPU model) exercised statically, so a GPU session meets no surprise there.
        # L = 384 is no power of two (padding) and H/G = 2 (GQA); not a shape the CPU model was fitted on.
        args.seq, args.head_dims, args.causal, args.d_model, args.batch_tokens = [384], [32], "true", 64, 384
        args.gqa = 2
        args.repeats, args.random_orders = min(args.repeats, 5), min(args.random_orders, 100)
        results += run(args, QUICK_GRIDS)
        if args.backend != "gpu":
            gpu_args = argparse.Namespace(**{**vars(args), "backend": "gpu", "static_only": True,
                                             "compile_workers": None, "head_dims": [64], "seq": [1024]})
            results += run(gpu_args, QUICK_GRIDS)
    else:
        results = run(args, GRIDS)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main(sys.argv[1:])
