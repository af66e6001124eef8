"""Speculative decoding (engine/speculative.py): greedy output identical to plain greedy decoding;
sampled output distributed as the target's own (a chi-square test that rejects a broken acceptance
rule); a draft equal to the target is always accepted; the server's pages of rejected positions go
back to the pool; a draft of another vocabulary, and `--speculative mtp` without MTP modules, are
refused in one line."""

import dataclasses
import math

import numpy as np
import pytest
from flax import nnx

from meshwork.config import ConfigError
from meshwork.config_sections import MLAConfig, ModelConfig, MTPConfig
from meshwork.engine import speculative
from meshwork.engine.generate import Generator
from meshwork.engine.sampling import SamplingParams
from meshwork.engine.serving import Request, Server
from meshwork.engine.speculative import DraftModelDrafter, SpeculativeGenerator, mtp_drafter
from meshwork.inference.cli import main
from meshwork.models.transformer import Transformer

chisquare = pytest.importorskip("scipy.stats").chisquare


def tiny(n_layers: int, vocab: int, std: float, seed: int = 0) -> Transformer:
    cfg = ModelConfig(vocab_size=vocab, d_model=16, n_layers=n_layers, n_heads=2, n_kv_heads=1, d_ff=32, init_std=std)
    return Transformer(cfg, rngs=nnx.Rngs(seed))


def truncated(model: Transformer, n_layers: int) -> Transformer:
    """The target's first n_layers with its embedding and head: a draft that agrees with it often."""
    draft = tiny(n_layers, model.cfg.vocab_size, model.cfg.init_std, seed=1)
    weights = dict(nnx.to_flat_state(nnx.state(model)))
    state = nnx.state(draft)
    for path, var in nnx.to_flat_state(state):
        var[...] = weights[path][...][:n_layers] if path[0] == "blocks" else weights[path][...]
    nnx.update(draft, state)
    return draft


@pytest.fixture(scope="module")
def pair():
    """A 2-layer target over 32 tokens and its first layer as the draft."""
    target = tiny(2, 32, 0.1)
    return target, truncated(target, 1)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(0, 32, rng.integers(1, 20))] for _ in range(50)]


def test_greedy_equals_plain_greedy_on_50_prompts(pair, prompts):
    """One batch of 50 rows, each with its own budget and some with a stop token: row by row the
    tokens plain greedy decoding gives, with draft tokens both accepted and rejected."""
    target, draft = pair
    params = [
        SamplingParams(temperature=0.0, max_new_tokens=1 + i % 12, stop_tokens=(3, 17) if i % 3 == 0 else ())
        for i in range(50)
    ]
    gen = Generator(target)
    spec = SpeculativeGenerator(gen, DraftModelDrafter(Generator(draft)), k=3)
    assert spec.generate(prompts, params) == gen.generate(prompts, params)
    assert 0 < spec.stats.accepted < spec.stats.proposed
    assert 1 < spec.stats.tokens_per_forward < 4


def test_a_draft_equal_to_the_target_is_always_accepted(pair, prompts):
    """The draft's cache follows the sequence (contiguous and paged): its proposals are the target's
    own greedy tokens, so every one is accepted and each forward yields k + 1 tokens."""
    target, _ = pair
    params = SamplingParams(temperature=0.0, max_new_tokens=9)
    spec = SpeculativeGenerator(Generator(target), DraftModelDrafter(Generator(target)), k=3)
    spec.generate(prompts[:4], params)
    server = Server(target, slots=2, page_size=4, max_len=48, drafter=DraftModelDrafter(Generator(target)))
    server.run(Request(i, p, params) for i, p in enumerate(prompts[:4]))
    for stats in (spec.stats, server.spec):
        assert stats.accepted == stats.proposed > 0
    assert spec.stats.tokens_per_forward == 4.0  # 9 tokens: the prefill's, then 2 rounds of k + 1


V, N = 8, 4096  # vocabulary, draws
PROMPT = [1, 2, 3]


def exact_joint(gen: Generator, p: SamplingParams) -> np.ndarray:
    """(V, V, V): the target's probability of each first three tokens, computed from its logits with
    the settings applied in numpy (penalty, temperature, top-k by a stable sort, top-p)."""
    seqs = np.array([PROMPT + [a, b] for a in range(V) for b in range(V)], np.int32)
    logits, _ = gen.forward(seqs, np.broadcast_to(np.arange(5), seqs.shape), gen.new_cache(V * V, 16))
    logits = np.asarray(logits, np.float64)

    def probs(row: np.ndarray, seen: list[int]) -> np.ndarray:
        row = row.copy()
        s = list(set(seen))
        row[s] = np.where(row[s] > 0, row[s] / p.repetition_penalty, row[s] * p.repetition_penalty)
        row = row / p.temperature
        order = np.argsort(-row, kind="stable")
        w = np.exp(row[order] - row.max())
        w[p.top_k or V :] = 0
        w /= w.sum()
        w[(np.cumsum(w) - w >= p.top_p) & (np.arange(V) > 0)] = 0
        out = np.zeros(V)
        out[order] = w / w.sum()
        return out

    joint = np.zeros((V, V, V))
    p1 = probs(logits[0, 2], PROMPT)
    for a in range(V):
        p2 = probs(logits[a * V, 3], PROMPT + [a])
        for b in range(V):
            joint[a, b] = p1[a] * p2[b] * probs(logits[a * V + b, 4], PROMPT + [a, b])
    return joint


def chi_square_p(spec: SpeculativeGenerator, p: SamplingParams) -> float:
    """p-value of N speculative samples of the first three tokens (seeds 0..N-1) against the exact
    joint; cells expected under 5 draws are pooled. Impossible sequences must never be drawn."""
    out = np.array(spec.generate([PROMPT] * N, [dataclasses.replace(p, seed=i) for i in range(N)]))
    counts = np.zeros((V, V, V))
    np.add.at(counts, tuple(out.T), 1)
    want, got = exact_joint(spec.target, p).ravel() * N, counts.ravel()
    assert got[want == 0].sum() == 0
    big = want >= 5
    observed, expected = list(got[big]), list(want[big])
    if want[~big].sum() > 0:
        observed.append(got[~big].sum())
        expected.append(want[~big].sum())
    return float(chisquare(observed, np.array(expected) * sum(observed) / sum(expected)).pvalue)


@pytest.fixture(scope="module")
def sampling_pair():
    """A target whose distributions are far from its draft's (init std 0.5): acceptance tells them apart."""
    target = tiny(2, V, 0.5)
    return Generator(target), DraftModelDrafter(Generator(truncated(target, 1)))


SETTINGS = [
    pytest.param(SamplingParams(temperature=1.0, max_new_tokens=3), id="plain"),
    pytest.param(
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, repetition_penalty=1.5, max_new_tokens=3),
        id="top_k-top_p-penalty",
    ),
]


@pytest.mark.parametrize("params", SETTINGS)
def test_sampled_tokens_follow_the_targets_distribution(sampling_pair, params):
    """4,096 draws of the first three tokens (the prefill's, then a k = 2 round: accepted draft tokens,
    residual draws after a rejection, bonus tokens) fit the target's exact joint: chi-square p > 0.001."""
    gen, drafter = sampling_pair
    spec = SpeculativeGenerator(gen, drafter, k=2)
    assert chi_square_p(spec, params) > 1e-3
    assert 0.05 < spec.stats.acceptance_rate < 0.95  # both branches taken often


def test_the_chi_square_test_rejects_accepting_every_draft_token(sampling_pair, monkeypatch):
    """The same test on a broken rule (every draft token accepted: the draft's distribution): p < 1e-6."""
    gen, drafter = sampling_pair
    monkeypatch.setattr(speculative, "acceptance_test", lambda u, p, q: u >= 0)
    spec = SpeculativeGenerator(gen, drafter, k=2)
    assert chi_square_p(spec, SETTINGS[0].values[0]) < 1e-6


def test_the_server_releases_the_pages_of_rejected_positions(prompts):
    """Continuous batching with a draft over a small pool (preemption included): each request gets its
    solo greedy tokens; after every step a decoding slot holds only the pages up to its next position,
    so pages taken ahead for rejected positions went back; at the end the whole pool is free."""
    target = tiny(2, 32, 0.2)  # further from its draft than `pair`'s: more rejections
    draft = truncated(target, 1)
    params = [SamplingParams(temperature=0.0, max_new_tokens=6 + i % 11) for i in range(12)]
    drafter = DraftModelDrafter(Generator(draft))
    server = Server(target, slots=3, page_size=4, max_len=48, n_pages=14, drafter=drafter, speculative_k=3)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        server.submit(Request(i, p, sp))
    while server.busy:
        server.step()
        for s in server.slots:
            if s is not None and not s.prefilling:
                assert math.ceil(s.length / 4) <= len(s.pages) <= math.ceil((s.length + 1) / 4)
    assert [server.results[i].tokens for i in range(12)] == Generator(target).generate(prompts[:12], params)
    assert server.spec.released_pages > 0 and server.preemptions > 0
    assert len(server.pages.free) == server.pages.usable
    assert server.stats()["acceptance_rate"] == round(server.spec.acceptance_rate, 4)


def test_a_draft_of_another_vocabulary_is_refused(pair):
    target, _ = pair
    with pytest.raises(ConfigError, match="vocabulary has 16 ids but the target's 32"):
        SpeculativeGenerator(Generator(target), DraftModelDrafter(Generator(tiny(1, 16, 0.1))))
    with pytest.raises(ConfigError, match="--speculative-k 0"):
        Server(target, drafter=DraftModelDrafter(Generator(tiny(1, 32, 0.1))), speculative_k=0)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--speculative", "mtp"], "--speculative mtp: this model has no multi-token-prediction modules"),
        (["--speculative", "/nonexistent"], "--speculative /nonexistent: not a meshwork run dir"),
        (["--speculative", ".", "--speculative-k", "0"], "--speculative-k 0: propose at least 1"),
    ],
)
def test_bad_speculative_options_are_one_line_and_status_2(lm_tiny_runs, capsys, extra, message):
    run_dir = str(lm_tiny_runs["1dev"]["run_dir"])
    assert main(["lm", "--checkpoint", run_dir, "--prompt", "x", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1


def test_lm_with_itself_as_draft_prints_the_greedy_text_and_the_stats(lm_tiny_runs, capsys):
    """`inference lm --speculative RUN_DIR` (the run drafting for itself): stdout is plain greedy
    decoding's text; stderr names the acceptance rate (1: the draft is the model) and the tokens per
    target forward."""
    run_dir = str(lm_tiny_runs["1dev"]["run_dir"])
    argv = ["lm", "--checkpoint", run_dir, "--prompt", "def f(", "--temperature", "0", "--max-new-tokens", "9"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main([*argv, "--speculative", run_dir, "--speculative-k", "3"]) == 0
    out, err = capsys.readouterr()
    assert out == plain
    assert "acceptance rate 1.000 (6/6), 4.00 tokens per target forward" in err, err


# The model's own MTP module as the draft (engine/mtp_draft.py): a tiny MLA model with one MTP module.


def tiny_mtp(vocab: int, std: float) -> Transformer:
    mla = MLAConfig(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=8)
    cfg = ModelConfig(
        vocab_size=vocab, d_model=16, n_layers=2, n_heads=2, d_ff=32, init_std=std, mla=mla, mtp=MTPConfig(depth=1)
    )
    return Transformer(cfg, rngs=nnx.Rngs(0))


def test_mtp_draft_greedy_equals_plain_greedy_on_50_prompts(prompts):
    """The MTP draft in `SpeculativeGenerator` and in the server (prefix caching and 5-token prefill
    chunks, so it re-runs its module at each chunk's first position - 1): every row's tokens are
    plain greedy's, with draft tokens accepted and rejected."""
    model = tiny_mtp(32, 0.3)
    gen = Generator(model)
    params = [SamplingParams(temperature=0.0, max_new_tokens=1 + i % 12) for i in range(50)]
    want = gen.generate(prompts, params)
    spec = SpeculativeGenerator(gen, mtp_drafter(gen), k=3)
    assert spec.generate(prompts, params) == want
    assert 0 < spec.stats.accepted < spec.stats.proposed
    server = Server(
        model, slots=4, page_size=4, max_len=48, prefill_chunk=5, prefix_caching=True, drafter=mtp_drafter(gen)
    )
    got = server.run(Request(i, p + p[:3], params[i]) for i, p in enumerate(prompts[:12]))
    assert [list(got[i].tokens) for i in range(12)] == gen.generate([p + p[:3] for p in prompts[:12]], params[:12])


def test_mtp_draft_sampling_follows_the_targets_distribution():
    """4,096 draws of the first three tokens with the MTP module drafting (k = 2) fit the target's exact
    joint (chi-square p > 0.001): the probabilities it returns are the ones it drew from."""
    gen = Generator(tiny_mtp(V, 0.5))
    spec = SpeculativeGenerator(gen, mtp_drafter(gen), k=2)
    assert chi_square_p(spec, SETTINGS[0].values[0]) > 1e-3
    assert 0.05 < spec.stats.acceptance_rate < 0.95
