"""Rewards for reinforcement learning (`train.objective: grpo`): Python functions of text.

A reward is any importable function

    def reward(prompt: str, completion: str, fields: dict) -> float

named in the config as `module:function` (`train.grpo.rewards: [my_rewards:is_polite]`), given the
rendered prompt, the completion's text (its end-of-turn token left out) and the example's other
fields from the prompts file (data/prompts.py: `answer`, say). A completion's reward is the
weighted sum of the listed rewards (`train.grpo.reward_weights`, default all 1).

Built in, for the demos, by bare name:
- `exact_match`: 1.0 when the completion, stripped of surrounding whitespace, is the example's
  `answer` exactly ("12" matches "12"; "The answer is 12." does not), else 0.0;
- `exact_answer`: 1.0 when the completion's last number equals the example's `answer`
  numerically ("12", "12.0" and "so it is 12" all match 12), else 0.0;
- `number_only`: 1.0 when the completion is a number and nothing else (a format check: the regex
  `NUMBER_ONLY`), else 0.0.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Sequence

from meshwork.config import ConfigError

Reward = Callable[[str, str, dict], float]
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
NUMBER_ONLY = re.compile(r"\s*-?\d+(?:\.\d+)?\s*")


def exact_match(prompt: str, completion: str, fields: dict) -> float:
    return float(completion.strip() == str(fields["answer"]).strip())


exact_match.fields = ("answer",)


def exact_answer(prompt: str, completion: str, fields: dict) -> float:
    numbers = NUMBER.findall(completion)
    if not numbers:
        return 0.0
    try:
        return float(float(numbers[-1]) == float(fields["answer"]))
    except (TypeError, ValueError):  # an answer that is not a number matches nothing
        return 0.0


exact_answer.fields = ("answer",)


def number_only(prompt: str, completion: str, fields: dict) -> float:
    return float(NUMBER_ONLY.fullmatch(completion) is not None)


BUILT_IN: dict[str, Reward] = {"exact_match": exact_match, "exact_answer": exact_answer, "number_only": number_only}


def load_reward(name: str) -> Reward:
    """The function `name` names (a built-in, or `module:function`); ConfigError in one line if it
    cannot be imported or is not callable."""
    if name in BUILT_IN:
        return BUILT_IN[name]
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"train.grpo.rewards: {name!r} is neither a built-in reward ({', '.join(BUILT_IN)}) nor "
            "'module:function'; name an importable function, e.g. my_rewards:score"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module's own error while importing
        raise ConfigError(
            f"train.grpo.rewards: cannot import {module_name!r} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            "put it on PYTHONPATH or fix its name"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(
            f"train.grpo.rewards: {module_name} has no function {attr!r}; define "
            f"def {attr}(prompt, completion, fields) -> float there"
        )
    return fn


class Rewards:
    """The weighted sum of the named rewards; `fields` are the example fields the built-ins read."""

    def __init__(self, names: Sequence[str], weights: Sequence[float] | None = None):
        if weights is not None and len(weights) != len(names):
            raise ConfigError(
                f"train.grpo.reward_weights: {len(weights)} weights for {len(names)} rewards; give one per reward"
            )
        self.names = list(names)
        self.functions = [load_reward(n) for n in names]
        self.weights = list(weights) if weights is not None else [1.0] * len(names)
        self.fields = tuple(dict.fromkeys(f for fn in self.functions for f in getattr(fn, "fields", ())))

    def __call__(self, prompt: str, completion: str, fields: dict) -> float:
        return sum(w * float(fn(prompt, completion, fields)) for w, fn in zip(self.weights, self.functions))

    def check(self, prompt: str, fields: dict) -> None:
        """Calls every reward once on an empty completion: ConfigError in one line when one raises or
        returns something that is not a number, before anything is trained or written."""
        for name, fn in zip(self.names, self.functions):
            try:
                value = fn(prompt, "", fields)
                float(value)
            except Exception as e:
                raise ConfigError(
                    f"train.grpo.rewards: {name} failed on the first example ({type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}); "
                    "a reward takes (prompt, completion, fields) and returns a number"
                ) from None
