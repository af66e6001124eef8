"""`data.source: text`: the user's own .txt/.jsonl/.parquet documents, tokenized by a tokenizer.json
(tests/fixtures/text_tokenizer, a 128-id Llama-style BPE), cached, packed into windows with
segment ids and a loss mask, split by a hash, and trained on through the CLI."""

import json
import math
import os
import pathlib
from pydoc_data.topics import topics

import numpy as np
from conftest import ROOT, tiny_overrides
from tokenizers import Tokenizer

from meshwork.data import user_text
from meshwork.data.user_text import PackedWindows, TokenSplit, text_corpus

TOKENIZER = ROOT / "tests/fixtures/text_tokenizer"
TOPICS = [topics[k] for k in sorted(topics)]  # English prose every Python ships


def _write_inputs(folder: pathlib.Path) -> dict[str, list[str]]:
    """One file of each kind, the text in field/column `body`; returns each file's documents."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    docs = {"a.txt": [TOPICS[0]], "b.jsonl": TOPICS[1:6], "c.parquet": TOPICS[6:10]}
    (folder / "a.txt").write_text(docs["a.txt"][0])
    lines = [json.dumps({"id": i, "body": t}) for i, t in enumerate(docs["b.jsonl"])]
    (folder / "b.jsonl").write_text("\n".join(lines[:2] + [""] + lines[2:]) + "\n")  # a blank line is skipped
    pq.write_table(pa.table({"body": docs["c.parquet"], "n": range(4)}), folder / "c.parquet")
    return docs


def _stream(split: TokenSplit) -> tuple[np.ndarray, np.ndarray]:
    return np.fromfile(split.tokens, split.dtype), np.load(split.starts)


def _documents(split: TokenSplit) -> list[np.ndarray]:
    tokens, starts = _stream(split)
    return np.split(tokens, starts[1:])


def test_each_format_is_read_and_tokenized_as_the_tokenizer_does(tmp_path):
    docs = _write_inputs(tmp_path / "data")
    corpus = text_corpus([str(tmp_path / "data/*")], tokenizer=str(TOKENIZER), text_field="body", val_fraction=0.3)
    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    want = {"train": [], "val": []}
    index = {"a.txt": [0], "b.jsonl": [0, 1, 3, 4, 5], "c.parquet": [0, 1, 2, 3]}  # line 2 of b.jsonl is blank
    for name in ("a.txt", "b.jsonl", "c.parquet"):
        for i, text in zip(index[name], docs[name]):
            split = "val" if user_text._in_validation(f"{name}:{i}", 0.3) else "train"
            want[split].append(tok.encode(text).ids + [eos])
    assert want["train"] and want["val"]  # the fixture has both splits
    for split in ("train", "val"):
        got = _documents(getattr(corpus, split))
        assert [d.tolist() for d in got] == want[split]
        assert all(d[0] == bos and d[-1] == eos for d in got)  # the post-processor's BOS, the config's EOS
    assert corpus.train.dtype == "uint16" and corpus.max_id < 128 and corpus.built


def test_ids_beyond_uint16_are_stored_as_uint32(tmp_path):
    """A vocabulary of over 65,536 ids (Llama 3 has 128,256) needs 4 bytes a token."""
    from tokenizers import models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70_000)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))  # no tokenizer_config.json: no EOS is appended
    (tmp_path / "a.txt").write_text("w69999 w5 w65536")
    corpus = text_corpus([str(tmp_path / "a.txt")], tokenizer=str(tmp_path), val_fraction=1e-4)
    assert corpus.train.dtype == "uint32" and corpus.max_id == 69_999
    assert _stream(corpus.train)[0].tolist() == [69_999, 5, 65_536]


def test_byte_tokenizer_and_windows_at_a_document_boundary(tmp_path):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ["abc", "defgh", "ijkl"]))
    corpus = text_corpus([str(tmp_path / "d.jsonl")], val_fraction=1e-4)  # no specials: the UTF-8 bytes
    tokens, starts = _stream(corpus.train)
    assert bytes(tokens.astype(np.uint8)) == b"abcdefghijkl" and starts.tolist() == [0, 3, 8]
    src = PackedWindows(corpus.train, seq_len=5)
    assert len(src) == 2  # (12 - 1) // 5 windows of 6 tokens
    w0, w1 = src[0], src[1]
    assert bytes(w0["inputs"].astype(np.uint8)) == b"abcde" and bytes(w0["targets"].astype(np.uint8)) == b"bcdef"
    # Window 0 holds tokens a..f: doc 1 = abc, doc 2 = def...; the target after 'c' is 'd', doc 2's first.
    assert w0["segment_ids"].tolist() == [1, 1, 1, 2, 2] and w0["loss_mask"].tolist() == [1, 1, 0, 1, 1]
    # Window 1 holds f..k: renumbered from 1 in the row; 'h' ends doc 2, 'i' opens doc 3.
    assert w1["segment_ids"].tolist() == [1, 1, 1, 2, 2] and w1["loss_mask"].tolist() == [1, 1, 0, 1, 1]
    assert all(v.dtype == np.int32 and v.shape == (5,) for v in w0.values())


def test_the_cache_is_reused_and_rebuilt_when_an_input_changes(tmp_path, monkeypatch):
    _write_inputs(tmp_path / "data")
    args = {"tokenizer": str(TOKENIZER), "text_field": "body", "val_fraction": 0.3}
    first = text_corpus([str(tmp_path / "data/*")], **args)
    assert first.folder.parent == tmp_path / "data" and first.folder.name.startswith(".meshwork-tokens-")
    meta_mtime = (first.folder / "meta.json").stat().st_mtime_ns

    def no_tokenizing(self, texts):
        raise AssertionError("tokenized again although nothing changed")

    with monkeypatch.context() as m:
        m.setattr(user_text.TextTokenizer, "encode", no_tokenizing)
        again = text_corpus([str(tmp_path / "data/*")], **args)
    assert not again.built and again.folder == first.folder
    assert (first.folder / "meta.json").stat().st_mtime_ns == meta_mtime

    with open(tmp_path / "data/a.txt", "a") as f:  # an edit: size and time change
        f.write("\nOne more sentence.\n")
    edited = text_corpus([str(tmp_path / "data/*")], **args)
    assert edited.built and edited.folder != first.folder
    assert not first.folder.exists()  # the stale cache of the same files is removed
    st = (tmp_path / "data/b.jsonl").stat()
    os.utime(tmp_path / "data/b.jsonl", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched only
    assert text_corpus([str(tmp_path / "data/*")], **args).built
    # Another split fraction is another cache; the first stays for the run that uses it.
    other = text_corpus([str(tmp_path / "data/*")], **{**args, "val_fraction": 0.5})
    assert other.built and len(list((tmp_path / "data").glob(".meshwork-tokens-*"))) == 2


def test_the_cache_goes_elsewhere_when_the_data_folder_is_read_only(tmp_path, monkeypatch):
    _write_inputs(tmp_path / "data")
    mkdtemp = user_text.tempfile.mkdtemp

    def read_only_data(prefix, dir):  # what a read-only folder answers (root would not be refused)
        if pathlib.Path(dir) == tmp_path / "data":
            raise PermissionError(13, "Permission denied")
        return mkdtemp(prefix=prefix, dir=dir)

    monkeypatch.setattr(user_text.tempfile, "mkdtemp", read_only_data)
    monkeypatch.setenv("MESHWORK_CACHE", str(tmp_path / "home_cache"))
    corpus = text_corpus([str(tmp_path / "data/*.txt")])
    assert corpus.built and corpus.folder.parent == tmp_path / "home_cache"
    assert not text_corpus([str(tmp_path / "data/*.txt")]).built  # and found there again
    assert (
        text_corpus([str(tmp_path / "data/*.txt")], cache_dir=str(tmp_path / "mine")).folder.parent == tmp_path / "mine"
    )  # data.cache_dir, when set, is where it goes


def test_the_split_is_deterministic_and_disjoint(tmp_path):
    texts = [f"document {i}: " + TOPICS[i % len(TOPICS)][:200] for i in range(400)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    a = text_corpus([str(tmp_path / "docs.jsonl")], val_fraction=0.1, cache_dir=str(tmp_path / "a"))
    b = text_corpus([str(tmp_path / "docs.jsonl")], val_fraction=0.1, cache_dir=str(tmp_path / "b"))
    for split in ("train", "val"):
        x, y = getattr(a, split), getattr(b, split)
        assert pathlib.Path(x.tokens).read_bytes() == pathlib.Path(y.tokens).read_bytes()
    train, val = ({bytes(d.astype(np.uint8)).decode() for d in _documents(split)} for split in (a.train, a.val))
    assert not train & val and train | val == set(texts)
    assert 0.05 < len(val) / len(texts) < 0.15


def test_iterator_state_resumes_exactly(tmp_path):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TOPICS[:60]))
    corpus = text_corpus([str(tmp_path / "docs.jsonl")], tokenizer=str(TOKENIZER), val_fraction=0.1)
    it = user_text.train_iterator(corpus.train, 32, 4, seed=3)
    for _ in range(5):
        next(it)
    saved = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
    expected = [next(it) for _ in range(3)]
    again = user_text.train_iterator(corpus.train, 32, 4, seed=3)
    again.set_state(saved)
    for want in expected:
        got = next(again)
        assert sorted(got) == ["inputs", "loss_mask", "segment_ids", "targets"]
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    evals = user_text.eval_batches(corpus.val, 32, 4, 2)
    assert [b["inputs"].shape for b in evals] == [(4, 32)] * 2
    again_evals = user_text.eval_batches(corpus.val, 32, 4, 2)
    np.testing.assert_array_equal(evals[0]["segment_ids"], again_evals[0]["segment_ids"])


def test_trains_through_the_cli_with_a_tokenizer(tmp_path, capsys):
    """The command line's `main`, in this process (its own process is checked in reliability/test_bad_inputs.py)."""
    from meshwork.train.cli import main

    (tmp_path / "data").mkdir()
    (tmp_path / "data/topics.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TOPICS))
    run = tmp_path / "run"
    argv = [
        "--config",
        str(ROOT / "configs/lm_tiny.yaml"),
        *tiny_overrides(run),
        "data.source=text",
        f"data.text_files=[{tmp_path / 'data'}/*.jsonl]",
        f"data.tokenizer={TOKENIZER}",
        "data.val_fraction=0.1",
        "model.vocab_size=128",
        "train.steps=4",
        "log.every=1",
        "log.eval_every=4",
        "checkpoint.every=4",
    ]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    assert "tokenizing 1 file(s)" in out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) >= 4 and all(math.isfinite(x) for x in losses)
    assert any(math.isfinite(r.get("val_loss", math.nan)) for r in rows)
    assert list((tmp_path / "data").glob(".meshwork-tokens-*/meta.json"))
