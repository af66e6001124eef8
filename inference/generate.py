"""Batched generation with a KV cache: one jitted prefill, then jitted one-token decode steps.

    gen = Generator(model)                                  # or Generator(model, mesh=mesh, rules=rules)
    out = gen.generate([[72, 105], [1, 2, 3, 4]], SamplingParams(temperature=0))
    out = gen.generate([p, p], SamplingParams(seed=7))      # seeds 7 and 8: two different samples
    for row, token in gen.stream(prompts, params): ...      # tokens as they are sampled

The prompts of a batch may differ in length: they are right-padded to a
bucketed length and prefilled together in one call, and each row then decodes
from its own position (`kv_cache.py` explains why right padding needs no
mask). The decode step donates the cache, so XLA writes the new keys/values in
place instead of copying the cache every token; sampling runs inside the same
jitted step, so only B token ids cross to the host per step (for streaming and
stop tokens).

Under a mesh the weights and the cache are placed by the model's logical names
and the rules table (batch over the data axes, heads and kv heads over
`tensor`), exactly as in training; the batch is padded with idle rows to a
multiple of the data-parallel size.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from meshwork.config import ConfigError
from meshwork.inference.kv_cache import KVCache, cache_bytes
from meshwork.inference.sampling import SamplingArrays, SamplingParams, mark_seen, sample, seen_tokens
from meshwork.kernels.pallas_backend import round_up
from meshwork.perf.hardware import device_memory_bytes
from meshwork.rope_scaling import rope_type_of
from meshwork.sharding.parallel import ParallelContext, use_parallel
from meshwork.sharding.rules import Rules, split_axes

PROMPT_BUCKET = 16  # prompts are padded to a multiple of this: one prefill compile per bucket, not per length


def place(model: nnx.Module, mesh: Mesh | None, rules: Rules | None) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state) of `model`, its state laid out on `mesh` by the rules (or left where it is)."""
    graphdef, state = nnx.split(model)
    if mesh is not None:
        from meshwork.partitioning import variable_shardings  # the trainer's layout, quantized weights included

        state = jax.device_put(state, variable_shardings(state, mesh, rules))
    return graphdef, state


class Generator:
    """A model ready to generate: weights placed, prefill and decode compiled once per shape."""

    def __init__(self, model: nnx.Module, *, mesh: Mesh | None = None, rules: Rules | None = None,
                 cache_dtype: jnp.dtype | None = None):
        self.cfg, self.mesh, self.rules = model.cfg, mesh, rules
        self.parallel = ParallelContext(rules)  # how the layers run on `mesh`, for every trace of this generator
        self.cache_dtype = cache_dtype or model.dtype
        self.graphdef, self.state = place(model, mesh, rules)
        self.vocab_size = self.cfg.vocab_size
        mesh_shape = dict(mesh.shape) if mesh is not None else {}
        self.batch_multiple = math.prod(mesh_shape[a] for a in split_axes("act_batch", rules, mesh_shape)) \
            if mesh is not None else 1
        self.cache_sharding = KVCache.shardings(mesh, rules).k if mesh is not None else None
        self._forward = jax.jit(self._forward_fn, donate_argnums=3)
        self._prefill = jax.jit(self._prefill_fn, donate_argnums=3)
        self._decode = jax.jit(self._decode_fn, donate_argnums=3)

    # -- the jitted pieces -------------------------------------------------

    def _forward_fn(self, state, tokens_BL, positions_BL, cache):
        return nnx.merge(self.graphdef, state).decode(tokens_BL, positions_BL, cache)

    def _prefill_fn(self, state, tokens_BL, lengths_B, cache, arrays):
        B, L = tokens_BL.shape
        logits_BLV, cache = self._forward_fn(state, tokens_BL, jnp.broadcast_to(jnp.arange(L), (B, L)), cache)
        last_BV = logits_BLV[jnp.arange(B), lengths_B - 1]
        seen_BV = seen_tokens(tokens_BL, lengths_B, self.vocab_size)
        return sample(last_BV, lengths_B, arrays, seen_BV), last_BV, cache, seen_BV

    def _decode_fn(self, state, tokens_B, positions_B, cache, arrays, seen_BV):
        """Feeds each row's last token at its position; samples the token after it."""
        seen_BV = mark_seen(seen_BV, tokens_B)
        logits_B1V, cache = self._forward_fn(state, tokens_B[:, None], positions_B[:, None], cache)
        return sample(logits_B1V[:, 0], positions_B + 1, arrays, seen_BV), logits_B1V[:, 0], cache, seen_BV

    def _in_context(self, fn, *args):
        """Runs a jitted function under the mesh and the generator's ParallelContext (the trace reads them)."""
        if self.mesh is None:
            return fn(*args)
        with jax.set_mesh(self.mesh), use_parallel(self.parallel):
            return fn(*args)

    # -- public ------------------------------------------------------------

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.zeros(self.cfg, batch, max_len, self.cache_dtype, self.cache_sharding)

    def forward(self, tokens_BL: np.ndarray, positions_BL: np.ndarray, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Logits of every given token, reading and extending `cache` (donated)."""
        return self._in_context(self._forward, self.state, jnp.asarray(tokens_BL, jnp.int32),
                                jnp.asarray(positions_BL, jnp.int32), cache)

    def check_prompt(self, prompt: Sequence[int], max_new_tokens: int, max_len: int | None = None) -> None:
        """ConfigError (one line) for a prompt this model cannot continue."""
        if len(prompt) == 0:
            raise ConfigError("empty prompt: give at least one token")
        bad = [int(t) for t in prompt if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ConfigError(f"token ids {bad[:3]} are outside the model's vocabulary of {self.vocab_size}: "
                              "the prompt was encoded with another tokenizer")
        if max_len is not None and len(prompt) + max_new_tokens > max_len:
            raise ConfigError(f"prompt of {len(prompt)} tokens + {max_new_tokens} new tokens exceeds the cache "
                              f"length {max_len}; shorten the prompt or lower max_new_tokens")
        need, have = cache_bytes(self.cfg, 1, max_len or len(prompt) + max_new_tokens, self.cache_dtype), \
            device_memory_bytes()
        if need > have:
            raise ConfigError(f"max_new_tokens={max_new_tokens}: a KV cache of {len(prompt) + max_new_tokens:,} "
                              f"tokens needs {need / 2**30:,.1f} GiB, more than the {have / 2**30:,.1f} "
                              f"GiB this device has; lower max_new_tokens (or max_len)")

    def stream(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
               max_len: int | None = None) -> Iterator[tuple[int, int]]:
        """Yields (row, token) as tokens are sampled, until every row has stopped.

        A row stops at one of its stop tokens (yielded, then no more) or after
        its `max_new_tokens`. `max_len` (default: just enough, rounded up) is
        the cache length; a prompt that does not fit raises ConfigError. One
        `SamplingParams` for all prompts gives prompt i the seed `seed + i`, so
        equal prompts get different samples; a list sets each row's own.
        """
        params = list(params) if isinstance(params, Sequence) else [
            dataclasses.replace(params, seed=params.seed + i) for i in range(len(prompts))]
        if len(params) != len(prompts) or not prompts:
            raise ConfigError(f"{len(prompts)} prompts but {len(params)} sampling settings")
        for p in params:
            p.check(self.vocab_size)
        budget = max(p.max_new_tokens for p in params)
        lengths = np.array([len(p) for p in prompts], np.int32)
        max_len = max_len or round_up(int(lengths.max()) + budget, 64)
        for prompt, p in zip(prompts, params):
            self.check_prompt(prompt, p.max_new_tokens, max_len)

        n = len(prompts)
        B = round_up(n, self.batch_multiple)  # idle rows fill the data-parallel size
        # Dynamic-NTK RoPE takes its frequencies from the longest position a call sees, so its
        # prompts are not padded: padding would change the prompt's frequencies.
        bucket = 1 if rope_type_of(self.cfg.rope_scaling) == "dynamic" else PROMPT_BUCKET
        L = min(round_up(int(lengths.max()), bucket), max_len)
        tokens = np.zeros((B, L), np.int32)
        for i, prompt in enumerate(prompts):
            tokens[i, :len(prompt)] = prompt
        lengths = np.concatenate([lengths, np.ones(B - n, np.int32)])
        arrays = SamplingArrays.stack(params + [SamplingParams(temperature=0.0)] * (B - n))

        token_B, _, cache, seen = self._in_context(self._prefill, self.state, jnp.asarray(tokens),
                                                   jnp.asarray(lengths), self.new_cache(B, max_len), arrays)
        produced = np.zeros(n, np.int32)
        live = np.ones(n, bool)
        while True:
            host = np.asarray(token_B)
            for row in np.flatnonzero(live):
                yield int(row), int(host[row])
                produced[row] += 1
                if host[row] in params[row].stop_tokens or produced[row] >= params[row].max_new_tokens:
                    live[row] = False
            if not live.any():
                return
            positions = lengths + np.concatenate([produced, np.zeros(B - n, np.int32)]) - 1
            token_B, _, cache, seen = self._in_context(self._decode, self.state, token_B, jnp.asarray(positions),
                                                       cache, arrays, seen)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 max_len: int | None = None) -> list[list[int]]:
        """The new tokens of each prompt (stop token included, if one was hit)."""
        out: list[list[int]] = [[] for _ in prompts]
        for row, token in self.stream(prompts, params, max_len):
            out[row].append(token)
        return out
