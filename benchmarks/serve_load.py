"""Load test of `python3 -m inference serve`: N concurrent streaming clients (the official `openai`
client) against 127.0.0.1; requests/s, output tokens/s, time to first token and inter-token latency.

    python3 benchmarks/serve_load.py --checkpoint runs/lm_tiny                  # starts the server itself
    python3 benchmarks/serve_load.py --base-url http://127.0.0.1:8000/v1 --concurrency 1,8

Each level runs `--requests` requests (default 4 per client, at least 8) through `concurrency` client
tasks, each sending its next request when the previous one ends; no new request starts after
`--duration` seconds. Prompts are slices of one Python source file, 8 to 96 characters; every request
asks for `--max-tokens` greedy tokens with `ignore_eos`, so each produces exactly that many. Before the
levels, a warm-up request per prompt-length bucket compiles the server's prefill and decode.
TTFT: from sending the request to the first token's chunk; ITL: between consecutive token chunks of a
request (p50/p99 over all gaps of the level); TPOT: a request's (last token - first token) / (tokens - 1),
its median over the level. A server that decodes several steps per dispatch sends tokens in bursts:
ITL's p50 is then the gap inside a burst and its p99 the gap between bursts; TPOT averages them.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import subprocess
import sys
import time

import numpy as np


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--checkpoint", help="start `python3 -m inference serve` on this run or HF folder")
    where.add_argument("--base-url", help="a running server's http://HOST:PORT/v1")
    p.add_argument("--concurrency", default="1,8,32", help="client counts, comma-separated")
    p.add_argument("--requests", type=int, default=None, help="requests per level (default: 4 x clients, >= 8)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds per level after which no request starts")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per request")
    p.add_argument("--slots", type=int, default=32, help="with --checkpoint: the server's --slots")
    p.add_argument("--max-len", type=int, default=256, help="with --checkpoint: the server's --max-len")
    p.add_argument("--prefill-chunk", type=int, default=None, help="with --checkpoint: the server's --prefill-chunk")
    p.add_argument("--json", default=None, help="also write the levels' numbers to this JSON file")
    return p.parse_args(argv)


def prompts(n: int) -> list[str]:
    source = inspect.getsource(json.decoder)
    lengths = [8 + (37 * i) % 89 for i in range(n)]  # 8..96 characters, mixed
    return [source[(101 * i) % 4000 : (101 * i) % 4000 + length] for i, length in enumerate(lengths)]


async def one(client, model: str, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    stamps, tokens = [], 0
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    async for chunk in stream:
        ids = (chunk.choices[0].model_extra or {}).get("token_ids") if chunk.choices else None
        n = len(ids) if ids is not None else int(bool(chunk.choices and chunk.choices[0].text))
        if n:
            stamps.append(time.perf_counter())
            tokens += n
    tpot = (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 else float("nan")
    return {
        "ttft": stamps[0] - start if stamps else float("nan"),
        "itl": list(np.diff(stamps)),
        "tokens": tokens,
        "tpot": tpot,
        "end": time.perf_counter(),
    }


async def level(url: str, model: str, clients: int, n: int, duration: float, max_tokens: int) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    texts, done, next_i = prompts(n), [], 0
    start = time.perf_counter()

    async def worker():
        nonlocal next_i
        while next_i < n and time.perf_counter() - start < duration:
            i, next_i = next_i, next_i + 1
            done.append(await one(client, model, texts[i], max_tokens))

    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = max(r["end"] for r in done) - start
    await client.close()
    ttft, itl = np.array([r["ttft"] for r in done]), np.array([g for r in done for g in r["itl"]] or [np.nan])
    return {
        "clients": clients,
        "requests": len(done),
        "wall_s": wall,
        "requests_per_s": len(done) / wall,
        "output_tokens_per_s": sum(r["tokens"] for r in done) / wall,
        "ttft_p50_ms": 1e3 * np.percentile(ttft, 50),
        "ttft_p99_ms": 1e3 * np.percentile(ttft, 99),
        "itl_p50_ms": 1e3 * np.percentile(itl, 50),
        "itl_p99_ms": 1e3 * np.percentile(itl, 99),
        "tpot_p50_ms": 1e3 * np.nanpercentile([r["tpot"] for r in done], 50),
    }


def start_server(args) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inference",
            "serve",
            "--checkpoint",
            args.checkpoint,
            "--port",
            "0",
            "--slots",
            str(args.slots),
            "--max-len",
            str(args.max_len),
            "--max-tokens",
            str(args.max_tokens),
            "--max-queue",
            "1024",
            *(["--prefill-chunk", str(args.prefill_chunk)] if args.prefill_chunk else []),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if " on " not in line:
        proc.kill()
        sys.exit(f"the server did not start: {line!r}")
    return proc, line.split(" on ")[1].split()[0]


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    proc, url = start_server(args) if args.checkpoint else (None, args.base_url)
    try:
        from openai import OpenAI

        model = OpenAI(base_url=url, api_key="unused").models.list().data[0].id
        t = time.perf_counter()
        asyncio.run(level(url, model, 4, 8, 600, args.max_tokens))  # warm-up: every prompt bucket compiles
        print(
            f"server {url} ({model}); warm-up {time.perf_counter() - t:.1f} s; {args.max_tokens} greedy tokens "
            "per request",
            flush=True,
        )
        rows = []
        for c in levels:
            n = args.requests or max(8, 4 * c)
            rows.append(asyncio.run(level(url, model, c, n, args.duration, args.max_tokens)))
        print(
            "| clients | requests | requests/s | output tokens/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | "
            "TPOT p50 (ms) |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(
                f"| {r['clients']} | {r['requests']} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.0f} | "
                f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | "
                f"{r['tpot_p50_ms']:.1f} |"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
