"""Templates and inputs stay data (issue 51): chat templates that reach for Python internals, files,
the environment, or try to take the memory or a thread are refused as ChatTemplateError (one line)
and nothing they reach for is read or run; legitimate templates render as jinja2's sandbox renders
them, a 2 MiB message included. Request fields that would reach an unbounded loop or array (a 10k-
character stop string, 10k stop ids, 10k messages or content parts, top_k 2**31, a NaN or infinite
temperature) are refused naming the field. Through a real server and the `openai` client each gets
a 400 in OpenAI's error shape, and the engine lives on: /health ok and a request served after."""

import math
import time

import jinja2.sandbox
import openai
import pytest
from conftest import hf_folder
from test_http_server import TEMPLATE, fetch

from meshwork.data.chat_template import (
    MAX_TEMPLATE_STEPS,
    MAX_TEMPLATE_VALUE,
    ChatTemplate,
    ChatTemplateError,
    render_chat,
)
from meshwork.engine.sampling import SamplingArrays, SamplingParams
from meshwork.engine.serving import Server
from meshwork.engine.validation import RequestError
from meshwork.inference.http_bodies import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)
from meshwork.inference.http_server import Limits, create_app
from meshwork.inference.serve_cli import ThreadedServer, load_served
from meshwork.inference.serve_engine import Engine

CHAT = [{"role": "user", "content": "hi"}]
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
NOT_INCLUDED = "may not include, import or extend"
UNSAFE = "is unsafe"

# (template, words of its ChatTemplateError). Jinja folds `**` left to right: 2 ** 10 ** 9 is 2 ** 90.
HOSTILE_TEMPLATES = {
    # files and other templates: there is no loader, so nothing is read
    "include-file": ("{% include '/etc/passwd' %}", NOT_INCLUDED),
    "import-module": ("{% import 'os' as os %}", NOT_INCLUDED),
    "from-import": ("{% from 'os' import system %}", NOT_INCLUDED),
    "extends": ("{% extends '/etc/passwd' %}", NOT_INCLUDED),
    # attribute walks to Python internals, globals and builtins
    "str-mro-subclasses": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", UNSAFE),
    "cycler-globals-os": ("{{ cycler.__init__.__globals__.os.popen('id').read() }}", UNSAFE),
    "joiner-globals-os": ("{{ joiner.__init__.__globals__.os.popen('id').read() }}", UNSAFE),
    "lipsum-globals": ("{{ lipsum.__globals__['os'].popen('id').read() }}", UNSAFE),
    "namespace-globals": ("{{ namespace.__init__.__globals__['__builtins__'] }}", UNSAFE),
    "self-globals": ("{{ self.__init__.__globals__ }}", UNSAFE),
    "loop-globals": ("{% for m in messages %}{{ loop.__class__.__init__.__globals__ }}{% endfor %}", UNSAFE),
    "format-attribute-walk": ("{{ '{0.__class__.__mro__}'.format('') }}", UNSAFE),
    "messages-append": ("{{ messages.append({'role': 'system', 'content': 'x'}) }}", UNSAFE),
    "dict-update": ("{% set d = {} %}{{ d.update({'a': 1}) }}", UNSAFE),
    "config": ("{{ config.items() }}", "'config' is undefined"),
    "request-environ": ("{{ request.environ }}", "'request' is undefined"),
    # memory: values past MAX_TEMPLATE_VALUE items, integers past MAX_TEMPLATE_INT_BITS, refused before built
    "string-times-10**12": ("{{ ('a' * 1000000000000)|length }}", r"\* would build 1,000,000,000,000 items"),
    "list-times-10**9": ("{{ ([0] * 1000000000)|length }}", r"\* would build 1,000,000,000 items"),
    "power-2**10**9": ("{{ 2 ** 1000000000 }}", r"\*\* would build an integer"),
    "squaring-loop": (
        "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x }}",
        r"\* would build an integer",
    ),
    "doubling-loop": (
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        r"\+ would build",
    ),
    "percent-width": ("{{ '%999999999d' % 1 }}", "%-formatting would build 999,999,999"),
    "percent-star-width": ("{{ '%*d' % (999999999, 1) }}", "%-formatting would build 999,999,999"),
    "format-width": ("{{ '{0:>999999999}'.format(1) }}", "str.format would build 999,999,999"),
    "format-nested-width": ("{{ '{0:>{1}}'.format(1, 999999999) }}", "nested replacement fields"),
    "ljust": ("{{ 'a'.ljust(999999999) }}", "str.ljust would build"),
    "replace-blowup": ("{{ ('a' * 100000).replace('a', 'a' * 100000) }}", "str.replace would build"),
    "join-blowup": ("{{ ('a' * 100000).join(['x'] * 100000) }}", "str.join would build"),
    "lipsum-million": ("{{ lipsum(n=1000000) }}", "lipsum would build"),
    # time: one render spends at most MAX_TEMPLATE_STEPS calls, operators and range items
    "range-10**9": ("{{ range(1000000000)|length }}", "range would build 1,000,000,000 items"),
    "loops-10**6-x-10**6": (
        "{% for i in range(1000000) %}{% for j in range(1000000) %}{% endfor %}{% endfor %}",
        "more than 100,000 steps",
    ),
    "loops-1000**3": (
        "{% for i in range(1000) %}{% for j in range(1000) %}{% for k in range(1000) %}"
        "{% endfor %}{% endfor %}{% endfor %}",
        "more than 100,000 steps",
    ),
    "recursive-macro": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    "branching-macro-2**40": (
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
        "more than 100,000 steps",
    ),
    # Python errors are the template's failure too: a 400, never a 500
    "zero-division": ("{{ 1 // 0 }}", "ZeroDivisionError"),
    "float-overflow": ("{{ 10.0 ** 1000 }}", "OverflowError"),
    "type-error": ("{{ messages + 1 }}", "TypeError"),
    "huge-error-message": ("{{ raise_exception('x' * 1000000) }}", r"xxx\.\.\.$"),
    "syntax-error": ("{% for %}", "does not parse"),
    "parser-recursion": ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "does not parse: RecursionError"),
}

# Templates that render, but what they reach for is an undefined value that prints as nothing.
EMPTY_HANDED = {
    "environ": "{{ environ }}",
    "private-attribute": "{{ self._TemplateReference__context }}",
    "attr-filter": "{{ ''|attr('__class__') }}",
    "function-globals": "{{ raise_exception.__globals__ }}{{ range.__globals__ }}",
    "format-map-walk": "{{ '{x.__class__}'.format_map({'x': 1}) }}",
    "generator-frame": "{{ (messages|map('string')).gi_frame }}",
}


@pytest.mark.parametrize("source, words", HOSTILE_TEMPLATES.values(), ids=HOSTILE_TEMPLATES.keys())
def test_a_hostile_template_is_a_one_line_chat_template_error(source, words):
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError, match=words) as refused:
        render_chat(CHAT, ChatTemplate(source, SPECIAL))
    message = str(refused.value)
    assert "\n" not in message and len(message) < 400, message
    assert time.perf_counter() - start < 5  # bounded, not a hang cut short


@pytest.mark.parametrize("source", EMPTY_HANDED.values(), ids=EMPTY_HANDED.keys())
def test_what_a_template_reaches_for_is_undefined(source):
    assert render_chat(CHAT, ChatTemplate(source, SPECIAL)) == ""


def test_a_command_a_template_tries_to_run_does_not_run(tmp_path):
    marker = tmp_path / "ran"
    for reach in ("cycler.__init__.__globals__.os", "lipsum.__globals__['os']", "joiner.__init__.__globals__.os"):
        with pytest.raises(ChatTemplateError, match=UNSAFE):
            render_chat(CHAT, ChatTemplate(f"{{{{ {reach}.popen('touch {marker}').read() }}}}"))
    assert not marker.exists()


def test_template_syntax_in_the_messages_is_text():
    """A client writes messages, not templates: Jinja in a role or a content is copied, never run."""
    payloads = ["{{ cycler.__init__.__globals__ }}", "{% include '/etc/passwd' %}", "{{ 'a' * 1000000000000 }}"]
    messages = [{"role": "{{ 7 * 7 }}", "content": p} for p in payloads]
    text = render_chat(messages, ChatTemplate(TEMPLATE, SPECIAL))
    assert all(p in text for p in payloads) and text.count("<|{{ 7 * 7 }}|>") == 3


LEGIT = (
    "{{ bos_token }}{% for m in messages %}{% set n = loop.index %}"
    "{{ '<|' + m['role'] + '|>' + m['content'] + eos_token }}{{ '%d' % n }}{{ '{}'.format(n * 2) }}"
    "{{ m['role'].center(12, '-') }}{{ ', '.join([m['role']] * 2) }}{% endfor %}"
    "{% for i in range(messages|length) %}{{ i ** 2 }}{% endfor %}{{ lipsum(1, False, 5, 10)|length > 0 }}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.mark.parametrize("template", [LEGIT, TEMPLATE], ids=["operators-and-methods", "http-server-template"])
def test_legitimate_templates_render_as_jinja2s_sandbox_renders_them(template):
    """The bounds change no output: 256 messages and a 2 MiB message render as the plain sandbox renders them."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["lipsum"] = lambda *a: "lorem"  # random words: only their presence is compared
    many = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i}"} for i in range(MAX_MESSAGES)]
    big = [{"role": "user", "content": "word " * (2 * 2**20 // 5)}]
    for messages in (many, big):
        expected = env.from_string(template).render(messages=messages, add_generation_prompt=True, **SPECIAL)
        assert render_chat(messages, ChatTemplate(template, SPECIAL)) == expected
    assert len(big[0]["content"]) < MAX_TEMPLATE_VALUE and 5 * MAX_MESSAGES < MAX_TEMPLATE_STEPS


# ----------------------------------------------------------------------------- request fields


def _refused(model, body, **kwargs) -> RequestError:
    with pytest.raises(RequestError) as refused:
        parse_body(model, body, **kwargs)
    assert "\n" not in str(refused.value) and len(str(refused.value)) < 200, refused.value
    return refused.value


def test_stop_strings_stop_ids_messages_and_parts_are_bounded():
    long_stop = "s" * 10_000
    for stop in (long_stop, ["a", long_stop]):
        e = _refused(CompletionRequest, {"prompt": "a", "stop": stop})
        assert e.param == "stop" and f"at most {MAX_STOP_CHARS} characters" in str(e)
    assert parse_body(CompletionRequest, {"prompt": "a", "stop": ["s" * MAX_STOP_CHARS] * 4}).stop_strings()
    e = _refused(CompletionRequest, {"prompt": "a", "stop_token_ids": list(range(10_000))})
    assert e.param == "stop_token_ids" and f"up to {MAX_STOP_TOKEN_IDS} token ids" in str(e)
    assert parse_body(CompletionRequest, {"prompt": "a", "stop_token_ids": [1] * MAX_STOP_TOKEN_IDS})

    chat = {"role": "user", "content": "x"}
    e = _refused(ChatCompletionRequest, {"messages": [chat] * 10_000})
    assert e.param == "messages" and f"10,000 messages; give at most {MAX_MESSAGES}" in str(e)
    assert len(parse_body(ChatCompletionRequest, {"messages": [chat] * MAX_MESSAGES}).messages) == MAX_MESSAGES
    # The server's --max-messages reaches the check through parse_body.
    e = _refused(ChatCompletionRequest, {"messages": [chat] * 3}, max_messages=2)
    assert "give at most 2" in str(e)
    assert parse_body(ChatCompletionRequest, {"messages": [chat] * 2}, max_messages=2)
    parts = [{"type": "text", "text": "x"}] * 10_000
    e = _refused(ChatCompletionRequest, {"messages": [{"role": "user", "content": parts}]})
    assert e.param == "messages" and f"at most {MAX_CONTENT_PARTS} per message" in str(e)


def test_fields_nobody_defines_are_ignored_whole():
    """logit_bias (which this server does not implement) and any other extra field: ignored, not walked."""
    body = parse_body(CompletionRequest, {"prompt": "a", "logit_bias": {str(i): 100 for i in range(100_000)}})
    assert body.model_extra is None and not hasattr(body, "logit_bias")


@pytest.mark.parametrize(
    "field, value, param, words",
    [
        ("top_k", 2**31, "top_k", "top_k=2147483648"),
        ("temperature", math.nan, "temperature", "temperature=nan"),
        ("temperature", math.inf, "temperature", "temperature=inf"),
        ("temperature", 1e300, "temperature", "finite"),
        ("repetition_penalty", math.inf, "repetition_penalty", "finite"),
        ("top_p", math.nan, "top_p", "top_p=nan"),
        ("max_tokens", 2**40, "max_tokens", "at most 2147483647"),
    ],
)
def test_numbers_that_would_not_fit_the_device_arrays_are_refused_by_the_check(field, value, param, words):
    """Through the pydantic model (which lets NaN and infinities through as floats) to the engine's one check,
    which refuses what `SamplingArrays.stack` would fail on in the engine's thread."""
    params = parse_body(CompletionRequest, {"prompt": "a", field: value}).sampling(stops=[2], default_max_tokens=4)
    with pytest.raises(RequestError, match=words) as refused:
        params.check(vocab_size=256)
    assert refused.value.param == param


def test_top_k_past_int32_is_what_failed_on_the_engine_thread():
    with pytest.raises(OverflowError):
        SamplingArrays.stack([SamplingParams(top_k=2**31)])
    SamplingArrays.stack([SamplingParams(top_k=2**31 - 1)])  # the largest the check lets through


def test_bad_stop_ids_are_named_by_the_first_few():
    with pytest.raises(RequestError) as refused:
        SamplingParams(stop_tokens=tuple(range(1000, 11_000))).check(vocab_size=256)
    assert "stop_tokens=[1000, 1001, 1002, ... (10,000 in all)]" in str(refused.value)


# ----------------------------------------------------------------------------- through the server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The HF Llama fixture (with its tokenizer and TEMPLATE) served in process; yields (client, served, url)."""
    model, served = load_served(str(hf_folder(tmp_path_factory.mktemp("hf") / "llama", TEMPLATE)))
    engine = Engine(Server(model, slots=2, page_size=4, max_len=64), max_queue=8)
    http = ThreadedServer(create_app(engine, served, Limits(max_tokens=8)))
    url = http.__enter__()
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60), served, url
    http.__exit__()


def _assert_400(call, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        call()
    error = refused.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and "\n" not in error["message"], error


def test_hostile_inputs_get_400_in_openais_shape_and_the_engine_lives_on(server):
    client, served, url = server
    name = served.name

    def completion(**extra):
        return lambda: client.completions.create(model=name, prompt="a b", max_tokens=2, extra_body=extra)

    _assert_400(completion(top_k=2**31), "top_k")  # it used to kill the engine: 503 for every later request
    _assert_400(completion(stop=["s" * 10_000]), "stop")
    _assert_400(completion(stop_token_ids=list(range(10_000))), "stop_token_ids")
    many = [{"role": "user", "content": "x"}] * 10_000
    _assert_400(lambda: client.chat.completions.create(model=name, messages=many, max_tokens=2), "messages")
    # One server, many templates: the template is read per request, so each is swapped in, not reloaded.
    original = served.chat_template
    try:
        for key in ("include-file", "cycler-globals-os", "string-times-10**12", "range-10**9", "recursive-macro"):
            served.chat_template = HOSTILE_TEMPLATES[key][0]
            _assert_400(lambda: client.chat.completions.create(model=name, messages=CHAT, max_tokens=2), "messages")
    finally:
        served.chat_template = original
    status, health = fetch(url + "/health")
    assert status == 200 and health["status"] == "ok", health
    reply = client.completions.create(model=name, prompt="a b", max_tokens=2, temperature=0, extra_body={"top_k": 5})
    assert reply.choices[0].finish_reason in ("stop", "length")
    chat = client.chat.completions.create(model=name, messages=CHAT, max_tokens=2, temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length")
