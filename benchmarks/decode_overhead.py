"""Where a serving decode step's time goes, and what the fused decode loop and the sort-free sampler save.

    python benchmarks/decode_overhead.py                     # lm_tiny and a ~50M model, batch 1 and 16
    python benchmarks/decode_overhead.py --batches 1 16 64 --steps 64 --models 50m

Random weights (the cost of a step does not depend on them); every figure comes
from one process, so the ratios compare like with like. Per model and batch B,
`Server` (src/meshwork/engine/serving.py) serves B greedy requests of --prompt-len
random tokens for --steps new tokens each, all admitted at once; the decode
time per step is (time of that run - time of the same run with 1 new token,
i.e. the prefill alone) / (steps - 1), the best of --repeats runs after one
that compiles (the machine is shared: the best run is the least disturbed;
the modes take turns, so a disturbance hits them alike).
The modes:

- before: the server as it was (src/meshwork/engine/serving.py at --before-commit, read
  with git): one decode step per dispatch with the host reading the tokens after
  every step, and the full-vocabulary stable sort sampler
  (`sampling.sample_reference`, what `sample` was).
- 1/dispatch: the sort-free sampler (greedy rows: one argmax under a
  `lax.cond`), still one step per dispatch.
- N/dispatch: the sort-free sampler and N decode steps per dispatch (a device
  `while_loop` that stops when every row is done).
- floor: N/dispatch with the sampler replaced by a bare argmax (no penalty,
  no `lax.cond`): the decode forward (attention and matmuls, and the paged
  cache's gather, kv_cache.py's business), the loop and the host's share per
  dispatch. after/floor is what the sampler still costs greedy rows.

Then the sampler alone on (B, V) logits, greedy and top-p rows, sort vs
top_k/threshold: the part of a step the sampler costs.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from meshwork.config import load_config
from meshwork.engine import generate, sampling, serving
from meshwork.engine.sampling import SamplingArrays, SamplingParams
from meshwork.engine.serving import Request, Server
from meshwork.models.build import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {
    "lm_tiny": [],
    # ~50M parameters: 8 layers of d=512 and a 32k vocabulary (untied embeddings).
    "50m": [
        "model.vocab_size=32000",
        "model.d_model=512",
        "model.n_layers=8",
        "model.n_heads=8",
        "model.n_kv_heads=4",
        "model.d_ff=1536",
    ],
}


def build(name: str):
    cfg = load_config(os.path.join(ROOT, "configs/lm_tiny.yaml"), MODELS[name])
    model = build_model(cfg)
    n_params = sum(x.size for x in jax.tree.leaves(jax.tree.map(lambda v: v, model)) if hasattr(x, "size"))
    return model, n_params


def old_server_class(commit: str):
    """`Server` as src/meshwork/engine/serving.py defined it at `commit` (the before of this benchmark)."""
    source = subprocess.run(
        ["git", "-C", ROOT, "show", f"{commit}:src/meshwork/engine/serving.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = os.path.join(tempfile.mkdtemp(), "serving_before.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("serving_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.Server


def serve_once(server, B: int, prompt_len: int, new: int, tag: str, rng) -> float:
    requests = [
        Request(
            f"{tag}/{i}",
            rng.integers(0, server.cfg.vocab_size, prompt_len).tolist(),
            SamplingParams(temperature=0.0, max_new_tokens=new),
        )
        for i in range(B)
    ]
    t = time.perf_counter()
    server.run(requests)
    return time.perf_counter() - t


def argmax_only(logits_BV, positions_B, arrays, seen_BV=None):
    """The floor's sampler: what any greedy decoder must do."""
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)


def warm_server(model, B: int, args, mode: str):
    """A server for `mode` (before, 1/dispatch, N/dispatch or floor), its programs compiled: the
    patched sampler is read when they are traced, here, and is restored afterwards."""
    max_len = args.prompt_len + args.steps + 16
    kw = dict(slots=B, page_size=16, max_len=max_len, n_pages=B * -(-max_len // 16) + 1)
    try:
        if mode == "before":
            generate.sample = sampling.sample_reference
            server = old_server_class(args.before_commit)(model, **kw)
        else:
            serving.sample = argmax_only if mode == "floor" else sampling.sample
            server = Server(model, **kw, steps_per_dispatch=1 if mode == "1/dispatch" else args.dispatch)
        rng = np.random.default_rng(0)
        serve_once(server, B, args.prompt_len, args.steps, "warm", rng)
        serve_once(server, B, args.prompt_len, 1, "warm1", rng)
        return server
    finally:
        generate.sample = serving.sample = sampling.sample


def decode_step_s(server, B: int, args, r: int) -> tuple[float, float]:
    """(decode seconds per step, decode steps per dispatch) of one run."""
    rng = np.random.default_rng(r + 1)
    steps0, dispatches0 = server.steps, getattr(server, "dispatches", None)
    full = serve_once(server, B, args.prompt_len, args.steps, f"f{r}", rng)
    ratio = 1.0 if dispatches0 is None else (server.steps - steps0) / (server.dispatches - dispatches0)
    prefill = serve_once(server, B, args.prompt_len, 1, f"p{r}", rng)
    return (full - prefill) / (args.steps - 1), ratio


def sampler_s(fn, B: int, V: int, params: SamplingParams, repeats: int = 20) -> float:
    logits = jax.random.normal(jax.random.key(0), (B, V)) * 3
    arrays = SamplingArrays.stack([params] * B)
    positions, seen = jnp.zeros(B, jnp.int32), jnp.zeros((B, V), bool)
    f = jax.jit(fn)
    jax.block_until_ready(f(logits, positions, arrays, seen))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(logits, positions, arrays, seen))
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--dispatch", type=int, default=8, help="decode steps per dispatch of the fused loop")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before-commit", default="486c893", help="the commit whose serving.py is the before")
    args = ap.parse_args(argv)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind} x{len(jax.devices())}, "
        f"{os.cpu_count()} cpus; prompt {args.prompt_len}, {args.steps} new tokens, greedy"
    )
    for name in args.models:
        model, n_params = build(name)
        V = model.cfg.vocab_size
        print(f"\n{name}: {n_params / 1e6:.2f}M parameters, vocabulary {V}")
        print(
            f"{'B':>3} {'before ms':>10} {'1/disp ms':>10} {f'{args.dispatch}/disp ms':>10} {'floor ms':>9}"
            f" {'steps/disp':>10} {'before/after':>12} {'after/floor':>11}"
        )
        for B in args.batches:
            modes = ("before", "1/dispatch", "N/dispatch", "floor")
            servers = {m: warm_server(model, B, args, m) for m in modes}
            runs = {m: [] for m in modes}
            for r in range(args.repeats):  # round robin: a disturbance hits every mode alike
                for m in modes:
                    runs[m].append(decode_step_s(servers[m], B, args, r))
            before, one, fused, floor = (min(t for t, _ in runs[m]) for m in modes)
            ratio = runs["N/dispatch"][0][1]
            print(
                f"{B:>3} {before * 1e3:>10.3f} {one * 1e3:>10.3f} {fused * 1e3:>10.3f} {floor * 1e3:>9.3f}"
                f" {ratio:>10.2f} {before / fused:>11.2f}x {fused / floor:>10.2f}x"
            )
        print(f"sampler alone, (B, {V}) logits:")
        print(f"{'B':>3} {'rows':>14} {'sort ms':>9} {'new ms':>9} {'sort/new':>9}")
        for B in args.batches:
            for label, p in [
                ("greedy", SamplingParams(temperature=0.0)),
                ("top_p=0.9", SamplingParams(temperature=0.8, top_p=0.9)),
                ("top_k=50", SamplingParams(temperature=0.8, top_k=50)),
            ]:
                old, new = sampler_s(sampling.sample_reference, B, V, p), sampler_s(sampling.sample, B, V, p)
                print(f"{B:>3} {label:>14} {old * 1e3:>9.3f} {new * 1e3:>9.3f} {old / new:>8.1f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
