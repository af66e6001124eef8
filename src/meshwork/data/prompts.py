"""Prompts for reinforcement learning (`train.objective: grpo`): what the policy is asked, and the
fields its reward reads.

Each line of a `.jsonl` file in `data.text_files` is one example:

    {"messages": [{"role": "user", "content": "What is 7 + 5?"}], "answer": "12"}
    {"prompt": "7 + 5 = ", "answer": "12"}

`messages` (the conversation so far, ending with the user's turn) is rendered with the chat
template and its generation prompt, as data/chat.py renders a conversation and the server renders
a request, so the policy is prompted with the text it was fine-tuned on; `prompt` is used as
written. Every other field (`answer` here) is kept as it is and handed to the reward function
(train/rewards.py) with the prompt and the completion.

Tokens: the byte tokenizer's bytes, or the tokenizer's ids (its post-processor's BOS unless the
template writes it; no EOS: the prompt goes on). `stop_ids` are what ends a completion: the
template's end-of-turn token (the first token of what the template writes after an assistant
message's content: `\\n` for the fallback, `<|eot_id|>` for Llama 3) and the tokenizer's EOS.

The validation split is chosen by a hash of each line, as chat data's is; the held-out prompts
are what evaluation samples greedily and scores with the reward.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshwork.config import ConfigError
from meshwork.data import user_text
from meshwork.data.chat import _check_messages, template_for
from meshwork.data.chat_template import ChatTemplate, render_chat
from meshwork.data.preference_pairs import json_object, jsonl_lines


@dataclass(frozen=True)
class Prompt:
    """One example: the rendered prompt text, its token ids, and the line's other fields."""

    text: str
    ids: tuple[int, ...]
    fields: dict


@dataclass(frozen=True)
class PromptSet:
    train: list[Prompt]
    val: list[Prompt]
    stop_ids: tuple[int, ...]
    max_id: int
    tokenizer: user_text.TextTokenizer

    def decode(self, ids: list[int]) -> str:
        """A completion's text (the stop token, if it ends with one, left out)."""
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        tok = self.tokenizer._tok
        if tok is None:  # bytes; a model with a larger vocabulary may sample ids no byte has
            return bytes(i for i in ids if i < 256).decode("utf-8", "replace")
        return tok.decode(ids, skip_special_tokens=True)


def _prompt_text(record: dict, template: ChatTemplate, where: str) -> str:
    if "messages" in record:
        messages = record["messages"]
        if messages == []:
            raise ConfigError(
                f"data.text_files: {where}: the messages are an empty list; a prompt ends with the user's turn"
            )
        _check_messages(
            messages + [{"role": "assistant", "content": "x"}] if isinstance(messages, list) else messages, where
        )
        if messages[-1]["role"] == "assistant":
            raise ConfigError(
                f"data.text_files: {where}: the messages end with the assistant's turn; a prompt ends with the "
                "user's (the policy writes the assistant's reply)"
            )
        try:
            return render_chat(messages, template, add_generation_prompt=True)
        except Exception as e:  # the template's own error, or a Jinja or type error
            which = "the fallback template" if template.source is None else "the chat template"
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"data.text_files: {where}: {which} does not render it ({first})") from None
    if not isinstance(record["prompt"], str) or not record["prompt"]:
        raise ConfigError(f"data.text_files: {where}: the prompt must be a non-empty string")
    return record["prompt"]


def _parse(line: bytes, where: str) -> dict | None:
    if (record := json_object(line, where)) is None:
        return None
    if ("prompt" in record) == ("messages" in record):
        fields = ", ".join(map(repr, record))
        raise ConfigError(
            f"data.text_files: {where}: an example needs exactly one of 'prompt' (text) or 'messages' "
            f"(a conversation ending with the user's turn) (it has: {fields or 'no field'})"
        )
    return record


def _encode(tok: user_text.TextTokenizer, text: str, *, special: bool) -> tuple[int, ...]:
    """`text`'s ids; `special`: with the post-processor's BOS (a template writes its own)."""
    if tok._tok is None:
        return tuple(text.encode("utf-8"))
    return tuple(tok._tok.encode(text, add_special_tokens=special).ids)


def stop_ids(tok: user_text.TextTokenizer, template: ChatTemplate) -> tuple[int, ...]:
    """The template's end-of-turn token and the tokenizer's EOS (see the module docstring)."""
    content = "\x01"
    turn = [{"role": "user", "content": "?"}, {"role": "assistant", "content": content}]
    text = render_chat(turn, template, add_generation_prompt=False)
    after = text[text.rindex(content) + len(content) :]
    ids = _encode(tok, after, special=False) if after else ()  # a continuation: no BOS
    found = ids[:1] + (() if tok.eos_id is None else (tok.eos_id,))
    return tuple(dict.fromkeys(found))


def prompt_set(
    text_files: list[str], *, tokenizer: str | None = None, val_fraction: float = 0.02, fields: tuple[str, ...] = ()
) -> PromptSet:
    """The examples of `text_files` (.jsonl), rendered, tokenized and split. ConfigError naming the
    file and line of the first bad example, or of one missing a field in `fields` (what the reward reads)."""
    tok = user_text.load_tokenizer(tokenizer)
    template = template_for(tokenizer)
    splits: dict[bool, list[Prompt]] = {False: [], True: []}
    for where, line in jsonl_lines(user_text.find_text_files(text_files), "prompts"):
        if (record := _parse(line, where)) is None:
            continue
        if missing := [f for f in fields if f not in record]:
            raise ConfigError(
                f"data.text_files: {where}: no field {missing[0]!r}, which the reward reads "
                f"(its fields: {', '.join(map(repr, record))}); add it or choose another reward"
            )
        text = _prompt_text(record, template, where)
        rest = {k: v for k, v in record.items() if k not in ("prompt", "messages")}
        val = user_text._in_validation(line.decode("utf-8", "replace"), val_fraction)
        special = not (template.templated and "messages" in record)  # a template writes BOS itself
        splits[val].append(Prompt(text, _encode(tok, text, special=special), rest))
    every = splits[False] + splits[True]
    top = max((max(p.ids, default=0) for p in every), default=0)
    return PromptSet(splits[False], splits[True], stop_ids(tok, template), top, tok)
