"""DPO (`train.objective: dpo`): preference pairs become chosen and rejected rows masked on the
reply, the task's loss, reward margin, accuracy and gradients equal a float64 numpy reference
computed from the model's own logits, the reference is the base model (LoRA adapters off, first
loss log 2), and a short run from configs/dpo_tiny.yaml learns the held-out pairs and resumes
bit-exactly."""

from __future__ import annotations

import importlib.util
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, tiny_overrides
from flax import nnx

from meshwork.config import ConfigError, load_config
from meshwork.data.preference_pairs import eval_batches, preference_pairs
from meshwork.models.build import build_model, split_model
from meshwork.objectives.preference import dpo_objective
from meshwork.run.metrics import read_metrics
from meshwork.train.cli import main

CONFIG = ROOT / "configs/dpo_tiny.yaml"
PAIRS = [
    {"messages": [{"role": "user", "content": "2 + 2?"}], "chosen": "4", "rejected": "22"},
    {"prompt": "3 + 5 = ", "chosen": "8", "rejected": "35"},
    {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "9 - 7?"}],
        "chosen": "2",
        "rejected": "-2",
    },
    {"prompt": "1 + 1 = ", "chosen": "2", "rejected": "11"},
]


def _jsonl(path, pairs):
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return path


def _masked_text(row, side):
    keep = row[f"{side}_loss_mask"].astype(bool)
    return bytes(row[f"{side}_targets"][keep].astype(np.uint8)).decode()


# ---------------------------------------------------------------- data


def test_each_pair_is_two_rows_masked_on_the_reply_only(tmp_path):
    pairs = preference_pairs([str(_jsonl(tmp_path / "p.jsonl", PAIRS))], seq_len=48, val_fraction=0.0)
    assert len(pairs.train) == 4 and len(pairs.val) == 0
    a = pairs.train.arrays
    assert all(v.shape == (4, 48) and v.dtype == np.int32 for v in a.values())
    # The fallback template: "role: content" lines; the reply is what its assistant turn adds.
    first = bytes(a["chosen_inputs"][0][: (a["chosen_targets"][0] > 0).sum()].astype(np.uint8)).decode()
    assert first == "user: 2 + 2?\nassistant: 4"
    assert [_masked_text(pairs.train[i], "chosen") for i in range(4)] == [" 4\n", "8", " 2\n", "2"]
    assert [_masked_text(pairs.train[i], "rejected") for i in range(4)] == [" 22\n", "35", " -2\n", "11"]
    # Targets are the inputs shifted by one; padding (after the reply) is 0 and never counted.
    row = pairs.train[1]
    n = len("3 + 5 = 35") - 1
    assert np.array_equal(row["rejected_inputs"][1:n], row["rejected_targets"][: n - 1])
    assert not row["rejected_loss_mask"][n:].any() and not row["rejected_targets"][n:].any()


BAD = [
    ("{", r"p\.jsonl:2: not valid JSON"),
    ('{"prompt": "x", "chosen": "a"}', r"p\.jsonl:2: no field 'rejected'"),
    ('{"chosen": "a", "rejected": "b"}', r"p\.jsonl:2: a pair needs exactly one of 'prompt' .* or 'messages'"),
    ('{"prompt": "x", "chosen": "", "rejected": "b"}', r"p\.jsonl:2: 'chosen' must be a non-empty string"),
    (
        '{"messages": [{"role": "robot", "content": "x"}], "chosen": "a", "rejected": "b"}',
        r"p\.jsonl:2: message 1 has role 'robot'",
    ),
    (
        '{"prompt": "' + "x" * 60 + '", "chosen": "a", "rejected": "b"}',
        r"p\.jsonl:2: the prompt with the chosen reply is 61 tokens, more than data\.seq_len\+1=49",
    ),
]


@pytest.mark.parametrize("line,error", BAD, ids=["json", "field", "prompt", "empty", "role", "too-long"])
def test_a_bad_pair_is_refused_in_one_line(tmp_path, line, error):
    path = tmp_path / "p.jsonl"
    path.write_text(f"{json.dumps(PAIRS[0])}\n{line}\n")
    with pytest.raises(ConfigError) as e:
        preference_pairs([str(path)], seq_len=48)
    (err,) = str(e.value).splitlines()
    assert err.startswith("data.text_files: ") and re.search(error, err), err


def test_dpo_needs_a_reference_it_can_compute_and_chat_data(capsys):
    cases = [
        ("finetune.method=full", "train.dpo.reference: adapters_off is the base model under LoRA adapters"),
        ("finetune.method=none", "train.dpo.reference: adapters_off"),
        ("data.source=text", "train.objective: dpo reads preference pairs rendered like chat data"),
    ]
    for extra, what in cases:
        assert main(["--config", str(CONFIG), "finetune.base=nowhere", extra, "--dry-run"]) == 2
        (err,) = capsys.readouterr().err.strip().splitlines()
        assert what in err, err
    precomputed = ["train.dpo.reference=precomputed", "finetune.method=none"]
    assert main(["--config", str(CONFIG), "finetune.base=nowhere", *precomputed, "--dry-run"]) == 2
    assert "precomputed is the fine-tuning base's log-probabilities" in capsys.readouterr().err


def test_the_shipped_pairs_are_the_generators(tmp_path):
    spec = importlib.util.spec_from_file_location("make_data", ROOT / "tools/make_arithmetic_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--kind", "pairs", "--out", str(tmp_path / "x.jsonl")])
    shipped = ROOT / "configs/data/preference_arithmetic.jsonl"
    assert (tmp_path / "x.jsonl").read_bytes() == shipped.read_bytes() and shipped.stat().st_size < 200_000


# ---------------------------------------------------------------- the objective against numpy


def _tiny(tmp_path, *extra):
    return load_config(CONFIG, [*tiny_overrides(tmp_path / "run"), "finetune.base=nowhere", "data.seq_len=48", *extra])


def _batch(tmp_path):
    pairs = preference_pairs([str(_jsonl(tmp_path / "p.jsonl", PAIRS))], seq_len=48, val_fraction=1.0)
    return {k: jnp.asarray(v) for k, v in eval_batches(pairs.val, 4, 1)[0].items()}


def _np_log_probs(logits, targets, mask):
    """float64: per row, the sum over masked positions of log softmax(logits)[target]; and softmax."""
    logits = np.asarray(logits, np.float64)
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0]
    return (picked * mask).sum(-1), np.exp(logp)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_loss_margin_accuracy_and_gradients_equal_a_numpy_reference(tmp_path, label_smoothing):
    beta = 0.5
    cfg = _tiny(tmp_path, f"train.dpo.beta={beta}", f"train.dpo.label_smoothing={label_smoothing}")
    model = build_model(cfg)
    # Move the policy away from the reference: random B factors (B = 0 at init would make them equal).
    graphdef, params, buffers = split_model(model, cfg)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    params = jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])
    batch = _batch(tmp_path)
    objective = dpo_objective(graphdef, beta=beta, label_smoothing=label_smoothing)
    # Jitted, as the trainer runs it: run op by op, the loss, its gradient and the reference's
    # forward and backward were hundreds of one-op programs, each traced and compiled (~8 s cold).
    (loss, metrics), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(params, buffers, batch)

    sides = ("chosen", "rejected")
    inputs, targets, mask = (
        np.concatenate([np.asarray(batch[f"{s}_{k}"]) for s in sides]) for k in ("inputs", "targets", "loss_mask")
    )

    def logits_of(p):
        return nnx.merge(graphdef, p, buffers).apply(jnp.asarray(inputs))[0]

    def vjp(cotangent):  # the policy's logits pulled back to its parameters
        return jax.jit(lambda p, c: jax.vjp(logits_of, p)[1](c))(params, cotangent)

    policy_logits = jax.jit(logits_of)(params)
    ref_logits = jax.jit(logits_of)(jax.tree.map(jnp.zeros_like, params))
    pi, probs = _np_log_probs(policy_logits, targets, mask)
    ref, _ = _np_log_probs(ref_logits, targets, mask)
    B = len(pi) // 2
    h = (pi[:B] - ref[:B]) - (pi[B:] - ref[B:])
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    eps = label_smoothing
    want_loss = np.mean(-(1 - eps) * np.log(sig(beta * h)) - eps * np.log(sig(-beta * h)))
    want_margin = np.mean(beta * h)
    want_accuracy = np.mean(h > 0)
    assert 0 < want_accuracy < 1 and abs(want_margin) > 0.05, (h, want_margin)  # a pair each way
    errors = {
        "loss": _rel(loss, want_loss),
        "reward_margin": _rel(metrics["reward_margin"], want_margin),
        "rewards_chosen": _rel(metrics["rewards_chosen"], np.mean(beta * (pi[:B] - ref[:B]))),
    }
    assert float(metrics["accuracy"]) == want_accuracy and float(metrics["loss"]) == float(loss)
    # d loss / d logits in float64: dL/dh per pair, then d log p(target) / d logits = mask (onehot - p).
    dh = beta / B * (-(1 - eps) * sig(-beta * h) + eps * sig(beta * h))
    dpi = np.concatenate([dh, -dh])
    onehot = np.zeros_like(probs)
    np.put_along_axis(onehot, targets[..., None], 1.0, -1)
    cotangent = dpi[:, None, None] * mask[..., None] * (onehot - probs)
    (want_grads,) = vjp(jnp.asarray(cotangent, jnp.float32))
    for (path, got), want in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(want_grads)):
        errors[jax.tree_util.keystr(path)] = _rel(got, want)
    print(f"label_smoothing={label_smoothing}: max relative error {max(errors.values()):.2e}", errors)
    assert max(errors.values()) < 1e-5, errors


def test_the_reference_is_the_base_model_and_the_first_loss_is_log_2(tmp_path):
    cfg = _tiny(tmp_path)
    graphdef, params, buffers = split_model(build_model(cfg), cfg)
    base = build_model(_tiny(tmp_path, "finetune.method=none", "train.objective=next_token"))
    batch = _batch(tmp_path)
    inputs = jnp.concatenate([batch["chosen_inputs"], batch["rejected_inputs"]])
    adapters_off = nnx.merge(graphdef, jax.tree.map(jnp.zeros_like, params), buffers).apply(inputs)[0]
    np.testing.assert_array_equal(np.asarray(adapters_off), np.asarray(base.apply(inputs)[0]))
    # At init B = 0: the policy is the reference, every reward is 0 and the loss is log 2.
    loss, metrics = dpo_objective(graphdef, beta=0.1)(params, buffers, batch)
    assert float(loss) == pytest.approx(math.log(2), rel=1e-7)
    assert float(metrics["reward_margin"]) == 0 and float(metrics["accuracy"]) == 0


# ---------------------------------------------------------------- training through the CLI

STEPS = ["train.steps=16", "checkpoint.every=8", "log.every=1", "log.eval_every=16", "optimizer.warmup_steps=4"]


@pytest.fixture(scope="module")
def sft_base(tmp_path_factory):
    """A briefly SFT'd chat model (sft_chat_tiny, tiny overrides) for DPO to start from."""
    tmp = tmp_path_factory.mktemp("sft")
    argv = ["--config", str(ROOT / "configs/sft_chat_tiny.yaml"), *tiny_overrides(tmp / "run"), f"data.cache_dir={tmp}"]
    assert main([*argv, "train.steps=12", "checkpoint.every=12", "log.eval_every=12", "optimizer.lr=1e-2"]) == 0
    return tmp / "run"


def _short_pairs(path):
    """The shipped pairs with one question (rows of 48 bytes keep the test fast); the rejected reply
    a refusal, which a model this small can learn to disprefer within steps (the shipped wrong
    numbers need arithmetic it has not learned)."""
    lines = (json.loads(line) for line in (ROOT / "configs/data/preference_arithmetic.jsonl").open())
    return _jsonl(path, [{**p, "rejected": "I do not know."} for p in lines if len(p["messages"]) == 1])


def _argv(run, base, pairs, *extra):
    return [
        *("--config", str(CONFIG), *tiny_overrides(run), f"finetune.base={base}", f"data.text_files=[{pairs}]"),
        *("data.seq_len=48", "data.val_fraction=0.2", "train.dpo.beta=0.5", "optimizer.lr=3e-3", *STEPS, *extra),
    ]


@pytest.mark.over_budget("three trainer invocations (straight, stopped, resumed) for the bit-exact resume", seconds=40)
def test_a_dpo_run_learns_the_held_out_pairs_and_resumes_bit_exactly(tmp_path, sft_base, capsys):
    pairs, straight, stopped = _short_pairs(tmp_path / "p.jsonl"), tmp_path / "straight", tmp_path / "stopped"
    assert main(_argv(straight, sft_base, pairs)) == 0, capsys.readouterr().err[-2000:]
    rows = [r for r in read_metrics(straight) if "accuracy" in r]
    # Step 1: the policy is the reference (LoRA B = 0), so the loss is log 2 and no reward differs.
    assert rows[0]["loss"] == pytest.approx(math.log(2), rel=1e-6) and rows[0]["accuracy"] == 0
    assert np.mean([r["accuracy"] for r in rows[-4:]]) > 0.9 and rows[-1]["reward_margin"] > 0.1, rows[-1]
    val = {r["step"]: r["val_loss"] for r in read_metrics(straight) if "val_loss" in r}
    assert val[0] == pytest.approx(math.log(2), rel=1e-6) and val[16] < val[0] - 0.1, val  # held-out pairs
    assert main(_argv(stopped, sft_base, pairs, "train.stop_after=8")) == 0
    assert main(_argv(stopped, sft_base, pairs)) == 0  # resumes from its step-8 checkpoint
    keys = ("step", "loss", "reward_margin", "accuracy")
    logged = lambda run: [tuple(r[k] for k in keys) for r in read_metrics(run) if "accuracy" in r]  # noqa: E731
    assert logged(stopped) == logged(straight) and len(logged(straight)) == 16
    resumed = {r["step"]: r["val_loss"] for r in read_metrics(stopped) if "val_loss" in r}
    assert resumed[16] == val[16]
    held_out = {
        r["step"]: (r["val_accuracy"], r["val_reward_margin"]) for r in read_metrics(straight) if "val_loss" in r
    }
    assert held_out[0] == (0.0, 0.0) and held_out[16][0] > 0.5 and held_out[16][1] > 0, held_out  # the held-out pairs
    # A bad pair through the CLI: one line, exit 2, nothing written.
    bad, refused = tmp_path / "bad.jsonl", tmp_path / "refused"
    bad.write_text(pairs.read_text().splitlines()[0] + '\n{"prompt": "x", "chosen": "a"}\n')
    capsys.readouterr()
    assert main(_argv(refused, sft_base, bad)) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err == f"error: data.text_files: {bad}:2: no field 'rejected' (its fields: 'prompt', 'chosen'); " + (
        "a pair holds 'chosen' and 'rejected' reply texts"
    )
    assert not refused.exists()
    print(
        "DPO run: first loss",
        rows[0]["loss"],
        "val_loss",
        val,
        "last accuracy",
        rows[-1]["accuracy"],
        "margin",
        rows[-1]["reward_margin"],
    )


def test_full_fine_tuning_dpo_reads_a_reference_computed_once_or_a_frozen_copy(tmp_path, sft_base, capsys):
    """train.dpo.reference=precomputed: the base's log-probabilities of every pair, computed before the
    first step and cached beside the data; the first loss is log 2 (the policy is the base), and a
    second run reads the cache and trains exactly as the first; frozen_copy (the base's weights
    scoring each batch) trains as they do, to float rounding."""
    pairs = _short_pairs(tmp_path / "p.jsonl")
    full = ["finetune.method=full", "train.dpo.reference=precomputed", f"data.cache_dir={tmp_path / 'cache'}"]
    short = ["train.steps=3", "checkpoint.every=3", "log.eval_every=3"]
    first, second = tmp_path / "first", tmp_path / "second"
    assert main([*_argv(first, sft_base, pairs, *full), *short]) == 0, capsys.readouterr().err[-2000:]
    assert "computing them once with the base model" in capsys.readouterr().out
    (cached,) = (tmp_path / "cache").glob("dpo-reference-*.npz")
    assert main([*_argv(second, sft_base, pairs, *full), *short]) == 0
    assert f"read from {cached}" in capsys.readouterr().out
    rows = [r for r in read_metrics(first) if "accuracy" in r]
    assert rows[0]["loss"] == pytest.approx(math.log(2), rel=1e-5) and rows[-1]["reward_margin"] != 0
    keys = ("step", "loss", "reward_margin", "accuracy", "val_loss")
    assert [tuple(r.get(k) for k in keys) for r in read_metrics(second)] == [
        tuple(r.get(k) for k in keys) for r in read_metrics(first)
    ]
    # A frozen copy of the base scoring each batch as it comes: the same reference, so the same run.
    frozen = tmp_path / "frozen"
    assert main([*_argv(frozen, sft_base, pairs, *full, "train.dpo.reference=frozen_copy"), *short]) == 0
    for a, b in zip(read_metrics(frozen), read_metrics(first), strict=True):
        present = [k for k in keys if k in b]  # a row without val_loss must lack it on both sides
        assert {k: a.get(k) for k in present} == pytest.approx({k: b[k] for k in present}, rel=1e-5, abs=1e-6)
