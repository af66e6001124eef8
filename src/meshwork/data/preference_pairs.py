"""Preference pairs for DPO (`train.objective: dpo`): a prompt, the chosen reply, the rejected one.

Each line of a `.jsonl` file in `data.text_files` is one pair:

    {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "chosen": "4", "rejected": "5"}
    {"prompt": "2 + 2 = ", "chosen": "4", "rejected": "5"}

`chosen` and `rejected` are the assistant's reply text. With `messages` (the conversation so far,
ending with the user's turn) each reply is rendered as one more assistant message with the chat
template, exactly as data/chat.py renders a conversation (the prompt is the template's rendering
with the generation prompt, the reply the characters the assistant turn adds, its end-of-turn
marker included); with `prompt` the text is the prompt followed by the reply, as written. Tokens
are made by chat.py's `encode_conversations` (so a template writes BOS, the fallback adds BOS and
EOS where the tokenizer has them).

Rows: each pair becomes two rows, chosen and rejected, of exactly data.seq_len positions each:
`inputs` the ids but the last, `targets` the ids but the first, `loss_mask` 1 where the target is
a reply token; padded with 0 (mask 0) at the end. There is no packing, so a row holds one pair's
side and needs no segment ids (attention is causal, the padding comes after every counted
token). A batch holds B pairs as `chosen_inputs`, `chosen_targets`, `chosen_loss_mask` and the
same three `rejected_*` keys, each (B, L).

A pair longer than data.seq_len + 1 tokens is refused (file and line), never truncated: a
truncated reply would be scored on a part of itself. The validation split is chosen by a hash of
each line, as chat data's is. Pairs are tokenized in memory on every start (no token cache yet).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import grain
import numpy as np

from meshwork.config import ConfigError
from meshwork.data import user_text
from meshwork.data.chat import Conversation, _check_messages, encode_conversations, template_for
from meshwork.data.chat_template import ChatTemplate, render_chat

SIDES = ("chosen", "rejected")
ROW_KEYS = ("inputs", "targets", "loss_mask")


@dataclass(frozen=True)
class PairSplit:
    """One split's rows: `arrays[f"{side}_{key}"]` (N, L) int32 for side in SIDES, key in ROW_KEYS."""

    arrays: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.arrays["chosen_inputs"])

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {k: v[i] for k, v in self.arrays.items()}


@dataclass(frozen=True)
class PreferencePairs:
    train: PairSplit
    val: PairSplit
    max_id: int
    tokenizer: str


def _reply_text(record: dict, reply: str, template: ChatTemplate, where: str) -> Conversation:
    """The text of the prompt followed by `reply`, and the reply's [start, end) character span."""
    if "messages" in record:
        messages = record["messages"]
        _check_messages(
            messages + [{"role": "assistant", "content": reply}] if isinstance(messages, list) else messages, where
        )
        try:
            before = render_chat(messages, template, add_generation_prompt=True)
            through = render_chat(
                messages + [{"role": "assistant", "content": reply}], template, add_generation_prompt=False
            )
        except Exception as e:  # the template's own error, or a Jinja or type error
            which = "the fallback template" if template.source is None else "the chat template"
            raise ConfigError(
                f"data.text_files: {where}: {which} does not render it ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
            ) from None
        if not through.startswith(before):
            raise ConfigError(
                f"data.text_files: {where}: the chat template does not render the reply as a continuation of "
                "the prompt, so its tokens cannot be told apart"
            )
        return Conversation(through, ((len(before), len(through)),))
    prompt = record["prompt"]
    if not isinstance(prompt, str):
        raise ConfigError(f"data.text_files: {where}: the prompt is a {type(prompt).__name__}, not a string")
    return Conversation(prompt + reply, ((len(prompt), len(prompt) + len(reply)),))


def jsonl_lines(files, what: str):
    """(file:line, the line's bytes) of each line of `files`, each a `.jsonl` file (ConfigError naming
    a file that is not, or cannot be read: `what` is what its lines hold)."""
    for path in files:
        if path.suffix.lower() != ".jsonl":
            raise ConfigError(f"data.text_files: {path} is not a .jsonl file; {what} are one JSON object a line")
        try:
            lines = path.read_bytes().splitlines()
        except OSError as e:
            raise ConfigError(f"data.text_files: {path} cannot be read ({e.strerror})") from None
        for i, line in enumerate(lines):
            yield f"{path}:{i + 1}", line


def json_object(line: bytes, where: str) -> dict | None:
    """The JSON object of one `.jsonl` line (None for a blank line); ConfigError naming `where` (file:line)
    for text that is not JSON or JSON that is not an object. Pairs and GRPO's prompts read lines so."""
    if not line.strip():
        return None
    try:
        record = json.loads(line.strip())
    except ValueError as e:
        why = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
        raise ConfigError(f"data.text_files: {where}: not valid JSON ({why}); fix the line or remove it") from None
    if not isinstance(record, dict):
        raise ConfigError(f"data.text_files: {where}: a JSON {type(record).__name__}, not an object")
    return record


def _parse(line: bytes, where: str) -> dict | None:
    """The pair of one line (None for a blank line); ConfigError naming `where` for a bad one."""
    if (record := json_object(line, where)) is None:
        return None
    if ("prompt" in record) == ("messages" in record):
        raise ConfigError(
            f"data.text_files: {where}: a pair needs exactly one of 'prompt' (text) or 'messages' (a conversation) "
            f"(its fields: {', '.join(map(repr, record)) or 'none'})"
        )
    for side in SIDES:
        if side not in record:
            raise ConfigError(
                f"data.text_files: {where}: no field {side!r} (its fields: {', '.join(map(repr, record))}); "
                "a pair holds 'chosen' and 'rejected' reply texts"
            )
        if not isinstance(record[side], str) or not record[side]:
            raise ConfigError(f"data.text_files: {where}: {side!r} must be a non-empty string")
    return record


def _rows(ids: np.ndarray, mask: np.ndarray, seq_len: int, where: str, side: str) -> tuple[np.ndarray, ...]:
    if len(ids) - 1 > seq_len:
        raise ConfigError(
            f"data.text_files: {where}: the prompt with the {side} reply is {len(ids)} tokens, more than "
            f"data.seq_len+1={seq_len + 1}; shorten the pair, remove it, or raise data.seq_len"
        )
    if not mask[1:].any():
        raise ConfigError(f"data.text_files: {where}: the {side} reply has no token to score")
    out = np.zeros((3, seq_len), np.int32)
    n = len(ids) - 1
    out[0, :n], out[1, :n], out[2, :n] = ids[:-1], ids[1:], mask[1:]
    return tuple(out)


def preference_pairs(
    text_files: list[str], *, seq_len: int, tokenizer: str | None = None, val_fraction: float = 0.02
) -> PreferencePairs:
    """The pairs of `text_files` (.jsonl), tokenized into rows of `seq_len` and split (ConfigError
    naming the file and line of the first bad pair)."""
    files = user_text.find_text_files(text_files)
    tok = user_text.load_tokenizer(tokenizer)
    template = template_for(tokenizer)
    splits: dict[bool, dict[str, list]] = {s: {f"{a}_{k}": [] for a in SIDES for k in ROW_KEYS} for s in (False, True)}
    top = 0
    for where, line in jsonl_lines(files, "preference pairs"):
        if (record := _parse(line, where)) is None:
            continue
        texts = [_reply_text(record, record[side], template, where) for side in SIDES]
        val = user_text._in_validation(line.decode("utf-8", "replace"), val_fraction)
        for side, (ids, mask) in zip(SIDES, encode_conversations(tok, template, texts)):
            top = max(top, int(ids.max(initial=0)))
            for k, row in zip(ROW_KEYS, _rows(ids, mask, seq_len, where, side)):
                splits[val][f"{side}_{k}"].append(row)
    made = {
        s: PairSplit({k: np.stack(v) if v else np.zeros((0, seq_len), np.int32) for k, v in rows.items()})
        for s, rows in splits.items()
    }
    return PreferencePairs(made[False], made[True], top, tok.name)


def train_iterator(split: PairSplit, global_batch: int, seed: int) -> grain.DatasetIterator:
    """An infinite, shuffled, checkpointable iterator of global batches of `global_batch` pairs."""
    ds = grain.MapDataset.source(split).shuffle(seed=seed).repeat(None)
    return iter(ds.batch(global_batch, drop_remainder=True).to_iter_dataset())


def eval_batches(split: PairSplit, global_batch: int, n_batches: int) -> list[dict[str, np.ndarray]]:
    """A fixed validation set: the split's first global_batch x n_batches pairs, in file order."""
    total = global_batch * n_batches
    if len(split) < total:
        raise ValueError(f"{len(split)} validation pairs, need {total}; lower log.eval_batches")
    return [
        {k: v[b * global_batch : (b + 1) * global_batch] for k, v in split.arrays.items()} for b in range(n_batches)
    ]
