"""Host offload's figures on the test model of tests/test_offload.py (lm_tiny at the
suite's tiny shape, one CPU device): the bytes the compiled step keeps in host
memory, and the copies the step makes when lowered for a GPU (no GPU needed).

    python benchmarks/offload_figures.py      # ~1 min on 2 cores

Host bytes are the `S(5)` (pinned host) buffers of the compiled step's entry layout,
arguments and outputs. Copies are the `annotate_device_placement` ops of the step
lowered for CUDA: to "pinned_host" (written out) and to "device" (brought in).
On CPU, jax 0.10 lowers an in-step transfer to nothing, hence the CUDA lowering.
"""

from __future__ import annotations

import os
import pathlib
import re
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from meshwork.config import load_config  # noqa: E402
from meshwork.partitioning import abstract_with_shardings  # noqa: E402
from meshwork.sharding.hlo_parse import host_memory_bytes  # noqa: E402
from meshwork.train.trainer import Trainer, build_trainer, check_runtime  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
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
    "optimizer.warmup_steps=0",
    "mesh.data=1",
]  # as tests/test_offload.py
OPTIONS = {
    "none": [],
    "optimizer": ["train.offload.optimizer=true"],
    "params + offload_dots": ["train.offload.params=true", "train.remat=offload_dots"],
}


def host_bytes(compiled) -> tuple[int, int]:
    """(argument, output) bytes per device in host memory of the compiled step's entry layout."""
    return host_memory_bytes(compiled.as_text())


def gpu_placements(trainer: Trainer) -> dict[str, int]:
    step = jax.jit(
        trainer.make_step(trainer.grad_shardings),
        in_shardings=(trainer.shardings, trainer.batch_sharding),
        out_shardings=(trainer.shardings, None),
        donate_argnums=0,
    )
    batch = trainer.batch_abstract()
    with trainer.context():
        text = (
            step.trace(abstract_with_shardings(trainer.abstract, trainer.shardings), batch)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
    found = re.findall(r'annotate_device_placement.*?_xla_buffer_placement = "(\w+)"', text)
    return {kind: found.count(kind) for kind in ("pinned_host", "device")}


def main() -> None:
    devices = jax.devices()[:1]
    print(f"jax {jax.__version__}, 1 CPU device; GPU copies from the step lowered for cuda")
    print(
        "| option | host bytes (args / outputs) | Adam moment arrays | layer weight arrays "
        "| copies to host | copies to device |\n|---|---|---|---|---|---|"
    )
    for name, extra in OPTIONS.items():
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(ROOT / "configs/lm_tiny.yaml", [f"run.dir={tmp}", *TINY, *extra])
            trainer = build_trainer(cfg, check_runtime(cfg, devices), devices).compile()
            args, outs = host_bytes(trainer.step_fn)
            copies = gpu_placements(trainer)
        n_moments = len(jax.tree.leaves(trainer.abstract.opt_state))
        n_layer = len(jax.tree.leaves(trainer.abstract.params["blocks"]))
        print(
            f"| {name} | {args:,} / {outs:,} | {n_moments} | {n_layer} | {copies['pinned_host']} | "
            f"{copies['device']} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
