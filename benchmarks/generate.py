"""LM generation throughput: prefill and decode tokens/s per batch size, against the decode roofline.

    python benchmarks/generate.py [--batches 1 8 32] [--prompt-len 128] [--decode-steps 64] [key=value ...]
    python benchmarks/generate.py model.d_model=512 model.n_layers=8 model.d_ff=1536 model.n_heads=8 \\
        model.n_kv_heads=4 --quantize int8,int4          # a shape where the weights dominate
    python benchmarks/generate.py --checkpoint runs/lm_tiny
    python benchmarks/generate.py train.compute_dtype=bfloat16 train.param_dtype=bfloat16   # on a GPU

Random weights unless --checkpoint: throughput does not depend on them. Every
figure comes from one process, so the ratios compare like with like.

What is timed, per batch size B (`src/meshwork/engine/generate.py`: `Generator.prefill`
and `Generator.decode_step`, what `Generator.stream` calls): one prefill of B prompts of --prompt-len tokens
into a fresh cache of length prompt + steps, then --decode-steps one-token
decode steps (sampling included), each feeding the token the previous step
sampled. The first round compiles and is dropped; figures are the median of
--repeats rounds. The tokens stay on the device between steps: `stream` also
copies each step's B tokens to the host, one sync per step not counted here.

KV cache bytes per token: the formula 2 (k, v) x layers x kv_heads x head_dim
x bytes (`kv_cache.cache_bytes_per_token`) next to the allocated cache's
nbytes / (B x cache length); the two must agree.

Decode roofline. A decode step must read every weight once (shared by the
batch; the untied input embedding is the exception, only B rows of it are
gathered) plus the keys and values the batch attends to: B x current length x
bytes per token, the current length averaged over the timed steps. Ceiling =
B x bandwidth / bytes per step tokens/s. The bandwidth is measured in the same
run: best of a few jitted sums over an array of --bandwidth-mib (far larger
than the CPU's last-level cache or a GPU's L2), i.e. the read bandwidth a
memory-bound decode step can hope for. Not counted: activations, logits, the
sampler's sort over the vocabulary, and that XLA's attention reads the whole
preallocated cache row (masked) rather than the current length. For an MoE
model the ceiling counts all experts, an under-estimate at small batch.

--quantize int8,int4 repeats decode at --quantize-batch with the projection
weights quantized (`models/quantize.py`) and prints their weight bytes and
tokens/s against float.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshwork.config import ConfigError, load_config
from meshwork.engine.generate import Generator
from meshwork.engine.kv_cache import cache_bytes_per_token
from meshwork.engine.sampling import SamplingArrays, SamplingParams
from meshwork.models.quantize import MODES, quantize_model, weight_bytes

ROOT = pathlib.Path(__file__).resolve().parents[1]
MB = 1e6
QUANT_MODES = [m for m in MODES if m != "none"]


def measure_bandwidth(nbytes: int, repeats: int = 10) -> float:
    """Read bandwidth (bytes/s) of the default device: best of `repeats` jitted sums over `nbytes` of float32.

    >>> measure_bandwidth(64 * 2**20) > 1e9   # a 64 MiB sum runs faster than 1 GB/s anywhere
    True
    """
    n = nbytes // 4
    x = jax.jit(lambda: jnp.ones((n,), jnp.float32))()
    total = jax.jit(jnp.sum)
    jax.block_until_ready(total(x))  # compile
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(total(x))
        best = min(best, time.perf_counter() - t0)
    del x
    return 4 * n / best


def all_core_read_bandwidth(nbytes: int, repeats: int = 10) -> float:
    """Read bandwidth (bytes/s) of the host with every core reading: one numpy sum per core over its
    share of `nbytes` of float32, in threads (numpy's loops release the GIL), best of `repeats`.
    A one-thread read (or copy) understates what a kernel that splits its reads over the cores gets.

    >>> all_core_read_bandwidth(64 * 2**20) > 1e9
    True
    """
    shares = np.array_split(np.ones(nbytes // 4, np.float32), os.cpu_count() or 1)
    best = float("inf")
    with concurrent.futures.ThreadPoolExecutor(len(shares)) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(np.sum, shares))
            best = min(best, time.perf_counter() - t0)
    return sum(s.nbytes for s in shares) / best


def load_model(args: argparse.Namespace):
    """(model, where it came from) from --checkpoint or --config + overrides."""
    if args.checkpoint:
        if args.overrides:
            raise ConfigError(
                f"overrides {args.overrides} apply to --config only; with --checkpoint the run's "
                "own config.yaml is used"
            )
        from meshwork.inference.runs import load_run

        cfg, model, step = load_run(args.checkpoint)
        source = f"{args.checkpoint} (step {step})"
    else:
        from meshwork.models.build import build_model

        cfg = load_config(args.config, args.overrides)
        model = build_model(cfg)
        source = f"{args.config}" + (f" + {' '.join(args.overrides)}" if args.overrides else "") + ", random weights"
    if cfg.model.kind not in ("transformer", "moe"):
        raise ConfigError(f"model.kind={cfg.model.kind}: this benchmark needs a language model (transformer or moe)")
    return model, source


def weights_read_per_step(model: nnx.Module, total_bytes: int, batch: int) -> int:
    """Weight bytes a decode step reads: all of them, except the rows of an untied input
    embedding that the batch does not look up."""
    if model.cfg.tie_embeddings or not hasattr(model, "embed"):
        return total_bytes
    table = model.embed.table.get_value()
    row_bytes = table.nbytes // table.shape[0]
    return total_bytes - table.nbytes + min(batch, table.shape[0]) * row_bytes


def time_generation(gen: Generator, batch: int, prompt_len: int, steps: int, repeats: int) -> dict:
    """Median seconds of one prefill and of `steps` decode steps at `batch`, after one compiling round."""
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, gen.vocab_size, (batch, prompt_len)), jnp.int32)
    lengths = jnp.full((batch,), prompt_len, jnp.int32)
    arrays = SamplingArrays.stack([SamplingParams(temperature=0.0)] * batch)
    # Step i feeds the token sampled before it at position prompt_len + i (as stream does).
    positions = [jnp.full((batch,), prompt_len + i, jnp.int32) for i in range(steps)]
    max_len = prompt_len + steps
    prefill_s, decode_s, cache_nbytes = [], [], None
    for r in range(repeats + 1):
        cache = gen.new_cache(batch, max_len)
        jax.block_until_ready(cache)
        cache_nbytes = cache.nbytes
        t0 = time.perf_counter()
        token, _, cache, seen = gen.prefill(tokens, lengths, cache, arrays)
        jax.block_until_ready((token, cache))
        t1 = time.perf_counter()
        for pos in positions:  # dispatched without waiting: the device runs the steps back to back
            token, _, cache, seen = gen.decode_step(token, pos, cache, arrays, seen)
        jax.block_until_ready((token, cache, seen))
        t2 = time.perf_counter()
        if r:  # round 0 compiles
            prefill_s.append(t1 - t0)
            decode_s.append(t2 - t1)
    del cache
    return {
        "batch": batch,
        "max_len": max_len,
        "cache_nbytes": cache_nbytes,
        "prefill_s": statistics.median(prefill_s),
        "decode_s": statistics.median(decode_s),
        "prefill_tok_s": batch * prompt_len / statistics.median(prefill_s),
        "decode_tok_s": batch * steps / statistics.median(decode_s),
    }


def roofline(weights_read: int, kv_bytes_per_token: int, batch: int, mean_len: float, bandwidth: float) -> dict:
    """Bytes a decode step must read and the tokens/s that reading them at `bandwidth` allows."""
    kv_read = batch * mean_len * kv_bytes_per_token
    per_step = weights_read + kv_read
    return {
        "weights_read": weights_read,
        "kv_read": kv_read,
        "bytes_per_step": per_step,
        "ceiling_tok_s": batch * bandwidth / per_step,
    }


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs/lm_tiny.yaml"))
    p.add_argument("--checkpoint", default=None, help="a training run's run.dir (its latest checkpoint)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per batch size (median)")
    p.add_argument("--quantize", default="", help="comma-separated modes to compare: int8,int4,w8a8")
    p.add_argument("--quantize-batch", type=int, default=1, help="the batch size of the quantized runs")
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="array size of the bandwidth measurement")
    p.add_argument("--json", action="store_true", help="also print every figure as one JSON object")
    p.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = p.parse_args(argv)
    modes = [m for m in args.quantize.split(",") if m.strip()]
    if min(args.prompt_len, args.decode_steps, args.quantize_batch, args.repeats, *args.batches) < 1:
        raise ConfigError("--prompt-len, --decode-steps, --batches, --quantize-batch and --repeats must be positive")

    bad = [m for m in modes if m not in QUANT_MODES]
    if bad:
        raise ConfigError(f"--quantize {','.join(bad)}: choose from {','.join(QUANT_MODES)}")

    model, source = load_model(args)

    cfg = model.cfg
    device = jax.devices()[0]
    gen = Generator(model)
    kv_formula = cache_bytes_per_token(cfg, gen.cache_dtype)
    wbytes = weight_bytes(model)["total"]
    bandwidth = measure_bandwidth(args.bandwidth_mib * 2**20)
    mean_len = args.prompt_len + (args.decode_steps + 1) / 2  # keys attended, averaged over the steps
    # Other processes on a CPU host skew its figures: say how busy it was.
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    print(
        f"machine: {device.device_kind}, backend {jax.default_backend()}, jax {jax.__version__}, "
        f"{os.cpu_count()} cores{load}; measured read bandwidth {bandwidth / 1e9:.1f} GB/s "
        f"(jitted sum over {args.bandwidth_mib} MiB)"
    )
    print(
        f"model: {source}; {cfg.kind}, d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads / "
        f"{cfg.n_kv_heads} kv heads x {cfg.resolved_head_dim}, d_ff {cfg.d_ff}, vocab {cfg.vocab_size}, "
        f"attention {cfg.attention}; weights {wbytes / MB:.2f} MB ({jnp.dtype(model.dtype).name} compute), "
        f"KV cache {jnp.dtype(gen.cache_dtype).name}"
    )
    print(
        f"prompt {args.prompt_len} tokens, {args.decode_steps} decode steps (cache length "
        f"{args.prompt_len + args.decode_steps}, mean attended length {mean_len:g}), median of {args.repeats}"
    )
    print(
        f"\n{'batch':>5} | {'prefill tok/s':>13} | {'decode tok/s':>12} {'ms/step':>8} | KV B/token formula "
        f"measured | {'weights MB':>10} {'KV MB':>7} /step | {'ceiling tok/s':>13} {'measured/ceil':>13}",
        flush=True,
    )

    rows = []
    for B in args.batches:
        t = time_generation(gen, B, args.prompt_len, args.decode_steps, args.repeats)
        kv_measured = t["cache_nbytes"] / (B * t["max_len"])
        roof = roofline(weights_read_per_step(model, wbytes, B), kv_formula, B, mean_len, bandwidth)
        row = {
            **t,
            **roof,
            "kv_bytes_per_token_formula": kv_formula,
            "kv_bytes_per_token_measured": kv_measured,
            "ratio": t["decode_tok_s"] / roof["ceiling_tok_s"],
        }
        rows.append(row)
        agree = "" if kv_measured == kv_formula else "  MISMATCH"
        print(
            f"{B:>5} | {t['prefill_tok_s']:>13,.0f} | {t['decode_tok_s']:>12,.0f} "
            f"{t['decode_s'] / args.decode_steps * 1e3:>8.2f} | {kv_formula:>18,} {kv_measured:>8,.0f}{agree} | "
            f"{roof['weights_read'] / MB:>10.2f} {roof['kv_read'] / MB:>7.2f}      | "
            f"{roof['ceiling_tok_s']:>13,.0f} {row['ratio']:>13.1%}",
            flush=True,
        )

    quantized = []
    if modes:
        B = args.quantize_batch
        base = next((r for r in rows if r["batch"] == B), None) or time_generation(
            gen, B, args.prompt_len, args.decode_steps, args.repeats
        )
        print(f"\nquantized weights, decode at batch {B} (float row: the table above, or measured now):")
        print(
            f"{'weights':>8} | {'weights MB':>10} {'vs float':>8} | {'decode tok/s':>12} {'vs float':>8} | "
            f"{'ceiling tok/s':>13} {'measured/ceil':>13}"
        )
        ceiling = roofline(weights_read_per_step(model, wbytes, B), kv_formula, B, mean_len, bandwidth)["ceiling_tok_s"]
        print(
            f"{'float':>8} | {wbytes / MB:>10.2f} {1:>8.2f} | {base['decode_tok_s']:>12,.0f} {1:>8.2f} | "
            f"{ceiling:>13,.0f} {base['decode_tok_s'] / ceiling:>13.1%}",
            flush=True,
        )
        del gen
        for mode in modes:
            qmodel = nnx.clone(model)  # quantize_model works in place: the float model stays as it is
            quantize_model(qmodel, mode)
            qbytes = weight_bytes(qmodel)["total"]
            t = time_generation(Generator(qmodel), B, args.prompt_len, args.decode_steps, args.repeats)
            roof = roofline(weights_read_per_step(qmodel, qbytes, B), kv_formula, B, mean_len, bandwidth)
            q = {
                "mode": mode,
                "batch": B,
                "weight_bytes": qbytes,
                "decode_tok_s": t["decode_tok_s"],
                "vs_float": t["decode_tok_s"] / base["decode_tok_s"],
                **roof,
                "ratio": t["decode_tok_s"] / roof["ceiling_tok_s"],
            }
            quantized.append(q)
            print(
                f"{mode:>8} | {qbytes / MB:>10.2f} {qbytes / wbytes:>8.2f} | {t['decode_tok_s']:>12,.0f} "
                f"{q['vs_float']:>8.2f} | {roof['ceiling_tok_s']:>13,.0f} {q['ratio']:>13.1%}",
                flush=True,
            )
            del qmodel

    print(
        "\nnotes: ceiling = batch x bandwidth / (weights + attended KV bytes) per step, memory traffic only; "
        "decode tokens stay on the device between steps (no per-token host sync).\n"
        "  A step also has a fixed cost (Python dispatch, the layer scan, the sampler's sort over the vocabulary) "
        "that no byte count sees: a small model runs far below its ceiling, whatever the device."
    )
    if device.platform == "cpu":
        print(
            "  CPU: XLA's CPU backend copies each layer's weights out of the stacked (layers, ...) arrays into a "
            "temporary before their matmul (seen in the compiled decode step with jax 0.10.2), traffic the "
            "ceiling does not count; weights that fit in the last-level cache are read faster than the measured "
            "bandwidth; other processes on the host skew both the bandwidth and the timings (see the load)."
        )
    if cfg.kind == "moe":
        print(
            "  MoE: the ceiling counts every expert as read each step; at small batch a step reads only the "
            "experts its tokens are routed to, so the true ceiling is higher."
        )
    if any(not r["kv_bytes_per_token_measured"] == kv_formula for r in rows):
        print("  WARNING: the allocated cache's bytes per token differ from the formula.")

    if args.json:
        print(
            json.dumps(
                {
                    "device": device.device_kind,
                    "backend": jax.default_backend(),
                    "jax": jax.__version__,
                    "model": source,
                    "weight_bytes": wbytes,
                    "bandwidth_bytes_s": bandwidth,
                    "prompt_len": args.prompt_len,
                    "decode_steps": args.decode_steps,
                    "mean_attended_len": mean_len,
                    "rows": rows,
                    "quantized": quantized,
                }
            )
        )


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ConfigError as e:
        sys.exit(f"error: {e}")
