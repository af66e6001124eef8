"""Tuning one attention shape: trace, cost and lower every candidate, compile and time them, report, record.

The report prints candidates in static order with their measured times, the
trials a static-order and a random-order search need to reach the best, and
the rank correlation of static cost and measured time; the winner goes to the
tuning cache (meshwork.kernels.tuning).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from meshwork.kernels import flash_attention as fa
from meshwork.kernels import tuning

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention import attention_flops, make_inputs, step, time_call  # noqa: E402
from autotune_cost_model import static_cost  # noqa: E402
from autotune_kernel_counts import kernels_of, triton_launches  # noqa: E402
from autotune_search import Candidate, random_trials, spearman, trials_to_reach  # noqa: E402


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
            return fa.flash_attention(
                q,
                k,
                v,
                causal=shape["causal"],
                block_q=c.block_q,
                block_kv=c.block_kv,
                num_warps=c.num_warps,
                num_stages=c.num_stages,
                backend=backend,
            )

        traced = jax.jit(step(attn, args.objective == "fwd+bwd")).trace(*specs)
        try:
            kernels = kernels_of(traced, shape, cand, backend)
            launch = tuple((kn.kind, kn.blocks, kn.num_warps, kn.num_stages) for kn in kernels)
            cost, facts = static_cost(kernels, backend, args.device_kind, args.dtype)
        except Exception as e:  # noqa: BLE001 -- JAX internals moved: still time everything, in grid order
            kernels, launch, cost, facts = [], cand, math.inf, dict(static="unavailable")
            if not getattr(args, "warned", False):
                print(f"WARNING: no static measure ({type(e).__name__}: {e}); candidates run in grid order", flush=True)
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
                raise RuntimeError(
                    f"{cand.label()}: the lowered Triton calls run (warps, stages) {found}; the "
                    f"flash_attention(num_warps=, num_stages=) no longer reach the kernel"
                )
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
    flops = attention_flops(
        shape["B"], shape["H"], shape["L"], shape["S"], shape["K"], shape["causal"], args.objective == "fwd+bwd"
    )
    print(f"{'static#':>7} {'est ms':>9} {'meas ms':>9} {'TFLOP/s':>8}  candidate  [static model's resource figures]")
    for i in order[: args.show] + [i for i in (best, 0) if i not in order[: args.show]]:
        t = trials[i]
        facts = " ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in t.facts.items())
        measured = (
            f"{t.seconds * 1e3:9.3f} {flops / t.seconds / 1e12:8.2f}"
            if math.isfinite(t.seconds)
            else f"{'-':>9} {'-':>8}"
        )
        print(
            f"{order.index(i) + 1:>7} {t.static * 1e3:9.3f} {measured}  {t.cand.label()}  [{facts}]"
            + (" <- best" if i == best and not args.static_only else "")
            + (f"  ({t.error})" if t.error else "")
        )


def search_stats(trials, order, args) -> dict:
    """Trials to reach the best (and near-best) in static order vs random orders; rank correlation."""
    times = [t.seconds for t in trials]
    best = int(np.argmin(times))
    stats = dict(n=len(trials), best=trials[best].cand.config(), best_s=times[best], default_s=times[0])
    for tol in (0.0, args.tolerance):
        tag = "best" if tol == 0 else f"within {tol:.0%}"
        stats[f"static_{tag}"] = trials_to_reach(order, times, tol)
        stats[f"random_{tag}"] = random_trials(times, tol, args.random_orders, args.seed)
        print(
            f"trials to reach {tag}: static order {stats[f'static_{tag}']}, random order "
            f"{stats[f'random_{tag}']:.1f} (mean of {args.random_orders} orders, seed {args.seed})"
        )
    both = [i for i, t in enumerate(trials) if math.isfinite(t.seconds) and math.isfinite(t.static)]
    stats["spearman"] = spearman([trials[i].static for i in both], [times[i] for i in both])
    print(
        f"best {trials[best].cand.label()}: {times[best] * 1e3:.3f} ms, x{times[0] / times[best]:.2f} vs defaults; "
        f"Spearman(static, measured) = {stats['spearman']:.2f} over {len(both)} candidates",
        flush=True,
    )
    return stats


def tune_shape(shape, args, platform, cands) -> dict:
    """Trace, cost, (compile and time) every candidate of one shape; record the winner."""
    key = tuning.shape_key(L=shape["L"], S=shape["S"], K=shape["K"], dtype=args.dtype, causal=shape["causal"])
    t0 = time.perf_counter()
    trials = prepare(cands, shape, args, platform)
    print(
        f"\n== {key}  (L {shape['L']}, S {shape['S']}, B {shape['B']}, H {shape['H']}, G {shape['G']}); "
        f"objective {args.objective}; {len(trials)} distinct candidates, "
        f"{sum(math.isinf(t.static) for t in trials)} statically infeasible; traced, costed and lowered in "
        f"{time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    order = sorted(range(len(trials)), key=lambda i: (trials[i].static, i))
    if not args.static_only:
        time_trials(trials, shape, args)
    timed = any(math.isfinite(t.seconds) for t in trials)
    best = int(np.argmin([t.seconds for t in trials])) if timed else order[0]
    print_trials(trials, order, best, shape, args)
    result = dict(
        key=key,
        shape=shape,
        candidates=[
            dict(
                config=t.cand.config(),
                static_s=t.static,
                seconds=t.seconds,
                facts=t.facts,
                static_rank=order.index(i) + 1,
                error=t.error,
            )
            for i, t in enumerate(trials)
        ],
    )
    if args.static_only:
        return result
    if not timed:
        print("no candidate ran; nothing recorded", flush=True)
        return result
    result["stats"] = search_stats(trials, order, args)
    if args.write_cache:
        config = trials[best].cand.config()
        path = tuning.record(
            args.device_kind,
            key,
            config,
            path=args.cache,
            measured=dict(
                ms=trials[best].seconds * 1e3,
                default_ms=trials[0].seconds * 1e3,
                objective=args.objective,
                candidates=len(trials),
                shape={k: shape[k] for k in "BLSHGK"},
                date=datetime.date.today().isoformat(),
                jax=jax.__version__,
            ),
        )
        print(f"recorded {args.device_kind!r} {key} -> {config or 'defaults'} in {path}", flush=True)
    return result
