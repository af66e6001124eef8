"""Writes the project's own arithmetic data under configs/data/, from a fixed seed, so the files
are the same on every machine:

- chat_arithmetic.jsonl, conversations for `data.source: chat` (configs/sft_chat_tiny.yaml):
  sometimes a system prompt, then one to three user questions on one-digit numbers ("What is
  7 + 8?"), each answered by the assistant with the number, alone ("15") or, a third of the
  time, in words ("The answer is 15.");
- preference_arithmetic.jsonl, pairs for DPO (configs/dpo_tiny.yaml, data/preference_pairs.py):
  `messages` (sometimes a system prompt, zero to two earlier questions answered, then the user's
  question), `chosen` the right answer and `rejected` a wrong one: half the time the other
  operation's result (the slip of reading + as -), else the right one off by 1 or 10;
- arithmetic_prompts.jsonl, prompts for GRPO (configs/grpo_arith.yaml, data/prompts.py):
  `messages` (sometimes a system prompt, mostly no earlier question, then the user's question) and
  `answer`, the right number, which the `exact_match` and `exact_answer` rewards read.

Each file's validation split is chosen by a hash of each line; tests/test_chat_data.py,
tests/test_dpo.py and tests/test_grpo.py check the shipped files are what this script writes.

    python3 tools/make_arithmetic_data.py                 # rewrites the three shipped files
    python3 tools/make_arithmetic_data.py --kind pairs --out x.jsonl --n 100 --seed 1
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random

DATA = pathlib.Path(__file__).resolve().parents[1] / "configs" / "data"
SYSTEMS = ["You are a calculator. Answer with the number only.", "Answer briefly."]
QUESTIONS = ["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} = ?"]


def question(rng: random.Random) -> tuple[str, int, int]:
    """A question's text, its answer, and the other operation's result."""
    a, b, op = rng.randint(0, 9), rng.randint(0, 9), rng.choice("+-")
    right, other = (a + b, a - b) if op == "+" else (a - b, a + b)
    return rng.choice(QUESTIONS).format(a=a, op=op, b=b), right, other


def _turns(rng: random.Random, counts: tuple[int, ...]) -> list[dict]:
    """Sometimes a system prompt, then rng.choice(counts) questions, each answered right."""
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.5 else []
    for _ in range(rng.choice(counts)):
        text, right, _ = question(rng)
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": str(right)}]
    return messages


VERBOSE = ["The answer is {n}.", "It is {n}.", "{n}, I think."]


def conversation(rng: random.Random) -> dict:
    """A third of the answers in a wordier form ("The answer is 15."), as demonstrations gathered
    from many people come: SFT imitates the mix, and GRPO's exact-match reward
    (configs/grpo_arith.yaml) asks for the number alone."""
    messages = _turns(rng, (1, 1, 2, 3))
    for m in messages:
        if m["role"] == "assistant" and rng.random() < 1 / 3:
            m["content"] = rng.choice(VERBOSE).format(n=m["content"])
    return {"messages": messages}


def pair(rng: random.Random) -> dict:
    messages = _turns(rng, (0, 0, 1, 2))
    text, right, other = question(rng)
    messages.append({"role": "user", "content": text})
    wrong = other if rng.random() < 0.5 else right + rng.choice((-10, -1, 1, 10))
    return {"messages": messages, "chosen": str(right), "rejected": str(wrong)}


def prompt(rng: random.Random) -> dict:
    messages = _turns(rng, (0, 0, 0, 1))
    text, right, _ = question(rng)
    return {"messages": [*messages, {"role": "user", "content": text}], "answer": str(right)}


# kind: (one example, default file, default count, what a line is)
KINDS = {
    "chat": (conversation, DATA / "chat_arithmetic.jsonl", 800, "conversations"),
    "pairs": (pair, DATA / "preference_arithmetic.jsonl", 600, "pairs"),
    "prompts": (prompt, DATA / "arithmetic_prompts.jsonl", 1000, "prompts"),
}


def lines(kind: str, n: int, seed: int) -> list[str]:
    rng, make = random.Random(seed), KINDS[kind][0]
    return [json.dumps(make(rng), separators=(",", ":")) + "\n" for _ in range(n)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=sorted(KINDS), default=None, help="one file (default: all three)")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="with --kind: where to write")
    parser.add_argument("--n", type=int, default=None, help="with --kind: how many lines")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for kind in [args.kind] if args.kind else sorted(KINDS):
        _, default_out, default_n, what = KINDS[kind]
        out, n = args.out or default_out, args.n or default_n
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(lines(kind, n, args.seed)))
        print(f"wrote {n} {what} to {out}")


if __name__ == "__main__":
    main()
