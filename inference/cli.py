"""Command line for inference: parse, validate, call one function."""

from __future__ import annotations

import argparse
import sys

from meshwork.config import ConfigError
from meshwork.engine.validation import RequestError


class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` names each option's default, except where there is none to name (None, off, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default == [] or not action.help:
            return action.help or ""
        return super()._get_help_string(action)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python3 -m inference",
        description="Generate from, serve or export a trained run or a Hugging Face checkpoint.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "diffusion",
        help="sample images from a trained UNet run into a PNG grid",
        formatter_class=HelpWithDefaults,
        description="Sample images from a trained UNet run into a PNG grid: one row per class, "
        "tiles scaled up (nearest neighbour) to at least 48 px.",
    )
    d.add_argument("--checkpoint", required=True, help="the run.dir of a `model.kind: unet` training run")
    d.add_argument(
        "--num",
        type=int,
        default=None,
        help="number of images (default: 4 per class, so 40 for the 10 digits, which fill 10 rows "
        "of 4; 16 for a model without classes)",
    )
    d.add_argument("--steps", type=int, default=50, help="sampler steps")
    d.add_argument("--sampler", choices=("ddim", "ddpm"), default="ddim", help="the reverse process")
    d.add_argument(
        "--guidance",
        type=float,
        default=None,
        help="classifier-free guidance scale (default: none, the plain conditional model)",
    )
    d.add_argument("--labels", default="cycle", help="'cycle' (0,1,2,...) or one class id for all images")
    d.add_argument("--seed", type=int, default=0, help="seed of the sampler's noise")
    d.add_argument("--no-ema", action="store_true", help="sample with the raw weights, not their EMA")
    d.add_argument("--out", default="grid.png", help="PNG file to write")
    d.add_argument(
        "--patch-parallel",
        type=int,
        default=1,
        metavar="N",
        help="DistriFusion: split each image into N horizontal patches, one per device, every UNet "
        "layer computed on its patch (N simulated devices on a CPU)",
    )
    d.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="with --patch-parallel: synchronous steps before the layers use one-step-stale "
        "activations of the other patches (default: 4, or --steps if fewer)",
    )
    from meshwork.inference import lm

    lm.add_arguments(
        sub.add_parser(
            "lm",
            help="generate text from a trained LM run or a Hugging Face checkpoint",
            formatter_class=HelpWithDefaults,
            description=lm.DESCRIPTION,
        )
    )
    e = sub.add_parser("export-hf", help="write a trained LM run as a Hugging Face checkpoint (safetensors)")
    e.add_argument("--checkpoint", required=True, help="the run.dir of a meshwork LM training run")
    e.add_argument("--out", required=True, help="directory to write config.json and model.safetensors into")
    e.add_argument(
        "--merge",
        action="store_true",
        help="for a LoRA or QLoRA run: write the base with the deltas added (export-peft writes the adapter alone)",
    )
    e.add_argument(
        "--allow-dropless",
        action="store_true",
        help="write a capacity-factor MoE run as dropless Mixtral anyway (it then computes the "
        "tokens the run dropped; a warning says so)",
    )
    f = sub.add_parser("export-peft", help="write a LoRA fine-tuning run's adapter in PEFT's format")
    f.add_argument("--checkpoint", required=True, help="the run.dir of a meshwork finetune.method=lora run")
    f.add_argument(
        "--out", required=True, help="directory to write adapter_config.json and adapter_model.safetensors into"
    )
    f.add_argument(
        "--base",
        default=None,
        help="base_model_name_or_path to record (default: the run's "
        "finetune.base; export that run with export-hf for peft)",
    )
    add_serve_arguments(
        sub.add_parser(
            "serve",
            help="serve an LM over HTTP with OpenAI's API (continuous batching)",
            formatter_class=HelpWithDefaults,
            description="Serve a trained LM run or a Hugging Face checkpoint over HTTP: OpenAI's /v1/completions and "
            "/v1/chat/completions (stream: true for server-sent events), /v1/models and /health, over the "
            "continuous-batching server. SIGTERM lets running requests finish, then exits 0.",
        )
    )
    return p.parse_args(argv)


def add_serve_arguments(s: argparse.ArgumentParser) -> None:
    from meshwork.inference.lm import add_attention_argument, add_dtype_argument

    s.add_argument(
        "--checkpoint", required=True, help="the run.dir of a meshwork LM run, or a Hugging Face checkpoint folder"
    )
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument(
        "--port", type=int, default=8000, help="TCP port (0: any free port; the first line printed names it)"
    )
    s.add_argument("--model-name", default=None, help="the model id clients send (default: the folder's name)")
    s.add_argument(
        "--slots",
        type=int,
        default=64,
        help="requests running at once (a decode step computes the running ones, not every slot)",
    )
    s.add_argument("--max-len", type=int, default=512, help="longest sequence, prompt + new tokens")
    s.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page")
    add_attention_argument(s)
    add_dtype_argument(s)
    s.add_argument(
        "--pages",
        type=int,
        default=None,
        help="pages in the KV pool (default: every slot at --max-len, as far as --kv-cache-gib allows)",
    )
    s.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="memory per device for the KV pool when --pages is not given (default: a quarter of the "
        "device's memory; on the CPU, of the host's)",
    )
    s.add_argument(
        "--prefill-chunk",
        type=int,
        default=256,
        help="prompt tokens prefilled per step, between decode steps, so new requests' first tokens "
        "and running requests' next ones keep coming (default 256; 0: whole prompts at admission)",
    )
    s.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="share the KV pages of equal prompt prefixes between requests (default: on, except for "
        "models with linear-attention layers and with --speculative, whose states cannot be shared)",
    )
    s.add_argument(
        "--data",
        type=int,
        default=1,
        help="data-parallel replicas: each serves slots/data requests from its own share of the pages",
    )
    s.add_argument(
        "--tensor",
        type=int,
        default=1,
        help="split attention heads and MLP columns over this many devices (data x tensor = the host's devices)",
    )
    from meshwork.inference.speculation import add_speculative_arguments

    add_speculative_arguments(s)
    s.add_argument("--max-tokens", type=int, default=256, help="most new tokens one request may ask for")
    s.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before new ones get 429")
    s.add_argument(
        "--api-key",
        default=None,
        help="require Authorization: Bearer KEY on every /v1 request (shows in ps and shell history: "
        "prefer --api-key-file or $MESHWORK_API_KEY)",
    )
    s.add_argument("--api-key-file", default=None, help="read the API key from this file (its first line)")
    s.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve a --host other machines reach without an API key (refused otherwise)",
    )
    s.add_argument(
        "--max-body-bytes", type=int, default=4 * 2**20, help="longest request body; longer ones get 413 unread"
    )
    s.add_argument("--max-messages", type=int, default=256, help="most chat messages in one request")
    s.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a request may take from arrival to its last token; then it is cancelled (504)",
    )
    s.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        help="seconds for a connection to send a request's head, and for its body to arrive (408)",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM lets running requests finish before cancelling them",
    )
    s.add_argument(
        "--log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's log level (info logs every request)",
    )


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        if args.command == "lm":
            from meshwork.inference import lm

            return lm.run(args)
        if args.command == "serve":
            from meshwork.inference.serve_cli import serve

            return serve(args)
        if args.command == "export-peft":
            return export_peft(args.checkpoint, args.out, base=args.base)
        if args.command == "export-hf":
            return export_hf(args.checkpoint, args.out, merge=args.merge, allow_dropless=args.allow_dropless)
        if (args.num is not None and args.num < 1) or args.steps < 1:
            raise ConfigError("--num and --steps must be positive")
        if args.patch_parallel < 1:
            raise ConfigError(f"--patch-parallel {args.patch_parallel}: give the number of patches (devices), >= 1")
        if args.warmup is not None and args.patch_parallel == 1:
            raise ConfigError("--warmup applies to patch-parallel sampling only; add --patch-parallel N (N > 1)")
        if args.patch_parallel > 1:
            _simulate_cpu_devices(args.patch_parallel)
        from meshwork.inference.generate_images import generate_grid

        out, accuracy = generate_grid(
            args.checkpoint,
            num=args.num,
            steps=args.steps,
            sampler=args.sampler,
            guidance=args.guidance,
            labels=args.labels,
            seed=args.seed,
            ema=not args.no_ema,
            out=args.out,
            patch_parallel=args.patch_parallel,
            warmup=min(4, args.steps) if args.warmup is None else args.warmup,
        )
    except (ConfigError, RequestError) as e:  # the command line's fault, or a prompt's or sampling setting's
        print(f"error: {e}", file=sys.stderr)
        return 2
    acc = f"; a digit classifier reads {accuracy:.0%} of them as the class asked for" if accuracy is not None else ""
    print(f"wrote {out}{acc}")
    return 0


def _simulate_cpu_devices(n: int) -> None:
    """Gives the CPU backend n devices, so that --patch-parallel runs on a machine without
    accelerators; a no-op once jax has started (the devices are then what they are) or when
    XLA_FLAGS already chooses the count."""
    import os

    import jax

    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass


def _empty_out_dir(out: str):
    """`out` as a path, refused (ConfigError) when it already holds files: an export overwrites nothing."""
    import pathlib

    out_dir = pathlib.Path(out)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(f"--out: {out_dir} is not empty; pick a new directory (nothing is overwritten)")
    return out_dir


def export_hf(checkpoint: str, out: str, *, merge: bool = False, allow_dropless: bool = False) -> int:
    from meshwork.inference.hf_export import export_hf as write
    from meshwork.inference.runs import load_run

    out_dir = _empty_out_dir(out)
    cfg, model, step = load_run(checkpoint)
    if cfg.finetune.method in ("lora", "qlora"):
        if not merge:
            raise ConfigError(
                f"export-hf: {checkpoint} is a finetune.method={cfg.finetune.method} run; pass --merge "
                "to write the base with the deltas added, or use export-peft for the adapter alone"
            )
        from meshwork.models.lora import merge_lora

        merge_lora(model)
    elif cfg.finetune.method not in ("none", "full"):
        raise ConfigError(
            f"export-hf: finetune.method={cfg.finetune.method} adds modules a Hugging Face "
            "Llama does not have; only lora and qlora runs merge into one"
        )
    try:
        path = write(cfg.model, model, out_dir, allow_dropless=allow_dropless)
    except ValueError as e:
        raise ConfigError(f"export-hf: {e}") from None
    print(f"wrote step {step} of {checkpoint} to {path}")
    return 0


def export_peft(checkpoint: str, out: str, *, base: str | None = None) -> int:
    from meshwork.inference.peft_export import export_peft as write
    from meshwork.inference.runs import load_run

    out_dir = _empty_out_dir(out)
    cfg, model, step = load_run(checkpoint)
    try:
        path = write(cfg, model, out_dir, base_model=base)
    except ValueError as e:
        raise ConfigError(f"export-peft: {e}") from None
    print(f"wrote the LoRA adapter of step {step} of {checkpoint} to {path}")
    return 0


def run() -> None:
    """Console-script entry point."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    run()
