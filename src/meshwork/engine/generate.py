"""Batched generation with a KV cache: one jitted prefill, then jitted one-token decode steps.

    gen = Generator(model)                                  # or Generator(model, mesh=mesh, rules=rules)
    out = gen.generate([[72, 105], [1, 2, 3, 4]], SamplingParams(temperature=0))
    out = gen.generate([p, p], SamplingParams(seed=7))      # seeds 7 and 8: two different samples
    for row, token in gen.stream(prompts, params): ...      # tokens as they are sampled
    out = gen.prefill(tokens_BL, lengths_B, gen.new_cache(B, 64), arrays)   # or one call at a time:
    out = gen.decode_step(out.tokens, lengths_B, out.cache, arrays, out.seen)  # out.logits: what was sampled from

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
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from meshwork.engine.kv_cache import KVCache, PagedKVCache, cache_bytes_per_token
from meshwork.engine.per_layer import unstack_layers
from meshwork.engine.sampling import SamplingArrays, SamplingParams, mark_seen, sample, seen_tokens
from meshwork.engine.validation import RequestError, RequestLimits, check_request
from meshwork.kernels.pallas_backend import round_up
from meshwork.perf.hardware import device_memory_bytes
from meshwork.rope_scaling import rope_type_of
from meshwork.sharding.parallel import ParallelContext, use_parallel
from meshwork.sharding.rules import Rules, split_axes

_Out = TypeVar("_Out")
PROMPT_BUCKET = 16  # prompts are padded to a multiple of this: one prefill compile per bucket, not per length


def place(model: nnx.Module, mesh: Mesh | None, rules: Rules | None) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state) of `model`, its state laid out on `mesh` by the rules (or left where it is)."""
    graphdef, state = nnx.split(model)
    if mesh is not None:
        from meshwork.partitioning import variable_shardings  # the trainer's layout, quantized weights included

        state = jax.device_put(state, variable_shardings(state, mesh, rules))
    return graphdef, state


class Step(NamedTuple):
    """What `Generator.prefill` and `Generator.decode_step` return (a tuple: unpack it or read fields)."""

    tokens: jax.Array  # int32 (B,): the token sampled for each row
    logits: jax.Array  # (B, V): the logits it was sampled from (`sampling.log_probs` turns them into log p)
    cache: KVCache  # the cache with this call's keys and values written (the one passed in was donated)
    seen: jax.Array  # bool (B, V): the tokens the repetition penalty applies to, for the next step


class Generator:
    """A model ready to generate: weights placed, prefill and decode compiled once per shape.

    The engine API (what `Server`, rollouts and speculative decoding build on):
    `prefill` and `decode_step` run a batch one call at a time and return the sampled tokens with
    their logits; `forward` returns the logits of any tokens at any positions; `apply` is the same
    computation as a pure function for a jitted program of one's own, run under `run_in_context`;
    `limits` and `check_request` say whether a request can be served (RequestError if not).
    `state` holds the weights with the stacked blocks split one array per layer (engine/per_layer.py:
    a decode step then reads each weight in place); `restack_layers(gen.state)` is the trainer's layout.
    """

    def __init__(
        self,
        model: nnx.Module,
        *,
        mesh: Mesh | None = None,
        rules: Rules | None = None,
        cache_dtype: jnp.dtype | None = None,
    ):
        self.cfg, self.mesh, self.rules = model.cfg, mesh, rules
        self.parallel = ParallelContext(rules)  # how the layers run on `mesh`, for every trace of this generator
        self.cache_dtype = cache_dtype or model.dtype
        self.graphdef, state = place(model, mesh, rules)
        # One array per layer for the stacked blocks: each decode step reads the weights in place
        # instead of copying every layer's slice (engine/per_layer.py).
        self.layer_stacks = tuple(getattr(model, "layer_stacks", tuple)())
        self.state = unstack_layers(state, self.layer_stacks)
        self.vocab_size = self.cfg.vocab_size
        mesh_shape = dict(mesh.shape) if mesh is not None else {}
        self.batch_multiple = (
            math.prod(mesh_shape[a] for a in split_axes("act_batch", rules, mesh_shape)) if mesh is not None else 1
        )
        self.cache_sharding = (
            KVCache.shardings(mesh, rules, latent=self.cfg.mla is not None).k if mesh is not None else None
        )
        self._forward = jax.jit(self.apply, donate_argnums=3)
        self._prefill = jax.jit(self._prefill_fn, donate_argnums=3)
        self._decode = jax.jit(self._decode_fn, donate_argnums=3)

    # -- the computation, as pure functions of the state ---------------------

    def apply(
        self, state: nnx.State, tokens_BL: jax.Array, positions_BL: jax.Array, cache: KVCache | PagedKVCache
    ) -> tuple[jax.Array, KVCache | PagedKVCache]:
        """(logits (B, L, V), cache) of `tokens_BL` at `positions_BL`: writes their keys and values into
        `cache` and attends over everything cached before them. Pure and traceable, for use inside a
        jitted program (the server's prefill chunk and decode loop); call that program through
        `run_in_context`. `forward` is this function jitted.

            logits_BLV, cache = gen.apply(gen.state, tokens_BL, positions_BL, cache)   # inside jax.jit
        """
        return nnx.merge(self.graphdef, state).decode(tokens_BL, positions_BL, cache)

    def apply_hidden(
        self, state: nnx.State, tokens_BL: jax.Array, positions_BL: jax.Array, cache: KVCache | PagedKVCache
    ) -> tuple[jax.Array, jax.Array, KVCache | PagedKVCache]:
        """`apply`, also returning the residual stream before the final norm (B, L, D): (logits, hidden,
        cache), what a multi-token-prediction draft reads (speculative decoding)."""
        return nnx.merge(self.graphdef, state).decode(tokens_BL, positions_BL, cache, hidden=True)

    def apply_mtp(
        self,
        state: nnx.State,
        hidden_BLD: jax.Array,
        tokens_BL: jax.Array,
        positions_BL: jax.Array,
        cache: KVCache | PagedKVCache,
        depth: int = 0,
    ) -> tuple[jax.Array, jax.Array, KVCache | PagedKVCache]:
        """The model's MTP module `depth` over new positions (model.mtp): at position p it reads the hidden
        state at p and the token at p + 1 and predicts the token at p + 2; its keys and values go in the
        cache's layer n_layers + depth. (logits, the module's hidden states, cache). Pure, as `apply`."""
        if self.cfg.mtp.depth <= depth:
            raise ValueError(f"the model has {self.cfg.mtp.depth} MTP modules (model.mtp.depth); no module {depth}")
        return nnx.merge(self.graphdef, state).mtp_decode(hidden_BLD, tokens_BL, positions_BL, cache, depth)

    def _prefill_fn(self, state, tokens_BL, lengths_B, cache, arrays):
        B, L = tokens_BL.shape
        positions_BL = jnp.broadcast_to(jnp.arange(L), (B, L))
        if cache.states is not None:  # padding sits past the cache, where a hybrid's linear layers skip it
            positions_BL = jnp.where(positions_BL < lengths_B[:, None], positions_BL, cache.capacity)
        logits_BLV, cache = self.apply(state, tokens_BL, positions_BL, cache)
        last_BV = logits_BLV[jnp.arange(B), lengths_B - 1]
        seen_BV = seen_tokens(tokens_BL, lengths_B, self.vocab_size)
        return Step(sample(last_BV, lengths_B, arrays, seen_BV), last_BV, cache, seen_BV)

    def _decode_fn(self, state, tokens_B, positions_B, cache, arrays, seen_BV):
        """Feeds each row's last token at its position; samples the token after it."""
        seen_BV = mark_seen(seen_BV, tokens_B)
        logits_B1V, cache = self.apply(state, tokens_B[:, None], positions_B[:, None], cache)
        return Step(sample(logits_B1V[:, 0], positions_B + 1, arrays, seen_BV), logits_B1V[:, 0], cache, seen_BV)

    def run_in_context(self, fn: Callable[..., _Out], *args) -> _Out:
        """fn(*args) under the generator's mesh and ParallelContext, which a jitted function reads when
        it is traced (attention's parallel paths, the rules): run every program that calls `apply`
        through it.

            out = gen.run_in_context(my_jitted_step, gen.state, tokens_B, ...)
        """
        if self.mesh is None:
            return fn(*args)
        with jax.set_mesh(self.mesh), use_parallel(self.parallel):
            return fn(*args)

    # -- the engine API ------------------------------------------------------

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """A zeroed contiguous cache of `batch` rows and `max_len` positions, placed for this generator's
        mesh (under a mesh, make `batch` a multiple of `batch_multiple`)."""
        return KVCache.zeros(self.cfg, batch, max_len, self.cache_dtype, self.cache_sharding)

    def forward(
        self, tokens_BL: np.ndarray, positions_BL: np.ndarray, cache: KVCache | PagedKVCache
    ) -> tuple[jax.Array, KVCache | PagedKVCache]:
        """(logits (B, L, V), cache): `apply`, jitted and run in this generator's context; reads and
        extends `cache` (donated), contiguous or paged."""
        return self.run_in_context(
            self._forward, self.state, jnp.asarray(tokens_BL, jnp.int32), jnp.asarray(positions_BL, jnp.int32), cache
        )

    def prefill(
        self,
        tokens_BL: np.ndarray | jax.Array,
        lengths_B: np.ndarray | jax.Array,
        cache: KVCache,
        arrays: SamplingArrays,
    ) -> Step:
        """Prefills right-padded prompts (row b's first lengths_B[b] tokens are real) at positions
        0..L-1 into `cache` (donated) and samples each row's first new token, at position lengths_B[b].
        Compiled once per (B, L) and cache shape.

            out = gen.prefill(tokens_BL, lengths_B, gen.new_cache(B, 64), SamplingArrays.stack(params))
        """
        return self.run_in_context(
            self._prefill,
            self.state,
            jnp.asarray(tokens_BL, jnp.int32),
            jnp.asarray(lengths_B, jnp.int32),
            cache,
            arrays,
        )

    def decode_step(
        self,
        tokens_B: np.ndarray | jax.Array,
        positions_B: np.ndarray | jax.Array,
        cache: KVCache,
        arrays: SamplingArrays,
        seen_BV: jax.Array,
    ) -> Step:
        """Feeds row b's last token at positions_B[b] and samples the token after it (at positions_B[b] + 1),
        extending `cache` (donated). `seen_BV` is the previous step's `seen`.

            out = gen.decode_step(out.tokens, lengths_B, out.cache, arrays, out.seen)   # after a prefill
        """
        return self.run_in_context(
            self._decode,
            self.state,
            jnp.asarray(tokens_B, jnp.int32),
            jnp.asarray(positions_B, jnp.int32),
            cache,
            arrays,
            seen_BV,
        )

    def limits(self, max_len: int | None = None) -> RequestLimits:
        """What one request may ask of this generator with a cache of `max_len` positions (None: sized to
        the request): its vocabulary, the cache length and the device's memory."""
        return RequestLimits(
            self.vocab_size,
            max_len=max_len,
            cache_bytes_per_token=cache_bytes_per_token(self.cfg, self.cache_dtype),
            memory_bytes=device_memory_bytes(),
        )

    def check_request(self, prompt: Sequence[int], params: SamplingParams, max_len: int | None = None) -> None:
        """RequestError (one line, with the OpenAI param) for a request this model cannot continue
        (`validation.check_request` against `limits(max_len)`)."""
        check_request(prompt, params, self.limits(max_len))

    def stream(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        max_len: int | None = None,
    ) -> Iterator[tuple[int, int]]:
        """Yields (row, token) as tokens are sampled, until every row has stopped.

        A row stops at one of its stop tokens (yielded, then no more) or after
        its `max_new_tokens`. `max_len` (default: just enough, rounded up) is
        the cache length; a prompt that does not fit raises RequestError. One
        `SamplingParams` for all prompts gives prompt i the seed `seed + i`, so
        equal prompts get different samples; a list sets each row's own.
        """
        params = per_prompt(prompts, params)
        for p in params:  # the settings first: a bad max_new_tokens would otherwise size the cache
            p.check(self.vocab_size)
        budget = max(p.max_new_tokens for p in params)
        lengths = np.array([len(p) for p in prompts], np.int32)
        max_len = max_len or round_up(int(lengths.max()) + budget, 64)
        limits = self.limits(max_len)
        for prompt, p in zip(prompts, params):
            check_request(prompt, p, limits)

        n = len(prompts)
        B = round_up(n, self.batch_multiple)  # idle rows fill the data-parallel size
        # Dynamic-NTK RoPE takes its frequencies from the longest position a call sees, so its
        # prompts are not padded: padding would change the prompt's frequencies.
        bucket = 1 if rope_type_of(self.cfg.rope_scaling) == "dynamic" else PROMPT_BUCKET
        L = min(round_up(int(lengths.max()), bucket), max_len)
        tokens = np.zeros((B, L), np.int32)
        for i, prompt in enumerate(prompts):
            tokens[i, : len(prompt)] = prompt
        lengths = np.concatenate([lengths, np.ones(B - n, np.int32)])
        arrays = SamplingArrays.stack(params + [SamplingParams(temperature=0.0)] * (B - n))

        token_B, _, cache, seen = self.prefill(tokens, lengths, self.new_cache(B, max_len), arrays)
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
            token_B, _, cache, seen = self.decode_step(token_B, positions, cache, arrays, seen)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        max_len: int | None = None,
    ) -> list[list[int]]:
        """The new tokens of each prompt (stop token included, if one was hit)."""
        return collect(self.stream(prompts, params, max_len), len(prompts))


def per_prompt(
    prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
) -> list[SamplingParams]:
    """One `SamplingParams` per prompt: a list as given (RequestError unless one per prompt), or one
    setting for all with prompt i's seed `seed + i` (equal prompts get different samples)."""
    out = (
        list(params)
        if isinstance(params, Sequence)
        else [dataclasses.replace(params, seed=params.seed + i) for i in range(len(prompts))]
    )
    if len(out) != len(prompts) or not prompts:
        raise RequestError(
            f"{len(prompts)} prompts but {len(out)} sampling settings; give one setting for all prompts or one per prompt"
        )
    return out


def collect(stream: Iterator[tuple[int, int]], rows: int) -> list[list[int]]:
    """The (row, token) pairs of a `stream` as each row's list of tokens."""
    out: list[list[int]] = [[] for _ in range(rows)]
    for row, token in stream:
        out[row].append(token)
    return out
