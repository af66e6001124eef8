"""Chat templates: a tokenizer folder's Jinja template, rendered in a sandbox, or the fallback.

The one renderer of chat messages: the chat server prompts with it (inference/http_server.py's
`Served.render_chat`) and `data.source: chat` renders its training conversations with it, so a
model is trained on the text it is later prompted with. It lives in the data layer, below both.

A template comes from a folder as transformers reads it: `chat_template.jinja`, else
`tokenizer_config.json`'s `chat_template` (a string, or a list whose entry named `default`).
It is rendered by jinja2's `ImmutableSandboxedEnvironment` (no attribute access to Python
internals, no mutation of the messages) with `raise_exception` and the folder's `bos_token` and
`eos_token`. Without a template, each message is one `role: content` line and the generation
prompt is `assistant:`.

A template is code that comes with the checkpoint, so it is as trusted as the checkpoint: the
sandbox bounds what it can *reach* (no Python internals, no files, no environment, no other
templates: `include`, `import` and `extends` are refused), and `_BoundedSandbox` bounds the
obvious ways one render could take the process's memory or a thread for good: `*`, `+`, `%`,
`str.format`, the str methods that pad, replace or join, and `lipsum` may not build a string or
list past `MAX_TEMPLATE_VALUE` items (nor an integer past `MAX_TEMPLATE_INT_BITS`), and one
render may spend at most `MAX_TEMPLATE_STEPS` calls, operators and `range` items. What it does
not bound: filters (`center`, `join`, `indent`, `format`) and `~` concatenation can still build
large strings, and a loop over a long string or list whose body calls nothing still runs. The
messages are data: their text is never rendered as a template. Every failure while rendering (a
refusal, a sandbox or bound error, any Python error) is a ChatTemplateError, which the HTTP
server answers with a 400.

    template = chat_template_of("~/Llama-3.2-1B-Instruct")
    render_chat([{"role": "user", "content": "Hi"}], template)  # '<|begin_of_text|>...'
"""

from __future__ import annotations

import contextvars
import functools
import json
import operator
import pathlib
import re
import string
from dataclasses import dataclass, field

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import generate_lorem_ipsum

# Without a chat template in the checkpoint's tokenizer files, messages are rendered as
# "role: content" lines and the prompt ends with "assistant:", the model to continue from there.
FALLBACK_CHAT_TEMPLATE = "{role}: {content}\n"
FALLBACK_GENERATION_PROMPT = "assistant:"


class ChatTemplateError(ValueError):
    """The template refused the messages or failed on them (its `raise_exception`, the sandbox, a bound, an error)."""


@dataclass(frozen=True)
class ChatTemplate:
    """A Hugging Face Jinja chat template (None: the fallback) and the special tokens it may write."""

    source: str | None = None
    special_tokens: dict = field(default_factory=dict)  # bos_token, eos_token

    @property
    def templated(self) -> bool:
        """Whether the text comes from the checkpoint's template (which writes BOS itself)."""
        return self.source is not None


def chat_template_of(folder) -> ChatTemplate:
    """The chat template of a tokenizer folder (its `source` None when the folder has none)."""
    folder = pathlib.Path(folder).expanduser()
    config = {}
    if (folder / "tokenizer_config.json").is_file():
        config = json.loads((folder / "tokenizer_config.json").read_text())
    special = {}
    for key in ("bos_token", "eos_token"):
        token = config.get(key)
        special[key] = token.get("content", "") if isinstance(token, dict) else (token or "")
    if (folder / "chat_template.jinja").is_file():
        return ChatTemplate((folder / "chat_template.jinja").read_text(), special)
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return ChatTemplate(template, special)


# Bounds on one render (see the module docstring): far above what a chat template renders for
# hundreds of messages (a value may hold a whole prompt, so its bound is above any context a
# model holds), far below what would take the server's memory or hold a thread.
MAX_TEMPLATE_VALUE = 1 << 24  # characters of a string or items of a list that an operator may build
MAX_TEMPLATE_INT_BITS = 4096  # bits of an integer that `*` or `**` may build
MAX_TEMPLATE_STEPS = 100_000  # calls, intercepted operators and range items in one render
MAX_ERROR_CHARS = 300  # of a template's error message, which a client sees

# Steps left in the render under way on this thread (None: outside render_chat, nothing counted).
_steps_left: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("chat_template_steps", default=None)
# A %-conversion's flags, width and precision, whose digits say how wide the result gets.
_PERCENT_SPEC = re.compile(r"%[#0 +\-]*(\*|\d*)(?:\.(\*|\d*))?")


def _refuse(message: str):
    raise SecurityError(f"{message} (chat templates are bounded; see meshwork.data.chat_template)")


def _spend(steps: int) -> None:
    left = _steps_left.get()
    if left is not None:
        left[0] -= steps
        if left[0] < 0:
            _refuse(f"the template took more than {MAX_TEMPLATE_STEPS:,} steps (calls, operators, range items)")


def _check_size(result_len: int, what: str) -> None:
    if result_len > MAX_TEMPLATE_VALUE:
        _refuse(f"{what} would build {result_len:,} items, more than {MAX_TEMPLATE_VALUE:,}")


def _check_bits(bits: int, what: str) -> None:
    if bits > MAX_TEMPLATE_INT_BITS:
        _refuse(f"{what} would build an integer of about {bits:,} bits, more than {MAX_TEMPLATE_INT_BITS:,}")


def _is_int(x) -> bool:
    return isinstance(x, int)  # bool included: True * 'a' is 'a'


def _bounded_binop(op: str, left, right):
    """`left op right` when its result stays within the bounds (checked before it is built, where
    the operands tell its size; %-formatting's result also after, as its arguments add to it)."""
    if op == "*":
        if _is_int(left) and _is_int(right):
            _check_bits(left.bit_length() + right.bit_length(), "*")
        elif isinstance(left, (str, list, tuple)) and _is_int(right):
            _check_size(len(left) * max(right, 0), "*")
        elif isinstance(right, (str, list, tuple)) and _is_int(left):
            _check_size(len(right) * max(left, 0), "*")
    elif op == "**":
        if _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
            _check_bits(left.bit_length() * right, "**")
    elif op == "+":
        if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            _check_size(len(left) + len(right), "+")
    elif op == "%" and isinstance(left, str):
        args = right if isinstance(right, tuple) else (right,)
        star_args = [a for a in args if _is_int(a)]  # '%*d' takes its width from the arguments
        for spec in _PERCENT_SPEC.finditer(left):
            for number in spec.groups():
                width = max(star_args, default=0) if number == "*" else int(number or 0)
                _check_size(width, "%-formatting")
        result = left % right
        _check_size(len(result), "%-formatting")
        return result
    return _BINOPS[op](left, right)


def _check_format(fmt: str) -> None:
    """Refuses a str.format string whose field widths or precisions pass MAX_TEMPLATE_VALUE."""
    for _, field_name, spec, _ in string.Formatter().parse(fmt):
        if field_name is None or not spec:
            continue
        if "{" in spec:  # a width taken from an argument: unbounded, and no chat template needs one
            _refuse("str.format with nested replacement fields in a format spec")
        for number in re.findall(r"\d+", spec):
            _check_size(int(number), "str.format")


_BINOPS = {"*": operator.mul, "**": operator.pow, "+": operator.add, "%": operator.mod}


def _bounded_range(*args) -> range:
    items = range(*args)
    _check_size(len(items), "range")
    _spend(len(items))
    return items


def _bounded_lipsum(n=5, html=True, min=20, max=100):  # jinja2's lipsum, whose keywords shadow min and max
    _check_size(n * max * 16, "lipsum")  # words of at most ~15 characters and a space
    return generate_lorem_ipsum(n, html, min, max)


# str methods whose integer arguments are the width of their result.
_WIDTH_METHODS = {"center", "ljust", "rjust", "zfill", "expandtabs"}


def _check_str_method(method, args) -> None:
    """Refuses a str method call whose result would pass MAX_TEMPLATE_VALUE (by its arguments)."""
    text, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if not isinstance(text, str):
        return
    if name in _WIDTH_METHODS:
        _check_size(max([a for a in args if _is_int(a)], default=0), f"str.{name}")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _check_size(len(text) + text.count(args[0]) * (len(args[1]) - len(args[0])), "str.replace")
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        parts = args[0]
        _check_size(sum(len(p) for p in parts if isinstance(p, str)) + len(text) * len(parts), "str.join")


class _NoTemplates(jinja2.BaseLoader):
    """A loader that has no templates: `include`, `import` and `extends` read nothing, and say why."""

    def get_source(self, environment, template):
        raise jinja2.TemplateNotFound(
            template, f"chat templates may not include, import or extend other templates (asked for {template!r})"
        )


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with the bounds above on operators, str.format, range and calls."""

    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def __init__(self, **kwargs):
        super().__init__(loader=_NoTemplates(), **kwargs)
        self.globals["range"] = _bounded_range
        self.globals["lipsum"] = _bounded_lipsum

    def call_binop(self, context, op, left, right):
        _spend(1)
        return _bounded_binop(op, left, right)

    def call(__self, __context, __obj, *args, **kwargs):
        _spend(1)
        _check_str_method(__obj, args)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value):
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None

        def bounded(*args, **kwargs):
            _check_format(value.__self__)
            result = wrapped(*args, **kwargs)
            _check_size(len(result), "str.format")
            return result

        return bounded


@functools.lru_cache(maxsize=8)
def _compiled(source: str):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except Exception as e:  # a syntax error, or a template nested past the parser's recursion
        raise ChatTemplateError(f"the chat template does not parse: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    """An error's message as one line of at most MAX_ERROR_CHARS characters (a template may raise any text)."""
    text = " ".join(str(e).split())
    if not isinstance(e, jinja2.exceptions.TemplateError):  # a Python error: its type says what went wrong
        text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def render_chat(messages: list[dict], template: ChatTemplate, *, add_generation_prompt: bool = True) -> str:
    """The text of `messages` under `template` (ChatTemplateError when the template refuses them).

    With `add_generation_prompt`, the text ends where the assistant's next message begins. Any
    failure of the template (its `raise_exception`, the sandbox, a bound, a Python error such as
    RecursionError) is a ChatTemplateError."""
    if template.source is None:
        text = "".join(FALLBACK_CHAT_TEMPLATE.format(**m) for m in messages)
        return text + FALLBACK_GENERATION_PROMPT if add_generation_prompt else text
    compiled = _compiled(template.source)
    budget = _steps_left.set([MAX_TEMPLATE_STEPS])
    try:
        return compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **template.special_tokens
        )
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the chat template refused these messages: {_one_line(e)}") from None
    except Exception as e:  # TypeError, OverflowError, RecursionError, MemoryError...: the template's fault
        raise ChatTemplateError(f"the chat template failed on these messages: {_one_line(e)}") from None
    finally:
        _steps_left.reset(budget)
