"""What serving in bfloat16 costs in accuracy: a run (or a Hugging Face folder) in float32 and in
bfloat16, through the engine's own paths.

    python3 benchmarks/serve_dtype.py --checkpoint runs/lm_tiny

Held-out text (the standard library's `json/decoder.py`, which no stdlib run trained on: its
validation split is other files) in --windows windows of --length tokens, teacher-forced through
`Generator.forward` (the KV-cache path): the next-token loss in each dtype and how often their
top-1 predictions agree; then greedy continuations of --new tokens from the windows' first
--prompt tokens through `Server`, compared token by token. Byte-level runs only (the text is fed
as bytes). Speed is benchmarks/serve_vs_vllm.py's (`--meshwork-args "--dtype bfloat16"`).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from meshwork.engine.generate import Generator
from meshwork.engine.sampling import SamplingParams
from meshwork.engine.serving import Request, Server
from meshwork.inference.serve_cli import load_served


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="a byte-level LM run dir (or a Hugging Face folder)")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--length", type=int, default=192)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args(argv)
    if min(args.windows, args.length, args.prompt, args.new) < 1 or args.prompt > args.length:
        ap.error("--windows, --length, --prompt and --new: at least 1, and --prompt at most --length")
    text = np.frombuffer(open(json.decoder.__file__, "rb").read(), np.uint8).astype(np.int32)
    starts = np.random.default_rng(0).integers(0, len(text) - args.length - 1, args.windows)
    windows = np.stack([text[s : s + args.length + 1] for s in starts])
    out = {}
    for dtype in ("float32", "bfloat16"):
        model = load_served(args.checkpoint, dtype=None if dtype == "float32" else dtype)[0]
        server = Server(model, slots=args.windows, max_len=args.prompt + args.new)
        greedy = SamplingParams(temperature=0.0, max_new_tokens=args.new)
        done = server.run([Request(i, w[: args.prompt].tolist(), greedy) for i, w in enumerate(windows)])
        gen = Generator(model)
        L = args.length
        logits, _ = gen.forward(
            windows[:, :-1], np.broadcast_to(np.arange(L), (len(windows), L)), gen.new_cache(len(windows), L)
        )
        log_p = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), -1))
        loss = float(-np.take_along_axis(log_p, windows[:, 1:, None], -1).mean())
        out[dtype] = ([done[i].tokens for i in range(len(windows))], loss, log_p.argmax(-1))
        print(f"{dtype}: next-token loss {loss:.5f}", flush=True)
    (t32, l32, a32), (t16, l16, a16) = out["float32"], out["bfloat16"]
    parted = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(t32, t16)]
    same = sum(p is None for p in parted)
    print(f"loss rise in bfloat16: {100 * (l16 / l32 - 1):+.2f}%")
    print(f"top-1 agreement: {(a32 == a16).mean():.2%} of {a32.size} positions")
    print(
        f"greedy continuations identical: {same} of {len(t32)}; the others part after {sorted(p for p in parted if p is not None)} tokens"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
