"""The HTTP server's request bodies as pydantic models: OpenAI's completions and chat completions.

    body = parse_body(CompletionRequest, json.loads(raw))   # RequestError naming the field, or the body
    params = body.sampling(stops=[2], default_max_tokens=16)

The models check each field's type and range (strictly: `max_tokens: 4.5`,
`temperature: "hot"` or `stream: "yes"` are errors, not coerced); whether the
request fits the engine (prompt length, vocabulary, pages) is
`validation.check_request`'s question, asked after the prompt is tokenized.
`n` choices (1 or more; the server bounds it by its slots) and log-probabilities
(completions: `logprobs` 0..5, the legacy API's; chat: `logprobs: true` and
`top_logprobs` 0..20) are OpenAI's. Fields OpenAI defines that this server
does not implement (echo, best_of, presence and frequency penalties) are
refused by name; fields nobody defines are ignored, as OpenAI's clients send
their own.
Beyond OpenAI's fields a body may give vLLM's `top_k`, `repetition_penalty`,
`stop_token_ids` and `ignore_eos`.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from meshwork.engine.sampling import SamplingParams
from meshwork.engine.validation import RequestError

COMPLETION_MAX_LOGPROBS = 5  # the legacy completions API's bound on `logprobs`
# Bounds on what one body may hold, so that no field reaches a loop or an array of any size: the
# stop strings are searched for in the text after every token, the stop ids are a (slots, ids)
# array on the device, and the messages are each rendered by the chat template.
MAX_STOP_STRINGS = 4  # OpenAI's
MAX_STOP_CHARS = 256  # characters of one stop string
MAX_STOP_TOKEN_IDS = 64
MAX_MESSAGES = 256  # the default of `parse_body`'s max_messages (the server's --max-messages)
MAX_CONTENT_PARTS = 64  # content parts of one message


class _Body(BaseModel):
    # strict: no coercion of strings or floats into numbers; extra fields: ignored, as clients add their own.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    """With `stream: true`, a last chunk carries the token counts."""


class _Sampling(_Body):
    """The fields both endpoints share: how to sample, when to stop, how to answer."""

    model: str | None = None
    """The served model's name (another name gets 404, checked before these fields)."""
    stream: bool = False
    """Answer as server-sent events, one per token."""
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    """New tokens at most (default: 16 for completions; for chat, what is left of the cache)."""
    # null stands for the default, as in OpenAI's API.
    temperature: float | None = None
    """Softmax temperature, 0 for greedy (default 1)."""
    top_p: float | None = None
    """Nucleus sampling's probability mass (default 1: off)."""
    top_k: int | None = None
    """Sample from the k most likely tokens (default 0: off)."""
    repetition_penalty: float | None = None
    """> 1 discourages tokens already seen (default 1: off)."""
    seed: int | None = None
    """The request's random seed (default: a fresh one per request)."""
    stop: str | list[str] | None = None
    """Up to 4 strings of at most 256 characters that end the text (matched in the text, which ends
    before the first one)."""
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    """Up to 64 token ids that end the sequence, besides the model's own (unless ignore_eos)."""
    ignore_eos: bool | None = None
    """Do not stop at the model's end-of-sequence tokens."""
    n: int | None = None
    """Choices for this prompt (default 1): each sampled with seed + i (a fresh seed when none is given)."""
    # OpenAI's fields this server does not implement: accepted only at their do-nothing values.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    echo: bool | None = None
    best_of: int | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop):
        stops = [] if stop in (None, "") else [stop] if isinstance(stop, str) else stop
        if len(stops) > MAX_STOP_STRINGS or not all(stops):
            raise ValueError(f"stop: give a string or a list of up to {MAX_STOP_STRINGS} non-empty strings")
        longest = max(map(len, stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(
                f"stop: a stop string of {longest:,} characters; give strings of at most {MAX_STOP_CHARS} characters"
            )
        return stop

    @field_validator("n")
    @classmethod
    def _n(cls, n):
        if n is not None and n < 1:
            raise ValueError(f"n={n}: ask for at least 1 choice")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, value, info):
        if value not in (None, 0):
            raise ValueError(f"{info.field_name} is not supported; use repetition_penalty (> 1 discourages repeats)")
        return value

    @field_validator("echo")
    @classmethod
    def _echo(cls, value):
        if value:
            raise ValueError("echo is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value):
        if value not in (None, 1):
            raise ValueError("best_of is not supported")
        return value

    @property
    def max_tokens_field(self) -> str:
        """The name the body gave its token budget under (chat may say max_completion_tokens)."""
        return "max_tokens"

    @property
    def asked_max_tokens(self) -> int | None:
        return self.max_tokens

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) and self.stop else tuple(self.stop or ())

    @property
    def choices(self) -> int:
        return 1 if self.n is None else self.n

    def alternatives(self) -> int | None:
        """How many top alternatives per token to return with the log-probabilities; None: no logprobs."""
        raise NotImplementedError

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self, *, stops: list[int], default_max_tokens: int) -> SamplingParams:
        """The body's SamplingParams: the model's stop ids (`stops`) unless ignore_eos, a fresh seed
        unless one was given, `default_max_tokens` unless the body asked for a number."""
        seed = int.from_bytes(os.urandom(4), "little") if self.seed is None else self.seed
        asked = self.asked_max_tokens
        return SamplingParams(
            temperature=_default(self.temperature, 1.0),
            top_p=_default(self.top_p, 1.0),
            top_k=_default(self.top_k, 0),
            repetition_penalty=_default(self.repetition_penalty, 1.0),
            seed=seed,
            max_new_tokens=default_max_tokens if asked is None else asked,
            stop_tokens=tuple(self.stop_token_ids or ()) + (() if self.ignore_eos else tuple(stops)),
            logprobs=self.alternatives() or 0,
        )


def _default(value, default):
    return default if value is None else value


class CompletionRequest(_Sampling):
    """`POST /v1/completions`: one prompt, as text or as token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    """Text or token ids; a list holding one of those is a batch of one."""

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ValueError(f"a batch of {len(prompt)} prompts: send one prompt per request")
            return prompt[0]
        return prompt

    logprobs: int | None = None
    """The legacy API's: return each token's log-probability and the `logprobs` (0..5) most likely
    alternatives (the sampled token's is added to them)."""

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value):
        if value is not None and not 0 <= value <= COMPLETION_MAX_LOGPROBS:
            raise ValueError(f"logprobs={value}: ask for 0 to {COMPLETION_MAX_LOGPROBS} alternatives per token")
        return value

    def alternatives(self) -> int | None:
        return self.logprobs


class ContentPart(_Body):
    type: str
    text: str = ""


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart]
    """Text, or up to 64 content parts (the text ones are joined; others are ignored)."""

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, content):
        # Before pydantic validates each part: a list of any length is refused at the cost of len().
        if isinstance(content, list) and len(content) > MAX_CONTENT_PARTS:
            raise ValueError(
                f"messages: a message of {len(content):,} content parts; give at most {MAX_CONTENT_PARTS} per message"
            )
        return content

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if p.type == "text")


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`: messages, rendered by the checkpoint's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    """The conversation: at most `parse_body`'s max_messages (MAX_MESSAGES unless the server says)."""

    @field_validator("messages", mode="before")
    @classmethod
    def _message_count(cls, messages, info: ValidationInfo):
        # Before pydantic validates each message, so that a list of any length costs only len().
        limit = (info.context or {}).get("max_messages", MAX_MESSAGES)
        if isinstance(messages, list) and len(messages) > limit:
            raise ValueError(f"messages: {len(messages):,} messages; give at most {limit} per request")
        return messages

    max_completion_tokens: int | None = Field(None, ge=1)
    """OpenAI's newer name of max_tokens (it wins when both are given)."""
    logprobs: bool | None = None
    """Return each content token's log-probability (and `top_logprobs` alternatives)."""
    top_logprobs: int | None = None
    """0..20 most likely alternatives per token; needs `logprobs: true` (the range is
    SamplingParams.check's, as for every sampling setting)."""

    def alternatives(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise RequestError(f"top_logprobs={self.top_logprobs} needs logprobs: true", "top_logprobs")
            return None
        return self.top_logprobs or 0

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def asked_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# The fix to name when a field has the wrong shape (its type's phrase otherwise).
_FIELD_HINTS = {
    "prompt": "give a string or a list of token ids",
    "messages": "give a non-empty list of {role, content} objects",
    "messages[]": "give an object with a string role and text content",
    "stop": "give a string or a list of up to 4 non-empty strings",
    "stop_token_ids": f"give a list of up to {MAX_STOP_TOKEN_IDS} token ids",
    "stream_options": 'give an object like {"include_usage": true}',
}
_TYPE_PHRASES = {
    "int_type": "give an integer",
    "float_type": "give a number",
    "bool_type": "give true or false",
    "string_type": "give a string",
    "missing": "this field is required",
}


def parse_body(model: type[_Body], body: dict[str, Any], *, max_messages: int = MAX_MESSAGES) -> Any:
    """`body` validated into `model`, or RequestError: one line naming the first bad field, `param` that field.

    A chat body may hold at most `max_messages` messages (the server's --max-messages).

        parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": "Hi"}]}, max_messages=64)
    """
    try:
        return model.model_validate(body, context={"max_messages": max_messages})
    except ValidationError as e:
        raise request_error(e) from None


def request_error(e: ValidationError) -> RequestError:
    """The first of pydantic's errors as one line, `field=value: the fix`; `param` is the top-level field."""
    error = e.errors()[0]
    loc, kind = error["loc"], error["type"]
    if kind == "value_error":  # a validator's own sentence, which names the field
        return RequestError(str(error["ctx"]["error"]), str(loc[0]) if loc else None)
    if not loc:
        return RequestError("the request body must be a JSON object")
    field = str(loc[0])
    item = len(loc) > 1 and isinstance(loc[1], int)  # messages[i]: the fix is about one item
    where = f"{field}[{loc[1]}]" if item else field
    if kind == "greater_than_equal":
        fix = f"use at least {error['ctx']['ge']}"
    else:
        fix = _FIELD_HINTS.get(field + "[]" if item else field) or _TYPE_PHRASES.get(kind) or error["msg"]
    value = error.get("input")
    shown = f"={value!r}" if len(loc) == 1 and isinstance(value, (int, float, str)) and len(repr(value)) <= 40 else ""
    return RequestError(f"{where}{shown}: {fix}", field)
