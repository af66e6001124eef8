"""Next-token sampling for KV-cache generation and continuous batching, one setting per row.

Per row (request), in float32:

1. repetition penalty (CTRL / Hugging Face): a token already seen in the
   prompt or the output has its logit divided by the penalty when positive,
   multiplied by it otherwise;
2. temperature 0 -> argmax of the penalized logits (greedy), else divide by
   the temperature and
3. top-k: keep the k highest logits (k = 0 keeps all);
4. top-p (nucleus): of what top-k kept, keep the smallest set of most likely
   tokens whose renormalized probability sums to >= top_p (the top token is
   always kept; top_p = 1 keeps all);
5. draw with `jax.random.categorical` over the kept logits.

Every setting is a (B,) array, so requests with different settings share one
batch. Nothing sorts the vocabulary: a batch of greedy rows is one argmax
(the sampling branch is skipped under `lax.cond`), and top-k / top-p read the
`TOP_K_BOUND` most likely tokens from `lax.top_k` (a static bound; a row's k
is a mask over those ranks). A row whose nucleus or k reaches past that bound
(a flat distribution, a huge k) finds its cut by a threshold search instead:
32 bisection passes over the float bit patterns, each a compare and a sum over
the vocabulary. Ties go to the lower token id, as in `jnp.argmax` (the
threshold search alone keeps every token tied at its cut).
`sample_reference` is the plain full-sort sampler, kept for tests and
benchmarks.

Randomness is per row: row b draws with
`fold_in(jax.random.key(seed_b), position_b)`, position_b being the position
the new token will occupy. A batch-wide key split by slot would make a
request's tokens depend on which slot the server put it in and on what else
was running; with per-row keys a request yields the same tokens alone, in
any batch, and after a restart, and a given token can be reproduced from
(seed, position) only.

    arrays = SamplingArrays.stack([SamplingParams(temperature=0.7, top_p=0.9, seed=1)])
    next_B = sample(logits_BV, positions_B, arrays, seen_BV)
    logp_BV = log_probs(logits_BV)          # log-softmax of the same logits (`log_probs` says which)
    p_BV = sampler_probs(logits_BV, arrays, seen_BV)   # the distribution `sample` draws from (speculative.py)
    lp_B, top_BK, ids_BK = token_log_probs(logits_BV, next_B, 5)   # what the server returns per token
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from meshwork.engine.validation import RequestError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (host side)."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 turns it off."""
    top_p: float = 1.0
    """Nucleus sampling: keep the most likely tokens covering this probability; 1.0 turns it off."""
    repetition_penalty: float = 1.0
    """> 1 discourages tokens already seen (prompt and output); 1.0 turns it off."""
    max_new_tokens: int = 64
    """Stop after this many generated tokens."""
    stop_tokens: tuple[int, ...] = ()
    """Stop after generating any of these token ids (the stop token is emitted)."""
    seed: int = 0
    """Seed of this request's random draws, in [0, 2**32)."""
    logprobs: int = 0
    """How many most likely alternatives (top_logprobs) to return with each token's log-probability,
    0 to MAX_TOP_LOGPROBS; the sampled token's own log-probability is always returned. No effect on
    which tokens are sampled."""

    def check(self, vocab_size: int) -> None:
        """Raise RequestError (one line naming the field and the fix; `param`: OpenAI's name) on a bad setting.

        Every number must also fit the device arrays it becomes (`SamplingArrays.stack`: float32,
        int32, uint32): a value that did not would fail on the engine's thread, not here."""
        problems = [
            (
                not 0 <= self.temperature <= FLOAT32_MAX,
                "temperature",
                f"temperature={self.temperature}: use 0 (greedy) or a positive finite value (at most {FLOAT32_MAX:.3g})",
            ),
            (
                not 0 <= self.top_k <= INT32_MAX,
                "top_k",
                f"top_k={self.top_k}: use 0 (off) or a positive count (at most {INT32_MAX}; past the "
                "vocabulary it keeps every token)",
            ),
            (not 0 < self.top_p <= 1, "top_p", f"top_p={self.top_p}: use a value in (0, 1]; 1.0 turns it off"),
            (
                not 0 < self.repetition_penalty <= FLOAT32_MAX,
                "repetition_penalty",
                f"repetition_penalty={self.repetition_penalty}: use a positive finite value (at most {FLOAT32_MAX:.3g}); "
                "1.0 turns it off",
            ),
            (
                not 1 <= self.max_new_tokens <= INT32_MAX,
                "max_tokens",
                f"max_new_tokens={self.max_new_tokens}: use at least 1 (and at most {INT32_MAX})",
            ),
            (not 0 <= self.seed < 2**32, "seed", f"seed={self.seed}: use an integer in [0, 2**32)"),
            (
                not 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
                "top_logprobs",
                f"logprobs={self.logprobs}: ask for 0 to {MAX_TOP_LOGPROBS} alternatives per token",
            ),
        ]
        bad_stops = [t for t in self.stop_tokens if not 0 <= t < vocab_size]
        # The first few bad ids only: a request may carry thousands, and the message is one line.
        shown = ", ".join(map(str, bad_stops[:3])) + (
            f", ... ({len(bad_stops):,} in all)" if len(bad_stops) > 3 else ""
        )
        problems.append(
            (bool(bad_stops), "stop_token_ids", f"stop_tokens=[{shown}]: token ids must lie in [0, {vocab_size})")
        )
        for bad, param, message in problems:
            if bad:
                raise RequestError(f"sampling.{message}", param)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    """The device side of `SamplingParams`: one (B,) row per batch slot."""

    temperature: jax.Array  # f32
    top_k: jax.Array  # i32
    top_p: jax.Array  # f32
    repetition_penalty: jax.Array  # f32
    seed: jax.Array  # u32

    @classmethod
    def stack(cls, params: Sequence[SamplingParams]) -> SamplingArrays:
        """Rows in the order given: `SamplingArrays.stack([p0, p1])` -> arrays of shape (2,)."""

        def column(name, dtype):
            return jnp.asarray([getattr(p, name) for p in params], dtype=dtype)

        return cls(
            temperature=column("temperature", jnp.float32),
            top_k=column("top_k", jnp.int32),
            top_p=column("top_p", jnp.float32),
            repetition_penalty=column("repetition_penalty", jnp.float32),
            seed=column("seed", jnp.uint32),
        )


MAX_TOP_LOGPROBS = 20  # the most alternatives per token a request may ask for (OpenAI's top_logprobs bound)
INT32_MAX = 2**31 - 1  # top_k and the token budget become int32 arrays
FLOAT32_MAX = 3.4028234663852886e38  # temperature and the penalty become float32 arrays (and must be finite)
TOP_K_BOUND = 64  # ranks read by lax.top_k; top-k and nuclei within them need no threshold search


def _penalize(logits_BV: jax.Array, arrays: SamplingArrays, seen_BV: jax.Array | None) -> jax.Array:
    logits_BV = logits_BV.astype(jnp.float32)
    if seen_BV is None:
        return logits_BV
    p_B1 = arrays.repetition_penalty[:, None]
    penalized_BV = jnp.where(logits_BV > 0, logits_BV / p_B1, logits_BV * p_B1)
    return jnp.where(seen_BV, penalized_BV, logits_BV)


def _draw(keep_BV: jax.Array, scaled_BV: jax.Array, positions_B: jax.Array, seed_B: jax.Array) -> jax.Array:
    keys_B = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seed_B, positions_B)
    return jax.vmap(jax.random.categorical)(keys_B, jnp.where(keep_BV, scaled_BV, -jnp.inf))


def _order_key(x_BV: jax.Array) -> jax.Array:
    """uint32 keys in the order of the float32 values (bit tricks: sign-magnitude -> offset binary)."""
    i_BV = jax.lax.bitcast_convert_type(x_BV, jnp.int32)
    i_BV = jnp.where(i_BV < 0, i_BV ^ jnp.int32(0x7FFFFFFF), i_BV)
    return jax.lax.bitcast_convert_type(i_BV, jnp.uint32) ^ jnp.uint32(0x80000000)


def _largest_threshold(holds: Callable[[jax.Array], jax.Array], B: int) -> jax.Array:
    """Per row, the largest uint32 t with holds(t) true, for a holds() that is true at 0 and
    monotone (true below some t, false above): built bit by bit from the top, 32 passes."""

    def bit(j, t_B):
        candidate_B = t_B | (jnp.uint32(1) << (31 - j).astype(jnp.uint32))
        return jnp.where(holds(candidate_B), candidate_B, t_B)

    return jax.lax.fori_loop(0, 32, bit, jnp.zeros(B, jnp.uint32))


def _threshold_keep(scaled_BV: jax.Array, k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
    """The top-k / top-p mask by threshold search (no sort): for rows the top_k ranks do not cover."""
    B, V = scaled_BV.shape
    key_BV = _order_key(scaled_BV)
    k_B = jnp.where((k_B <= 0) | (k_B > V), V, k_B)
    t_k_B = _largest_threshold(lambda t_B: (key_BV >= t_B[:, None]).sum(-1) >= k_B, B)
    keep_BV = key_BV >= t_k_B[:, None]
    probs_BV = jax.nn.softmax(jnp.where(keep_BV, scaled_BV, -jnp.inf), axis=-1)
    t_p_B = _largest_threshold(
        lambda t_B: jnp.where(key_BV >= t_B[:, None], probs_BV, 0).sum(-1) >= jnp.minimum(top_p_B, 1.0), B
    )
    return keep_BV & ((top_p_B[:, None] >= 1) | (key_BV >= t_p_B[:, None]))


def _keep_mask(scaled_BV: jax.Array, arrays: SamplingArrays) -> jax.Array:
    """bool (B, V): the tokens top-k and top-p keep of each row's temperature-scaled logits (greedy
    rows: whatever; their callers take the argmax)."""
    B, V = scaled_BV.shape
    K = min(V, TOP_K_BOUND)
    top_BX, order_BX = jax.lax.top_k(scaled_BV, K)  # ties: lower id first, as the stable sort
    rank_X = jnp.arange(K)
    k_B, top_p_B = arrays.top_k, arrays.top_p
    whole_B = (k_B <= 0) | (k_B >= V)  # k keeps the whole vocabulary
    in_prefix_B = ~whole_B & (k_B <= K)  # k keeps exactly the first k ranks
    keep_BX = whole_B[:, None] | (rank_X < k_B[:, None])
    # Probabilities over what k keeps: normalized over the first k ranks or the whole vocabulary.
    lse_B = jnp.where(
        in_prefix_B,
        jax.nn.logsumexp(jnp.where(keep_BX, top_BX, -jnp.inf), axis=-1),
        jax.nn.logsumexp(scaled_BV, axis=-1),
    )
    probs_BX = jnp.where(keep_BX, jnp.exp(top_BX - lse_B[:, None]), 0.0)
    cum_BX = jnp.cumsum(probs_BX, axis=-1)
    nucleus_BX = (top_p_B[:, None] >= 1) | (cum_BX - probs_BX < top_p_B[:, None]) | (rank_X == 0)
    # The prefix decides a row when k lies within it, or when its nucleus closes inside it.
    nucleus_closes_B = (top_p_B < 1) & (cum_BX[:, -1] >= top_p_B)
    decided_B = in_prefix_B | (whole_B & ((top_p_B >= 1) | nucleus_closes_B))
    rows_B1 = jnp.arange(B)[:, None]
    keep_BV = jnp.zeros((B, V), bool).at[rows_B1, order_BX].set(keep_BX & nucleus_BX)
    keep_BV |= (whole_B & (top_p_B >= 1))[:, None]
    return jax.lax.cond(
        jnp.any(~decided_B & (arrays.temperature > 0)),
        lambda: jnp.where(decided_B[:, None], keep_BV, _threshold_keep(scaled_BV, k_B, top_p_B)),
        lambda: keep_BV,
    )


def _scaled(logits_BV: jax.Array, temperature_B: jax.Array) -> jax.Array:
    return logits_BV / jnp.where(temperature_B > 0, temperature_B, 1.0)[:, None]


def sample(
    logits_BV: jax.Array, positions_B: jax.Array, arrays: SamplingArrays, seen_BV: jax.Array | None = None
) -> jax.Array:
    """int32 (B,) next tokens, row b drawn with `fold_in(key(seed_b), positions_B[b])`. Jittable.

    positions_B[b] is the position the sampled token will occupy; seen_BV (bool) marks
    the tokens the repetition penalty applies to (None: no penalty).
    """
    logits_BV = _penalize(logits_BV, arrays, seen_BV)
    greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    temperature_B = arrays.temperature

    def sampled(_):
        scaled_BV = _scaled(logits_BV, temperature_B)
        drawn_B = _draw(_keep_mask(scaled_BV, arrays), scaled_BV, positions_B, arrays.seed)
        return jnp.where(temperature_B > 0, drawn_B, greedy_B).astype(jnp.int32)

    # A batch of greedy rows (the common serving case) never reaches top_k, softmax or the draw.
    return jax.lax.cond(jnp.any(temperature_B > 0), sampled, lambda _: greedy_B, None)


def sampler_probs(logits_BV: jax.Array, arrays: SamplingArrays, seen_BV: jax.Array | None = None) -> jax.Array:
    """float32 (B, V): the distribution `sample` draws each row's token from, after the repetition
    penalty, temperature, top-k and top-p (zero outside what they keep); a greedy row's is one-hot
    on its argmax. What speculative decoding's acceptance test compares (speculative.py). Jittable.

        p_BV = sampler_probs(logits_BV, SamplingArrays.stack([SamplingParams(top_k=5)]))
    """
    logits_BV = _penalize(logits_BV, arrays, seen_BV)
    V = logits_BV.shape[-1]
    greedy_BV = jax.nn.one_hot(jnp.argmax(logits_BV, axis=-1), V, dtype=jnp.float32)
    temperature_B = arrays.temperature

    def sampled(_):
        scaled_BV = _scaled(logits_BV, temperature_B)
        probs_BV = jax.nn.softmax(jnp.where(_keep_mask(scaled_BV, arrays), scaled_BV, -jnp.inf), axis=-1)
        return jnp.where((temperature_B > 0)[:, None], probs_BV, greedy_BV)

    return jax.lax.cond(jnp.any(temperature_B > 0), sampled, lambda _: greedy_BV, None)


def log_probs(
    logits_BV: jax.Array, arrays: SamplingArrays | None = None, seen_BV: jax.Array | None = None
) -> jax.Array:
    """float32 (B, V) log-probabilities of the next token, from the logits `sample` was given. Jittable.

    Without `arrays`: the model's own distribution, log_softmax(logits) (what a policy-gradient
    rollout or a speculative-decoding acceptance test compares). With `arrays` (and `seen_BV` for
    the repetition penalty): the distribution the sampler scales before top-k/top-p cut it, the
    penalized logits over each row's temperature (1 for a greedy row).

        out = gen.decode_step(tokens_B, positions_B, cache, arrays, seen_BV)
        lp_B = log_probs(out.logits)[jnp.arange(B), out.tokens]   # log p of each sampled token
    """
    if arrays is None:
        return jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
    logits_BV = _penalize(logits_BV, arrays, seen_BV)
    t_B = arrays.temperature
    return jax.nn.log_softmax(logits_BV / jnp.where(t_B > 0, t_B, 1.0)[:, None], axis=-1)


def token_log_probs(logits_BV: jax.Array, tokens_B: jax.Array, top: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(lp_B, top_BK, ids_BK): each row's log-probability of tokens_B[b] under the model's own
    distribution, log_softmax(logits) in float32 (`log_probs` without arrays: before the repetition
    penalty, temperature, top-k and top-p, as vLLM's default "raw" logprobs), and its `top` most likely
    tokens' log-probabilities (descending; ties: the lower id first) and ids. Jittable; `top` is static
    (0: empty (B, 0) arrays, nothing computed beyond one logsumexp per row).

        lp_B, top_BK, ids_BK = token_log_probs(logits_BV, sample(logits_BV, ...), 5)
    """
    logits_BV = logits_BV.astype(jnp.float32)
    lse_B = jax.nn.logsumexp(logits_BV, axis=-1)
    lp_B = jnp.take_along_axis(logits_BV, tokens_B[:, None].astype(jnp.int32), axis=-1)[:, 0] - lse_B
    if top == 0:
        B = logits_BV.shape[0]
        return lp_B, jnp.zeros((B, 0), jnp.float32), jnp.zeros((B, 0), jnp.int32)
    top_BK, ids_BK = jax.lax.top_k(logits_BV, top)
    return lp_B, top_BK - lse_B[:, None], ids_BK.astype(jnp.int32)


def sample_reference(
    logits_BV: jax.Array, positions_B: jax.Array, arrays: SamplingArrays, seen_BV: jax.Array | None = None
) -> jax.Array:
    """`sample` by one stable descending sort of every row: the definition the fast path must equal.

    positions_B[b] is the position the sampled token will occupy; seen_BV (bool) marks
    the tokens the repetition penalty applies to (None: no penalty).
    """
    B, V = logits_BV.shape
    logits_BV = logits_BV.astype(jnp.float32)
    if seen_BV is not None:
        p_B1 = arrays.repetition_penalty[:, None]
        penalized_BV = jnp.where(logits_BV > 0, logits_BV / p_B1, logits_BV * p_B1)
        logits_BV = jnp.where(seen_BV, penalized_BV, logits_BV)
    greedy_B = jnp.argmax(logits_BV, axis=-1)

    temperature_B = arrays.temperature
    scaled_BV = logits_BV / jnp.where(temperature_B > 0, temperature_B, 1.0)[:, None]
    # One stable descending sort: rank r of a row is its r-th most likely token, ties by lower id.
    order_BV = jnp.argsort(scaled_BV, axis=-1, descending=True, stable=True)
    sorted_BV = jnp.take_along_axis(scaled_BV, order_BV, axis=-1)
    rank_V = jnp.arange(V)
    k_B1 = arrays.top_k[:, None]
    keep_BV = (k_B1 <= 0) | (rank_V < k_B1)
    probs_BV = jax.nn.softmax(jnp.where(keep_BV, sorted_BV, -jnp.inf), axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # probability of the higher ranks
    top_p_B1 = arrays.top_p[:, None]
    keep_BV &= (top_p_B1 >= 1) | (mass_before_BV < top_p_B1) | (rank_V == 0)
    # Back from rank order to token order (order_BV is a permutation: no write collides).
    keep_BV = jnp.zeros((B, V), bool).at[jnp.arange(B)[:, None], order_BV].set(keep_BV)

    keys_B = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(arrays.seed, positions_B)
    drawn_B = jax.vmap(jax.random.categorical)(keys_B, jnp.where(keep_BV, scaled_BV, -jnp.inf))
    return jnp.where(temperature_B > 0, drawn_B, greedy_B).astype(jnp.int32)


def seen_tokens(tokens_BL: jax.Array, lengths_B: jax.Array, vocab_size: int) -> jax.Array:
    """bool (B, V): which token ids occur among row b's first lengths_B[b] tokens.

    `seen_tokens(jnp.array([[3, 1, 0]]), jnp.array([2]), 4)` -> [[False, True, False, True]].
    """
    B, L = tokens_BL.shape
    valid_BL = jnp.arange(L) < lengths_B[:, None]
    # Padding is sent out of range and dropped, so every write that lands sets True.
    ids_BL = jnp.where(valid_BL, tokens_BL, vocab_size)
    return jnp.zeros((B, vocab_size), bool).at[jnp.arange(B)[:, None], ids_BL].set(True, mode="drop")


def mark_seen(seen_BV: jax.Array, tokens_B: jax.Array) -> jax.Array:
    """seen_BV with each row's new token added: call after every `sample`."""
    return seen_BV.at[jnp.arange(seen_BV.shape[0]), tokens_B].set(True)
