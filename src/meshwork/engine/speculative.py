"""Speculative decoding: a draft proposes k tokens, the target verifies them in one forward.

    drafter = DraftModelDrafter(Generator(small_model))          # same tokenizer as the target
    spec = SpeculativeGenerator(Generator(model), drafter, k=4)
    out = spec.generate(prompts, SamplingParams(temperature=0.7, top_p=0.9))
    spec.stats.acceptance_rate, spec.stats.tokens_per_forward
    Server(model, drafter=drafter, speculative_k=4)              # continuous batching (serving.py)

One round, per row: the draft proposes d_1..d_k from its distributions q_1..q_k; the target
computes its logits at [last, d_1, ..., d_k], at positions pos..pos+k, in ONE forward over its
cache; draft token d_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first
rejection the row's next token is drawn from normalize(max(0, p_j - q_j)), and when all k are
accepted a bonus token is drawn from p_{k+1} (Leviathan et al. 2023, Chen et al. 2023). Each
token a round emits is distributed exactly as the target's next token given the ones before it,
so the output distribution is the target's, whatever the draft. p and q are the distributions
the sampler draws from (`sampling.sampler_probs`: repetition penalty, temperature, top-k and
top-p as for plain sampling; a greedy row's p and q are one-hot on the argmax), so a greedy row
accepts while the target's argmax equals the draft token and decodes exactly what plain greedy
decoding does. The repetition penalty stays exact too: p_j is penalized by the tokens at
positions <= pos + j (the draft tokens before j included), as plain decoding would see them.
Every setting of `SamplingParams` is kept exact; a target whose logits depend on the length of
the call (dynamic-NTK RoPE) is refused.

Randomness is per row and position, as in `sampling.py`: the draft's draw, the acceptance test
and the residual draw for the token at position t use `fold_in(key(seed), t)` folded with their
own tag, so a request yields the same tokens alone or in any batch.

Caches: both are position-driven (a write at p overwrites; a query at p sees keys <= p), so the
keys and values of rejected tokens need no copy: the next round writes its tokens over them. In
a paged cache, the pages a round allocated only for positions that ended up rejected are
released back to the pool after the round (serving.py); a round that could not get pages for all
k positions emits at most as many tokens as its pages cover (a prefix of an exact sample is
exact). Rows accept different counts and each keeps its own position.

Metrics (`SpecStats`): acceptance rate = accepted draft tokens / proposed ones; tokens per target
forward = tokens emitted / (rows x rounds), each row's share of a verification counting as one
forward (plain decoding: 1; at most k + 1).

The Drafter interface: a drafter is pure functions that run inside the round's jitted program,
with its weights and cache passed in as arguments.

- `vocab_size`, `needs_hidden` (class attribute: whether it wants the target's pre-final-norm
  hidden states), `weights()` (a pytree; the round's jit argument).
- `new_cache(batch, max_len)` / `new_pool(n_pages, page_size, batch, pages_per_seq)`: its own
  contiguous cache, or its paged pool (a `PagedKVCache` whose page table the server replaces
  with the target's: both caches share pages); None when it keeps nothing of its own.
- `observe(weights, target_state, cache, target_cache, verified) -> (cache, target_cache)`:
  called after every target forward, a prefill (chunk) or a verification, with `Verified`:
  the tokens fed, their positions, how many of them (leading) now belong to the sequence, the
  target's hidden states at them when `needs_hidden` (else None), the token sampled after the
  accepted ones, the rows' slots and whether it was a prefill.
- `propose(weights, target_state, cache, target_cache, rows, k, arrays, seen_BV) -> Proposal`:
  k draft tokens per row and the distributions they were drawn from. `rows` holds each row's
  last token (`last_B`, at `pos_B`, in neither cache yet) and the one before it (`prev_B`).

`DraftModelDrafter` is a second, small model (a Generator of its own, same vocabulary): its
`observe` prefills its own cache with the prompt; `propose` feeds [prev, last] then its own
proposals. An MTP drafter (`mtp_drafter`) drafts with the target's multi-token-prediction
module: `needs_hidden = True`, its KV layers appended to the target's cache (passed in as
`target_cache`), and it reads the hidden states of the verified positions in `observe`; the
target's forward is then `Generator.apply_hidden(state, tokens, positions, cache) -> (logits,
hidden, cache)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from meshwork.config import ConfigError
from meshwork.engine.generate import PROMPT_BUCKET, Generator, collect, per_prompt
from meshwork.engine.kv_cache import PagedKVCache
from meshwork.engine.sampling import (
    SamplingArrays,
    SamplingParams,
    mark_seen,
    sample,
    sampler_probs,
    seen_tokens,
    token_log_probs,
)
from meshwork.engine.validation import RequestError
from meshwork.kernels.pallas_backend import round_up
from meshwork.rope_scaling import rope_type_of

# Tags folded into a row's (seed, position) key: each random choice about one position is its own.
DRAFT_TAG, ACCEPT_TAG, RESIDUAL_TAG = 1, 2, 3


class Rows(NamedTuple):
    """Each row's state between rounds: `last_B` is fed at `pos_B` next (in no cache yet); `prev_B`,
    at pos_B - 1, is in the target's cache."""

    prev_B: jax.Array
    last_B: jax.Array
    pos_B: jax.Array


class Verified(NamedTuple):
    """What a target forward computed, for `Drafter.observe`."""

    tokens_BL: jax.Array  # the tokens fed
    positions_BL: jax.Array  # their positions
    accepted_B: jax.Array  # how many leading tokens of tokens_BL now belong to the sequence
    hidden_BLD: jax.Array | None  # the target's pre-final-norm hidden states at them (needs_hidden) or None
    next_B: jax.Array  # the token sampled after the accepted ones (a prefill chunk: meaningful when it ends the prompt)
    slot_B: jax.Array  # each row's row of the drafter's per-row state (the server's prefill chunk: one slot)
    prefill: bool  # a prefill (chunk), not a verification


class Proposal(NamedTuple):
    tokens_BK: jax.Array  # int32 draft tokens
    probs_BKV: jax.Array  # float32: the distributions they were drawn from
    cache: Any  # the drafter's cache
    target_cache: Any  # the target's cache (changed only by a drafter whose layers live there)


class Drafter:
    """The interface (see the module docstring); subclasses override what they use."""

    needs_hidden = False
    vocab_size: int

    def weights(self) -> Any:
        return None

    def new_cache(self, batch: int, max_len: int) -> Any:
        return None

    def new_pool(self, n_pages: int, page_size: int, batch: int, pages_per_seq: int, sharding=None) -> Any:
        return None

    def observe(self, weights, target_state, cache, target_cache, verified: Verified):
        return cache, target_cache

    def propose(self, weights, target_state, cache, target_cache, rows: Rows, k: int, arrays, seen_BV) -> Proposal:
        raise NotImplementedError


def with_table(pool, table_BP: jax.Array):
    """A drafter's paged pool with the target's page table (the pool itself when it is not paged)."""
    return dataclasses.replace(pool, page_table=table_BP) if isinstance(pool, PagedKVCache) else pool


def draw(probs_BV: jax.Array, positions_B: jax.Array, seed_B: jax.Array, tag: int) -> jax.Array:
    """int32 (B,) tokens drawn from probs_BV with row b's key for `positions_B[b]` and `tag`."""

    def key(seed, position):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), position), tag)

    keys_B = jax.vmap(key)(seed_B, positions_B)
    return jax.vmap(jax.random.categorical)(keys_B, jnp.log(probs_BV)).astype(jnp.int32)


class DraftModelDrafter(Drafter):
    """A second, small model of the same vocabulary drafts: `DraftModelDrafter(Generator(model))`."""

    def __init__(self, generator: Generator):
        self.gen = generator
        self.vocab_size = generator.vocab_size

    def weights(self):
        return self.gen.state

    def new_cache(self, batch, max_len):
        return self.gen.new_cache(batch, max_len)

    def new_pool(self, n_pages, page_size, batch, pages_per_seq, sharding=None):
        return PagedKVCache.zeros(
            self.gen.cfg, n_pages, page_size, batch, pages_per_seq, self.gen.cache_dtype, sharding
        )

    def observe(self, weights, target_state, cache, target_cache, verified):
        # A verification's tokens were fed to the draft while it proposed them; a prompt was not.
        if verified.prefill:
            _, cache = self.gen.apply(weights, verified.tokens_BL, verified.positions_BL, cache)
        return cache, target_cache

    def propose(self, weights, target_state, cache, target_cache, rows, k, arrays, seen_BV):
        # prev is fed again (the same keys/values at the same position): after a round that
        # accepted all k, the draft never saw d_k, which is now prev.
        tokens_B2 = jnp.stack([rows.prev_B, rows.last_B], axis=1)
        logits_B2V, cache = self.gen.apply(weights, tokens_B2, rows.pos_B[:, None] + jnp.arange(-1, 1), cache)
        seen_BV = mark_seen(seen_BV, rows.last_B)

        def one(logits_BV, seen_BV, j):
            q_BV = sampler_probs(logits_BV, arrays, seen_BV)
            return draw(q_BV, rows.pos_B + 1 + j, arrays.seed, DRAFT_TAG), q_BV

        def step(carry, j):
            logits_BV, cache, seen_BV = carry
            d_B, q_BV = one(logits_BV, seen_BV, j)
            logits_B1V, cache = self.gen.apply(weights, d_B[:, None], (rows.pos_B + 1 + j)[:, None], cache)
            return (logits_B1V[:, 0], cache, mark_seen(seen_BV, d_B)), (d_B, q_BV)

        (logits_BV, cache, seen_BV), (d_JB, q_JBV) = jax.lax.scan(
            step, (logits_B2V[:, 1], cache, seen_BV), jnp.arange(k - 1)
        )
        d_B, q_BV = one(logits_BV, seen_BV, k - 1)
        tokens_BK = jnp.concatenate([d_JB.T, d_B[:, None]], axis=1)
        probs_BKV = jnp.concatenate([jnp.moveaxis(q_JBV, 0, 1), q_BV[:, None]], axis=1)
        return Proposal(tokens_BK, probs_BKV, cache, target_cache)


def mtp_drafter(generator: Generator) -> Drafter:
    """The target's own multi-token-prediction module as its draft (model.mtp.depth > 0; engine/mtp_draft.py)."""
    from meshwork.engine.mtp_draft import MTPDrafter  # it builds on this module's interface

    return MTPDrafter(generator)


def check_drafter(target: Generator, drafter: Drafter, k: int) -> None:
    """ConfigError (one line) when `drafter` cannot draft for `target` with k proposals per round."""
    if k < 1:
        raise ConfigError(f"--speculative-k {k}: propose at least 1 token per round")
    if drafter.vocab_size != target.vocab_size:
        raise ConfigError(
            f"--speculative: the draft model's vocabulary has {drafter.vocab_size} ids but the target's "
            f"{target.vocab_size}; use a draft trained with the target's tokenizer"
        )
    if rope_type_of(target.cfg.rope_scaling) == "dynamic":
        raise ConfigError(
            "--speculative: the model's dynamic-NTK RoPE changes its logits with the length of each call, "
            "so verifying k tokens at once cannot reproduce its decoding; serve it without --speculative"
        )


def acceptance_test(u_BK: jax.Array, p_BK: jax.Array, q_BK: jax.Array) -> jax.Array:
    """Accept draft token d with probability min(1, p(d) / q(d)): u < p / q, u uniform in [0, 1)."""
    return u_BK * q_BK < p_BK


def accept(p_BJV, q_BKV, d_BK, positions_BJ, seed_B, greedy_B):
    """(out_BJ, accepted_B): the leading draft tokens accepted (accepted_B of them, 0..K) followed by
    the residual (or bonus) token, -1 after it. p_BJV: the target's distributions for the tokens at
    positions_BJ (J = K + 1), q_BKV: the draft's."""
    B, J, V = p_BJV.shape
    K = J - 1
    q_BJV = jnp.concatenate([q_BKV, jnp.zeros((B, 1, V), q_BKV.dtype)], axis=1)
    take = lambda x_BKV: jnp.take_along_axis(x_BKV, d_BK[:, :, None], axis=-1)[..., 0]  # noqa: E731
    keys = jax.vmap(jax.vmap(lambda s, t: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), t), ACCEPT_TAG)))
    u_BK = jax.vmap(jax.vmap(jax.random.uniform))(keys(jnp.broadcast_to(seed_B[:, None], (B, K)), positions_BJ[:, :K]))
    ok_BK = acceptance_test(u_BK, take(p_BJV[:, :K]), take(q_BKV))
    accepted_B = jnp.cumprod(ok_BK, axis=1).sum(axis=1).astype(jnp.int32)
    rows = jnp.arange(B)
    p_BV, q_BV = p_BJV[rows, accepted_B], q_BJV[rows, accepted_B]
    residual_BV = jnp.maximum(p_BV - q_BV, 0.0)
    residual_BV = jnp.where(residual_BV.sum(-1, keepdims=True) > 0, residual_BV, p_BV)  # p == q: never rejected
    drawn_B = draw(residual_BV, positions_BJ[rows, accepted_B], seed_B, RESIDUAL_TAG)
    next_B = jnp.where(greedy_B, jnp.argmax(residual_BV, axis=-1).astype(jnp.int32), drawn_B)
    j_J = jnp.arange(J)
    d_BJ = jnp.concatenate([d_BK, jnp.full((B, 1), -1, jnp.int32)], axis=1)
    out_BJ = jnp.where(j_J < accepted_B[:, None], d_BJ, jnp.where(j_J == accepted_B[:, None], next_B[:, None], -1))
    return out_BJ, accepted_B


class RoundOut(NamedTuple):
    tokens_BJ: jax.Array  # the tokens emitted, row b's first emitted_B[b] (J = k + 1)
    emitted_B: jax.Array
    accepted_B: jax.Array  # draft tokens the target accepted (before truncation to the limit)
    logprobs_BJ: jax.Array  # log p of each token under the target's own distribution (`token_log_probs`)
    top_BJK: jax.Array
    ids_BJK: jax.Array
    rows: Rows  # the rows' state for the next round


def target_forward(target: Generator, needs_hidden: bool, state, tokens_BL, positions_BL, cache):
    """(logits, hidden or None, cache): the target's forward, with its hidden states when a drafter needs them."""
    if needs_hidden:
        return target.apply_hidden(state, tokens_BL, positions_BL, cache)
    logits_BLV, cache = target.apply(state, tokens_BL, positions_BL, cache)
    return logits_BLV, None, cache


def speculative_round(
    target: Generator,
    drafter: Drafter,
    k: int,
    top: int,
    state,
    weights,
    cache,
    draft_cache,
    rows: Rows,
    limit_B: jax.Array,
    stop_BS: jax.Array,
    arrays: SamplingArrays,
    seen_BV: jax.Array,
):
    """One round for every row (pure; jit it): draft k, verify in one target forward, accept. Row b
    emits at most limit_B[b] tokens (0: an idle row) and stops after a token in stop_BS[b]. Returns
    (RoundOut, cache, draft_cache, seen_BV)."""
    B, V = seen_BV.shape
    J = k + 1
    proposal = drafter.propose(weights, state, draft_cache, cache, rows, k, arrays, seen_BV)
    tokens_BJ = jnp.concatenate([rows.last_B[:, None], proposal.tokens_BK], axis=1)
    positions_BJ = rows.pos_B[:, None] + jnp.arange(J)
    logits_BJV, hidden_BJD, cache = target_forward(
        target, drafter.needs_hidden, state, tokens_BJ, positions_BJ, proposal.target_cache
    )
    # The token at position pos + j + 1 is sampled seeing the tokens at positions <= pos + j.
    fed_BJV = jax.lax.cummax(jax.nn.one_hot(tokens_BJ, V, dtype=jnp.int8), axis=1) > 0
    seen_BJV = seen_BV[:, None] | fed_BJV
    flat = lambda x: x.reshape(B * J, *x.shape[2:])  # noqa: E731
    arrays_J = jax.tree.map(lambda x: jnp.repeat(x, J, axis=0), arrays)
    p_BJV = sampler_probs(flat(logits_BJV), arrays_J, flat(seen_BJV)).reshape(B, J, V)
    out_BJ, accepted_B = accept(
        p_BJV, proposal.probs_BKV, proposal.tokens_BK, positions_BJ + 1, arrays.seed, arrays.temperature <= 0
    )
    # Emitted: up to the residual token, the limit and the first stop token.
    j_J = jnp.arange(J)
    stop_BJ = jnp.any(out_BJ[:, :, None] == stop_BS[:, None, :], axis=-1) & (out_BJ >= 0)
    first_stop_B = jnp.where(stop_BJ.any(1), jnp.argmax(stop_BJ, axis=1) + 1, J)
    emitted_B = jnp.minimum(jnp.minimum(accepted_B + 1, limit_B), first_stop_B).astype(jnp.int32)
    out_BJ = jnp.where(j_J < emitted_B[:, None], out_BJ, -1)
    rows_B = jnp.arange(B)
    last_i = jnp.maximum(emitted_B - 1, 0)
    live_B = emitted_B > 0
    next_B = out_BJ[rows_B, last_i]
    new_rows = Rows(
        jnp.where(live_B, tokens_BJ[rows_B, last_i], rows.prev_B),
        jnp.where(live_B, next_B, rows.last_B),
        rows.pos_B + emitted_B,
    )
    seen_BV = jnp.where(live_B[:, None], seen_BJV[rows_B, last_i], seen_BV)
    verified = Verified(tokens_BJ, positions_BJ, emitted_B, hidden_BJD, next_B, rows_B, False)
    draft_cache, cache = drafter.observe(weights, state, proposal.cache, cache, verified)
    lp, top_, ids = token_log_probs(flat(logits_BJV), flat(jnp.maximum(out_BJ, 0)), top)
    out = RoundOut(
        out_BJ, emitted_B, accepted_B, lp.reshape(B, J), top_.reshape(B, J, top), ids.reshape(B, J, top), new_rows
    )
    return out, cache, draft_cache, seen_BV


@dataclasses.dataclass
class SpecStats:
    """Counters of speculative rounds: `acceptance_rate` and `tokens_per_forward` (module docstring)."""

    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    row_rounds: int = 0  # rows x rounds: each live row's share of a target verification
    rounds: int = 0
    released_pages: int = 0  # paged cache: pages allocated ahead for positions then rejected, released

    def add(self, k: int, emitted: np.ndarray, accepted: np.ndarray) -> None:
        live = emitted > 0
        self.proposed += k * int(live.sum())
        self.accepted += int(accepted[live].sum())
        self.emitted += int(emitted.sum())
        self.row_rounds += int(live.sum())
        self.rounds += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.emitted / self.row_rounds if self.row_rounds else 0.0

    def as_dict(self) -> dict:
        return {
            "spec_proposed": self.proposed,
            "spec_accepted": self.accepted,
            "spec_rounds": self.rounds,
            "spec_released_pages": self.released_pages,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_target_forward": round(self.tokens_per_forward, 4),
        }

    def line(self, k: int) -> str:
        return (
            f"speculative decoding (k={k}): acceptance rate {self.acceptance_rate:.3f} "
            f"({self.accepted}/{self.proposed}), {self.tokens_per_forward:.2f} tokens per target forward"
        )


class SpeculativeGenerator:
    """`Generator.stream` / `generate` with speculative decoding (a contiguous cache per model)."""

    def __init__(self, target: Generator, drafter: Drafter, k: int = 4):
        check_drafter(target, drafter, k)
        self.target, self.drafter, self.k = target, drafter, k
        self.stats = SpecStats()
        self._prefill = jax.jit(self._prefill_fn, donate_argnums=(4, 5))
        self._round = jax.jit(lambda *a: speculative_round(target, drafter, k, 0, *a), donate_argnums=(2, 3, 8))

    def check_request(self, prompt: Sequence[int], params: SamplingParams, max_len: int | None = None) -> None:
        """RequestError (one line) for a request this cannot continue with a cache of `max_len`
        positions, k + 1 of which verification may write past the request's last token."""
        if max_len is not None and max_len <= self.k + 1:
            raise RequestError(
                f"max_len {max_len} leaves no room: speculative decoding keeps k + 1 = {self.k + 1} positions "
                "for verification; pass a larger max_len"
            )
        try:
            self.target.check_request(prompt, params, None if max_len is None else max_len - self.k - 1)
        except RequestError as e:  # name the length the caller gave, not the one left after verification
            raise RequestError(
                f"{e} (max_len {max_len} less the k + 1 = {self.k + 1} positions verification writes)"
            ) from None

    def _prefill_fn(self, state, weights, tokens_BL, lengths_B, cache, draft_cache, arrays):
        B, L = tokens_BL.shape
        positions_BL = jnp.broadcast_to(jnp.arange(L), (B, L))
        logits_BLV, hidden_BLD, cache = target_forward(
            self.target, self.drafter.needs_hidden, state, tokens_BL, positions_BL, cache
        )
        seen_BV = seen_tokens(tokens_BL, lengths_B, self.target.vocab_size)
        first_B = sample(logits_BLV[jnp.arange(B), lengths_B - 1], lengths_B, arrays, seen_BV)
        verified = Verified(tokens_BL, positions_BL, lengths_B, hidden_BLD, first_B, jnp.arange(B), True)
        draft_cache, cache = self.drafter.observe(weights, state, draft_cache, cache, verified)
        return first_B, cache, draft_cache, seen_BV

    def stream(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        max_len: int | None = None,
    ) -> Iterator[tuple[int, int]]:
        """Yields (row, token) as tokens are accepted, until every row has stopped (as `Generator.stream`,
        whose sampling settings and seeds it takes; its tokens are distributed as the target's, and equal
        them at temperature 0). `max_len` must leave k + 1 positions past the longest request."""
        gen = self.target
        params = per_prompt(prompts, params)
        for p in params:
            p.check(gen.vocab_size)
        lengths = np.array([len(p) for p in prompts], np.int32)
        need = int(max(len(q) + p.max_new_tokens for q, p in zip(prompts, params))) + self.k + 1
        max_len = max_len or round_up(need, 64)
        for prompt, p in zip(prompts, params):
            self.check_request(prompt, p, max_len)
        n = len(prompts)
        B = round_up(n, gen.batch_multiple)
        L = min(round_up(int(lengths.max()), PROMPT_BUCKET), max_len)
        tokens = np.zeros((B, L), np.int32)
        for i, prompt in enumerate(prompts):
            tokens[i, : len(prompt)] = prompt
        lengths = np.concatenate([lengths, np.ones(B - n, np.int32)])
        params = params + [SamplingParams(temperature=0.0)] * (B - n)
        arrays = SamplingArrays.stack(params)
        stops = np.full((B, max(1, *(len(p.stop_tokens) for p in params))), -1, np.int32)
        for i, p in enumerate(params):
            stops[i, : len(p.stop_tokens)] = p.stop_tokens
        stops = jnp.asarray(stops)
        weights = self.drafter.weights()
        first, cache, draft_cache, seen = gen.run_in_context(
            self._prefill,
            gen.state,
            weights,
            jnp.asarray(tokens),
            jnp.asarray(lengths),
            gen.new_cache(B, max_len),
            self.drafter.new_cache(B, max_len),
            arrays,
        )
        first = np.asarray(first)
        produced = np.zeros(B, np.int32)
        live = np.zeros(B, bool)
        for row in range(n):
            yield row, int(first[row])
            produced[row] = 1
            live[row] = first[row] not in params[row].stop_tokens and params[row].max_new_tokens > 1
        prev = np.array([tokens[b, lengths[b] - 1] for b in range(B)], np.int32)
        rows = Rows(jnp.asarray(prev), jnp.asarray(first), jnp.asarray(lengths))
        budgets = np.array([p.max_new_tokens for p in params], np.int32)
        while live.any():
            limit = np.where(live, budgets - produced, 0).astype(np.int32)
            out, cache, draft_cache, seen = gen.run_in_context(
                self._round, gen.state, weights, cache, draft_cache, rows, jnp.asarray(limit), stops, arrays, seen
            )
            rows = out.rows
            tokens_BJ, emitted, accepted = jax.device_get((out.tokens_BJ, out.emitted_B, out.accepted_B))
            self.stats.add(self.k, emitted, accepted)
            for row in np.flatnonzero(live):
                for token in tokens_BJ[row, : emitted[row]]:
                    yield int(row), int(token)
                produced[row] += emitted[row]
                last = tokens_BJ[row, emitted[row] - 1]
                if last in params[row].stop_tokens or produced[row] >= budgets[row]:
                    live[row] = False

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        max_len: int | None = None,
    ) -> list[list[int]]:
        """The new tokens of each prompt (stop token included, if one was hit)."""
        return collect(self.stream(prompts, params, max_len), len(prompts))
