"""How far the serving engine's log-probabilities are from the trainer's, and what a sync costs, for
GRPO on 8 simulated CPU devices: per placement (colocated fsdp 8 -> data 4 x tensor 2; split fsdp 4
on 0-3 -> data 2 x tensor 2 on 4-7; LoRA, colocated) and per compute dtype (float32, bfloat16).

For each: one rollout batch of the tiny test model on short arithmetic prompts, the trainer's
forward pass over the same rows, the largest |engine - trainer| log p over the sampled tokens and
the first step's mean importance ratio; then the median seconds of 10 syncs.

    python3 benchmarks/grpo_agreement.py
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys
import tempfile

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
ROOT = pathlib.Path(__file__).resolve().parents[1]

import jax  # noqa: E402
import numpy as np  # noqa: E402

from meshwork.config import load_config  # noqa: E402
from meshwork.train.rollouts import placement_devices  # noqa: E402
from meshwork.train.trainer import build_trainer, check_runtime  # noqa: E402

TINY = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128"]
COMMON = [
    "data.seq_len=32",
    "data.val_fraction=0.25",
    "train.global_batch=8",
    "train.grpo.group_size=4",
    "train.grpo.max_new_tokens=6",
    "train.grpo.engine_slots=8",
    "train.grpo.page_size=4",
    "train.grpo.engine_tensor=2",
    "mesh.data=1",
    "rules.preset=fsdp",
    "log.progress=false",
    "log.tensorboard=false",
]
PLACEMENTS = {
    "colocated": ["mesh.fsdp=8", *TINY, "finetune.method=none", "finetune.base=null"],
    "split": ["mesh.fsdp=4", "train.grpo.placement=split", *TINY, "finetune.method=none", "finetune.base=null"],
    "lora": ["mesh.fsdp=8", "finetune.method=lora", "finetune.rank=4"],
}


def measure(placement: str, dtype: str, folder: pathlib.Path, base: str | None) -> dict:
    prompts = folder / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": f"Q: {a} plus {b}? A:", "answer": str(a + b)}) + "\n"
            for a in range(6)
            for b in range(4)
        )
    )
    extra = [f"finetune.base={base}"] if placement == "lora" else []
    cfg = load_config(
        ROOT / "configs/grpo_arith.yaml",
        [
            f"run.dir={folder / placement / dtype}",
            f"data.text_files=[{prompts}]",
            *COMMON,
            *PLACEMENTS[placement],
            *extra,
        ]
        + [f"train.compute_dtype={dtype}"],  # bfloat16: mixed precision, float32 weights
    )
    devices = placement_devices(cfg, jax.devices())
    task = check_runtime(cfg, devices)
    trainer = build_trainer(cfg, task, devices).compile()
    state = trainer.init_state()
    source = task.train_iterator()
    batch = source.next_from(trainer, state)
    mask = batch["loss_mask"] > 0
    ours = source.token_log_probs(trainer, state.params, state.buffers, batch)
    _, metrics = trainer.step_fn(jax.tree.map(lambda x: x.copy(), state), trainer.to_device(batch))
    seconds = []
    for _ in range(10):
        seconds.append(source.sync(state.params).seconds)
    return {
        "max_abs_logp_diff": float(np.abs(ours - batch["old_logp"])[mask].max()),
        "first_ratio": float(metrics["ratio"]),
        "sync_bytes": source.host["sync_bytes"],
        "sync_ms": 1e3 * statistics.median(seconds),
    }


def main() -> None:
    base = sys.argv[1] if len(sys.argv) > 1 else None  # a trained lm_tiny run dir for the LoRA rows
    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}")
    print(
        f"{'placement':<10} {'dtype':<9} {'max |engine - trainer| log p':>29} {'first ratio':>12} {'sync bytes':>11} {'sync ms':>8}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for placement in PLACEMENTS:
            if placement == "lora" and base is None:
                print("lora: pass a trained lm_tiny run dir as the first argument")
                continue
            for dtype in ("float32", "bfloat16"):
                r = measure(placement, dtype, pathlib.Path(tmp), base)
                print(
                    f"{placement:<10} {dtype:<9} {r['max_abs_logp_diff']:>29.3e} {r['first_ratio']:>12.7f} "
                    f"{r['sync_bytes']:>11,} {r['sync_ms']:>8.2f}"
                )


if __name__ == "__main__":
    main()
