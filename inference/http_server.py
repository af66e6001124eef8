"""OpenAI-compatible HTTP serving over the continuous-batching `Server` (`python3 -m inference serve`).

    engine = Engine(Server(model, slots=8, max_len=512), max_queue=64)
    app = create_app(engine, Served("lm_tiny", tokenizer, stops=[2]), Limits(max_tokens=256))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with
`stream: true` as server-sent events), `GET /v1/models`, `GET /health` (the
pool's state: live slots, pages held, free and cached, queued, completed and cancelled requests).

The batching loop runs on its own thread (`Engine`, inference/serve_engine.py),
fed by a queue of commands (submit, cancel, stop); between two decode steps it
applies what arrived, so requests join and leave the running batch as in
`serving.py`. The command line is inference/serve_cli.py.
Each request's tokens go back to the asyncio loop of its HTTP handler through
`call_soon_threadsafe`. A handler whose client has gone (polled between
tokens) cancels its request: the engine takes it out of the queue or frees
its slot and pages before the next step.

Bad requests are answered before they reach the engine, with a 4xx and
OpenAI's error body `{"error": {"message", "type", "param", "code"}}`: 400 for
a bad field, 404 for another model's name, 429 when the queue is full. The
body is validated by its pydantic model (inference/http_bodies.py), the
request by the engine's one validator (`validation.check_request`, against
the server's limits and --max-tokens); a RequestError becomes the 400, its
`param` the error's.

Beyond OpenAI's fields a request may give `top_k`, `repetition_penalty`,
`stop_token_ids` and `ignore_eos` (vLLM's names), and every choice carries
`token_ids`, the ids it generated (the stop token included), so a client can
compare them with a solo run. `n` choices are n engine requests of the prompt (choice i with seed + i;
with prefix caching they share its full pages), their events tagged with the choice's index on one
queue; a client that leaves cancels all of them. Log-probabilities come with every token from the
engine (`sink("token", (id, logprob, alternatives))`) and are answered in OpenAI's shapes: the
completions API's {tokens, token_logprobs, top_logprobs, text_offset}, chat's {"content": [{token,
logprob, bytes, top_logprobs}]}, streamed per chunk. Stop strings (`stop`) are matched in the text
here: the text ends before the first one and the request is cancelled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from meshwork.data.chat_template import ChatTemplate, ChatTemplateError, render_chat
from meshwork.data.chat_template import chat_template_of as data_chat_template_of
from meshwork.engine.sampling import SamplingParams
from meshwork.engine.serving import Request, Result
from meshwork.engine.validation import RequestError, check_request
from meshwork.inference.http_bodies import ChatCompletionRequest, CompletionRequest, parse_body
from meshwork.inference.http_guard import KeyGuard
from meshwork.inference.http_limits import BodyTooLarge, read_body
from meshwork.inference.serve_engine import Engine, QueueFull

# ----------------------------------------------------------------------------- text in, text out


@dataclass
class Served:
    """What the HTTP layer knows of the model: its name, tokenizer (None: ids only), default stops."""

    name: str
    tokenizer: Any
    stops: list[int] = field(default_factory=list)
    chat_template: str | None = None  # a Hugging Face Jinja template, or None for FALLBACK_CHAT_TEMPLATE
    special_tokens: dict = field(default_factory=dict)  # bos_token, eos_token for the template

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise RequestError(
                "this model has no tokenizer here (it was trained on pre-tokenized data); send the "
                "prompt as a list of token ids",
                "prompt",
            )
        if not special and hasattr(self.tokenizer, "tok"):  # the template already wrote BOS
            return list(self.tokenizer.tok.encode(text, add_special_tokens=False).ids)
        return [int(t) for t in self.tokenizer.encode(text)]

    def decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)

    def token_text(self, token: int) -> str:
        """One token's text for the logprobs (its decoding alone; `token_id:N` without a tokenizer)."""
        return f"token_id:{token}" if self.tokenizer is None else self.tokenizer.decode([token])

    def render_chat(self, messages: list[dict]) -> tuple[str, bool]:
        """(prompt text, whether it came from the checkpoint's template): the renderer
        `data.source: chat` trains with (meshwork.data.chat_template), so a model is prompted
        with the text it was tuned on."""
        template = ChatTemplate(self.chat_template, self.special_tokens)
        try:
            return render_chat(messages, template), template.templated
        except ChatTemplateError as e:
            raise RequestError(f"the checkpoint's {e}", "messages") from None


def chat_template_of(folder) -> tuple[str | None, dict]:
    """(chat template, {bos_token, eos_token}) from a tokenizer folder's files, as transformers reads them:
    chat_template.jinja, else tokenizer_config.json's "chat_template" (a string, or a list with "default")."""
    template = data_chat_template_of(folder)
    return template.source, template.special_tokens


class TextStream:
    """Turns tokens into text deltas: bytes of one character may arrive in several tokens, so text that
    ends in an unfinished character (U+FFFD) is held back until it completes or the request ends.

    Stop strings (OpenAI's `stop`): once the text contains one, it ends just before it (`stopped`; the
    handler then cancels the request). Text that may be the start of a stop string is held back
    until the next tokens tell whether it is one."""

    def __init__(self, served: Served, stops: tuple[int, ...], stop_strings: tuple[str, ...] = ()):
        self.served, self.stops, self.stop_strings = served, stops, stop_strings
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False

    def push(self, token: int) -> str:
        if token in self.stops or self.stopped:  # a stop token ends the text and adds none
            return ""
        self.ids.append(token)
        text = self._cut(self.served.decode(self.ids).rstrip("\ufffd"))
        if not self.stopped:
            text = text[: len(text) - self._partial_stop(text)]
        return self._delta(text)

    def flush(self) -> str:
        return self._delta(self._cut(self.served.decode(self.ids)))

    def _cut(self, text: str) -> str:
        """`text` up to the earliest stop string in it (and `stopped` set), or all of it."""
        hits = [i for i in (text.find(stop) for stop in self.stop_strings) if i >= 0]
        if hits:
            self.stopped = True
            return text[: min(hits)]
        return text

    def _partial_stop(self, text: str) -> int:
        """The length of the longest end of `text` that begins a stop string."""
        return max(
            (
                n
                for stop in self.stop_strings
                for n in range(min(len(stop) - 1, len(text)), 0, -1)
                if text.endswith(stop[:n])
            ),
            default=0,
        )

    def _delta(self, text: str) -> str:
        if not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta


# ----------------------------------------------------------------------------- requests


class _Refused(Exception):
    """A request answered with another status than a bad field's 400 (another model, a full queue, ...)."""

    def __init__(
        self, message: str, param: str | None, status: int, code: str | None = None, kind: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Limits:
    max_tokens: int = 256  # the most tokens one request may ask for
    default_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default)
    max_body_bytes: int = 4 * 2**20  # a longer body gets 413 before it is read whole
    max_messages: int = 256  # chat messages in one request
    request_timeout: float = 600.0  # seconds from a request's arrival to its last token; then 504, its pages freed
    read_timeout: float = 30.0  # seconds for a request's body to arrive (its head: uvicorn's timeout, http_limits.py)


def prompt_ids(body: CompletionRequest | ChatCompletionRequest, served: Served) -> list[int]:
    """The body's prompt as token ids: completions' text encoded (ids as given), chat's messages rendered."""
    if isinstance(body, ChatCompletionRequest):
        text, templated = served.render_chat([{"role": m.role, "content": m.text()} for m in body.messages])
        return served.encode(text, special=not templated)
    return served.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)


def stop_strings(body: CompletionRequest | ChatCompletionRequest, served: Served) -> tuple[str, ...]:
    """OpenAI's `stop`, matched in the generated text: it needs a tokenizer."""
    stops = body.stop_strings()
    if stops and served.tokenizer is None:
        raise RequestError("stop strings need a tokenizer, which this model has not here; give stop_token_ids", "stop")
    return stops


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest, served: Served, limits: Limits, prompt_len: int, max_len: int
) -> SamplingParams:
    """The body's SamplingParams; without max_tokens, 16 for completions and, for chat, what is left of
    the cache (at most --max-tokens; at least 1, so that a prompt that fills the cache is named as such)."""
    chat = isinstance(body, ChatCompletionRequest)
    default = max(1, min(limits.max_tokens, max_len - prompt_len)) if chat else limits.default_max_tokens
    return body.sampling(stops=served.stops, default_max_tokens=default)


def openai_param(e: RequestError, body: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The field of this body that a RequestError's param names (chat has messages, not a prompt)."""
    if e.param == "prompt" and isinstance(body, ChatCompletionRequest):
        return "messages"
    if e.param == "max_tokens":
        return body.max_tokens_field
    return e.param


# ----------------------------------------------------------------------------- the app


def create_app(engine: Engine, served: Served, limits: Limits | None = None, api_key: str | None = None):
    """The FastAPI application serving `engine` (its thread starts and stops with the app's lifespan);
    with `api_key`, every path but /health answers 401 to a request without it (http_guard.py)."""
    import contextlib

    limits = limits or Limits()
    # What one request may ask: the server's own limits and this app's --max-tokens.
    request_limits = dataclasses.replace(engine.server.limits, max_new_tokens=limits.max_tokens)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_):
        engine.start()
        yield
        engine.stop()

    # No /docs or /openapi.json: nothing beyond the API itself is served.
    app = FastAPI(title="meshwork", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    if api_key is not None:
        app.add_middleware(KeyGuard, key=api_key)

    @app.exception_handler(Exception)
    async def unexpected(request: HTTPRequest, exc: Exception):  # a bug, answered in OpenAI's shape, not text
        return JSONResponse(error_body(f"internal error ({type(exc).__name__})", "server_error"), 500)

    @app.exception_handler(404)
    async def not_found(request: HTTPRequest, exc):
        return JSONResponse(
            error_body(
                f"no route {request.method} {request.url.path}; see /v1/models, "
                "/v1/completions, /v1/chat/completions, /health",
                code="not_found",
            ),
            404,
        )

    @app.exception_handler(405)
    async def not_allowed(request: HTTPRequest, exc):
        return JSONResponse(error_body(f"{request.method} is not allowed on {request.url.path}"), 405)

    @app.get("/health")
    async def health():
        ok = engine.alive
        return JSONResponse(
            {"status": "ok" if ok else "failed", "error": engine.failure, **engine.stats()},
            status_code=200 if ok else 503,
        )

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": served.name,
                    "object": "model",
                    "created": created,
                    "owned_by": "meshwork",
                    "max_model_len": engine.server.max_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await _serve(request, False, engine, served, limits, request_limits)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await _serve(request, True, engine, served, limits, request_limits)

    return app


def _bad(e: RequestError | _Refused, param: str | None = None) -> JSONResponse:
    """A refused request in OpenAI's error shape: a bad field is a 400, the rest carry their status."""
    if isinstance(e, RequestError):
        return JSONResponse(error_body(str(e), param=param or e.param), status_code=400)
    return JSONResponse(error_body(e.message, e.kind, e.param, e.code), status_code=e.status)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


async def _read_body(
    request: HTTPRequest, chat: bool, served: Served, limits: Limits
) -> CompletionRequest | ChatCompletionRequest:
    """The body, at most --max-body-bytes within --read-timeout, parsed whatever its Content-Type says
    (as OpenAI does), then validated into its model."""
    try:
        raw = await read_body(request, limits.max_body_bytes, limits.read_timeout)
    except BodyTooLarge as e:
        raise _Refused(str(e), None, 413, "request_too_large") from None
    except TimeoutError:
        raise _Refused(
            f"the request body did not arrive within {limits.read_timeout:g} s (the server's --read-timeout)",
            None,
            408,
            "request_timeout",
        ) from None
    try:  # NaN and Infinity are Python's extensions of JSON; nesting deep enough overflows the parser's stack
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise RequestError(f"the request body is not JSON ({str(e)[:200]})") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if body.get("model") not in (None, served.name):  # 404 before any field's 400
        raise _Refused(
            f"model {body.get('model')!r} is not served here; this server serves {served.name!r} (GET /v1/models)",
            "model",
            404,
            "model_not_found",
        )
    return parse_body(ChatCompletionRequest if chat else CompletionRequest, body, max_messages=limits.max_messages)


def choice_params(body: CompletionRequest | ChatCompletionRequest, params: SamplingParams, slots: int):
    """The SamplingParams of each of the body's `n` choices: choice i samples with seed + i (mod 2**32),
    so sampled choices differ and greedy ones agree. RequestError when n exceeds the server's slots."""
    n = body.choices
    if n > slots:
        raise RequestError(f"n={n}: this server runs at most {slots} choices of one prompt (its slots); ask fewer", "n")
    return [dataclasses.replace(params, seed=(params.seed + i) % 2**32) for i in range(n)]


async def _serve(request: HTTPRequest, chat: bool, engine: Engine, served: Served, limits: Limits, request_limits):
    """One completion request: validated, its n choices submitted to the engine, then streamed or answered
    whole."""
    body, submitted = None, []
    try:
        deadline = asyncio.get_running_loop().time() + limits.request_timeout
        body = await _read_body(request, chat, served, limits)
        prompt = prompt_ids(body, served)
        params = sampling_params(body, served, limits, len(prompt), engine.server.max_len)
        stops = stop_strings(body, served)
        check_request(prompt, params, request_limits)  # a 400 now, not a stream that ends in an error
        choices = choice_params(body, params, len(engine.server.slots))
        if not engine.alive:
            raise _Refused(
                f"the engine is not running ({engine.failure or 'shutting down'})", None, 503, kind="server_error"
            )
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        for i, p in enumerate(choices):  # equal prompts: with prefix caching, the later ones share its full pages
            engine.submit(Request(f"{rid}-{i}", prompt, p), _sink(loop, events, i))
            submitted.append(f"{rid}-{i}")
    except RequestError as e:
        return _bad(e, openai_param(e, body) if body is not None else None)
    except _Refused as e:
        return _bad(e)
    except QueueFull as e:
        for sub in submitted:
            engine.cancel(sub)
        return _bad(_Refused(str(e), None, 429, "queue_full", "rate_limit_error"))
    reply = _Reply(
        rid,
        served,
        chat,
        [_Choice(i, sub, TextStream(served, params.stop_tokens, stops)) for i, sub in enumerate(submitted)],
        len(prompt),
        params.logprobs if body.alternatives() is not None else None,
    )
    waiting = _Waiting(request, events, deadline, limits.request_timeout)
    if body.stream:
        return StreamingResponse(_sse(waiting, engine, reply, body.include_usage()), media_type="text/event-stream")
    return await _whole(waiting, engine, reply)


def _sink(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, index: int):
    """The engine's sink of choice `index`: its events, tagged with the index, onto the handler's queue."""
    return lambda kind, x: loop.call_soon_threadsafe(events.put_nowait, (index, kind, x))


async def _whole(waiting: _Waiting, engine: Engine, reply: _Reply):
    """A non-streamed request's answer, once each choice's last token (or a stop string) arrives."""
    try:
        while not reply.done:
            _, c, kind, x = reply.take(await waiting.next())
            if c is not None and kind == "token":
                c.push(x)
                if c.stream.stopped:  # a stop string: this choice ends here
                    engine.cancel(c.rid)
                    c.result = Result(c.rid, list(c.tokens), "stop")
    except _Gone:
        reply.cancel(engine)
        return JSONResponse(error_body("client disconnected"), 499)
    except _TimedOut:
        reply.cancel(engine)  # its slots and pages freed before the next step
        # A retry would time out again: the openai client retries a 504 unless told not to.
        return JSONResponse(waiting.timeout_error(), 504, headers={"x-should-retry": "false"})
    failed = reply.failed()
    if failed is not None:
        reply.cancel(engine)
        return _bad(RequestError(failed.error or "the request failed"))
    return reply.whole()


class _Gone(Exception):
    pass


class _TimedOut(Exception):
    pass


@dataclass
class _Waiting:
    """A handler waiting for its request's events: until its client leaves (_Gone) or its deadline
    passes (_TimedOut), checked at least every 0.2 s."""

    request: HTTPRequest
    events: asyncio.Queue
    deadline: float  # the event loop's clock
    timeout: float

    async def next(self) -> tuple[int, str, Any]:
        """The request's next event.

        `asyncio.wait_for(events.get(), t)` could drop an event (a get that completes as the timeout
        cancels it loses its item), so one pending get lives across the polls and is never cancelled
        while it may hold an item."""
        loop = asyncio.get_running_loop()
        if await self.request.is_disconnected():
            raise _Gone
        if not self.events.empty():
            return self.events.get_nowait()
        getter = asyncio.ensure_future(self.events.get())
        try:
            while True:
                left = self.deadline - loop.time()
                if left <= 0:
                    raise _TimedOut
                done, _ = await asyncio.wait({getter}, timeout=min(0.2, left))
                if done:
                    return getter.result()
                if await self.request.is_disconnected():
                    raise _Gone
        finally:
            if not getter.done():
                getter.cancel()

    def timeout_error(self) -> dict:
        return error_body(
            f"the request ran past the server's --request-timeout of {self.timeout:g} s and was cancelled; "
            "ask for fewer tokens",
            "server_error",
            code="request_timeout",
        )


@dataclass
class _Choice:
    """One of a request's n choices: its engine request, text and the tokens (with log-probabilities) so far."""

    index: int
    rid: str
    stream: TextStream
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    result: Result | None = None
    offset: int = 0  # the text offset of the next token (the completions API's logprobs.text_offset)

    def push(self, event: tuple[int, float, list[tuple[int, float]]]) -> str:
        """Records a (token, log p, alternatives) event; the text it adds."""
        token, logprob, top = event
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.top.append(top)
        return self.stream.push(token)


@dataclass
class _Reply:
    rid: str
    served: Served
    chat: bool
    choices: list[_Choice]
    prompt_tokens: int
    alternatives: int | None  # top alternatives per token in the logprobs; None: no logprobs asked
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def done(self) -> bool:
        return all(c.result is not None for c in self.choices)

    def take(self, event: tuple[int, str, Any]) -> tuple[int, _Choice | None, str, Any]:
        """(index, its choice, kind, payload) of an engine event; the choice is None when it has ended
        already (a stop string cancelled it while its events were on the way). A "done" ends it."""
        i, kind, x = event
        c = self.choices[i]
        if c.result is not None:
            return i, None, kind, x
        if kind == "done":
            c.result = x
        return i, c, kind, x

    def failed(self) -> Result | None:
        return next((c.result for c in self.choices if c.result is not None and c.result.finish == "error"), None)

    def cancel(self, engine: Engine) -> None:
        """Cancels every choice still running (the client left, or another choice failed)."""
        for c in self.choices:
            if c.result is None:
                engine.cancel(c.rid)

    def usage(self) -> dict:
        """The prompt counted once, the completion tokens summed over the choices (as OpenAI does)."""
        n = sum(len(c.tokens) for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}

    def logprobs(self, c: _Choice, start: int) -> dict | None:
        """The logprobs object of c's tokens from `start` on in OpenAI's shape (None when not asked):
        chat's {"content": [{token, logprob, bytes, top_logprobs}]}; the completions API's {tokens,
        token_logprobs, top_logprobs (dicts, with the sampled token's added), text_offset}."""
        if self.alternatives is None:
            return None
        text = self.served.token_text
        picked = list(zip(c.tokens[start:], c.logprobs[start:], c.top[start:]))
        if self.chat:
            return {
                "content": [
                    {**_token_entry(text(t), lp), "top_logprobs": [_token_entry(text(a), alp) for a, alp in top]}
                    for t, lp, top in picked
                ]
            }
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp, top in picked:
            out["tokens"].append(text(t))
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({**{text(a): alp for a, alp in top}, text(t): lp})
            out["text_offset"].append(c.offset)
            c.offset += len(text(t))
        return out

    def whole(self) -> dict:
        choices = []
        for c in self.choices:
            text = c.stream.sent + c.stream.flush()
            choice = {
                "index": c.index,
                "finish_reason": c.result.finish,
                "logprobs": self.logprobs(c, 0),
                "token_ids": c.tokens,
            }
            choice.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
            choices.append(choice)
        return {
            "id": self.rid,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.served.name,
            "choices": choices,
            "usage": self.usage(),
        }

    def chunk(self, c: _Choice, text: str | None, new: int, finish: str | None, first: bool = False) -> str:
        """A server-sent event of choice c: its text delta and its last `new` tokens (with their logprobs)."""
        start = len(c.tokens) - new
        logprobs = self.logprobs(c, start) if new else None
        choice: dict = {"index": c.index, "finish_reason": finish, "logprobs": logprobs, "token_ids": c.tokens[start:]}
        if self.chat:
            choice["delta"] = (
                {"role": "assistant", "content": text or ""} if first else {} if text is None else {"content": text}
            )
        else:
            choice["text"] = text or ""
        return self.event([choice])

    def event(self, choices: list[dict], **extra) -> str:
        body = {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.served.name,
            "choices": choices,
            **extra,
        }
        return f"data: {json.dumps(body)}\n\n"


def _token_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


async def _sse(waiting: _Waiting, engine: Engine, reply: _Reply, usage: bool):
    """Server-sent events: one chunk per token (each of one choice, with its index), a last one per
    choice with its finish reason, then the usage (if asked) and [DONE]."""
    try:
        if reply.chat:
            for c in reply.choices:
                yield reply.chunk(c, "", 0, None, first=True)
        while not reply.done:
            _, c, kind, x = reply.take(await waiting.next())
            if c is None:
                continue
            if kind == "token":
                yield reply.chunk(c, c.push(x), 1, None)
                if not c.stream.stopped:
                    continue
                engine.cancel(c.rid)  # a stop string: this choice ends here
                c.result = Result(c.rid, list(c.tokens), "stop")
            if c.result.finish == "error":
                yield f"data: {json.dumps(error_body(c.result.error or 'the request failed', 'server_error'))}\n\n"
                return
            tail = c.stream.flush()
            yield reply.chunk(c, tail if tail or not reply.chat else None, 0, c.result.finish)
        if usage:
            yield reply.event([], usage=reply.usage())
        yield "data: [DONE]\n\n"
    except _Gone:
        pass
    except _TimedOut:  # the status is sent already: the stream ends with an error event
        yield f"data: {json.dumps(waiting.timeout_error())}\n\n"
    finally:  # the client left, a choice failed, or the server is shutting down: free the slots and pages
        reply.cancel(engine)
