"""Checkpoint tiers and in-process elasticity, measured in one run.

    python benchmarks/checkpoint_tiers.py          # ~7 min on 2 shared cores
    python benchmarks/checkpoint_tiers.py --elastic-only --compile-cache DIR   # part 3, warm cache (run twice)

1. The stall per checkpoint (what the step loop waits) with buffered writes (the step copies the
   state to host memory, a thread writes it) and synchronous ones, for the fast tier on local disk
   and for the persistent tier (Orbax async vs sync).
2. Recovery: restoring the same step from the fast tier's disk copy and from the persistent tier
   (Orbax), onto the same compiled trainer.
3. The time one elastic change costs (4 of 8 devices lost at step 10, back at step 20; fsdp) and
   what a process restart on the same device counts costs: a new `python -m train` that resumes
   and trains one step (interpreter, imports, compile, restore), less that step.

lm_tiny at its own sizes (0.85M parameters) on 8 simulated CPU devices, no persistent
compilation cache (unless --compile-cache: then both the trainer and the restarted process use
that persistent cache, as a production run would), XLA's default optimization.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

_args = argparse.ArgumentParser(description=__doc__.split("\n")[0])
_args.add_argument("--elastic-only", action="store_true", help="only part 3 (elastic change vs restart)")
_args.add_argument("--compile-cache", help="a persistent compilation cache folder for every compile")
ARGS = _args.parse_args()
if ARGS.compile_cache:  # before jax is imported: the cache is read once
    os.environ.update(
        JAX_COMPILATION_CACHE_DIR=ARGS.compile_cache,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from meshwork.config import load_config  # noqa: E402
from meshwork.partitioning import abstract_with_shardings  # noqa: E402
from meshwork.run.checkpoint import Checkpointer  # noqa: E402
from meshwork.run.fast_tier import FastTier  # noqa: E402
from meshwork.run.metrics import read_metrics  # noqa: E402
from meshwork.train.loop import train  # noqa: E402
from meshwork.train.trainer import build_trainer, check_runtime  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
FSDP8 = ["mesh.data=1", "mesh.fsdp=8", "rules.preset=fsdp"]
FSDP4 = ["mesh.data=1", "mesh.fsdp=4", "rules.preset=fsdp", "train.microbatches=2"]
QUIET = ["log.progress=false", "log.tensorboard=false", "log.eval_every=1000", "log.eval_batches=1", "log.every=1"]


def cfg(run_dir: pathlib.Path, *extra: str):
    return load_config(ROOT / "configs/lm_tiny.yaml", [f"run.dir={run_dir}", *QUIET, *FSDP8, *extra])


def stalls(work: pathlib.Path) -> dict[str, float]:
    """Median stall per checkpoint (ms): fast tier on disk and persistent tier, buffered and synchronous."""
    out = {}
    for buffered in (True, False):
        run = work / f"stall_{buffered}"
        done = train(
            cfg(
                run,
                "train.steps=40",
                "checkpoint.every=4",
                f"checkpoint.async={str(buffered).lower()}",
                "checkpoint.fast_every=2",
                f"checkpoint.fast_path={run / 'fast'}",
            )
        )
        s = done["checkpoint_stalls"]
        # The last persistent save is the run's final, waited-for write: not a step's stall.
        out[f"fast_{'buffered' if buffered else 'sync'}"] = 1e3 * float(np.median(s["fast"]))
        out[f"persistent_{'buffered' if buffered else 'sync'}"] = 1e3 * float(np.median(s["persistent"][:-1]))
    return out


def recovery(work: pathlib.Path) -> dict[str, float]:
    """Seconds to restore step 10 from each tier (median of 3), onto the same compiled trainer."""
    run = work / "recovery"
    c = cfg(
        run,
        "train.steps=20",
        "checkpoint.every=10",
        "checkpoint.fast_every=10",
        f"checkpoint.fast_path={run / 'fast'}",
        "checkpoint.async=false",
    )
    train(c)
    trainer = build_trainer(c, check_runtime(c)).compile()
    target = abstract_with_shardings(trainer.abstract, trainer.shardings)
    ckpt = Checkpointer(run / "checkpoints", every=1, keep=2, use_async=False)
    fast = FastTier(10, run / "fast", buffered=False)
    step = fast.on_disk()[-1]
    times = {"fast": [], "persistent": []}
    for _ in range(3):
        t = time.perf_counter()
        jax.block_until_ready(fast.restore(fast.read(step), target))
        times["fast"].append(time.perf_counter() - t)
        t = time.perf_counter()
        jax.block_until_ready(ckpt.restore(step, target)[0])
        times["persistent"].append(time.perf_counter() - t)
    ckpt.close()
    return {k: float(np.median(v)) for k, v in times.items()} | {"step": step}


def elastic_vs_restart(work: pathlib.Path) -> dict[str, float]:
    """Seconds lost per elastic change (shrink, grow) vs per process restart (to 4 devices, back to 8)."""
    faults = work / "faults"
    faults.write_text("4 5 6 7 @ 10-20\n")
    done = train(
        cfg(
            work / "elastic",
            "train.steps=30",
            "checkpoint.every=10",
            "train.elastic=true",
            f"train.fault_file={faults}",
            "checkpoint.fast_every=5",
        )
    )
    shrink, grow = (c["elastic_lost_s"] for c in done["elastic"])
    step_s = float(np.median([r["step_time_s"] for r in read_metrics(work / "elastic") if "step_time_s" in r]))

    def restart(run: pathlib.Path, devices: int, layout: list[str], stop: int) -> float:
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        cmd = [
            sys.executable,
            "-m",
            "train",
            "--config",
            str(ROOT / "configs/lm_tiny.yaml"),
            f"run.dir={run}",
            *QUIET,
            *layout,
            "train.steps=30",
            "checkpoint.every=10",
            f"train.stop_after={stop}",
        ]
        t = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
        return time.perf_counter() - t - step_s  # the one step it trains is not lost

    run = work / "restarted"
    train(cfg(run, "train.steps=30", "checkpoint.every=10", "train.stop_after=10"))
    to4 = restart(run, 4, FSDP4, 11)
    shutil.rmtree(run)  # back to 8 from a checkpoint of step 20 written on 4 devices
    train(cfg(run, *FSDP4, "train.steps=30", "checkpoint.every=10", "train.stop_after=20"), devices=jax.devices()[:4])
    to8 = restart(run, 8, FSDP8, 21)
    return {"shrink": shrink, "grow": grow, "restart_to_4": to4, "restart_to_8": to8, "step_s": step_s}


def main() -> None:
    work = pathlib.Path(tempfile.mkdtemp(prefix="meshwork-tiers-"))
    try:
        s = None if ARGS.elastic_only else stalls(work)
        r = None if ARGS.elastic_only else recovery(work)
        e = elastic_vs_restart(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if s is not None:
        report_tiers(s, r)
    cache = f"persistent compilation cache {ARGS.compile_cache}" if ARGS.compile_cache else "no compilation cache"
    print(
        f"time lost per change (s, {cache}): elastic shrink {e['shrink']:.2f} (a new device set: its step "
        f"compiled or read from the cache), grow "
        f"{e['grow']:.2f} (the 8-device step is kept); process restart to 4 devices {e['restart_to_4']:.2f}, "
        f"to 8 {e['restart_to_8']:.2f} ({e['restart_to_4'] / e['shrink']:.1f}x and "
        f"{e['restart_to_8'] / max(e['grow'], 1e-3):.0f}x the elastic change); one step {e['step_s'] * 1e3:.0f} ms"
    )


def report_tiers(s: dict[str, float], r: dict[str, float]) -> None:
    print(
        f"stall per checkpoint (median ms): fast tier buffered {s['fast_buffered']:.1f}, synchronous "
        f"{s['fast_sync']:.1f} ({s['fast_sync'] / s['fast_buffered']:.1f}x); persistent buffered "
        f"{s['persistent_buffered']:.1f}, synchronous {s['persistent_sync']:.1f} "
        f"({s['persistent_sync'] / s['persistent_buffered']:.1f}x)"
    )
    print(
        f"recovery of step {r['step']} (median s): fast tier {r['fast']:.3f}, persistent {r['persistent']:.3f} "
        f"({r['persistent'] / r['fast']:.1f}x)"
    )


if __name__ == "__main__":
    main()
