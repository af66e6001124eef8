"""Context parallelism's four algorithms (train.context_parallel) on 8 fake CPU devices: the bytes
each train step sends, read from the compiled step and predicted by the planner, and the step time.

    python benchmarks/context_parallel.py [--seq 512 2048] [--steps 5]

A small LM (d_model 128, 8 query / 2 kv heads, 2 layers, 8 rows) at two sequence lengths: ring,
all_gather and ulysses over sequence=8, usp as a ring over sequence=4 and Ulysses over tensor=2
(act_seq over both), and one device without context parallelism. Bytes are what one device sends
per step under ring algorithms (sharding/hlo.py), the context-parallel kinds only (all-gather,
reduce-scatter, all-to-all, collective-permute: the gradients' all-reduce is the same for all);
the planner's figure is `planner_comm.step_collectives` for the same config. Step time is the
median of `--steps` steps after two warm-up steps. On one CPU the "devices" share the same cores,
so the times say what the algorithms cost in compute and copies here, not on a network.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from meshwork.config import load_config  # noqa: E402
from meshwork.perf.planner_comm import step_collectives, summarize  # noqa: E402
from meshwork.perf.planner_layout import layout_from_config  # noqa: E402
from meshwork.sharding.hlo import collective_summary  # noqa: E402
from meshwork.train.trainer import build_trainer, check_runtime  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = [
    "model.d_model=128",
    "model.n_heads=8",
    "model.n_kv_heads=2",
    "model.n_layers=2",
    "model.d_ff=256",
    "model.tie_embeddings=false",
    "train.global_batch=8",
    "train.loss_chunk=null",
    "log.progress=false",
    "log.tensorboard=false",
]
SEQ8 = ["mesh.data=1", "mesh.sequence=8", "rules.preset=cp"]
USP = [
    "mesh.data=1",
    "mesh.sequence=4",
    "mesh.tensor=2",
    "rules.preset=cp",
    "rules.overrides.act_seq=[sequence, tensor]",
    "rules.overrides.act_norm_seq=[sequence, tensor]",
]
ROWS = [
    ("none (1 device)", ["mesh.data=1"], 1),
    ("ring", [*SEQ8, "train.context_parallel=ring"], 8),
    ("all_gather", [*SEQ8, "train.context_parallel=all_gather"], 8),
    ("ulysses", [*SEQ8, "train.context_parallel=ulysses"], 8),
    ("usp (ring 4 x ulysses 2)", [*USP, "train.context_parallel=usp"], 8),
]
KINDS = ("all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def measure(seq_len: int, overrides: list[str], n_devices: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            ROOT / "configs/lm_tiny.yaml", [f"run.dir={tmp}", *MODEL, f"data.seq_len={seq_len}", *overrides]
        )
        devices = jax.devices()[:n_devices]
        trainer = build_trainer(cfg, check_runtime(cfg, devices), devices).compile()
        measured = collective_summary(trainer.step_fn.as_text())
        planned = summarize(step_collectives(cfg, layout_from_config(cfg, n_devices)))
        rng = np.random.default_rng(0)
        rows = (cfg.train.global_batch, seq_len)
        batch = trainer.to_device(
            {k: rng.integers(0, cfg.model.vocab_size, rows).astype(np.int32) for k in ("inputs", "targets")}
        )
        state = trainer.init_state()
        times = []
        for i in range(steps + 2):
            t = time.perf_counter()
            state, metrics = trainer.step_fn(state, batch)
            jax.block_until_ready(metrics)
            if i >= 2:
                times.append(time.perf_counter() - t)
    return {
        "kinds": {k: measured[k]["bytes"] for k in KINDS},
        "hlo": sum(measured[k]["bytes"] for k in KINDS),
        "planner": sum(planned[k]["bytes"] for k in KINDS),
        "step_ms": 1e3 * statistics.median(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    print(
        "| seq_len | algorithm | cp bytes/step/device (HLO) | planner | all-gather | reduce-scatter "
        "| all-to-all | collective-permute | step ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    kib = lambda b: f"{b / 2**10:,.1f} KiB" if b else "-"  # noqa: E731
    for seq_len in args.seq:
        for name, overrides, n in ROWS:
            r = measure(seq_len, overrides, n, args.steps)
            cells = " | ".join(kib(r["kinds"][k]) for k in KINDS)
            print(
                f"| {seq_len} | {name} | {kib(r['hlo'])} | {kib(r['planner'])} | {cells} | {r['step_ms']:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
