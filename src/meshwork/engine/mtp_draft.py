"""The model's own multi-token-prediction module as the draft of speculative decoding (DeepSeek-V3's use).

MTP module 1 at position i reads the target's hidden state h_i (before the final norm) and the token
t_{i+1}, and predicts t_{i+2} (models/mtp.py). Its keys and values live in the target's cache, in
the layer after the model's own (`kv_cache.cache_layers`), so a paged cache shares the target's
pages and page table.

- `observe`, after every target forward (a prompt, a prefill chunk, a verification): the module
  runs over the forward's positions with their hidden states, each paired with the token after it
  (the next fed token; after the last accepted one, the token sampled there). That fills its cache
  layer with true states up to the last accepted position p and yields, at p, the distribution of
  the first draft token (position p + 2 = the round's pos + 1) and the module's hidden state,
  kept per slot. A prefill chunk that does not end the prompt has no sampled token after it:
  the next chunk first runs the module again at its own first position - 1, from the kept
  target hidden state and its own first token (when the slot's kept state is of that position; a
  prefix-cache hit starts after positions this slot never saw, whose entries stay as the request
  that wrote the shared pages left them: only the acceptance rate can suffer, never exactness).
- `propose`: d_1 from the kept distribution; d_j (j >= 2) from the module at position pos + j - 2,
  fed its own previous hidden state (in place of the target's, which the draft does not have) and
  d_{j-1}, as vLLM does with one MTP layer and k > 1. Positions it writes past the sequence are
  written again, with true states, by the next `observe` before anything reads them (the caches are
  position-driven: a query at q reads keys <= q).

The MTP module is trained to predict two tokens ahead, so its acceptance rate depends on how well
it was trained (model.mtp.loss_coef); the output distribution is the target's whatever it is
(speculative.py's rejection sampling).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from meshwork.config import ConfigError
from meshwork.engine.generate import Generator
from meshwork.engine.sampling import mark_seen, sampler_probs
from meshwork.engine.speculative import DRAFT_TAG, Drafter, Proposal, Rows, Verified, draw


class MTPState(NamedTuple):
    """Per slot: the first draft's logits and the hidden states at the last position observed."""

    logits_SV: jax.Array  # float32 (slots, V): the module's logits there (for the token two ahead)
    mtp_hidden_SD: jax.Array  # the module's hidden state there (the next draft step's input)
    target_hidden_SD: jax.Array  # the target's hidden state there (a following prefill chunk's fix-up)
    position_S: jax.Array  # int32: that position (-1: none yet)


class MTPDrafter(Drafter):
    """Drafts with the target's MTP module 0: `MTPDrafter(generator)` for a model with model.mtp.depth > 0."""

    needs_hidden = True

    def __init__(self, generator: Generator):
        if not generator.cfg.mtp.depth:
            raise ConfigError(
                "--speculative mtp: this model has no multi-token-prediction module (model.mtp.depth 0); "
                "pass a draft model's folder instead"
            )
        self.gen, self.vocab_size = generator, generator.vocab_size

    def _state(self, slots: int) -> MTPState:
        D, dtype = self.gen.cfg.d_model, self.gen.cache_dtype
        return MTPState(
            jnp.zeros((slots, self.vocab_size), jnp.float32),
            jnp.zeros((slots, D), dtype),
            jnp.zeros((slots, D), dtype),
            jnp.full((slots,), -1, jnp.int32),
        )

    def new_cache(self, batch: int, max_len: int) -> MTPState:
        return self._state(batch)

    def new_pool(self, n_pages: int, page_size: int, batch: int, pages_per_seq: int, sharding=None) -> MTPState:
        return self._state(batch)

    def observe(self, weights, target_state, cache: MTPState, target_cache, verified: Verified):
        v = verified
        B, L = v.tokens_BL.shape
        rows = jnp.arange(B)
        if v.prefill:  # the previous chunk's last position, now that its next token (our first) is known
            start_B = v.positions_BL[:, 0]
            # Only when this slot observed that position (not for a new prompt, nor after a prefix the
            # prefix cache supplied): otherwise the write goes to `start`, which the call below rewrites.
            known_B = (cache.position_S[v.slot_B] == start_B - 1) & (start_B > 0)
            _, _, target_cache = self.gen.apply_mtp(
                target_state,
                cache.target_hidden_SD[v.slot_B][:, None],
                v.tokens_BL[:, :1],
                jnp.where(known_B, start_B - 1, start_B)[:, None],
                target_cache,
            )
        last_B = v.accepted_B - 1
        after_BL = jnp.concatenate([v.tokens_BL[:, 1:], v.next_B[:, None]], axis=1)
        after_BL = jnp.where(jnp.arange(L)[None, :] == last_B[:, None], v.next_B[:, None], after_BL)
        logits_BLV, mtp_hidden_BLD, target_cache = self.gen.apply_mtp(
            target_state, v.hidden_BLD, after_BL, v.positions_BL, target_cache
        )
        new = MTPState(
            logits_BLV[rows, last_B].astype(jnp.float32),
            mtp_hidden_BLD[rows, last_B],
            v.hidden_BLD[rows, last_B],
            v.positions_BL[rows, last_B],
        )

        def keep(old_S, new_B):  # a row that took nothing this time (idle, or no page) keeps its state
            old_B = old_S[v.slot_B]
            live = (v.accepted_B > 0).reshape(-1, *([1] * (old_B.ndim - 1)))
            return old_S.at[v.slot_B].set(jnp.where(live, new_B.astype(old_S.dtype), old_B))

        return MTPState(*map(keep, cache, new)), target_cache

    def propose(self, weights, target_state, cache: MTPState, target_cache, rows: Rows, k: int, arrays, seen_BV):
        seen_BV = mark_seen(seen_BV, rows.last_B)
        q_BV = sampler_probs(cache.logits_SV, arrays, seen_BV)
        d_B = draw(q_BV, rows.pos_B + 1, arrays.seed, DRAFT_TAG)

        def step(carry, j):
            d_B, hidden_BD, target_cache, seen_BV = carry
            seen_BV = mark_seen(seen_BV, d_B)
            logits_B1V, hidden_B1D, target_cache = self.gen.apply_mtp(
                target_state, hidden_BD[:, None], d_B[:, None], (rows.pos_B + j - 2)[:, None], target_cache
            )
            q_BV = sampler_probs(logits_B1V[:, 0], arrays, seen_BV)
            new_B = draw(q_BV, rows.pos_B + j, arrays.seed, DRAFT_TAG)
            return (new_B, hidden_B1D[:, 0].astype(hidden_BD.dtype), target_cache, seen_BV), (new_B, q_BV)

        carry = (d_B, cache.mtp_hidden_SD, target_cache, seen_BV)
        (_, _, target_cache, _), (d_JB, q_JBV) = jax.lax.scan(step, carry, jnp.arange(2, k + 1))
        tokens_BK = jnp.concatenate([d_B[:, None], d_JB.T], axis=1)
        probs_BKV = jnp.concatenate([q_BV[:, None], jnp.moveaxis(q_JBV, 0, 1)], axis=1)
        return Proposal(tokens_BK, probs_BKV, cache, target_cache)
