"""The planner's predictions against what XLA compiled, as tests/test_planner.py compares them.

    python benchmarks/planner_accuracy.py        # ~1 min on 2 cores

The test's model: lm_tiny at the suite's tiny shape with 8 scanned layers, 64 tokens
x 64 sequences, on 8 fake CPU devices, under dp, zero1, zero2, fsdp and tp. For each:
per-device state bytes (`state_memory` vs the dry-run report's shard shapes),
bytes each device sends per collective kind (`step_collectives` vs the compiled HLO),
and, for dp, the step's FLOPs (`compiled_step_flops` vs `cost_analysis`, which
counts the scanned layer once). Prints the relative errors (predicted / measured - 1).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from meshwork.config import dump_config, load_config  # noqa: E402
from meshwork.perf.planner import compiled_step_flops, layout_from_config  # noqa: E402
from meshwork.perf.planner_comm import step_collectives, summarize  # noqa: E402
from meshwork.perf.planner_memory import state_memory  # noqa: E402
from meshwork.train import cli  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
# tests/conftest.py's tiny_overrides, then tests/test_planner.py's tiny_cfg and LAYOUTS.
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
    "model.n_layers=8",
    "data.seq_len=64",
    "train.global_batch=64",
]
LAYOUTS = {
    "dp": ["rules.preset=dp", "mesh.data=8"],
    "zero1": ["rules.preset=zero1", "mesh.data=8"],
    "zero2": ["rules.preset=zero2", "mesh.data=8"],
    "fsdp": ["rules.preset=fsdp", "mesh.data=1", "mesh.fsdp=8"],
    "tp": ["rules.preset=tp", "mesh.data=4", "mesh.tensor=2"],
}


def _rel(p: float, m: float) -> str:
    return f"{p / m - 1:+.2%}" if m else ("exact (0 = 0)" if not p else "predicted, not compiled")


def main() -> None:
    print("| layout | quantity | predicted | measured | predicted / measured - 1 |\n|---|---|---|---|---|")
    for name, overrides in LAYOUTS.items():
        with tempfile.TemporaryDirectory() as tmp:
            tmp = pathlib.Path(tmp)
            cfg = load_config(ROOT / "configs/lm_tiny.yaml", [f"run.dir={tmp}", *TINY, *overrides])
            (tmp / "config.yaml").write_text(dump_config(cfg))
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert cli.main(["--config", str(tmp / "config.yaml"), "--dry-run", "--json"]) == 0
            report = json.loads(out.getvalue().strip().splitlines()[-1])
        layout = layout_from_config(cfg, 8)
        got = state_memory(cfg, layout)
        for kind in ("params", "grads", "opt_state"):
            print(
                f"| {name} | state {kind} B | {got[kind]:,.0f} | {report['state'][kind]:,.0f} | "
                f"{_rel(got[kind], report['state'][kind])} |"
            )
        predicted, measured = summarize(step_collectives(cfg, layout)), report["collectives"]
        for kind in sorted(set(predicted) | set(measured)):
            p, m = predicted.get(kind, {}).get("bytes", 0), measured.get(kind, {}).get("bytes", 0)
            if p or m:
                print(f"| {name} | {kind} B sent | {p:,.0f} | {m:,.0f} | {_rel(p, m)} |")
        tp, tm = (sum(v["bytes"] for v in s.values()) for s in (predicted, measured))
        print(f"| {name} | all collectives B sent | {tp:,.0f} | {tm:,.0f} | {_rel(tp, tm)} |")
        if name == "dp":
            f = compiled_step_flops(cfg, layout)
            print(
                f"| dp | FLOPs (scan body once) | {f:,.0f} | {report['flops']:,.0f} | {_rel(f, report['flops'])} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
