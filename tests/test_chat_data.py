"""`data.source: chat`: OpenAI-style conversations rendered with the checkpoint's chat template (or the
fallback), packed with segment ids, the loss on the assistant's tokens only. Checked: exactly the
assistant's text is a target (fallback with bytes; Qwen2- and Llama-3-style Jinja templates with a
tokenizer.json); targets outside it change neither loss nor gradients, bit for bit; training through
the CLI lowers the held-out loss and resumes bit-exactly; bad conversations are refused in one line."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, hf_folder, tiny_overrides
from flax import nnx
from tokenizers import Tokenizer

from meshwork.config_sections import ModelConfig
from meshwork.data import user_text
from meshwork.data.chat import chat_corpus, render_conversation
from meshwork.data.chat_template import ChatTemplate, render_chat
from meshwork.models.transformer import Transformer
from meshwork.objectives.next_token import next_token_loss
from meshwork.run.metrics import read_metrics
from meshwork.train.cli import main

FIXTURE_TOKENIZER = ROOT / "tests/fixtures/text_tokenizer"
CONFIG = ROOT / "configs/sft_chat_tiny.yaml"
QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CONVERSATIONS = [
    [
        {"role": "system", "content": "Answer with the number."},
        {"role": "user", "content": "What is 37 + 48?"},
        {"role": "assistant", "content": "85"},
    ],
    [
        {"role": "user", "content": "Wie viel ist 12 - 30? (grüße)"},
        {"role": "assistant", "content": "-18, grüße zurück"},
        {"role": "user", "content": "And 99 + 99?"},
        {"role": "assistant", "content": "198"},
    ],
    [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}],
] * 4


def _jsonl(path, conversations, field="messages"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: c}) + "\n" for c in conversations))
    return path


def _tokenizer_folder(folder, template: str | None):
    """The tests' 128-id BPE, with the chat templates' special tokens added and, unless None, a template."""
    folder.mkdir(parents=True)
    tok = Tokenizer.from_file(str(FIXTURE_TOKENIZER / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((FIXTURE_TOKENIZER / "tokenizer_config.json").read_text())
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _conversations(split):
    """Each conversation's (ids, mask) from a split's cache files."""
    ids, starts = np.fromfile(split.tokens, split.dtype), np.load(split.starts)
    mask = np.fromfile(split.mask, np.uint8)
    return list(zip(np.split(ids, starts[1:]), np.split(mask, starts[1:])))


def _all_conversations(corpus):
    return _conversations(corpus.train) + _conversations(corpus.val)


# ---------------------------------------------------------------- the mask


def test_the_server_prompts_with_the_training_text_and_bytes_mark_exactly_the_assistant_turns(tmp_path):
    from meshwork.inference.http_server import Served

    for messages in CONVERSATIONS[:3]:  # the prompt the server builds is the prefix the turn is learned after
        assert render_chat(messages, ChatTemplate()) == Served("m", None).render_chat(messages)[0]
        assert render_chat(messages, ChatTemplate(QWEN2)) == Served("m", None, [], QWEN2).render_chat(messages)[0]
    corpus = chat_corpus([str(_jsonl(tmp_path / "c.jsonl", CONVERSATIONS))], val_fraction=0.3, cache_dir=tmp_path)
    got = _all_conversations(corpus)
    assert len(got) == len(CONVERSATIONS) and corpus.val.n_documents > 0
    for ids, mask in got:
        text = bytes(ids.astype(np.uint8)).decode()
        messages = next(c for c in CONVERSATIONS if render_chat(c, ChatTemplate(), add_generation_prompt=False) == text)
        want = "".join(f" {m['content']}\n" for m in messages if m["role"] == "assistant")
        assert bytes(ids[mask == 1].astype(np.uint8)).decode() == want  # "assistant:" prompts, targets the rest


@pytest.mark.parametrize("template", [QWEN2, LLAMA3], ids=["qwen2", "llama3"])
def test_a_jinja_template_marks_exactly_the_assistant_tokens(tmp_path, template):
    folder = _tokenizer_folder(tmp_path / "tok", template)
    corpus = chat_corpus(
        [str(_jsonl(tmp_path / "c.jsonl", CONVERSATIONS[:3]))],
        tokenizer=str(folder),
        val_fraction=0.01,
        cache_dir=tmp_path,
    )
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for (ids, mask), messages in zip(_conversations(corpus.train), CONVERSATIONS[:3]):
        conv = render_conversation(messages, ChatTemplate(template, {"bos_token": "<s>", "eos_token": "</s>"}))
        enc = tok.encode(conv.text, add_special_tokens=False)  # what the server sends the model
        assert ids.tolist() == enc.ids
        spans = {k for s, e in conv.spans for k in range(s, e)}
        targets = {k for (s, e), m in zip(enc.offsets, mask) if m for k in range(s, e)}
        context = {k for (s, e), m in zip(enc.offsets, mask) if not m for k in range(s, e)}
        assert targets == spans and not context & spans  # token boundaries fall on the turns' edges
        end = "<|im_end|>\n" if template == QWEN2 else "<|eot_id|>"
        want = "".join(m["content"].strip() + end for m in messages if m["role"] == "assistant")
        assert "".join(conv.text[s:e] for s, e in conv.spans) == want  # each reply and what ends its turn
        special = {tok.token_to_id(t) for t in ("<|im_end|>", "<|eot_id|>")}
        assert any(i in special for i in ids[mask == 1]) and any(i in special for i in ids[mask == 0][1:])


def test_the_fallback_with_a_tokenizer_adds_bos_and_ends_with_a_target_eos(tmp_path):
    """A tokenizer folder without a template: the fallback text, the post-processor's BOS (as the
    server encodes a fallback prompt) and the EOS the folder names, a target after an assistant turn."""
    folder = _tokenizer_folder(tmp_path / "tok", None)
    files = [str(_jsonl(tmp_path / "c.jsonl", CONVERSATIONS[:3]))]
    corpus = chat_corpus(files, tokenizer=str(folder), val_fraction=0.01, cache_dir=tmp_path)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    for (ids, mask), messages in zip(_conversations(corpus.train), CONVERSATIONS[:3]):
        text = render_chat(messages, ChatTemplate(), add_generation_prompt=False)
        assert ids.tolist() == tok.encode(text).ids + [eos] and ids[0] == bos and mask[0] == 0
        assert mask[-1] == (messages[-1]["role"] == "assistant")


def test_windows_mask_targets_of_the_assistant_in_the_same_conversation(tmp_path):
    corpus = chat_corpus([str(_jsonl(tmp_path / "c.jsonl", CONVERSATIONS))], val_fraction=0.01, cache_dir=tmp_path)
    ids, mask = np.fromfile(corpus.train.tokens, np.uint16), np.fromfile(corpus.train.mask, np.uint8)
    starts = np.load(corpus.train.starts)
    windows = user_text.PackedWindows(corpus.train, 16)
    for i in range(len(windows)):
        w, lo = windows[i], i * 16
        same = np.searchsorted(starts, np.arange(lo + 1, lo + 17), "right") == np.searchsorted(
            starts, np.arange(lo, lo + 16), "right"
        )
        np.testing.assert_array_equal(w["targets"], ids[lo + 1 : lo + 17])
        np.testing.assert_array_equal(w["loss_mask"], (mask[lo + 1 : lo + 17] == 1) & same)


# ---------------------------------------------------------------- the loss


@pytest.mark.parametrize("loss_chunk", [None, 64], ids=["plain", "fused"])
def test_user_targets_change_neither_loss_nor_gradients(tmp_path, loss_chunk):
    """Same inputs; only targets where loss_mask is 0 (user and system turns, the template's
    prompts, the next conversation's first token) differ: loss and every gradient bit-identical.
    One assistant target changed: the loss changes."""
    corpus = chat_corpus([str(_jsonl(tmp_path / "c.jsonl", CONVERSATIONS))], val_fraction=0.01, cache_dir=tmp_path)
    batch = next(user_text.train_iterator(corpus.train, 32, 4, seed=0))
    mask = batch["loss_mask"]
    assert 0 < mask.sum() < mask.size // 2
    rng = np.random.default_rng(0)
    other = np.where(mask == 1, batch["targets"], rng.integers(0, 256, mask.shape)).astype(np.int32)
    assert (other != batch["targets"]).sum() > mask.size // 3
    cfg = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    graphdef, params, buffers = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    grad = jax.jit(jax.value_and_grad(next_token_loss(graphdef, loss_chunk), has_aux=True))

    def run(targets):
        (loss, _), g = grad(params, buffers, {**{k: jnp.asarray(v) for k, v in batch.items()}, "targets": targets})
        return np.asarray(loss), [np.asarray(x) for x in jax.tree.leaves(g)]

    loss, grads = run(batch["targets"])
    loss2, grads2 = run(other)
    assert loss.tobytes() == loss2.tobytes()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(grads, grads2))
    r, c = map(int, np.argwhere(mask == 1)[0])
    changed = batch["targets"].copy()
    changed[r, c] = (changed[r, c] + 1) % 256
    assert run(changed)[0] != loss


# ---------------------------------------------------------------- training through the CLI

STEPS = ["train.steps=24", "checkpoint.every=12", "log.every=1", "log.eval_every=24", "optimizer.warmup_steps=4"]


def _argv(run, cache, *extra):
    return ["--config", str(CONFIG), *tiny_overrides(run), f"data.cache_dir={cache}", *STEPS, *extra]


def _losses(run):
    return [(r["step"], r["loss"]) for r in read_metrics(run) if "loss" in r]


def test_training_lowers_the_held_out_loss_and_resumes_bit_exactly(tmp_path, capsys):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert main(_argv(straight, tmp_path)) == 0, capsys.readouterr().err[-2000:]
    val = {r["step"]: r["val_loss"] for r in read_metrics(straight) if "val_loss" in r}
    assert set(val) == {0, 24} and val[24] < val[0] - 0.5, val  # held out: the conversations hashed to val
    assert main(_argv(stopped, tmp_path, "train.stop_after=12")) == 0
    assert len(_losses(stopped)) == 12
    assert main(_argv(stopped, tmp_path)) == 0  # resumes from its step-12 checkpoint
    assert _losses(stopped) == _losses(straight) and len(_losses(straight)) == 24
    resumed = {r["step"]: r["val_loss"] for r in read_metrics(stopped) if "val_loss" in r}
    assert resumed[24] == val[24]


# ---------------------------------------------------------------- bad inputs

BAD = [
    ('{"messages": [}', r"c\.jsonl:2: not valid JSON"),
    ('{"text": "hi"}', r"data\.messages_field: .*c\.jsonl:2 has no field 'messages' \(its fields: 'text'\)"),
    ('{"messages": [{"role": "user"}]}', r"c\.jsonl:2: message 1 is not an object with a role and a content"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', r"c\.jsonl:2: message 1 has role 'robot'; use one of"),
    ('{"messages": [{"role": "user", "content": "x"}]}', r"c\.jsonl:2: the conversation has no assistant message"),
    ('{"messages": []}', r"c\.jsonl:2: the messages are an empty list"),
]


@pytest.mark.parametrize("line,error", BAD, ids=["json", "field", "no-content", "role", "no-assistant", "empty"])
def test_a_bad_conversation_is_refused_in_one_line(tmp_path, capsys, line, error):
    good = json.dumps({"messages": CONVERSATIONS[0]})
    (tmp_path / "c.jsonl").write_text(f"{good}\n{line}\n{good}\n")
    run = tmp_path / "run"
    assert main(_argv(run, tmp_path, f"data.text_files=[{tmp_path / 'c.jsonl'}]")) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith("error: data.") and re.search(error, err), err
    assert not run.exists() and not list(tmp_path.glob(".meshwork-tokens-*"))  # nothing written


def test_a_template_that_refuses_or_a_missing_file_list_is_one_line(tmp_path, capsys):
    strict = QWEN2.replace(
        "{% for message in messages %}",
        "{% for message in messages %}{% if message['role'] == 'system' %}"
        "{{ raise_exception('no system prompts here') }}{% endif %}",
    )
    folder = _tokenizer_folder(tmp_path / "tok", strict)
    _jsonl(tmp_path / "c.jsonl", CONVERSATIONS[1:3] + CONVERSATIONS[:1])
    run = tmp_path / "run"
    extra = [f"data.text_files=[{tmp_path / 'c.jsonl'}]", f"data.tokenizer={folder}", "model.vocab_size=133"]
    assert main(_argv(run, tmp_path, *extra)) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "c.jsonl:3: the chat template does not render it (" in err and "no system prompts here" in err, err
    assert main(_argv(run, tmp_path, "data.text_files=[]")) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "data.text_files: data.source=chat needs data.text_files" in err, err
    (tmp_path / "c.txt").write_text("hi")
    assert main(_argv(run, tmp_path, f"data.text_files=[{tmp_path / 'c.txt'}]")) == 2
    assert "is not a .jsonl file" in capsys.readouterr().err
    assert not run.exists()


def test_the_shipped_data_is_the_generators(tmp_path):
    """configs/data/chat_arithmetic.jsonl is what tools/make_arithmetic_data.py writes, byte for byte."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_data", ROOT / "tools/make_arithmetic_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--kind", "chat", "--out", str(tmp_path / "x.jsonl")])
    assert (tmp_path / "x.jsonl").read_bytes() == (ROOT / "configs/data/chat_arithmetic.jsonl").read_bytes()


def test_lora_on_a_hugging_face_folder_renders_with_its_tokenizer_and_template(tmp_path, capsys):
    """finetune.base a Hugging Face folder (the Llama fixture plus the tests' tokenizer and a ChatML
    template), data.tokenizer unset: the folder's tokenizer.json and chat template make the tokens."""
    base = hf_folder(tmp_path / "base", QWEN2)
    run = tmp_path / "run"
    argv = [
        *("--config", str(ROOT / "configs/lora_hf_text.yaml"), f"run.dir={run}", f"finetune.base={base}"),
        *(
            "data.source=chat",
            f"data.text_files=[{ROOT / 'configs/data/chat_arithmetic.jsonl'}]",
            "data.tokenizer=null",
        ),
        *(f"data.cache_dir={tmp_path}", "data.seq_len=64", "data.val_fraction=0.1", "train.steps=8"),
        *(
            "log.eval_every=8",
            "log.eval_batches=1",
            "checkpoint.every=8",
            "log.progress=false",
            "log.tensorboard=false",
        ),
    ]
    assert main(argv) == 0, capsys.readouterr().err[-2000:]
    val = [r["val_loss"] for r in read_metrics(run) if "val_loss" in r]
    assert len(val) == 2 and val[1] < val[0], val
    (meta,) = tmp_path.glob(".meshwork-tokens-*/meta.json")
    corpus = user_text._load(meta.parent, built=False)
    assert corpus.tokenizer == str(base / "tokenizer.json")
    ids, mask = _conversations(corpus.train)[0]
    text = Tokenizer.from_file(str(base / "tokenizer.json")).decode(ids.tolist(), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"), text
