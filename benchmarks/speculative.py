"""Speculative decoding against plain decoding: accepted tokens per target forward and wall-clock
tokens/s, in one process, so the ratios compare like with like.

    python benchmarks/speculative.py [--batches 1 8] [--ks 2 4] [--new-tokens 128] [--repeats 3]
    python benchmarks/speculative.py --mtp runs/deepseek_tiny     # the model's own MTP module drafts

With `--mtp RUN_DIR` the target is that trained run (a model with `model.mtp.depth` >= 1, e.g.
configs/deepseek_tiny.yaml) and its own multi-token-prediction module is the draft
(engine/mtp_draft.py); the prompts are windows of this Python's standard-library sources, the
corpus such a run trains on (byte tokens). Nothing is constructed: the acceptance rate is what the
MTP module learned.

The models (random weights; nothing is trained, so this is a constructed draft, said plainly).
Target: a dense Transformer, vocabulary 256, d_model 512, 8 layers, 8 heads (4 kv heads), d_ff
1536, init std 0.3 (peaked next-token distributions), whose layers 2..8 have their output
projections (attention `wo`, MLP `w_down`) scaled by --perturbation (0.05): the target is its
first layer plus a small perturbation. Draft: that first layer with the target's embedding, final
norm and head (`truncated`), 1/8 of a target forward per token. So the acceptance rate is set by
the perturbation, not learned: read the speedup as a function of the acceptance rate it prints
(a trained model's early-exit or small-model draft reaches whatever rate it reaches), and the
cost side (k draft steps + one verification of k + 1 tokens vs k + 1 decode steps) as measured.

What is timed, per batch B, sampling setting (greedy; temperature 1) and k: `Generator.generate`
(plain: one prefill, then one jitted decode step per token) and `SpeculativeGenerator.generate`
(one prefill of both models, then one jitted round per k + 1 tokens at most: k draft steps, one
target forward over k + 1 positions, the acceptance test), each producing --new-tokens tokens per
prompt of --prompt-len random tokens. The first call compiles and is dropped; figures are the
median of --repeats calls. Greedy speculative output is asserted equal to plain greedy output.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import statistics
import time

import numpy as np
from flax import nnx

from meshwork.config_sections import ModelConfig
from meshwork.engine.generate import Generator
from meshwork.engine.sampling import SamplingParams
from meshwork.engine.speculative import DraftModelDrafter, SpeculativeGenerator
from meshwork.models.transformer import Transformer

TARGET = dict(vocab_size=256, d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, d_ff=1536)


def truncated(model: Transformer, n_layers: int) -> Transformer:
    """The target's first n_layers with its embedding, final norm and head."""
    draft = Transformer(model.cfg.model_copy(update={"n_layers": n_layers}), rngs=nnx.Rngs(1))
    weights = dict(nnx.to_flat_state(nnx.state(model)))
    state = nnx.state(draft)
    for path, var in nnx.to_flat_state(state):
        var[...] = weights[path][...][:n_layers] if path[0] == "blocks" else weights[path][...]
    nnx.update(draft, state)
    return draft


def perturbed_target(scale: float) -> Transformer:
    """TARGET with every layer after the first scaled down to a perturbation of the residual stream."""
    target = Transformer(ModelConfig(**TARGET, init_std=0.3), rngs=nnx.Rngs(0))
    state = nnx.state(target)
    for path, var in nnx.to_flat_state(state):
        if path[0] == "blocks" and path[-1] in ("wo", "w_down"):
            var[...] = var[...].at[1:].multiply(scale)
    nnx.update(target, state)
    return target


def stdlib_windows(rng: np.random.Generator, n: int, length: int) -> list[list[int]]:
    """n windows of `length` bytes from this Python's standard-library sources, starting at line starts."""
    import sysconfig

    files = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    out = []
    while len(out) < n:
        text = files[rng.integers(len(files))].read_bytes()
        starts = [i + 1 for i in range(len(text) - length - 1) if text[i] == 10]
        if starts:
            start = starts[rng.integers(len(starts))]
            out.append(list(text[start : start + length]))
    return out


def timed(generate, repeats: int) -> tuple[float, list[list[int]]]:
    generate()  # compiles
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = generate()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--perturbation", type=float, default=0.05, help="scale of layers 2.. output projections")
    p.add_argument("--mtp", metavar="RUN_DIR", help="draft with this trained run's own MTP module")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    if args.mtp:
        from meshwork.engine.speculative import mtp_drafter
        from meshwork.inference.runs import load_run

        gen = Generator(load_run(args.mtp)[1])
        make_drafter = lambda: mtp_drafter(gen)  # noqa: E731
        make_prompts = lambda B: stdlib_windows(rng, B, args.prompt_len)  # noqa: E731
        what = f"target {args.mtp} (its model.mtp module drafts), prompts from the stdlib sources"
    else:
        target = perturbed_target(args.perturbation)
        gen, draft = Generator(target), Generator(truncated(target, 1))
        make_drafter = lambda: DraftModelDrafter(draft)  # noqa: E731
        make_prompts = lambda B: [  # noqa: E731
            list(map(int, rng.integers(0, TARGET["vocab_size"], args.prompt_len))) for _ in range(B)
        ]
        what = (
            f"target {TARGET} (init std 0.3, layers 2-8's output projections x {args.perturbation}), "
            "draft = its first layer (+ embedding and head)"
        )
    print(
        f"speculative decoding, {datetime.date.today()}: {what}; "
        f"{args.prompt_len}-token prompts, {args.new_tokens} new tokens each"
    )
    print("| batch | sampling | k | acceptance | tokens / target forward | plain tok/s | speculative tok/s | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for B in args.batches:
        prompts = make_prompts(B)
        for name, temperature in (("greedy", 0.0), ("temperature 1", 1.0)):
            params = SamplingParams(temperature=temperature, max_new_tokens=args.new_tokens)
            plain_s, plain = timed(lambda: gen.generate(prompts, params), args.repeats)
            for k in args.ks:
                spec = SpeculativeGenerator(gen, make_drafter(), k=k)
                spec_s, out = timed(lambda: spec.generate(prompts, params), args.repeats)
                if temperature == 0:
                    assert out == plain, "greedy speculative decoding differs from plain greedy decoding"
                tokens = B * args.new_tokens
                print(
                    f"| {B} | {name} | {k} | {spec.stats.acceptance_rate:.3f} | {spec.stats.tokens_per_forward:.2f} "
                    f"| {tokens / plain_s:.0f} | {tokens / spec_s:.0f} | {plain_s / spec_s:.2f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
