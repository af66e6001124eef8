"""OpenAI-compatible HTTP serving over the continuous-batching `Server` (`python3 -m inference serve`).

    engine = Engine(Server(model, slots=8, max_len=512), max_queue=64)
    app = create_app(engine, Served("lm_tiny", tokenizer, stops=[2], chat_template=None), max_tokens=256)
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with
`stream: true` as server-sent events), `GET /v1/models`, `GET /health` (the
pool's state: live slots, free pages, queued requests).

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
a bad field, 404 for another model's name, 429 when the queue is full.

Beyond OpenAI's fields a request may give `top_k`, `repetition_penalty`,
`stop_token_ids` and `ignore_eos` (vLLM's names), and every choice carries
`token_ids`, the ids it generated (the stop token included), so a client can
compare them with a solo run. Stop strings (`stop`) are matched in the text
here: the text ends before the first one and the request is cancelled.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from meshwork.config import ConfigError
from meshwork.inference.sampling import SamplingParams
from meshwork.inference.serve_engine import Engine, QueueFull
from meshwork.inference.serving import Request, Result, Server

# Without a chat template in the checkpoint's tokenizer files, messages are rendered as
# "role: content" lines and the prompt ends with "assistant:", the model to continue from there.
FALLBACK_CHAT_TEMPLATE = "{role}: {content}\n"


# ----------------------------------------------------------------------------- text in, text out


@dataclass
class Served:
    """What the HTTP layer knows of the model: its name, tokenizer (None: ids only), default stops."""

    name: str
    tokenizer: Any
    stops: list[int] = field(default_factory=list)
    chat_template: str | None = None   # a Hugging Face Jinja template, or None for FALLBACK_CHAT_TEMPLATE
    special_tokens: dict = field(default_factory=dict)  # bos_token, eos_token for the template

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise _Bad("this model has no tokenizer here (it was trained on pre-tokenized data); send the prompt "
                       "as a list of token ids", "prompt")
        if not special and hasattr(self.tokenizer, "tok"):  # the template already wrote BOS
            return list(self.tokenizer.tok.encode(text, add_special_tokens=False).ids)
        return [int(t) for t in self.tokenizer.encode(text)]

    def decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)

    def render_chat(self, messages: list[dict]) -> tuple[str, bool]:
        """(prompt text, whether it came from the checkpoint's template)."""
        if self.chat_template is None:
            return "".join(FALLBACK_CHAT_TEMPLATE.format(**m) for m in messages) + "assistant:", False
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            text = env.from_string(self.chat_template).render(messages=messages, add_generation_prompt=True,
                                                              **self.special_tokens)
        except jinja2.exceptions.TemplateError as e:
            raise _Bad(f"the checkpoint's chat template refused these messages: {e}", "messages") from None
        return text, True


def chat_template_of(folder) -> tuple[str | None, dict]:
    """(chat template, {bos_token, eos_token}) from a tokenizer folder's files, as transformers reads them:
    chat_template.jinja, else tokenizer_config.json's "chat_template" (a string, or a list with "default")."""
    import pathlib

    folder = pathlib.Path(folder)
    config = {}
    if (folder / "tokenizer_config.json").is_file():
        config = json.loads((folder / "tokenizer_config.json").read_text())
    special = {}
    for key in ("bos_token", "eos_token"):
        token = config.get(key)
        special[key] = token.get("content", "") if isinstance(token, dict) else (token or "")
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(), special
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template, special


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
            text = text[:len(text) - self._partial_stop(text)]
        return self._delta(text)

    def flush(self) -> str:
        return self._delta(self._cut(self.served.decode(self.ids)))

    def _cut(self, text: str) -> str:
        """`text` up to the earliest stop string in it (and `stopped` set), or all of it."""
        hits = [i for i in (text.find(stop) for stop in self.stop_strings) if i >= 0]
        if hits:
            self.stopped = True
            return text[:min(hits)]
        return text

    def _partial_stop(self, text: str) -> int:
        """The length of the longest end of `text` that begins a stop string."""
        return max((n for stop in self.stop_strings for n in range(min(len(stop) - 1, len(text)), 0, -1)
                    if text.endswith(stop[:n])), default=0)

    def _delta(self, text: str) -> str:
        if not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


# ----------------------------------------------------------------------------- requests


class _Bad(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _number(body: dict, key: str, default, kind=float, minimum=None):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise _Bad(f"{key}={value!r}: give a{'n integer' if kind is int else ' number'}", key)
    if minimum is not None and value < minimum:
        raise _Bad(f"{key}={value!r}: use at least {minimum}", key)
    return kind(value)


@dataclass
class Limits:
    max_tokens: int = 256      # the most tokens one request may ask for
    default_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default)


def parse_sampling(body: dict, served: Served, limits: Limits, prompt_len: int, max_len: int,
                   chat: bool) -> SamplingParams:
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise _Bad(f"{key} is not supported; use repetition_penalty (> 1 discourages repeats)", key)
    if body.get("n") not in (None, 1):
        raise _Bad(f"n={body.get('n')!r}: one choice per request; send n requests", "n")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise _Bad("logprobs are not supported", "logprobs")
    if body.get("echo"):
        raise _Bad("echo is not supported", "echo")
    if body.get("best_of") not in (None, 1):
        raise _Bad("best_of is not supported", "best_of")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    room = max_len - prompt_len
    default = min(limits.max_tokens, room) if chat else limits.default_max_tokens
    max_tokens = _number(body, key, default, int, 1)
    if max_tokens > limits.max_tokens:
        raise _Bad(f"{key}={max_tokens}: this server gives at most {limits.max_tokens} tokens per request "
                   "(--max-tokens)", key)
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise _Bad("stop_token_ids: give a list of token ids", "stop_token_ids")
    stops = tuple(stop_ids) + (() if body.get("ignore_eos") else tuple(served.stops))
    seed = body.get("seed")
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else _number(body, "seed", 0, int)
    params = SamplingParams(temperature=_number(body, "temperature", 1.0), top_p=_number(body, "top_p", 1.0),
                            top_k=_number(body, "top_k", 0, int), max_new_tokens=max_tokens, stop_tokens=stops,
                            repetition_penalty=_number(body, "repetition_penalty", 1.0), seed=seed)
    return params


def parse_stop(body: dict, served: Served) -> tuple[str, ...]:
    """OpenAI's `stop`: a string or a list of up to 4, matched in the generated text."""
    stop = body.get("stop")
    if stop in (None, [], ""):
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops) or len(stops) > 4:
        raise _Bad("stop: give a string or a list of up to 4 non-empty strings", "stop")
    if served.tokenizer is None:
        raise _Bad("stop strings need a tokenizer, which this model has not here; give stop_token_ids", "stop")
    return tuple(stops)


def completion_prompt(body: dict, served: Served) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return served.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise _Bad(f"a batch of {len(prompt)} prompts: send one prompt per request", "prompt")
    raise _Bad("prompt: give a string or a list of token ids", "prompt")


def chat_prompt(body: dict, served: Served) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _Bad("messages: give a non-empty list of {role, content} objects", "messages")
    plain = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # content parts: the text ones, joined
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise _Bad(f"messages[{i}]: give an object with a string role and text content", "messages")
        plain.append({"role": m["role"], "content": content})
    text, templated = served.render_chat(plain)
    return served.encode(text, special=not templated)


def check_request(server: Server, prompt: list[int], params: SamplingParams) -> None:
    """The checks Server.submit makes, before the request is queued (so that it gets a 400, not a
    stream that ends in an error)."""
    try:
        params.check(server.cfg.vocab_size)
        server.gen.check_prompt(prompt, params.max_new_tokens, server.max_len)
    except ConfigError as e:
        raise _Bad(str(e), "prompt" if "prompt" in str(e) or "token ids" in str(e) else None) from None
    worst = -(-(len(prompt) + params.max_new_tokens) // server.page_size)
    if worst > server.pages.per_replica - 1:
        raise _Bad(f"the request needs up to {worst} pages of {server.page_size} tokens but a replica's pool "
                   f"has {server.pages.per_replica - 1}; shorten the prompt or lower max_tokens", "max_tokens")


# ----------------------------------------------------------------------------- the app


def create_app(engine: Engine, served: Served, limits: Limits | None = None):
    """The FastAPI application serving `engine` (its thread starts and stops with the app's lifespan)."""
    import contextlib

    limits = limits or Limits()
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="meshwork", lifespan=lifespan)

    def bad(e: _Bad) -> JSONResponse:
        return JSONResponse(error_body(e.message, e.kind, e.param, e.code), status_code=e.status)

    @app.exception_handler(404)
    async def not_found(request: HTTPRequest, exc):
        return JSONResponse(error_body(f"no route {request.method} {request.url.path}; see /v1/models, "
                                       "/v1/completions, /v1/chat/completions, /health", code="not_found"), 404)

    @app.exception_handler(405)
    async def not_allowed(request: HTTPRequest, exc):
        return JSONResponse(error_body(f"{request.method} is not allowed on {request.url.path}"), 405)

    @app.get("/health")
    async def health():
        ok = engine.alive
        return JSONResponse({"status": "ok" if ok else "failed", "error": engine.failure, **engine.stats()},
                            status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": created,
                                            "owned_by": "meshwork", "max_model_len": engine.server.max_len}]}

    async def read_body(request: HTTPRequest) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _Bad(f"the request body is not JSON ({e})") from None
        if not isinstance(body, dict):
            raise _Bad("the request body must be a JSON object")
        if body.get("model") not in (None, served.name):
            raise _Bad(f"model {body.get('model')!r} is not served here; this server serves {served.name!r} "
                       "(GET /v1/models)", "model", 404, "model_not_found")
        if not isinstance(body.get("stream", False), bool):
            raise _Bad("stream: give true or false", "stream")
        return body

    async def serve(request: HTTPRequest, chat: bool):
        try:
            body = await read_body(request)
            prompt = chat_prompt(body, served) if chat else completion_prompt(body, served)
            params = parse_sampling(body, served, limits, len(prompt), engine.server.max_len, chat)
            stop_strings = parse_stop(body, served)
            check_request(engine.server, prompt, params)
            if not engine.alive:
                raise _Bad(f"the engine is not running ({engine.failure or 'shutting down'})", None, 503,
                           kind="server_error")
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            loop, events = asyncio.get_running_loop(), asyncio.Queue()
            engine.submit(Request(rid, prompt, params),
                          lambda kind, x: loop.call_soon_threadsafe(events.put_nowait, (kind, x)))
        except _Bad as e:
            return bad(e)
        except QueueFull as e:
            return bad(_Bad(str(e), None, 429, "queue_full", "rate_limit_error"))
        reply = _Reply(rid, served.name, chat, TextStream(served, params.stop_tokens, stop_strings), len(prompt))
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(_sse(request, engine, rid, events, reply, usage), media_type="text/event-stream")
        try:
            while True:
                kind, x = await _next(request, events)
                if kind == "done":
                    break
                reply.stream.push(x)
                if reply.stream.stopped:  # a stop string: the request ends here
                    engine.cancel(rid)
                    x = Result(rid, list(reply.stream.ids), "stop")
                    break
        except _Gone:
            engine.cancel(rid)
            return JSONResponse(error_body("client disconnected"), 499)
        if x.finish == "error":
            return bad(_Bad(x.error or "the request failed"))
        return reply.whole(x)

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await serve(request, chat=True)

    return app


class _Gone(Exception):
    pass


async def _next(request, events: asyncio.Queue) -> tuple[str, Any]:
    """The request's next event; _Gone when its client has disconnected meanwhile.

    `asyncio.wait_for(events.get(), t)` could drop an event (a get that completes as the timeout
    cancels it loses its item), so one pending get lives across the polls and is never cancelled
    while it may hold an item."""
    if await request.is_disconnected():
        raise _Gone
    if not events.empty():
        return events.get_nowait()
    getter = asyncio.ensure_future(events.get())
    try:
        while True:
            done, _ = await asyncio.wait({getter}, timeout=0.2)
            if done:
                return getter.result()
            if await request.is_disconnected():
                raise _Gone
    finally:
        if not getter.done():
            getter.cancel()


@dataclass
class _Reply:
    rid: str
    model: str
    chat: bool
    stream: TextStream
    prompt_tokens: int
    created: int = field(default_factory=lambda: int(time.time()))

    def usage(self, n: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}

    def whole(self, result: Result) -> dict:
        text = self.stream.sent + self.stream.flush()
        choice = {"index": 0, "finish_reason": result.finish, "logprobs": None, "token_ids": result.tokens}
        choice.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
        return {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": self.usage(len(result.tokens))}

    def chunk(self, text: str | None, ids: list[int], finish: str | None, first: bool = False) -> str:
        choice: dict = {"index": 0, "finish_reason": finish, "logprobs": None, "token_ids": ids}
        if self.chat:
            choice["delta"] = ({"role": "assistant", "content": text or ""} if first else
                               {} if text is None else {"content": text})
        else:
            choice["text"] = text or ""
        body = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}
        return f"data: {json.dumps(body)}\n\n"


async def _sse(request, engine: Engine, rid: str, events: asyncio.Queue, reply: _Reply, usage: bool):
    """Server-sent events: one chunk per token, a last one with the finish reason, then [DONE]."""
    done, n = False, 0
    try:
        if reply.chat:
            yield reply.chunk("", [], None, first=True)
        while True:
            kind, x = await _next(request, events)
            if kind == "done":
                done = True
                break
            n += 1
            yield reply.chunk(reply.stream.push(x), [x], None)
            if reply.stream.stopped:  # a stop string: the request ends here
                engine.cancel(rid)
                done, x = True, Result(rid, list(reply.stream.ids), "stop")
                break
        if x.finish == "error":
            yield f"data: {json.dumps(error_body(x.error or 'the request failed', 'server_error'))}\n\n"
            return
        tail = reply.stream.flush()
        yield reply.chunk(tail if tail or not reply.chat else None, [], x.finish)
        if usage:
            body = {"id": reply.rid, "object": "chat.completion.chunk" if reply.chat else "text_completion",
                    "created": reply.created, "model": reply.model, "choices": [], "usage": reply.usage(n)}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    except _Gone:
        pass
    finally:  # the client left (or the server is being shut down): free the slot and pages
        if not done:
            engine.cancel(rid)


