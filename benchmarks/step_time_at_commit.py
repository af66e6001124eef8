"""Step time and compiled temp memory at the MaxText-matched shape and at d 512 x 8, on 1 and
2 (fsdp) devices, through the Trainer API alone, so that it runs unchanged at older commits:

    git checkout <commit> && python3 benchmarks/step_time_at_commit.py [key=value ...]

Prints markdown rows: shape, devices, ms/step, tokens/s, temp MiB, load average.
"""

import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax  # noqa: E402

from meshwork.config import load_config  # noqa: E402
from meshwork.data.text import train_iterator  # noqa: E402

try:  # the Trainer API of 2026-12-05 on; older commits below
    from meshwork.train.trainer import build_trainer, check_runtime  # noqa: E402
except ImportError:
    from meshwork.train.loop import Trainer, check_runtime  # noqa: E402

    build_trainer = None

M = [
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
print("jax", jax.__version__, flush=True)
for shape, sov in (("matched", M), ("d512x8", D512)):
    for name, n, ov in (
        ("1 device", 1, ["mesh.data=1"]),
        ("2 devices fsdp", 2, ["mesh.data=1", "mesh.fsdp=2", "rules.preset=fsdp"]),
    ):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config("configs/lm_tiny.yaml", [f"run.dir={tmp}"] + sov + ov + sys.argv[1:])
            devices = jax.devices()[:n]
            files = check_runtime(cfg, devices)
            tr = build_trainer(cfg, files, devices).compile() if build_trainer else Trainer(cfg, files, devices)
            it = train_iterator(str(files.train), cfg.data.seq_len, cfg.train.global_batch, cfg.run.seed)
            state, ts = tr.init_state(), []
            for i in range(9 if shape == "matched" else 5):
                b = tr.to_device(next(it))
                t0 = time.perf_counter()
                state, m = tr.step_fn(state, b)
                jax.block_until_ready(m)
                if i >= 2:
                    ts.append(time.perf_counter() - t0)
            temp = tr.step_fn.memory_analysis().temp_size_in_bytes
            print(
                f"| {shape} | {name} | {statistics.median(ts) * 1e3:.0f} | {cfg.train.global_batch * cfg.data.seq_len / statistics.median(ts):,.0f} | {temp / 2**20:.0f} | {os.getloadavg()[0]:.1f} |",
                flush=True,
            )
