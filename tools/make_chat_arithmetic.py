"""Writes configs/data/chat_arithmetic.jsonl: small arithmetic conversations for `data.source: chat`.

Each line is one OpenAI-style conversation: sometimes a system prompt, then one to three user
questions on two-digit numbers ("What is 37 + 48?"), each answered by the assistant with the
number alone ("85"). The numbers come from a fixed seed, so the file is the same on every
machine; configs/sft_chat_tiny.yaml trains on it (its validation split, chosen by a hash of each
line, is the held-out set), and tests/test_chat_data.py checks the shipped file is this script's.

    python3 tools/make_chat_arithmetic.py            # rewrites the shipped file
    python3 tools/make_chat_arithmetic.py --out x.jsonl --n 200 --seed 1
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random

OUT = pathlib.Path(__file__).resolve().parents[1] / "configs" / "data" / "chat_arithmetic.jsonl"
SYSTEMS = ["You are a calculator. Answer with the number only.", "Answer briefly."]
QUESTIONS = ["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} = ?"]


def conversation(rng: random.Random) -> dict:
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.5 else []
    for _ in range(rng.choice((1, 1, 2, 3))):
        a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-")
        messages.append({"role": "user", "content": rng.choice(QUESTIONS).format(a=a, op=op, b=b)})
        messages.append({"role": "assistant", "content": str(a + b if op == "+" else a - b)})
    return {"messages": messages}


def lines(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [json.dumps(conversation(rng), separators=(",", ":")) + "\n" for _ in range(n)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    parser.add_argument("--n", type=int, default=800, help="conversations")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(lines(args.n, args.seed)))
    print(f"wrote {args.n} conversations to {args.out}")


if __name__ == "__main__":
    main()
