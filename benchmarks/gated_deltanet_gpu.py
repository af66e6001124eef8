"""Is XLA's compilation of the chunked gated delta rule enough, or does it need a Pallas kernel?

Times, on the accelerator, at Qwen3-Next's linear-attention shape (key and value heads of 128, 16 key
heads, chunks of 64) and at long contexts:
  chunked   src/meshwork/kernels/gated_delta_rule.py's chunked form, forward and forward + backward,
            and its two parts apart: the chunk-parallel terms (the triangular solve and the C x C
            products; what a Pallas kernel would fuse) and the scan over chunks
  recurrent the token-by-token scan (forward; the decoding form), the same inputs (its backward
            would keep one (H, K, K) state per token: 17 GB at the first shape, so it is not timed)
  attention causal softmax attention at the same B, L, H, K (jax.nn.dot_product_attention, XLA and
            cuDNN), forward and forward + backward: what a full-attention layer costs instead
and prints for each the time, the FLOP/s reached on its model FLOPs and the bandwidth on its
compulsory bytes (inputs + outputs, read or written once; for the recurrence also the state read and
written every token), with the chunked form's error against the recurrence.

Model FLOPs per token and value head (K = K_key = K_value, l the chunk): chunked 8 l K + 6 K^2
(k k^T and q k^T, the solve of l x l against 2K columns, attn v_new, and w S, q S, k^T v_new);
attention 2 L K (causal half of 4 L K); recurrence 7 K^2. Backward counted as 2x forward.

    python3 benchmarks/gated_deltanet_gpu.py --out results.json       # GPU: ~60 s
    python3 benchmarks/gated_deltanet_gpu.py --smoke                  # CPU: tiny shapes, checks the script

Not under pytest (tests/conftest.py forces the CPU). Inputs bf16 (q, k, v; g and beta float32); the
rule computes in float32 at the backend's default matmul precision (TF32 on NVIDIA GPUs).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from meshwork.kernels.gated_delta_rule import (
    chunked_gated_delta_rule,
    expand_to_value_heads,
    inter_chunk_scan,
    intra_chunk_terms,
    recurrent_gated_delta_rule,
)

# (B, L, G key heads, H value heads, K) at chunk 64: Qwen3-Next-80B's 16/32 heads of 128 at 8K, and
# 16/16 heads at 4K with two sequences.
SHAPES = [(1, 8192, 16, 32, 128), (2, 4096, 16, 16, 128)]
SMOKE_SHAPES = [(1, 256, 2, 4, 32)]


def time_ms(f, *args, budget_s: float = 0.4) -> float:
    """Mean over enough calls to fill `budget_s` (at least 3), after a warm-up call."""
    jax.block_until_ready(f(*args))
    start = time.perf_counter()
    jax.block_until_ready(f(*args))
    once = time.perf_counter() - start
    reps = max(3, min(50, int(budget_s / max(once, 1e-6))))
    start = time.perf_counter()
    for _ in range(reps):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps * 1e3


def inputs(B, L, G, H, K, key):
    ks = jax.random.split(key, 5)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(ks[0], (B, L, G, K))).astype(jnp.bfloat16)
    k = unit(jax.random.normal(ks[1], (B, L, G, K))).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, L, H, K), jnp.bfloat16)
    g = -jnp.exp(jax.random.uniform(ks[3], (B, L, H), minval=-6.0, maxval=0.0))  # decays e^-1 .. e^-0.0025
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, L, H)))
    return q, k, v, g, beta


def record(results, name, shape, ms, flops, bytes_, extra=None):
    row = dict(name=name, shape=shape, ms=round(ms, 4), tflop_s=flops / ms / 1e9, gb_s=bytes_ / ms / 1e6)
    row.update(extra or {})
    results.append(row)
    print(
        f"{name:<34} {str(shape):<26} {ms:9.3f} ms  {row['tflop_s']:8.2f} TFLOP/s  {row['gb_s']:8.1f} GB/s"
        + "".join(f"  {k} {v}" for k, v in (extra or {}).items()),
        flush=True,
    )


def bench_shape(results, B, L, G, H, K, chunk, attention: bool):
    shape = dict(B=B, L=L, G=G, H=H, K=K, chunk=chunk)
    q, k, v, g, beta = inputs(B, L, G, H, K, jax.random.key(0))
    io_bytes = (2 * B * L * G * K + 2 * B * L * H * K) * 2 + 2 * B * L * H * 4 + B * H * K * K * 4
    chunk_flops = B * H * L * (8 * chunk * K + 6 * K * K)

    chunked = jax.jit(lambda *a: chunked_gated_delta_rule(*a, chunk_size=chunk))
    recurrent = jax.jit(recurrent_gated_delta_rule)
    # Error against the recurrence on float32 copies of the inputs (bf16 outputs would hide it), at the
    # default matmul precision (TF32 on NVIDIA GPUs) and at full float32.
    f32 = [t.astype(jnp.float32) for t in (q, k, v, g, beta)]
    o_r, s_r = recurrent(*f32)
    errs = {}
    for precision in ("default", "highest"):
        with jax.default_matmul_precision(precision):
            o_c, s_c = jax.jit(lambda *a: chunked_gated_delta_rule(*a, chunk_size=chunk))(*f32)
        errs[f"err_o_{precision}"] = f"{float(jnp.max(jnp.abs(o_c - o_r)) / jnp.max(jnp.abs(o_r))):.1e}"
        errs[f"err_state_{precision}"] = f"{float(jnp.max(jnp.abs(s_c - s_r)) / jnp.max(jnp.abs(s_r))):.1e}"
    record(results, "chunked fwd", shape, time_ms(chunked, q, k, v, g, beta), chunk_flops, io_bytes, errs)

    def chunked_loss(q, k, v, g, beta):
        o, s = chunked_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    grad = jax.jit(jax.grad(chunked_loss, argnums=(0, 1, 2, 3, 4)))
    record(results, "chunked fwd+bwd", shape, time_ms(grad, q, k, v, g, beta), 3 * chunk_flops, 2 * io_bytes)

    prepared = jax.jit(expand_to_value_heads, static_argnums=5)(q, k, v, g, beta, None)
    terms_fn = jax.jit(lambda *a: intra_chunk_terms(*a, chunk))
    terms = terms_fn(*prepared)
    intra_flops = B * H * L * (6 * chunk * K)
    record(results, "  chunked: intra-chunk terms", shape, time_ms(terms_fn, *prepared), intra_flops, io_bytes)
    scan = jax.jit(inter_chunk_scan)
    state0 = jnp.zeros((B, H, K, K), jnp.float32)
    terms_bytes = sum(t.size * t.dtype.itemsize for t in terms) + B * L * H * K * 4
    record(results, "  chunked: scan over chunks", shape, time_ms(scan, terms, state0),
           B * H * L * (2 * chunk * K + 6 * K * K), terms_bytes)  # fmt: skip

    state_traffic = 2 * B * H * L * K * K * 4  # the state read and written once per token
    record(results, "recurrent fwd", shape, time_ms(recurrent, q, k, v, g, beta, budget_s=0.2),
           7 * B * H * L * K * K, io_bytes + state_traffic)  # fmt: skip

    if not attention:
        return
    qa = jnp.repeat(q, H // G, axis=2) if G != H else q
    ka = jnp.repeat(k, H // G, axis=2) if G != H else k
    attn_flops, attn_bytes = 2 * B * H * L * L * K, 4 * B * L * H * K * 2
    for impl in ("xla", "cudnn"):
        fwd = jax.jit(
            lambda q, k, v, impl=impl: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
        )
        bwd = jax.jit(jax.grad(lambda q, k, v, impl=impl: jnp.sum(
            jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl).astype(jnp.float32)
        ), argnums=(0, 1, 2)))  # fmt: skip
        try:
            record(results, f"attention {impl} fwd", shape, time_ms(fwd, qa, ka, v), attn_flops, attn_bytes)
            record(results, f"attention {impl} fwd+bwd", shape, time_ms(bwd, qa, ka, v), 3 * attn_flops, 2 * attn_bytes)
        except Exception as e:  # cuDNN absent or refusing the shape: say so and go on
            print(f"attention {impl}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU): checks the script runs")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--budget-s", type=float, default=60, help="skip the next shape once half of this is spent")
    args = parser.parse_args(argv)
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}", flush=True)
    results, start = [], time.perf_counter()
    for B, L, G, H, K in SMOKE_SHAPES if args.smoke else SHAPES:
        if time.perf_counter() - start > args.budget_s / 2:
            print(f"skipped {(B, L, G, H, K)}: over half of --budget-s {args.budget_s:g} spent", flush=True)
            continue
        bench_shape(results, B, L, G, H, K, args.chunk, attention=not args.smoke or jax.default_backend() != "cpu")
    print(f"total {time.perf_counter() - start:.1f} s", flush=True)
    if args.out:
        meta = dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(), jax=jax.__version__)
        with open(args.out, "w") as f:
            json.dump(dict(meta, rows=results), f, indent=1)


if __name__ == "__main__":
    main()
