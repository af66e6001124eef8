"""`python3 -m inference lm`: text generation from a meshwork run or a Hugging Face checkpoint.

One prompt streams its tokens to stdout as they are sampled (Generator);
several (`--prompts-file`, or `--prompt` repeated) go through the
continuous-batching server, each printed when it finishes.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

from meshwork.config import ConfigError
from meshwork.inference.speculation import add_speculative_arguments, make_drafter

DESCRIPTION = """Generate text from a trained LM run or a Hugging Face checkpoint. One prompt streams its
tokens as they are sampled; several are served together and printed in prompt order, one line
each: `[i] PROMPT + CONTINUATION` as text, or `[i] PROMPT IDS | NEW IDS` for a model without a
tokenizer here. Prompt i draws with seed + i, so two equal prompts get different samples (except
at --temperature 0)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="the run.dir of a meshwork LM training run")
    src.add_argument(
        "--hf",
        help="a Hugging Face checkpoint directory (config.json + *.safetensors): Llama, Mistral, Qwen2, Qwen3, "
        "Mixtral, Qwen2-MoE or Qwen3-MoE",
    )
    p.add_argument("--prompt", action="append", default=[], help="text to continue (repeat for a batch)")
    p.add_argument("--prompts-file", help="a text file, one prompt per line")
    p.add_argument(
        "--prompt-ids",
        action="append",
        default=[],
        help="a prompt as comma-separated token ids (for models without a tokenizer here; repeat for a batch)",
    )
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt, at most")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 for greedy decoding")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0: off")
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: the most likely tokens covering this probability; 1.0: off",
    )
    p.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="> 1 discourages tokens already seen; 1.0: off"
    )
    p.add_argument(
        "--stop-id",
        type=int,
        action="append",
        default=[],
        help="a token id that ends a sequence (repeatable; default: the checkpoint's eos, if any)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="random seed; prompt i of a batch uses seed + i, so equal prompts differ"
    )
    p.add_argument(
        "--quantize",
        choices=("none", "int8", "int4", "w8a8"),
        default="none",
        help="weight-only int8/int4, or int8 weights and activations in the MLPs",
    )
    p.add_argument("--max-len", type=int, default=None, help="KV cache length (default: what the prompts need)")
    add_attention_argument(p)
    p.add_argument("--slots", type=int, default=8, help="batch slots of the serving loop (several prompts)")
    add_speculative_arguments(p)


def add_attention_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--attention",
        choices=("xla", "pallas", "cudnn", "reference"),
        default=None,
        help="attention implementation (model.attention; default: the run's, xla for a Hugging Face folder); "
        "pallas reads the paged cache with the paged-attention kernel",
    )


def add_dtype_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="weights, activations and KV cache in this dtype (logits and softmax stay float32; "
        "default: the run's, float32 for a Hugging Face folder); bfloat16 halves the bytes a decode step "
        "reads on an accelerator, but XLA's CPU products run it about 8x slower than float32",
    )


def load_lm(
    checkpoint: str | None, hf: str | None, attention: str | None = None, dtype: str | None = None
) -> tuple[Any, Any, Any]:
    """(model, tokenizer or None, default stop ids) from a run dir or a Hugging Face directory;
    `attention` replaces the model's attention implementation (it changes no weight); `dtype`
    (float32, bfloat16) the weights' and the computation's."""
    model, tokenizer, stops, cfg = _load_lm(checkpoint, hf, attention, dtype)
    if dtype is not None and cfg is not None:
        model = _cast(model, cfg, checkpoint, dtype)
    return model, tokenizer, stops


def _cast(model, cfg, checkpoint: str, dtype: str):
    """The run's model rebuilt in `dtype` (weights, compute and, through it, the KV cache), its
    weights cast from the checkpoint's."""
    import jax
    from flax import nnx

    from meshwork.models.build import build_model

    if cfg.finetune.method not in ("none", "full"):
        raise ConfigError(
            f"--dtype {dtype}: {checkpoint} is a {cfg.finetune.method} fine-tuning run; serve it in its own "
            "dtype (drop --dtype) or export it merged (python3 -m inference export-hf --merge) and serve that"
        )
    train = cfg.train.model_copy(update={"compute_dtype": dtype, "param_dtype": dtype})
    cast = nnx.eval_shape(lambda: build_model(cfg.model_copy(update={"train": train})))  # shapes only
    state = jax.tree.map(lambda x, ref: x.astype(ref.dtype), nnx.state(model), nnx.state(cast))
    return nnx.merge(nnx.graphdef(cast), state)


def _load_lm(checkpoint: str | None, hf: str | None, attention: str | None, dtype: str | None) -> tuple:
    if checkpoint is not None:
        from meshwork.data.text import ByteTokenizer
        from meshwork.inference.runs import load_run

        cfg, model, _ = load_run(checkpoint, attention=attention)
        if cfg.model.kind not in ("transformer", "moe"):
            raise ConfigError(f"--checkpoint: {checkpoint} trained a {cfg.model.kind}; `lm` needs a language model")
        tokenizer, stops = ByteTokenizer() if cfg.data.source in ("stdlib", "stdlib_docs") else None, []
        if cfg.data.source in ("text", "chat"):  # the tokenizer the run's text was tokenized with, and its EOS
            from meshwork.data.user_text import load_tokenizer

            used = load_tokenizer(cfg.data.tokenizer)
            tokenizer = ByteTokenizer() if used.path is None else _HFTokenizer(used.path)
            stops = [] if used.eos_id is None else [used.eos_id]
        if cfg.finetune.method == "prefix":
            raise ConfigError(
                f"--checkpoint: {checkpoint} is prefix-tuned; generation with a KV cache does not "
                "support prefixes yet (models/adapters.py)"
            )
        if cfg.finetune.method == "lora":
            from meshwork.models.lora import merge_lora

            merge_lora(model)  # W0 + (alpha/r) B A: inference at the base model's cost
        return model, tokenizer, stops, cfg
    path = pathlib.Path(hf).expanduser()
    if not path.is_dir():
        raise ConfigError(f"--hf: {path} is not a directory; pass a Hugging Face checkpoint directory")
    from meshwork.models.build import DTYPES
    from meshwork.models.hf import model_from_hf

    try:
        kw = {} if dtype is None else {"dtype": DTYPES[dtype], "param_dtype": DTYPES[dtype]}
        _, model = model_from_hf(path, attention=attention, **kw)
    except ValueError as e:
        raise ConfigError(f"--hf: {e}") from None
    return model, _hf_tokenizer(path), _hf_eos(path), None


class _HFTokenizer:
    """A checkpoint's tokenizer.json through the `tokenizers` package, with ByteTokenizer's interface."""

    def __init__(self, path: pathlib.Path):
        from tokenizers import Tokenizer

        self.path = pathlib.Path(path)  # its folder may hold the chat template (serve_cli.load_served)
        self.tok = Tokenizer.from_file(str(path))
        self.vocab_size = self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def _hf_tokenizer(path: pathlib.Path) -> _HFTokenizer | None:
    """The checkpoint's tokenizer, when it ships a tokenizer.json and `tokenizers` is installed."""
    if not (path / "tokenizer.json").is_file():
        return None
    try:
        return _HFTokenizer(path / "tokenizer.json")
    except ImportError:
        return None


def _hf_eos(path: pathlib.Path) -> list[int]:
    import json

    eos = json.loads((path / "config.json").read_text()).get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def encode_prompts(args: argparse.Namespace, tokenizer, vocab_size: int) -> list[list[int]]:
    texts = list(args.prompt)
    if args.prompts_file:
        f = pathlib.Path(args.prompts_file)
        if not f.is_file():
            raise ConfigError(f"--prompts-file: {f} does not exist")
        try:
            texts += [line for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
        except UnicodeDecodeError:
            raise ConfigError(f"--prompts-file: {f} is not UTF-8 text; give a text file, one prompt per line") from None
    if texts and tokenizer is None:
        raise ConfigError(
            "this model has no tokenizer here (pre-tokenized training data, or no tokenizer.json "
            "with the `tokenizers` package); pass --prompt-ids 1,2,3"
        )
    if tokenizer is not None and tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"tokenizer mismatch: the tokenizer has {tokenizer.vocab_size} ids but the model only "
            f"{vocab_size}; use the tokenizer the model was trained with"
        )
    prompts = [[int(t) for t in tokenizer.encode(text)] for text in texts]
    for ids in args.prompt_ids:
        try:
            prompts.append([int(t) for t in ids.split(",") if t.strip()])
        except ValueError:
            raise ConfigError(f"--prompt-ids {ids!r}: give comma-separated integers") from None
    if not prompts:
        raise ConfigError("no prompt: pass --prompt TEXT, --prompts-file FILE or --prompt-ids IDS")
    return prompts


def per_request_seeds(params, n: int) -> list:
    """`params` for each of n prompts, prompt i drawing with seed + i (equal prompts, different samples)."""
    import dataclasses

    return [dataclasses.replace(params, seed=params.seed + i) for i in range(n)]


def _decode(tokenizer, ids: list[int]) -> str:
    if tokenizer is None:
        return " ".join(map(str, ids))
    return tokenizer.decode(ids)


def run(args: argparse.Namespace) -> int:
    """Loads, generates, prints. ConfigError (the command line) or RequestError (a prompt or sampling
    setting) for anything the user can fix."""
    from meshwork.engine.sampling import SamplingParams

    if args.slots < 1:
        raise ConfigError(f"--slots: {args.slots}; the serving loop needs at least 1 slot")
    model, tokenizer, eos = load_lm(args.checkpoint, args.hf, args.attention)
    prompts = encode_prompts(args, tokenizer, model.cfg.vocab_size)
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        max_new_tokens=args.max_new_tokens,
        stop_tokens=tuple(args.stop_id or eos),
        seed=args.seed,
    )
    params.check(model.cfg.vocab_size)
    per_prompt = per_request_seeds(params, len(prompts))
    for p in per_prompt:
        p.check(model.cfg.vocab_size)
    if args.quantize != "none":
        from meshwork.models.quantize import quantize_model

        quantize_model(model, args.quantize)
    from meshwork.models.pack import pack_for_cpu_decode

    pack_for_cpu_decode(model)  # on a CPU, decode's float32 projections run the C++ matmul kernel
    drafter = make_drafter(args, model)
    if len(prompts) == 1:
        return _stream_one(args, model, tokenizer, prompts[0], per_prompt[0], drafter)
    from meshwork.engine.serving import Request, Server

    max_len = args.max_len or max(len(p) for p in prompts) + params.max_new_tokens + 1
    server = Server(model, slots=args.slots, max_len=max_len, drafter=drafter, speculative_k=args.speculative_k)
    results = server.run(Request(i, p, per_prompt[i]) for i, p in enumerate(prompts))
    failed = 0
    for i, prompt in enumerate(prompts):
        r = results[i]
        if r.finish == "error":
            failed += 1
            print(f"[{i}] error: {r.error}")
        elif tokenizer is None:  # ids: where the prompt ends and the new tokens start must show
            print(f"[{i}] {_decode(tokenizer, prompt)} | {_decode(tokenizer, r.tokens)}")
        else:
            print(f"[{i}] {_decode(tokenizer, prompt)}{_decode(tokenizer, r.tokens)}")
    if drafter is not None:
        print(server.spec.line(args.speculative_k), file=sys.stderr)
    return 0 if not failed else 2


def _stream_one(args: argparse.Namespace, model, tokenizer, prompt: list[int], params, drafter) -> int:
    """Streams one prompt's tokens to stdout as they are sampled (or accepted, with a drafter: the
    acceptance rate and tokens per target forward then go to stderr)."""
    from meshwork.engine.generate import Generator

    gen = Generator(model)
    if drafter is not None:
        from meshwork.engine.speculative import SpeculativeGenerator

        gen = SpeculativeGenerator(gen, drafter, args.speculative_k)
    gen.check_request(prompt, params, args.max_len)  # before the prompt is printed
    produced: list[int] = []
    sys.stdout.write(_decode(tokenizer, prompt))
    for _, token in gen.stream([prompt], params, args.max_len):
        # Bytes of one character can arrive in several tokens: print what decodes so far.
        before = _decode(tokenizer, produced)
        produced.append(token)
        sys.stdout.write(_decode(tokenizer, produced)[len(before) :] if tokenizer else f" {token}")
        sys.stdout.flush()
    sys.stdout.write("\n")
    if drafter is not None:
        print(gen.stats.line(args.speculative_k), file=sys.stderr)
    return 0
