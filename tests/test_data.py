"""Tokenizer, the default corpus, a user's own token file, and iterator state."""

import numpy as np
from conftest import ROOT, tiny_overrides

from meshwork.config import load_config
from meshwork.data.text import ByteTokenizer, eval_batches, stdlib_corpus, stdlib_sources, train_iterator
from meshwork.run.metrics import read_metrics
from meshwork.train.loop import train


def test_byte_tokenizer_round_trips_unicode():
    tok = ByteTokenizer()
    text = "def f(x):\n    return x ** 2  # ünïcødé ✓\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint16 and ids.max() < 256 and tok.decode(ids) == text


def test_stdlib_corpus_is_real_deterministic_and_split(tmp_path):
    # A fresh build equals the machine's shared one (built by another test, process or run): one build here.
    train_a, val_a = stdlib_corpus(0.02, cache_dir=str(tmp_path / "a"))
    train_b, val_b = stdlib_corpus(0.02)
    assert train_a.read_bytes() == train_b.read_bytes() and val_a.read_bytes() == val_b.read_bytes()
    total = sum(p.stat().st_size for p in stdlib_sources())
    n_train, n_val = train_a.stat().st_size // 2, val_a.stat().st_size // 2
    assert total > 10_000_000 and n_train + n_val > total  # every source byte, plus the file headers
    assert 0.01 < n_val / (n_train + n_val) < 0.15
    text = ByteTokenizer().decode(np.fromfile(val_a, np.uint16)[:4096])
    assert text.startswith("# file: ") and ("def " in text or "import " in text)


def test_iterator_state_resumes_exactly():
    train_bin, _ = stdlib_corpus(0.02)
    it = train_iterator(str(train_bin), 16, 4, seed=3)
    for _ in range(5):
        next(it)
    saved = it.get_state()
    expected = [next(it)["inputs"] for _ in range(3)]
    again = train_iterator(str(train_bin), 16, 4, seed=3)
    again.set_state(saved)
    for want in expected:
        np.testing.assert_array_equal(next(again)["inputs"], want)
    other = next(train_iterator(str(train_bin), 16, 4, seed=4))["inputs"]
    assert not np.array_equal(other, next(train_iterator(str(train_bin), 16, 4, seed=3))["inputs"])


def test_eval_batches_are_fixed_and_targets_shift_inputs():
    _, val_bin = stdlib_corpus(0.02)
    a, b = eval_batches(str(val_bin), 32, 4, 2), eval_batches(str(val_bin), 32, 4, 2)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
        np.testing.assert_array_equal(x["inputs"][:, 1:], x["targets"][:, :-1])


def test_trains_on_a_users_token_file(tmp_path):
    text = "".join(p.read_text(errors="replace") for p in stdlib_sources()[:40])
    ids = ByteTokenizer().encode(text)
    cut = int(len(ids) * 0.9)
    ids[:cut].tofile(tmp_path / "train.bin")
    ids[cut:].tofile(tmp_path / "val.bin")
    cfg = load_config(
        ROOT / "configs/lm_tiny.yaml",
        [
            *tiny_overrides(tmp_path / "run"),
            "data.source=tokens",
            f"data.train_path={tmp_path / 'train.bin'}",
            f"data.val_path={tmp_path / 'val.bin'}",
            "train.steps=30",
            "log.eval_every=30",
            "mesh.data=8",
        ],
    )
    out = train(cfg)
    assert out["val_loss"][30] < out["val_loss"][0] - 1.0
    assert read_metrics(tmp_path / "run")[-1]["step"] == 30
