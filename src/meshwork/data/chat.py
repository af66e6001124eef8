"""Chat conversations for supervised fine-tuning (`data.source: chat`): rendered, masked, packed.

Each line of a `.jsonl` file in `data.text_files` holds one conversation, OpenAI-style: field
`data.messages_field` (default `messages`) is a list of `{"role", "content"}` messages, roles
system, user, assistant or tool, at least one of them the assistant's.

Rendering: with the chat template of the tokenizer's folder (data/chat_template.py: the
sandboxed Jinja renderer the server uses; the `role: content` fallback when the folder has
none, or with the byte tokenizer), so the model learns the text it will be prompted with.

Masking, by incremental rendering: for the assistant message i, the text up to it is
`render(messages[:i], add_generation_prompt=True)` and the text through it
`render(messages[:i+1])`; each must be a prefix of the next and of the whole conversation's
text, and the characters between the two are that turn's (its content and whatever the
template closes a turn with, e.g. `<|eot_id|>`, so the model learns to stop). A template that
does not render turns as prefixes of one another (one that rewrites earlier turns) is refused.
The whole text is then tokenized once, as the server tokenizes a prompt (templated text with no
added special tokens, since the template writes BOS; the fallback's with them, plus the EOS the
tokenizer names, a target when the conversation ends with the assistant), and a token is a
target when the character it starts at lies in an assistant turn (the byte tokenizer: each byte).

Packing, the split and the cache are data.source text's (user_text.py): conversations are
concatenated into windows of seq_len+1 tokens with a segment id per conversation; `loss_mask`
is 1 only where the target is an assistant token of the same conversation. The cache is keyed
also by the template and the special tokens it is rendered with.

    corpus = chat_corpus(["chats/*.jsonl"], tokenizer="~/Qwen2.5-0.5B-Instruct")
    batch = next(user_text.train_iterator(corpus.train, seq_len=512, global_batch=8, seed=0))
    batch["loss_mask"]  # 1 on the assistant's tokens
"""

from __future__ import annotations

import hashlib
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from meshwork.config import ConfigError
from meshwork.data import user_text
from meshwork.data.chat_template import ChatTemplate, ChatTemplateError, chat_template_of, render_chat

ROLES = ("system", "user", "assistant", "tool")
CHAT_FORMAT = 1  # bump when rendering or masking changes what a conversation's tokens are


@dataclass(frozen=True)
class Conversation:
    """A conversation's rendered text and its assistant turns' [start, end) character spans."""

    text: str
    spans: tuple[tuple[int, int], ...]

    def __len__(self) -> int:
        return len(self.text)


def template_for(tokenizer: str | None) -> ChatTemplate:
    """The chat template of `data.tokenizer`'s folder (a tokenizer.json's own folder); the fallback
    for the byte tokenizer or a folder without one."""
    if tokenizer is None:
        return ChatTemplate()
    path = pathlib.Path(tokenizer).expanduser()
    folder = path if path.is_dir() else path.parent
    try:
        return chat_template_of(folder)
    except ValueError as e:  # tokenizer_config.json that is not JSON
        raise ConfigError(
            f"data.tokenizer: {folder}/tokenizer_config.json is not JSON ({e}); fix or remove it"
        ) from None


def render_conversation(messages: list[dict], template: ChatTemplate) -> Conversation:
    """The text of `messages` and where each assistant turn lies in it (ChatTemplateError if the
    template refuses the messages or rewrites earlier turns as the conversation grows)."""
    whole = render_chat(messages, template, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render_chat(messages[:i], template, add_generation_prompt=True)
        through = render_chat(messages[: i + 1], template, add_generation_prompt=False)
        if not (through.startswith(before) and whole.startswith(through)):
            raise ChatTemplateError(
                f"the chat template does not render assistant message {i + 1} as a continuation of the "
                "turns before it (it rewrites earlier turns), so its tokens cannot be told apart"
            )
        if len(through) > len(before):
            spans.append((len(before), len(through)))
    return Conversation(whole, tuple(spans))


def _check_messages(messages, where: str) -> None:
    """ConfigError naming `where` (file:line) for a conversation meshwork cannot train on."""
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if messages == [] else f"a {type(messages).__name__}"
        raise ConfigError(f"data.text_files: {where}: the messages are {got}, not a list of messages")
    for j, m in enumerate(messages, 1):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ConfigError(
                f"data.text_files: {where}: message {j} is not an object with a role and a content "
                '(write {"role": "user", "content": "..."})'
            )
        if m["role"] not in ROLES:
            raise ConfigError(
                f"data.text_files: {where}: message {j} has role {m['role']!r}; use one of {', '.join(ROLES)}"
            )
        if not isinstance(m["content"], str):
            raise ConfigError(
                f"data.text_files: {where}: message {j}'s content is a {type(m['content']).__name__}, not a string"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(
            f"data.text_files: {where}: the conversation has no assistant message, so nothing to learn; "
            "add the assistant's reply or remove the line"
        )


def read_conversations(
    path: pathlib.Path, messages_field: str, template: ChatTemplate
) -> Iterator[tuple[int, Conversation | None, int]]:
    """(line index, rendered conversation or None for a blank line, bytes read) for one .jsonl file."""
    if path.suffix.lower() != ".jsonl":
        raise ConfigError(
            f"data.text_files: {path} is not a .jsonl file; data.source=chat reads .jsonl files "
            f"holding one conversation per line (field {messages_field!r})"
        )
    try:
        for i, messages, nbytes in user_text.jsonl_records(path, messages_field, "data.messages_field", "the messages"):
            if messages is None:
                yield i, None, nbytes
                continue
            _check_messages(messages, f"{path}:{i + 1}")
            try:
                conversation = render_conversation(messages, template)
            except Exception as e:  # the template's own error (raise_exception), or a Jinja or type error
                which = "the fallback template" if template.source is None else "the chat template"
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise ConfigError(f"data.text_files: {path}:{i + 1}: {which} does not render it ({msg})") from None
            yield i, conversation, nbytes
    except OSError as e:
        raise ConfigError(f"data.text_files: {path} cannot be read ({e.strerror}); check its permissions") from None


def encode_conversations(
    tok: user_text.TextTokenizer, template: ChatTemplate, conversations: list[Conversation]
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each conversation's ids and, per id, 1 when it is an assistant token (a target), else 0."""
    out = []
    if tok._tok is None:  # bytes: a byte is a target when it lies in an assistant span
        for c in conversations:
            data = c.text.encode("utf-8")
            mask = np.zeros(len(data), np.uint8)
            for start, end in c.spans:
                mask[len(c.text[:start].encode("utf-8")) : len(c.text[:end].encode("utf-8"))] = 1
            out.append((np.frombuffer(data, np.uint8).astype(tok.dtype), mask))
        return out
    special = not template.templated  # the template writes BOS itself, as the server assumes
    for c, enc in zip(
        conversations, tok._tok.encode_batch([c.text for c in conversations], add_special_tokens=special)
    ):
        ids, mask = list(enc.ids), _starts_in(np.asarray(enc.offsets, np.int64).reshape(-1, 2), c.spans)
        if special and tok.eos_id is not None and (not ids or ids[-1] != tok.eos_id):
            ids.append(tok.eos_id)  # the fallback names no end: EOS ends the conversation
            mask = np.append(mask, np.uint8(bool(c.spans) and c.spans[-1][1] == len(c.text)))
        out.append((np.asarray(ids, tok.dtype), mask))
    return out


def _starts_in(offsets: np.ndarray, spans: tuple[tuple[int, int], ...]) -> np.ndarray:
    """1 for each token (its [start, end) characters) that is not empty and starts inside a span."""
    if not spans:
        return np.zeros(len(offsets), np.uint8)
    begin, end = np.asarray(spans, np.int64).T
    which = np.searchsorted(begin, offsets[:, 0], side="right") - 1  # the last span starting at or before it
    inside = (which >= 0) & (offsets[:, 0] < end[np.maximum(which, 0)]) & (offsets[:, 1] > offsets[:, 0])
    return inside.astype(np.uint8)


def chat_corpus(
    text_files: list[str],
    *,
    tokenizer: str | None = None,
    messages_field: str = "messages",
    val_fraction: float = 0.02,
    cache_dir: str | None = None,
    progress: bool | None = None,
) -> user_text.TextCorpus:
    """The tokenized conversations of `text_files` (.jsonl), from the cache when every input still
    matches, else rendered and tokenized now; each split's `mask` marks the assistant tokens."""
    files = user_text.find_text_files(text_files)
    tok = user_text.load_tokenizer(tokenizer)
    template = template_for(tokenizer)
    same_inputs = {
        "chat": CHAT_FORMAT,
        "text_field": messages_field,
        "tokenizer": tok.fingerprint,
        "chat_template": hashlib.sha256(
            repr((template.source, sorted(template.special_tokens.items()))).encode()
        ).hexdigest()[:16],
        "val_fraction": val_fraction,
    }
    fmt = user_text.DocumentFormat(
        read=lambda path: read_conversations(path, messages_field, template),
        encode=lambda conversations: encode_conversations(tok, template, conversations),
        masked=True,
    )
    return user_text.cached_corpus(files, tok, fmt, same_inputs, val_fraction, cache_dir, progress)
