"""Error feedback's promise, measured: over T steps, the compressed gradients that were applied sum
to the true gradients' sum minus one step's error, instead of drifting further away step after step.

One experiment with two readers: tests/test_comm.py asserts the ratio, benchmarks/comm_figures.py
prints it for benchmarks/RESULTS.md. Each replica's gradient is a persistent rank-3 trend (64 x 48)
plus its own noise, reduced by `make_comm_gradients` with and without error feedback.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshwork.config import Config
from meshwork.train.comm import init_comm_state, make_comm_gradients

SHAPE = (64, 48)


def sum_drift(cfg: Config, mesh: Mesh, steps: int = 20, seed: int = 0) -> dict[bool, float]:
    """{error_feedback: |sum of applied - sum of true| / |sum of true|} after `steps` steps of
    cfg.comm's compression on the mesh axis "data" (one seeded stream: error feedback on, then off)."""
    replicas = mesh.shape["data"]
    rng = np.random.default_rng(seed)
    trend = sum(np.outer(rng.normal(size=SHAPE[0]), rng.normal(size=SHAPE[1])) * w for w in (1.0, 0.7, 0.5)).astype(
        np.float32
    )
    by_row = NamedSharding(mesh, PartitionSpec("data"))
    drift = {}
    for ef in (True, False):
        run_cfg = cfg.model_copy(update={"comm": cfg.comm.model_copy(update={"error_feedback": ef})})
        params = {"w": np.zeros(SHAPE, np.float32)}
        # The "loss function" hands each replica its own row of the batch as its gradient.
        fn = jax.jit(make_comm_gradients(lambda p, b, batch, k: ({"loss": 0.0}, {"w": batch["g"][0]}), run_cfg, mesh))
        comm = init_comm_state(run_cfg, params, replicas, None)
        sent, true = 0.0, 0.0
        for _ in range(steps):
            g = trend + rng.normal(size=(replicas, *SHAPE)).astype(np.float32) * 0.3
            _, mean, comm = fn(params, {}, {"g": jax.device_put(g[:, None], by_row)}, jax.random.key(0), comm)
            sent, true = sent + np.asarray(mean["w"]), true + g.mean(axis=0)
        drift[ef] = float(np.linalg.norm(sent - true) / np.linalg.norm(true))
    return drift
