"""The per-row token sampler: greedy limits, sampled distributions, penalty, per-row determinism."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshwork.engine.sampling import SamplingArrays, SamplingParams, mark_seen, sample, seen_tokens
from meshwork.engine.validation import RequestError

sample_jit = jax.jit(sample)

# Token ids deliberately not in logit order, so a rank/id mix-up shows.
LOGITS_V = np.array([0.5, -1.0, 2.0, 0.0, 1.0], np.float32)


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def renormalized(keep, logits=LOGITS_V, temperature=1.0):
    p = softmax(logits / temperature) * np.isin(np.arange(len(logits)), keep)
    return p / p.sum()


def draw(params, logits_BV, positions_B, seen_BV=None):
    arrays = SamplingArrays.stack(params)
    return np.asarray(
        sample_jit(
            jnp.asarray(logits_BV), jnp.asarray(positions_B), arrays, None if seen_BV is None else jnp.asarray(seen_BV)
        )
    )


def test_greedy_and_top_k_1_are_argmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(12, 50)).astype(np.float32) * 3
    logits[0, [7, 30]] = 100.0  # a tie goes to the lower id, as in argmax
    expected = logits.argmax(-1)
    params = [SamplingParams(temperature=0.0, seed=i) for i in range(4)]
    params += [SamplingParams(temperature=t, top_k=1, seed=i) for i, t in enumerate([0.3, 1.0, 7.0, 50.0] * 2)]
    for position in (0, 5, 1000):
        np.testing.assert_array_equal(draw(params, logits, np.full(12, position)), expected)
    assert expected[0] == 7


# (params, seen token ids, expected distribution over LOGITS_V's 5 tokens)
DISTRIBUTIONS = {
    "softmax": (SamplingParams(), (), softmax(LOGITS_V)),
    "tempered": (SamplingParams(temperature=0.5), (), softmax(LOGITS_V / 0.5)),
    "hot": (SamplingParams(temperature=3.0), (), softmax(LOGITS_V / 3.0)),
    "top_k": (SamplingParams(top_k=3), (), renormalized([2, 4, 0])),
    # probs by rank .53 .20 .12 .07 .03: 0.8 is first covered by the top 3
    "top_p": (SamplingParams(top_p=0.8), (), renormalized([2, 4, 0])),
    # tempered first: .37 .23 .18 .14 .08 -> 0.8 needs the top 4
    "tempered_top_p": (SamplingParams(temperature=2.0, top_p=0.8), (), renormalized([2, 4, 0, 3], temperature=2.0)),
    # top-p of the renormalized top 3 (.63 .23 .14): 0.8 needs only 2
    "top_k_top_p": (SamplingParams(top_k=3, top_p=0.8), (), renormalized([2, 4])),
    # hand-penalized: seen 2.0 -> 1.0, seen -1.0 -> -2.0, unseen untouched
    "penalty": (SamplingParams(repetition_penalty=2.0), (1, 2), softmax(np.array([0.5, -2.0, 1.0, 0.0, 1.0]))),
}


def test_sampled_distributions_match_and_filtered_tokens_never_appear():
    n = 20_000  # rows per setting, each its own (seed, position); all settings in one batch
    names = list(DISTRIBUTIONS)
    params, seen = [], np.zeros((n * len(names), 5), bool)
    for i, name in enumerate(names):
        p, seen_ids, _ = DISTRIBUTIONS[name]
        params += [SamplingParams(**{**p.__dict__, "seed": s}) for s in range(n)]
        seen[i * n : (i + 1) * n, list(seen_ids)] = True
    positions = np.tile(np.arange(n) % 97, len(names))
    tokens = draw(params, np.tile(LOGITS_V, (n * len(names), 1)), positions, seen).reshape(len(names), n)
    for name, row in zip(names, tokens):
        expected = DISTRIBUTIONS[name][2]
        freq = np.bincount(row, minlength=5) / n
        tolerance = 5 * np.sqrt(expected * (1 - expected) / n) + 1e-9  # 5 sigma per token
        assert np.all(np.abs(freq - expected) <= tolerance), (name, freq.round(4), expected.round(4))
        assert np.all(freq[expected == 0] == 0), (name, freq)


def test_ties_at_the_top_k_cut_keep_the_lower_ids():
    logits = np.tile(np.array([1.0, 3.0, 3.0, 3.0, 0.0], np.float32), (2000, 1))
    tokens = draw([SamplingParams(top_k=2, seed=s) for s in range(2000)], logits, np.zeros(2000))
    counts = np.bincount(tokens, minlength=5)
    assert counts[[0, 3, 4]].sum() == 0 and min(counts[1], counts[2]) > 850, counts


def test_repetition_penalty_changes_greedy_choice():
    logits = np.array([[3.0, 2.0, -1.0, -1.5]] * 3, np.float32)
    seen = np.array([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]], bool)
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0)] * 3
    # row 0: 3 -> 1.5 < 2; row 1: nothing seen; row 2: 1.5, 1.0, -2.0 vs unseen -1.5
    np.testing.assert_array_equal(draw(params, logits, np.zeros(3), seen), [1, 0, 0])
    # a penalty below 1 favours seen tokens, negative ones included: -1 * 0.1 > -1.5
    logits = np.array([[-1.0, -1.5, -3.0]], np.float32)
    params = [SamplingParams(temperature=0.0, repetition_penalty=0.1)]
    assert draw(params, logits, [0], [[False, True, False]])[0] == 1
    assert draw(params, logits, [0], [[False, False, False]])[0] == 0
    assert draw(params, logits, [0])[0] == 0  # no seen mask: no penalty


def test_row_draws_follow_seed_and_position_not_the_batch():
    rng = np.random.default_rng(1)
    V = 40
    mixed = [
        SamplingParams(seed=11),
        SamplingParams(top_k=5, seed=12),
        SamplingParams(top_p=0.7, seed=13),
        SamplingParams(temperature=0.6, top_k=8, top_p=0.9, repetition_penalty=1.3, seed=14),
        SamplingParams(temperature=0.0, seed=15),
    ]
    logits = rng.normal(size=(len(mixed), V)).astype(np.float32) * 2
    seen = rng.random((len(mixed), V)) < 0.3
    positions = np.array([3, 17, 17, 250, 9])
    alone = [draw([p], logits[i : i + 1], positions[i : i + 1], seen[i : i + 1])[0] for i, p in enumerate(mixed)]

    # The same rows shuffled into a larger batch among unrelated rows.
    others = [SamplingParams(temperature=2.0, top_k=2, seed=s) for s in range(7)]
    at = np.array([9, 0, 4, 11, 6])
    params = [None] * 12
    for j, i in enumerate(at):
        params[i] = mixed[j]
    for j, i in enumerate(sorted(set(range(12)) - set(at))):
        params[i] = others[j]
    big_logits = rng.normal(size=(12, V)).astype(np.float32)
    big_seen = rng.random((12, V)) < 0.5
    big_positions = rng.integers(0, 500, 12)
    big_logits[at], big_seen[at], big_positions[at] = logits, seen, positions
    np.testing.assert_array_equal(draw(params, big_logits, big_positions, big_seen)[at], alone)

    # The documented key: a plain row is categorical(fold_in(key(seed), position), logits).
    key = jax.random.fold_in(jax.random.key(11), 3)
    assert alone[0] == int(jax.random.categorical(key, jnp.asarray(logits[0])))


def test_draws_vary_with_seed_and_position():
    logits = np.zeros((200, 64), np.float32)
    by_seed = draw([SamplingParams(seed=s) for s in range(200)], logits, np.zeros(200))
    by_position = draw([SamplingParams(seed=0)] * 200, logits, np.arange(200))
    assert len(set(by_seed)) > 40 and len(set(by_position)) > 40
    assert (by_seed != by_position).any()


def test_seen_tokens_and_mark_seen():
    tokens = jnp.array([[3, 1, 0, 0], [2, 2, 4, 1]])
    seen = seen_tokens(tokens, jnp.array([2, 4]), 5)
    np.testing.assert_array_equal(seen, [[0, 1, 0, 1, 0], [0, 1, 1, 0, 1]])
    np.testing.assert_array_equal(mark_seen(seen, jnp.array([4, 0])), [[0, 1, 0, 1, 1], [1, 1, 1, 0, 1]])


@pytest.mark.parametrize(
    "field, value, param",
    [
        ("temperature", -0.5, "temperature"),
        ("temperature", float("nan"), "temperature"),
        ("top_k", -1, "top_k"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("repetition_penalty", 0.0, "repetition_penalty"),
        ("max_new_tokens", 0, "max_tokens"),
        ("stop_tokens", (3, 100), "stop_token_ids"),
        ("seed", -1, "seed"),
    ],
)
def test_check_names_the_bad_field(field, value, param):
    """A RequestError naming the field, its `param` OpenAI's name of it."""
    with pytest.raises(RequestError, match=field) as err:
        SamplingParams(**{field: value}).check(vocab_size=100)
    assert "\n" not in str(err.value) and err.value.param == param


def test_check_accepts_valid_settings():
    SamplingParams(
        temperature=0.0,
        top_k=5,
        top_p=0.5,
        repetition_penalty=1.2,
        max_new_tokens=1,
        stop_tokens=(0, 99),
        seed=2**32 - 1,
    ).check(vocab_size=100)
