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
batch, and top-k / top-p use one stable descending sort per row plus masks
(k varies per row, so `lax.top_k` with a static k does not fit). Ties go to
the lower token id, as in `jnp.argmax`.

Randomness is per row: row b draws with
`fold_in(jax.random.key(seed_b), position_b)`, position_b being the position
the new token will occupy. A batch-wide key split by slot would make a
request's tokens depend on which slot the server put it in and on what else
was running; with per-row keys a request yields the same tokens alone, in
any batch, and after a restart, and a given token can be reproduced from
(seed, position) only.

    arrays = SamplingArrays.stack([SamplingParams(temperature=0.7, top_p=0.9, seed=1)])
    next_B = sample(logits_BV, positions_B, arrays, seen_BV)
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp

from meshwork.config import ConfigError


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

    def check(self, vocab_size: int) -> None:
        """Raise ConfigError (one line naming the field and the fix) on a bad setting."""
        problems = [
            (not self.temperature >= 0, f"temperature={self.temperature}: use 0 (greedy) or a positive value"),
            (self.top_k < 0, f"top_k={self.top_k}: use 0 (off) or a positive count"),
            (not 0 < self.top_p <= 1, f"top_p={self.top_p}: use a value in (0, 1]; 1.0 turns it off"),
            (not self.repetition_penalty > 0,
             f"repetition_penalty={self.repetition_penalty}: use a positive value; 1.0 turns it off"),
            (self.max_new_tokens < 1, f"max_new_tokens={self.max_new_tokens}: use at least 1"),
            (not 0 <= self.seed < 2**32, f"seed={self.seed}: use an integer in [0, 2**32)"),
        ]
        bad_stops = [t for t in self.stop_tokens if not 0 <= t < vocab_size]
        problems.append((bool(bad_stops), f"stop_tokens={bad_stops}: token ids must lie in [0, {vocab_size})"))
        for bad, message in problems:
            if bad:
                raise ConfigError(f"sampling.{message}")


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
        return cls(temperature=column("temperature", jnp.float32), top_k=column("top_k", jnp.int32),
                   top_p=column("top_p", jnp.float32),
                   repetition_penalty=column("repetition_penalty", jnp.float32),
                   seed=column("seed", jnp.uint32))


def sample(logits_BV: jax.Array, positions_B: jax.Array, arrays: SamplingArrays,
           seen_BV: jax.Array | None = None) -> jax.Array:
    """int32 (B,) next tokens, row b drawn with `fold_in(key(seed_b), positions_B[b])`. Jittable.

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
