"""Held-out exact-match accuracy on the arithmetic prompts, before SFT, after SFT and after GRPO:
each run's greedy answers to the held-out tenth of configs/data/arithmetic_prompts.jsonl, served by
meshwork's engine and scored by the `exact_answer` reward, as GRPO's evaluation does (val_reward).

    python3 benchmarks/arith_accuracy.py runs/sft_chat_tiny runs/grpo_arith   # "init": an untrained model

"init" is the chat model's architecture (configs/sft_chat_tiny.yaml) with its initial weights: the
accuracy before any fine-tuning.
"""

from __future__ import annotations

import pathlib
import sys

from meshwork.config import load_config
from meshwork.data.prompts import prompt_set
from meshwork.engine.serving import Server
from meshwork.inference.runs import load_run
from meshwork.models.build import build_model
from meshwork.train.rewards import Rewards
from meshwork.train.rollouts import greedy_reward

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "configs/data/arithmetic_prompts.jsonl"


def accuracy(model, val_fraction: float = 0.1) -> tuple[float, int]:
    """(held-out exact match, prompts) of `model`'s greedy answers, as GRPO's evaluation scores them."""
    prompts = prompt_set([str(PROMPTS)], val_fraction=val_fraction, fields=("answer",))
    server = Server(model, slots=64, page_size=16, max_len=144, prefix_caching=True)
    return greedy_reward(server, prompts.val, prompts, Rewards(["exact_match"]), max_new_tokens=8), len(prompts.val)


def main(argv: list[str]) -> None:
    for name in ["init", *argv]:
        if name == "init":
            model = build_model(load_config(ROOT / "configs/sft_chat_tiny.yaml"))
            step = 0
        else:
            _, model, step = load_run(name)
        acc, n = accuracy(model)
        print(f"{name:<40} step {step:>4}: held-out exact match {acc:.3f} ({round(acc * n)}/{n})")


if __name__ == "__main__":
    main(sys.argv[1:])
