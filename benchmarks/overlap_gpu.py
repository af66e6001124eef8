"""Compute-communication overlap on GPUs: one sharded train step compiled with
overlap off and on; the async collectives of each compiled schedule, the compute
each hides behind, and the step time.

    python benchmarks/overlap_gpu.py [--layout dp|fsdp] [--layers 8] [--d 1024] [--tokens 4096] [--steps 20]

The step: a scanned stack of residual MLP blocks (lm_tiny's MLP shape, wider by
default) under plain SGD, batch split over all GPUs; `dp` replicates the
weights (gradient all-reduces), `fsdp` splits them too (per-layer all-gathers
and gradient reduce-scatters). "off" compiles with every collective synchronous
and no latency-hiding scheduler; "on" with `sharding.overlap.compiler_options`
(overlap=True). Needs two or more GPUs: on one there is nothing to
communicate, so it says so and exits 0. Not run by the tests.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from meshwork.sharding.hlo import collective_summary
from meshwork.sharding.overlap import async_collective_schedule, compiler_options, gradients_issued_before_backward_end

OFF = {"xla_gpu_disable_async_collectives": "ALLCOLLECTIVES", "xla_gpu_enable_latency_hiding_scheduler": False}


def build(layout: str, L: int, D: int, tokens_per_device: int):
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
    F = 4 * D
    w_spec = (P(None, "data", None), P(None, None, "data")) if layout == "fsdp" else (P(), P())
    w_sh = tuple(NamedSharding(mesh, s) for s in w_spec)
    x_sh = NamedSharding(mesh, P("data"))
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = (
        jax.device_put(jax.random.normal(k1, (L, D, F)) * D**-0.5, w_sh[0]),
        jax.device_put(jax.random.normal(k2, (L, F, D)) * F**-0.5, w_sh[1]),
    )
    x_TD = jax.device_put(jax.random.normal(k3, (n * tokens_per_device, D)), x_sh)

    def loss(params, x_TD):
        def block(h_TD, w):
            w_in_DF, w_out_FD = w
            return h_TD + jax.nn.silu(h_TD @ w_in_DF) @ w_out_FD, None

        h_TD, _ = jax.lax.scan(block, x_TD, params)
        return jnp.mean((h_TD - x_TD) ** 2)

    def step(params, x_TD):
        value, grads = jax.value_and_grad(loss)(params, x_TD)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), value

    jitted = jax.jit(step, in_shardings=(w_sh, x_sh), out_shardings=(w_sh, NamedSharding(mesh, P())), donate_argnums=0)
    return jitted.lower(params, x_TD), params, x_TD


def measure(compiled, params, x_TD, steps: int) -> float:
    params = jax.tree.map(jnp.copy, params)  # the step donates its parameters
    for _ in range(3):
        params, value = compiled(params, x_TD)
    value.block_until_ready()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        params, value = compiled(params, x_TD)
        value.block_until_ready()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", choices=("dp", "fsdp"), default="dp")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per device")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2:
        print(
            f"overlap needs collectives, so two or more GPUs; found {len(gpus)} "
            f"({jax.devices()[0].platform}: {len(jax.devices())} device(s)). Nothing to measure."
        )
        return 0
    lowered, params, x_TD = build(args.layout, args.layers, args.d, args.tokens)
    on = compiler_options(SimpleNamespace(overlap=True, combine_threshold_bytes=None, xla_options={}), "gpu")
    times = {}
    for arm, opts in (("off", OFF), ("on", on)):
        compiled = lowered.compile(compiler_options=opts)
        text = compiled.as_text()
        schedule = async_collective_schedule(text)
        pairs = [c for c in schedule if c.is_async]
        counts = {k: v["count"] for k, v in collective_summary(text).items() if v["count"]}
        print(f"[{arm}] {opts}")
        print(f"  collectives per step: {counts}")
        print(
            f"  async pairs: {len(pairs)} of {len(schedule)} collectives in the schedule; compute ops between "
            f"start and done: {[c.overlapped_compute for c in pairs]}"
        )
        print(
            f"  gradient collectives issued before the backward pass ends: {gradients_issued_before_backward_end(text)}"
        )
        times[arm] = measure(compiled, params, x_TD, args.steps)
        print(f"  step time (median of {args.steps}): {times[arm] * 1e3:.2f} ms")
    print(
        f"{args.layout} on {len(gpus)} x {gpus[0].device_kind}: overlap on / off step time = "
        f"{times['on'] / times['off']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
