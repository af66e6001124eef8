"""Peak FLOP/s per device: a small table for accelerators, a measurement for CPUs.

Figures are dense (no sparsity) matmul peaks from the vendors' data sheets, per
chip as JAX sees it (one device).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

# device_kind substring -> {dtype: peak FLOP/s}. fp32 on NVIDIA is the TF32
# tensor-core figure, which XLA uses for fp32 matmuls by default.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bfloat16": 989e12, "float32": 494e12},
    "H100": {"bfloat16": 989e12, "float32": 494e12},
    "A100": {"bfloat16": 312e12, "float32": 156e12},
    "TPU v4": {"bfloat16": 275e12, "float32": 275e12 / 2},
    "TPU v5 lite": {"bfloat16": 197e12, "float32": 197e12 / 2},
    "TPU v5e": {"bfloat16": 197e12, "float32": 197e12 / 2},
    "TPU v5p": {"bfloat16": 459e12, "float32": 459e12 / 2},
}


def measure_cpu_peak(dtype: str = "float32", n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of one n x n matmul on the first CPU device, best of `repeats`.

    XLA's CPU devices share one thread pool, so with several (fake) devices in
    a process the per-device peak is this figure divided by their number.
    """
    cpu = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((n, n), dtype), cpu)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops_per_device(dtype: str = "float32") -> tuple[float, str]:
    """(peak FLOP/s of one local device, where the figure came from)."""
    dev = jax.local_devices()[0]
    if dev.platform == "cpu":
        return measure_cpu_peak(dtype) / jax.local_device_count(), "cpu (measured matmul / local devices)"
    for name, peaks in PEAK_FLOPS.items():
        if name.lower() in dev.device_kind.lower():
            return peaks[dtype], f"{name} table"
    raise KeyError(f"no peak FLOP/s for device kind {dev.device_kind!r}; add it to meshwork/hardware.py")
