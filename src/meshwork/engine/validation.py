"""One request validator for every engine: `Generator`, `Server` and the HTTP server all ask it.

    limits = server.limits                               # or generator.limits(max_len)
    check_request(prompt_ids, SamplingParams(top_p=0.9), limits)   # RequestError, or None: servable

A request is a prompt (token ids) and its `SamplingParams`; an engine describes
what it can serve as `RequestLimits` (vocabulary, cache length, pages one
request may hold, memory). A request that does not fit raises `RequestError`:
one line naming the problem and the fix, with `param`, the name of the
OpenAI field at fault (None where no single field is), so the HTTP layer
answers 400 without parsing the message. `RequestError` is a request's
fault, `ConfigError` the operator's (an engine built with impossible
settings); the command lines answer both with one line and exit status 2.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # sampling.py raises RequestError, so it is imported from there, not here
    from meshwork.engine.sampling import SamplingParams


class RequestError(ValueError):
    """A request this engine cannot serve: one line with the problem and the fix.

    `param` is the OpenAI name of the field at fault (`prompt`, `max_tokens`, `top_p`, ...), or None.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of an engine (None: no such limit)."""

    vocab_size: int
    """Token ids must lie in [0, vocab_size)."""
    max_len: int | None = None
    """Longest sequence, prompt + new tokens (the cache length); None: the cache is sized per request."""
    page_size: int | None = None
    """Tokens per page of a paged pool."""
    max_pages: int | None = None
    """Pages one request may hold at most (a data-parallel replica's pool, less its null page)."""
    max_new_tokens: int | None = None
    """The most tokens a request may ask for (the HTTP server's --max-tokens)."""
    cache_bytes_per_token: int | None = None
    """KV-cache bytes of one token of one sequence, checked against `memory_bytes`."""
    memory_bytes: int | None = None
    """What one device can hold."""


def check_request(prompt: Sequence[int], params: SamplingParams, limits: RequestLimits) -> None:
    """Raises RequestError when `limits`' engine cannot serve `prompt` with `params`.

    In order: the prompt (empty, ids outside the vocabulary), the sampling settings, then whether
    prompt + max_new_tokens fits the cache length, the pages a request may hold and the device.

        check_request([5, 7], SamplingParams(max_new_tokens=8), RequestLimits(vocab_size=256, max_len=16))
    """
    if len(prompt) == 0:
        raise RequestError("empty prompt: give at least one token", "prompt")
    bad = [int(t) for t in prompt if not 0 <= int(t) < limits.vocab_size]
    if bad:
        raise RequestError(
            f"token ids {bad[:3]} are outside the model's vocabulary of {limits.vocab_size}: "
            "the prompt was encoded with another tokenizer",
            "prompt",
        )
    params.check(limits.vocab_size)
    new = params.max_new_tokens
    if limits.max_new_tokens is not None and new > limits.max_new_tokens:
        raise RequestError(
            f"max_new_tokens={new}: this server gives at most {limits.max_new_tokens} tokens per "
            "request; ask for fewer",
            "max_tokens",
        )
    total = len(prompt) + new
    if limits.max_len is not None and total > limits.max_len:
        # The prompt is at fault when it alone fills the cache; otherwise fewer new tokens would fit.
        raise RequestError(
            f"prompt of {len(prompt)} tokens + {new} new tokens exceeds the cache length "
            f"{limits.max_len}; shorten the prompt or lower max_new_tokens",
            "prompt" if len(prompt) >= limits.max_len else "max_tokens",
        )
    if limits.page_size is not None and limits.max_pages is not None:
        worst = -(-total // limits.page_size)
        if worst > limits.max_pages:
            raise RequestError(
                f"the request needs up to {worst} pages of {limits.page_size} tokens but a "
                f"replica's pool has {limits.max_pages}; shorten the prompt or lower "
                "max_new_tokens (or serve with more pages)",
                "max_tokens",
            )
    if limits.cache_bytes_per_token is not None and limits.memory_bytes is not None:
        tokens = limits.max_len or total
        need, have = limits.cache_bytes_per_token * tokens, limits.memory_bytes
        if need > have:
            raise RequestError(
                f"max_new_tokens={new}: a KV cache of {tokens:,} tokens needs "
                f"{need / 2**30:,.1f} GiB, more than the {have / 2**30:,.1f} GiB this device has; "
                "lower max_new_tokens (or max_len)",
                "max_tokens",
            )
