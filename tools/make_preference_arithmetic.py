"""Writes configs/data/preference_arithmetic.jsonl: arithmetic preference pairs for DPO (`train.objective: dpo`).

Each line is one pair in the format of data/preference_pairs.py: `messages` (sometimes a system
prompt, zero to two earlier questions answered by the assistant, then the user's question on
two-digit numbers, as in tools/make_chat_arithmetic.py's conversations), `chosen` the right
answer and `rejected` a wrong one: half the time the other operation's result (the slip of
reading + as -), else the right one off by 1 or 10. The numbers come from a fixed seed, so the
file is the same on every machine; configs/dpo_tiny.yaml trains on it and tests/test_dpo.py
checks the shipped file is this script's.

    python3 tools/make_preference_arithmetic.py            # rewrites the shipped file
    python3 tools/make_preference_arithmetic.py --out x.jsonl --n 100 --seed 1
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random

OUT = pathlib.Path(__file__).resolve().parents[1] / "configs" / "data" / "preference_arithmetic.jsonl"
SYSTEMS = ["You are a calculator. Answer with the number only.", "Answer briefly."]
QUESTIONS = ["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} = ?"]


def question(rng: random.Random) -> tuple[str, int, int]:
    """A question's text, its answer, and the other operation's result."""
    a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-")
    right, other = (a + b, a - b) if op == "+" else (a - b, a + b)
    return rng.choice(QUESTIONS).format(a=a, op=op, b=b), right, other


def pair(rng: random.Random) -> dict:
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.5 else []
    for _ in range(rng.choice((0, 0, 1, 2))):
        text, right, _ = question(rng)
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": str(right)}]
    text, right, other = question(rng)
    messages.append({"role": "user", "content": text})
    wrong = other if rng.random() < 0.5 else right + rng.choice((-10, -1, 1, 10))
    return {"messages": messages, "chosen": str(right), "rejected": str(wrong)}


def lines(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [json.dumps(pair(rng), separators=(",", ":")) + "\n" for _ in range(n)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    parser.add_argument("--n", type=int, default=600, help="pairs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(lines(args.n, args.seed)))
    print(f"wrote {args.n} pairs to {args.out}")


if __name__ == "__main__":
    main()
