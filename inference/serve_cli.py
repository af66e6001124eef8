"""`python3 -m inference serve`: load a checkpoint, bind the port, serve the OpenAI API until SIGTERM.

    python3 -m inference serve --checkpoint runs/lm_tiny --port 8000 [--data 4 --tensor 2]

With `--data`/`--tensor` the model and the KV page pool are split over a mesh of this host's
devices: the pool's pages over `data` (each data-parallel replica serves its own slots from its own
pages) and heads over `tensor` (src/meshwork/engine/kv_cache.py, serving.py).
`ThreadedServer` runs an app on a background thread, for tests and benchmarks in one process.
"""

from __future__ import annotations

import threading
import time

from meshwork.config import ConfigError
from meshwork.engine.serving import Server
from meshwork.inference.http_guard import check_bind, resolve_api_key
from meshwork.inference.http_limits import uvicorn_options
from meshwork.inference.http_server import Limits, Served, chat_template_of, create_app
from meshwork.inference.serve_engine import Engine
from meshwork.inference.speculation import make_drafter


def load_served(checkpoint: str, name: str | None = None, attention: str | None = None, dtype: str | None = None):
    """(model, Served) from a meshwork run dir (checkpoints/) or a Hugging Face folder (config.json)."""
    import pathlib

    from meshwork.inference.lm import load_lm

    path = pathlib.Path(checkpoint).expanduser()
    if (path / "checkpoints").is_dir() or (path / "config.yaml").is_file():
        model, tokenizer, stops = load_lm(str(path), None, attention, dtype)
        folder = getattr(tokenizer, "path", None)  # the run's tokenizer.json: its folder has the template
        folder = folder.parent if folder is not None else None
    elif (path / "config.json").is_file():
        model, tokenizer, stops = load_lm(None, str(path), attention, dtype)
        folder = path
    else:
        raise ConfigError(
            f"--checkpoint: {path} holds neither config.yaml (a meshwork run) nor config.json "
            "(a Hugging Face checkpoint); pass one of those folders"
        )
    template, special = chat_template_of(folder) if folder is not None and folder.is_dir() else (None, {})
    return model, Served(name or path.resolve().name, tokenizer, list(stops), template, special)


def _mesh_options(args) -> dict:
    """--data and --tensor as the Server's mesh and rules (none for one device)."""
    if args.data * args.tensor == 1:
        return {}
    import jax

    from meshwork.sharding.mesh import make_mesh
    from meshwork.sharding.rules import rules_for

    n = jax.device_count()
    if args.data * args.tensor != n:
        raise ConfigError(
            f"--data {args.data} x --tensor {args.tensor} = {args.data * args.tensor} devices, but "
            f"this host has {n}; give sizes whose product is {n}"
        )
    mesh = make_mesh({"data": args.data, "tensor": args.tensor})
    return {"mesh": mesh, "rules": rules_for("tp" if args.tensor > 1 else "dp")}


def sharable(model, drafter) -> bool:
    """Whether prefix caching is on by default: a model with linear-attention layers keeps recurrent
    states that shared pages cannot restore, and neither can a speculative draft's rejected tokens."""
    return drafter is None and not model.cfg.linear_layers


def default_pages(args, model) -> int:
    """The KV pool's pages when --pages is not given, as vLLM sizes its cache: every slot at
    --max-len (no request ever waits for pages), unless that exceeds --kv-cache-gib per device
    (default: a quarter of the device's memory), which then sets the count. ConfigError when the
    budget cannot hold one --max-len sequence per data replica."""
    from meshwork.engine.kv_cache import cache_bytes_per_token
    from meshwork.perf.hardware import device_memory_bytes

    per_seq = -(-args.max_len // args.page_size)
    full = args.slots * per_seq + args.data  # and a null page per replica
    budget = device_memory_bytes() / 4 if args.kv_cache_gib is None else args.kv_cache_gib * 2**30
    # A device holds its replica's pages (the pool is split over --data) and 1/--tensor of their heads.
    page_bytes = args.page_size * cache_bytes_per_token(model.cfg, model.dtype) / args.tensor
    fits = args.data * int(budget // page_bytes)
    if fits < args.data * (per_seq + 1):
        raise ConfigError(
            f"--kv-cache-gib {budget / 2**30:.3g}: holds {fits} pages of {args.page_size} tokens, fewer than one "
            f"--max-len {args.max_len} sequence per replica needs ({per_seq + 1} each); give more memory, "
            "a smaller --max-len or --pages"
        )
    return min(full, fits)


def _limits(args) -> Limits:
    """--max-tokens, --max-body-bytes, --max-messages, --request-timeout, --read-timeout as the app's
    Limits (the counts were checked with the other counts in `serve`)."""
    for flag, value in (("--request-timeout", args.request_timeout), ("--read-timeout", args.read_timeout)):
        if not value > 0:  # a NaN too
            raise ConfigError(f"{flag} {value}: give a positive number")
    return Limits(
        max_tokens=args.max_tokens,
        max_body_bytes=args.max_body_bytes,
        max_messages=args.max_messages,
        request_timeout=args.request_timeout,
        read_timeout=args.read_timeout,
    )


def serve(args) -> int:
    """Loads the checkpoint, binds the port, serves until SIGTERM/SIGINT, and returns 0."""
    import os
    import signal
    import socket
    import sys

    import uvicorn

    for flag, value, low in (
        ("--slots", args.slots, 1),
        ("--max-len", args.max_len, 2),
        ("--page-size", args.page_size, 1),
        ("--max-tokens", args.max_tokens, 1),
        ("--max-queue", args.max_queue, 1),
        ("--max-body-bytes", args.max_body_bytes, 1),
        ("--max-messages", args.max_messages, 1),
        ("--data", args.data, 1),
        ("--tensor", args.tensor, 1),
    ):
        if value < low:
            raise ConfigError(f"{flag} {value}: use at least {low}")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: give a TCP port in [0, 65535] (0: any free port)")
    options = _mesh_options(args)
    if args.prefill_chunk < 0:
        raise ConfigError(f"--prefill-chunk {args.prefill_chunk}: give a token count (0: whole prompts at admission)")
    if args.pages is not None and args.pages < 2 * args.data:
        raise ConfigError(
            f"--pages {args.pages}: the pool needs at least 2 pages per data replica (a null page "
            f"and one to hand out); give at least {2 * args.data}"
        )
    if args.kv_cache_gib is not None and not args.kv_cache_gib > 0:
        raise ConfigError(f"--kv-cache-gib {args.kv_cache_gib}: give a positive size in GiB")
    if args.slots % args.data:
        raise ConfigError(
            f"--slots {args.slots}: each of the --data {args.data} replicas serves its own slots; "
            f"give a multiple of {args.data}"
        )
    limits = _limits(args)
    key = resolve_api_key(args.api_key, args.api_key_file, os.environ)
    warning = check_bind(args.host, key, args.allow_unauthenticated)  # before anything is bound or loaded
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:  # before loading the model: a taken port fails at once
        sock.bind((args.host, args.port))
        sock.listen(2048)  # clients that connect before uvicorn runs wait in the backlog
    except OSError as e:
        raise ConfigError(
            f"--host {args.host} --port {args.port}: cannot listen there ({e.strerror}); pick another "
            "port (0: any free one)"
        ) from None
    model, served = load_served(args.checkpoint, args.model_name, args.attention, args.dtype)
    if "mesh" not in options:  # one device: on a CPU, decode's projections run the C++ matmul kernel
        from meshwork.models.pack import pack_for_cpu_decode

        pack_for_cpu_decode(model)
    drafter = make_drafter(args, model, options.get("mesh"), options.get("rules"))
    engine = Engine(
        Server(
            model,
            slots=args.slots,
            page_size=args.page_size,
            max_len=args.max_len,
            n_pages=args.pages or default_pages(args, model),
            prefill_chunk=args.prefill_chunk or None,
            prefix_caching=args.prefix_caching if args.prefix_caching is not None else sharable(model, drafter),
            drafter=drafter,
            speculative_k=args.speculative_k,
            **options,
        ),
        max_queue=args.max_queue,
    )
    del model  # the engine holds its own copy of the weights, one array per layer (engine/per_layer.py)
    app = create_app(engine, served, limits, api_key=key)
    config = uvicorn.Config(
        app,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
        **uvicorn_options(args.read_timeout),
    )
    host, port = sock.getsockname()[:2]
    layout = f", data {args.data} x tensor {args.tensor}" if options else ""
    layout += f", speculative {args.speculative} k={args.speculative_k}" if drafter is not None else ""
    layout += ", API key required" if key is not None else ""
    if warning:
        print(warning, file=sys.stderr, flush=True)
    print(
        f"serving {served.name} on http://{host}:{port}/v1 (slots {args.slots}, max_len {args.max_len}, "
        f"pages {engine.server.pages.usable} of {args.page_size} tokens{layout})",
        flush=True,
    )
    # uvicorn re-raises the signal that stopped it once it has shut down, which would end the
    # process with that signal's status; a graceful shutdown exits 0, so the handler it restores
    # and re-raises is this no-op.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    uvicorn.Server(config).run(sockets=[sock])
    print("shut down", file=sys.stderr, flush=True)
    return 0


class ThreadedServer:
    """uvicorn serving `app` on 127.0.0.1 (any free port) from a background thread, for tests and
    benchmarks in one process:

        with ThreadedServer(create_app(engine, served)) as url: OpenAI(base_url=url + "/v1", api_key="-")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, read_timeout: float = Limits.read_timeout):
        import socket

        import uvicorn

        self.sock = socket.socket()
        self.sock.bind((host, port))
        host, port = self.sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **uvicorn_options(read_timeout)))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(60)
