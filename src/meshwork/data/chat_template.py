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

    template = chat_template_of("~/Llama-3.2-1B-Instruct")
    render_chat([{"role": "user", "content": "Hi"}], template)  # '<|begin_of_text|>...'
"""

from __future__ import annotations

import functools
import json
import pathlib
from dataclasses import dataclass, field

# Without a chat template in the checkpoint's tokenizer files, messages are rendered as
# "role: content" lines and the prompt ends with "assistant:", the model to continue from there.
FALLBACK_CHAT_TEMPLATE = "{role}: {content}\n"
FALLBACK_GENERATION_PROMPT = "assistant:"


class ChatTemplateError(ValueError):
    """The template refused the messages (its `raise_exception`, or a Jinja error)."""


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


@functools.lru_cache(maxsize=8)
def _compiled(source: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not parse: {e}") from None


def render_chat(messages: list[dict], template: ChatTemplate, *, add_generation_prompt: bool = True) -> str:
    """The text of `messages` under `template` (ChatTemplateError when the template refuses them).

    With `add_generation_prompt`, the text ends where the assistant's next message begins."""
    if template.source is None:
        text = "".join(FALLBACK_CHAT_TEMPLATE.format(**m) for m in messages)
        return text + FALLBACK_GENERATION_PROMPT if add_generation_prompt else text
    import jinja2

    try:
        return _compiled(template.source).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **template.special_tokens
        )
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the chat template refused these messages: {e}") from None
