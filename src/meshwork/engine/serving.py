"""Continuous batching over a paged KV cache: requests join and leave the running batch between decode steps.

    server = Server(model, slots=8, page_size=16, max_len=512, prefix_caching=True, prefill_chunk=256)
    results = server.run([Request("a", prompt_ids), Request("b", other_ids, SamplingParams(top_p=0.9))])
    results["a"].tokens, results["a"].finish        # "stop", "length", "error" or "cancelled"
    server.submit(r); events = server.step(); server.cancel("b")   # driving it yourself
    server.check_request(prompt_ids, params)        # RequestError (with OpenAI's param) if it cannot be served

The batch has a fixed number of slots. Between decode dispatches, finished
requests leave (their slot and pages are freed) and waiting requests are
prefilled into free slots, so a short request never waits for the longest one
in its batch (Orca's iteration-level scheduling).

Memory is a pool of fixed-size pages (kv_cache.PagedKVCache). A request gets
the pages its prompt needs when admitted and more as its length crosses page
boundaries; so the pool holds what live sequences use, not slots x max_len.
When a sequence needs a page and none is available, the most recently
admitted other request is preempted: its pages are released and it goes back
to the front of the queue, to be prefilled again from its prompt and the
tokens it already produced (vLLM's recompute preemption). Sampling keys
depend only on (seed, position), so a preempted request continues exactly as
it would have.

Prefix caching (`prefix_caching=True`, vLLM's automatic prefix caching): every
full page of a sequence is entered in a table under a chained hash of its
tokens (the hash of page i covers tokens 0..(i+1)*page_size-1, so equal hashes
mean equal prefixes). A new request looks its prompt's full pages up and holds
the ones found (reference counts in `PageAllocator`) instead of computing and
storing them again; it prefills only the rest. Shared pages are only ever
read: a request's writes start after its last shared page, and the page of
its last prompt token is never shared (its logits are needed), so the partial
last page is recomputed rather than copied on write. A page no sequence holds
stays cached until the pool runs short, then is evicted least recently
released first.

Chunked prefill (`prefill_chunk=N`, Sarathi/vLLM): a step prefills at most N
prompt tokens (over the keys already cached, at their positions), then runs a
decode step for every running request, so a long prompt no longer stalls the
running ones. Unchunked (None), each prompt is prefilled whole as it is
admitted.

Decode (`steps_per_dispatch`): one jitted call runs up to that many decode
steps in a device-side while loop; a row that samples a stop token or reaches
its max_new_tokens stops writing (to the null page) from then on, and the loop
ends when every row is done, or after a step in which one finished while
requests wait for a slot. The pages the next steps need are handed out before
the call; when the pool cannot cover them, the server falls back to one step
per call with preemption. So the host sees one call and one copy of tokens
per dispatch, not per token. The sampler does not sort (sampling.py).
A dispatch computes the running requests, not every slot: their rows, padded
with idle slots to a power of two (`_batch_rows`), so one request on a server
of 32 slots costs a 1-row step (`fixed_batch=True`: every slot, every time).
The step that prefills a prompt runs one decode step rather than a dispatch,
so the prompt's first token reaches its client after prefill + 1 step instead
of with the next 8 (with `on_events` set, as the serving thread sets it, right
after its prefill: of several prompts prefilled in one step, each first token
goes out as its prompt is done).

Log-probabilities: every Result carries `logprobs`, the log-probability of each of its tokens under
the model's own distribution, log_softmax of the logits the sampler was given, in float32, before
the repetition penalty, temperature, top-k and top-p (vLLM's default "raw" logprobs; what a trainer's
forward pass over the same tokens gives). They are computed on the device, in the prefill chunk and
inside the decode loop (a (N, B) float32 output beside the tokens, copied with them once per
dispatch), so they cost one logsumexp per row per step and no host round trip. A request whose
`params.logprobs` is k > 0 also gets, per token, the k most likely (token id, log p) alternatives
(`top_logprobs`): `lax.top_k` with a static K, MAX_TOP_LOGPROBS when a running request asks for any
and 0 otherwise, so the loop and the chunk compile in two variants each and a batch that asks for
none runs no top_k (its only extra work is that logsumexp). Sampled tokens do not depend on either.

Speculative decoding (`drafter=`, `speculative_k=`; speculative.py): each step runs one round
instead of the decode loop: the draft proposes k tokens per running request and the target
verifies them in one forward over the paged cache; each row emits its accepted tokens and one
more. A slot gets the pages of the positions a round may keep ahead of it when the pool has them,
and gives back, after the round, those past its next position (rejected positions); the draft's
own pool shares the target's page table. `stats()` adds the acceptance rate and the tokens per
target forward. A sampled request's tokens follow the target's distribution exactly but, unlike
plain decoding, can depend on where its rounds started, which pool pressure can move.

The engine API: `submit` queues a request (`check_request` is what it asks
first), `admit` gives waiting requests slots and pages, `step` admits,
prefills and decodes, `cancel` and `release` free a request's slot and pages,
`take_result` hands a finished request's Result over. A bad request (empty,
longer than the cache or the pool, token ids outside the vocabulary, bad
sampling settings: `validation.check_request`) gets a Result with finish
"error" and the RequestError's one line; the others keep being served.
`cancel(id)` stops a waiting or running request (finish "cancelled", its
tokens so far) and frees its slot and pages; `release(id)` does the same
without recording a Result. The model runs through `Generator`'s public
`apply` (inside the server's own jitted prefill chunk and decode loop) and
`run_in_context`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Callable, Hashable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from meshwork.config import ConfigError
from meshwork.engine.generate import PROMPT_BUCKET, Generator
from meshwork.engine.kv_cache import NULL_PAGE, PagedKVCache
from meshwork.engine.page_pool import PageAllocator, page_digests
from meshwork.engine.sampling import (
    MAX_TOP_LOGPROBS,
    SamplingArrays,
    SamplingParams,
    mark_seen,
    sample,
    token_log_probs,
)
from meshwork.engine.speculative import (
    Drafter,
    Rows,
    SpecStats,
    Verified,
    check_drafter,
    speculative_round,
    target_forward,
    with_table,
)
from meshwork.engine.validation import RequestError, RequestLimits, check_request
from meshwork.kernels.pallas_backend import round_up
from meshwork.sharding.rules import Rules


@dataclasses.dataclass(frozen=True)
class Request:
    id: Hashable
    prompt: Sequence[int]
    params: SamplingParams = SamplingParams()


@dataclasses.dataclass
class Result:
    id: Hashable
    tokens: list[int]
    finish: str  # "stop" (a stop token, included), "length" (max_new_tokens), "error" or "cancelled"
    error: str | None = None
    logprobs: list[float] = dataclasses.field(default_factory=list)
    """log p of each of `tokens` under the model's own distribution (log_softmax of its logits, before
    temperature, penalty, top-k and top-p), in float32."""
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    """Per token, the params.logprobs most likely (token id, log p), descending; [] when none asked."""


@dataclasses.dataclass
class _Scores:
    """A request's per-token log-probabilities so far (kept across preemption)."""

    logprobs: list[float] = dataclasses.field(default_factory=list)
    top: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Live:
    request: Request
    pages: list[int]
    length: int  # tokens whose keys/values are cached (positions 0..length-1)
    produced: list[int]  # sampled so far; the last one is fed at position `length` next
    admitted: int  # admission order, for choosing whom to preempt
    context: int  # tokens to prefill before decoding: the prompt (+ what a preempted run produced, bar one)
    digests: list[bytes] = dataclasses.field(default_factory=list)  # of the full pages registered so far

    def tokens(self) -> list[int]:
        """The sequence so far: cached positions 0..length-1 hold tokens()[:length]."""
        return list(self.request.prompt) + self.produced

    @property
    def prefilling(self) -> bool:
        return self.length < self.context


@functools.partial(jax.jit, donate_argnums=0)
def _set_seen(seen: jax.Array, row: jax.Array, slot) -> jax.Array:
    """`seen` with row `slot` replaced (module-level: one trace per shape for every server)."""
    return seen.at[slot].set(row)


class Server:
    """A continuous-batching generation server over one model (see the module docstring).

    prefix_caching: share full pages of equal prefixes between requests (off: no page is ever shared).
    prefill_chunk: prefill at most this many prompt tokens per step, between decode steps (None: whole
        prompts at admission).
    steps_per_dispatch: decode steps run on the device per call (a while loop that stops early when
        every row is done, or when one finishes while requests wait for a slot).
    """

    def __init__(
        self,
        model: nnx.Module,
        *,
        slots: int = 8,
        page_size: int = 16,
        max_len: int = 512,
        n_pages: int | None = None,
        mesh: Mesh | None = None,
        rules: Rules | None = None,
        cache_dtype: jnp.dtype | None = None,
        prefix_caching: bool = False,
        prefill_chunk: int | None = None,
        steps_per_dispatch: int = 8,
        drafter: Drafter | None = None,
        speculative_k: int = 4,
        fixed_batch: bool = False,
    ):
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk={prefill_chunk}: use a positive token count, or None for whole prompts")
        if steps_per_dispatch < 1:
            raise ConfigError(f"steps_per_dispatch={steps_per_dispatch}: use at least 1")
        self.gen = Generator(model, mesh=mesh, rules=rules, cache_dtype=cache_dtype)
        if drafter is not None:
            check_drafter(self.gen, drafter, speculative_k)
        self.drafter, self.speculative_k = drafter, speculative_k
        self.fixed_batch = fixed_batch  # every dispatch computes every slot (_batch_rows)
        self.cfg, self.page_size, self.max_len = self.gen.cfg, page_size, max_len
        self.prefix_caching, self.prefill_chunk, self.steps_per_dispatch = (
            prefix_caching,
            prefill_chunk,
            steps_per_dispatch,
        )
        self.pages_per_seq = math.ceil(max_len / page_size)
        # Under a mesh each data-parallel replica serves slots/replicas rows from its own range of pages
        # (kv_cache._attend_per_replica): the pool is split, not copied.
        self.replicas = self.gen.batch_multiple
        if slots % self.replicas:
            raise ConfigError(
                f"slots={slots} cannot be split over {self.replicas} data-parallel replicas; "
                f"use a multiple of {self.replicas}"
            )
        if mesh is not None and dict(mesh.shape).get("stage", 1) > 1:
            raise ConfigError(
                "serving does not split layers over mesh.stage; serve with stage 1 "
                "(data replicas and tensor-parallel heads)"
            )
        # Default pool: half of what slots x max_len would need, plus a null page per replica.
        n_pages = n_pages or slots * self.pages_per_seq // 2 + self.replicas
        n_pages = round_up(n_pages, self.replicas)
        sharding = PagedKVCache.shardings(mesh, rules, latent=self.cfg.mla is not None).k if mesh is not None else None
        pool = PagedKVCache.zeros(
            self.cfg, n_pages, page_size, slots, self.pages_per_seq, self.gen.cache_dtype, sharding
        )
        self.k, self.v = pool.k, pool.v
        # A hybrid model's linear layers keep a fixed-size state per slot instead of pages: zeroed when a
        # sequence starts in the slot (prefill from position 0), recomputed by re-prefilling after a
        # preemption, and not rebuilt from shared pages, so prefix caching and speculation are refused.
        self.states = pool.states
        if self.states is not None and (prefix_caching or drafter is not None):
            raise ConfigError(
                "a model with linear-attention layers keeps per-sequence recurrent states that shared prefix "
                "pages and rejected drafts cannot restore: serve it without prefix caching and speculation"
            )
        # The draft's own pool, if it keeps one: the same pages as the target's (one page table for both).
        self.draft_pool = (
            drafter.new_pool(n_pages, page_size, slots, self.pages_per_seq, sharding) if drafter is not None else None
        )
        self.spec = SpecStats()
        self.seen = jnp.zeros((slots, self.cfg.vocab_size), bool)
        self.pages = PageAllocator(n_pages, self.replicas)
        # What one request may ask: a replica's pool less its null page is the most it can ever hold.
        self.limits = RequestLimits(
            self.cfg.vocab_size, max_len=max_len, page_size=page_size, max_pages=self.pages.per_replica - 1
        )
        self.slots: list[_Live | None] = [None] * slots
        self.waiting: collections.deque[tuple[Request, list[int]]] = collections.deque()
        self.results: dict[Hashable, Result] = {}
        self.steps = self.preemptions = self.peak_pages = 0
        # Counters for measurements: calls of the decode loop, prompt tokens computed by prefill and
        # those found in the prefix cache instead.
        self.dispatches = self.prefill_tokens = self.cached_tokens = 0
        self.batch_sizes: collections.Counter[int] = collections.Counter()  # decode dispatches per rows computed
        self._admitted = 0
        self._scores: dict[Hashable, _Scores] = {}  # per queued or running request
        # (log p, top alternatives) of each (id, token) pair the last `step` returned, in the same order.
        self.last_scores: list[tuple[float, list[tuple[int, float]]]] = []
        self._first_tokens = False  # a prefill in this step sampled a prompt's first token
        # Called with (events, their scores) as a prefill produces them, mid-step (the serving thread's
        # delivery, inference/serve_engine.py); None: they are returned with the step's.
        self.on_events: Callable[[list[tuple[Hashable, int]], list], None] | None = None
        self._arrays: tuple[SamplingArrays, jax.Array] | None = None
        # The last argument, `top`, is static: 0, or MAX_TOP_LOGPROBS when a request in the call asks for
        # alternatives (two compiled variants each; the common path never runs lax.top_k).
        self._chunk = jax.jit(self._chunk_fn, donate_argnums=(4, 5, 11, 13), static_argnums=(9,))
        self._round = jax.jit(self._round_fn, donate_argnums=(3, 4, 5, 11), static_argnums=(0,))
        self._loop = jax.jit(self._loop_fn, donate_argnums=(3, 4, 6, 10), static_argnums=(9,))
        self._table: tuple[np.ndarray, jax.Array] | None = None  # the last page table sent, on the device

    # -- requests ---------------------------------------------------------------

    def check_request(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """RequestError (one line, with the OpenAI param) when this server cannot serve the request:
        `validation.check_request` against `limits` (vocabulary, max_len, the pages of one replica)."""
        check_request(prompt, params, self.limits)

    def submit(self, request: Request) -> None:
        """Queues a request, or records its error Result at once if it cannot be served.

        Ids key the results, so reusing one is the caller's bug: ValueError, nothing queued.
        """
        if (
            request.id in self.results
            or any(r.id == request.id for r, _ in self.waiting)
            or any(s and s.request.id == request.id for s in self.slots)
        ):
            raise ValueError(f"request id {request.id!r} is already in use")
        try:
            self.check_request(request.prompt, request.params)
        except RequestError as e:
            self.results[request.id] = Result(request.id, [], "error", str(e))
            return
        self.waiting.append((request, []))
        self._scores[request.id] = _Scores()

    def release(self, request_id: Hashable) -> list[int] | None:
        """Takes a request out of the queue, or frees its slot and pages, without recording a Result: the
        tokens it produced so far, or None when it is not waiting or running. Call it between steps."""
        for entry in self.waiting:
            if entry[0].id == request_id:
                self.waiting.remove(entry)
                self._scores.pop(request_id, None)
                return list(entry[1])
        for i, s in enumerate(self.slots):
            if s is not None and s.request.id == request_id:
                self._free(i)
                self._scores.pop(request_id, None)
                return s.produced
        return None

    def cancel(self, request_id: Hashable) -> bool:
        """Stops a waiting or running request now: its slot and pages are freed and its Result (the
        tokens produced so far, finish "cancelled") recorded. False when it is not waiting or running."""
        scores = self._scores.get(request_id, _Scores())
        produced = self.release(request_id)
        if produced is None:
            return False
        self.results[request_id] = Result(request_id, produced, "cancelled", None, scores.logprobs, scores.top)
        return True

    def take_result(self, request_id: Hashable) -> Result | None:
        """The Result of a finished (or refused, or cancelled) request, removed from `results`; None while
        it is still waiting or running."""
        return self.results.pop(request_id, None)

    @property
    def busy(self) -> bool:
        """Whether a request is waiting or running (a `step` has work to do)."""
        return bool(self.waiting) or any(s is not None for s in self.slots)

    def run(
        self, requests: Iterable[Request] = (), on_token: Callable[[Hashable, int], None] | None = None
    ) -> dict[Hashable, Result]:
        """Submits `requests` and steps until nothing is live or waiting; returns all results."""
        for r in requests:
            self.submit(r)
        while self.busy:
            for rid, token in self.step():
                if on_token:
                    on_token(rid, token)
        return self.results

    def live_pages(self) -> dict[Hashable, list[int]]:
        """The pages each running request holds (with prefix caching, shared pages appear under each holder)."""
        return {s.request.id: list(s.pages) for s in self.slots if s}

    def stats(self) -> dict:
        """The pool's state, for /health and measurements: slots live, pages held, free and cached."""
        held = {p for pages in self.live_pages().values() for p in pages}
        return {
            "slots": len(self.slots),
            "slots_live": sum(s is not None for s in self.slots),
            "pages_total": self.pages.usable,
            "pages_held": len(held),
            "pages_free": len(self.pages.free),
            "pages_cached": len(self.pages.lru),  # a prefix cache's pages, held by no one
            "steps": self.steps,
            "preemptions": self.preemptions,
            **({"speculative_k": self.speculative_k, **self.spec.as_dict()} if self.drafter is not None else {}),
        }

    # -- the jitted pieces ------------------------------------------------------------

    def _chunk_fn(
        self, state, tokens_1C, start, n_real, k, v, table_1P, arrays, seen_1V, top, weights, draft, slot, states
    ):
        """Prefills tokens at positions start.. (the first n_real are real) over the cached ones before
        them; samples the token after the last real one (used when this chunk ends the prompt) and
        returns it with its log-probability and the `top` (static) alternatives (`token_log_probs`).
        A drafter observes the chunk (its `weights` and pool `draft`, None without one). `states`: a
        hybrid model's recurrent states (None without linear layers), slot `slot`'s zeroed at start 0."""
        C = tokens_1C.shape[1]
        positions_1C = start + jnp.arange(C, dtype=jnp.int32)[None]
        cache = PagedKVCache(k, v, table_1P)
        if states is not None:
            # The padding after the real tokens sits past the table, where linear layers skip it.
            positions_1C = jnp.where(jnp.arange(C)[None] < n_real, positions_1C, cache.capacity)
            cache = PagedKVCache(k, v, table_1P, states.cleared(slot[None], (start == 0)[None]), slot[None])
        hidden = self.drafter is not None and self.drafter.needs_hidden
        logits_1CV, hidden_1CD, cache = target_forward(self.gen, hidden, state, tokens_1C, positions_1C, cache)
        last_1V = jax.lax.dynamic_index_in_dim(logits_1CV, n_real - 1, axis=1, keepdims=False)
        token_1 = sample(last_1V, (start + n_real)[None], arrays, seen_1V)
        if self.drafter is not None:
            seen = Verified(tokens_1C, positions_1C, n_real[None], hidden_1CD, token_1, slot[None], True)
            draft, cache = self.drafter.observe(weights, state, with_table(draft, table_1P), cache, seen)
        return (token_1, *token_log_probs(last_1V, token_1, top)), cache.k, cache.v, draft, cache.states

    def _loop_fn(self, state, rows_4B, control_2, k, v, table_BP, seen_SV, arrays_S, stop_SN, top, states):
        """Up to n_steps decode steps on the device. Row b feeds tokens_B[b] at positions_B[b] and is
        done after remaining_B[b] tokens or a stop token; a done row writes to the null page from then
        on. The loop ends when every row is done, or (halt_on_finish) after a step in which one finished.
        rows_4B = (tokens, positions, remaining, slot) and control_2 = (n_steps, halt_on_finish) travel as
        one array each (a transfer per argument is a cost per dispatch); row b computes slot slot_B[b],
        whose seen row (S, V), sampling settings and stop list (S, N) it reads (seen is written back).
        Returns the (N, B) tokens (-1 where a
        row was done; a step ran iff its row has a token), their (N, B) float32 log-probabilities and the
        (N, B, top) alternatives' log-probabilities and ids (`token_log_probs`; top static), the pool,
        seen and a hybrid model's recurrent states (`states`, None without linear layers)."""
        (tokens_B, positions_B, remaining_B, slot_B), n_steps = rows_4B, control_2[0]
        halt_on_finish = control_2[1] != 0
        B, N = tokens_B.shape[0], self.steps_per_dispatch
        # The rows are slots `slot_B` (_batch_rows): their seen rows, settings and stop lists.
        seen_BV, stop_BN = seen_SV[slot_B], stop_SN[slot_B]
        arrays = jax.tree.map(lambda a: a[slot_B], arrays_S)
        beyond = table_BP.shape[1] * self.page_size  # past the page table: writes go to the null page

        def cond(carry):
            i, _, _, remaining_B, _, _, _, _, _, halted, _ = carry
            return (i < n_steps) & jnp.any(remaining_B > 0) & ~halted

        def body(carry):
            i, tokens_B, positions_B, remaining_B, k, v, seen_BV, out_NB, scores, _, states = carry
            active_B = remaining_B > 0
            at_B = jnp.where(active_B, positions_B, beyond)
            seen_BV = mark_seen(seen_BV, tokens_B)
            cache = PagedKVCache(k, v, table_BP, states)
            logits_B1V, cache = self.gen.apply(state, tokens_B[:, None], at_B[:, None], cache)
            new_B = sample(logits_B1V[:, 0], at_B + 1, arrays, seen_BV)
            out_NB = out_NB.at[i].set(jnp.where(active_B, new_B, -1))
            scores = tuple(x.at[i].set(y) for x, y in zip(scores, token_log_probs(logits_B1V[:, 0], new_B, top)))
            stopped_B = active_B & jnp.any(new_B[:, None] == stop_BN, axis=-1)
            remaining_B = jnp.where(stopped_B, 0, remaining_B - active_B)
            finished = jnp.any(active_B & (remaining_B == 0))
            return (
                i + 1,
                jnp.where(active_B, new_B, tokens_B),
                positions_B + active_B,
                remaining_B,
                cache.k,
                cache.v,
                seen_BV,
                out_NB,
                scores,
                halt_on_finish & finished,
                cache.states,
            )

        carry = (
            jnp.int32(0),
            tokens_B,
            positions_B,
            remaining_B,
            k,
            v,
            seen_BV,
            jnp.full((N, B), -1, jnp.int32),
            (jnp.zeros((N, B), jnp.float32), jnp.zeros((N, B, top), jnp.float32), jnp.zeros((N, B, top), jnp.int32)),
            jnp.bool_(False),
            states,
        )
        _, _, _, _, k, v, seen_BV, out_NB, scores, _, states = jax.lax.while_loop(cond, body, carry)
        return (out_NB, *scores), k, v, seen_SV.at[slot_B].set(seen_BV), states

    # -- one iteration ------------------------------------------------------------

    def step(self) -> list[tuple[Hashable, int]]:
        """Admits what fits, prefills (a chunk of) the waiting prompts, then decodes every prefilled
        slot for up to `steps_per_dispatch` steps: the (request id, token) pairs sampled, in order
        (`last_scores` holds their log-probabilities and alternatives, in the same order)."""
        self.last_scores, self._first_tokens = [], False
        events = self.admit()
        events += self._prefill()
        if self.drafter is not None:
            return events + self._speculate()
        # A request whose prefill just sampled its first token (without `on_events`, it waits for this
        # step's return to see it): one decode step then, not a dispatch of many.
        return events + self._decode(one_step=self._first_tokens)

    def _now(self, events: list[tuple[Hashable, int]]) -> list[tuple[Hashable, int]]:
        """A prefill's events (its prompt's first token, if it ended one): handed to `on_events` at once
        where it is set, so that of several prompts prefilled in one step each first token goes out
        as its prompt is done, not after the others and a decode step; otherwise returned."""
        if not events:
            return events
        self._first_tokens = True
        if self.on_events is None:
            return events
        self.on_events(events, self.last_scores[-len(events) :])
        del self.last_scores[-len(events) :]
        return []

    def admit(self) -> list[tuple[Hashable, int]]:
        """Gives waiting requests free slots and the pages of their context (+1 position), reusing
        cached pages of an equal prefix; the (request id, token) pairs sampled meanwhile. Unchunked,
        each prompt is prefilled as it is admitted (its first token is among the pairs), so the next
        admission already finds its pages in the prefix cache; chunked, the next `step` prefills."""
        T, events = self.page_size, []
        while self.waiting and None in self.slots:
            request, produced = self.waiting[0]
            # A preempted request resumes from its prompt plus what it produced, bar the pending last token.
            context = list(request.prompt) + produced[:-1]
            # Full pages only, and never the page of the last context token: its logits are needed.
            digests = page_digests(context[: len(context) - 1], T) if self.prefix_caching else []
            slot = self._place(digests)
            replica = self._replica(slot)
            hits = self.pages.lookup(digests, replica)
            self.pages.share(request.id, hits)
            fresh = self.pages.allocate(request.id, math.ceil((len(context) + 1) / T) - len(hits), replica)
            if fresh is None:
                self.pages.release(request.id, hits)
                break
            self.waiting.popleft()
            self.slots[slot] = _Live(
                request, hits + fresh, len(hits) * T, list(produced), self._admitted, len(context), digests[: len(hits)]
            )
            self._admitted += 1
            self._arrays = None
            self.cached_tokens += len(hits) * T
            self.peak_pages = max(self.peak_pages, len(self.pages.owners))
            seen_V = np.zeros(self.cfg.vocab_size, bool)
            seen_V[np.asarray(context, np.int64)] = True
            self.seen = _set_seen(self.seen, jnp.asarray(seen_V), slot)
            if self.prefill_chunk is None:
                events += self._now(self._prefill_slot(slot, len(context) - len(hits) * T))
        return events

    def _replica(self, slot: int) -> int:
        """The data-parallel replica whose devices hold the slot's row and pages."""
        return slot // (len(self.slots) // self.replicas)

    def _place(self, digests: list[bytes]) -> int:
        """A free slot for a new request: in the replica that has most of its prefix cached, then the
        most pages available (one replica: the first free slot)."""
        free = [i for i, s in enumerate(self.slots) if s is None]
        best = {}
        for i in free:
            best.setdefault(self._replica(i), i)
        return max(
            best.values(),
            key=lambda i: (
                len(self.pages.lookup(digests, self._replica(i))),
                self.pages.available_in(self._replica(i)),
                -i,
            ),
        )

    def _prefill(self) -> list[tuple[Hashable, int]]:
        """Prefills prompts in admission order, `prefill_chunk` tokens in all per step (None: all of them)."""
        events = []
        budget = self.prefill_chunk or math.inf
        for i in sorted(
            (i for i, s in enumerate(self.slots) if s and s.prefilling), key=lambda i: self.slots[i].admitted
        ):
            if budget <= 0:
                break
            n = int(min(self.slots[i].context - self.slots[i].length, budget))
            budget -= n
            events += self._now(self._prefill_slot(i, n))
        return events

    def _prefill_slot(self, i: int, n: int) -> list[tuple[Hashable, int]]:
        """Computes the next n context tokens of slot i; at the end of a fresh prompt, its first token."""
        s = self.slots[i]
        C = min(round_up(n, PROMPT_BUCKET), self.pages_per_seq * self.page_size)
        tokens = np.zeros((1, C), np.int32)
        tokens[0, :n] = s.tokens()[s.length : s.length + n]
        table = np.full((1, self.pages_per_seq), NULL_PAGE, np.int32)
        table[0, : len(s.pages)] = s.pages
        top = MAX_TOP_LOGPROBS if s.request.params.logprobs else 0
        scored, self.k, self.v, self.draft_pool, self.states = self.gen.run_in_context(
            self._chunk,
            self.gen.state,
            jnp.asarray(tokens),
            jnp.int32(s.length),
            jnp.int32(n),
            self.k,
            self.v,
            jnp.asarray(table),
            SamplingArrays.stack([s.request.params]),
            self.seen[i : i + 1],
            top,
            self.drafter.weights() if self.drafter is not None else None,
            self.draft_pool,
            jnp.int32(i),
            self.states,
        )
        s.length += n
        self.prefill_tokens += n
        self._register(s)
        if not s.prefilling and not s.produced:  # a fresh request: its prefill sampled its first token
            token, lp, top_1K, ids_1K = jax.device_get(scored)
            return self._emit(i, int(token[0]), float(lp[0]), top_1K[0], ids_1K[0])
        return []

    def _decode(self, one_step: bool = False) -> list[tuple[Hashable, int]]:
        """One dispatch of up to `steps_per_dispatch` decode steps (one with `one_step`) for every
        prefilled slot."""
        T = self.page_size

        def ready() -> list[int]:
            return [i for i, s in enumerate(self.slots) if s and not s.prefilling]

        # One step at a time while a prompt is being prefilled in chunks, so its chunks keep coming.
        n = 1 if one_step or any(s and s.prefilling for s in self.slots) else self.steps_per_dispatch
        steps = {i: min(n, self.slots[i].request.params.max_new_tokens - len(self.slots[i].produced)) for i in ready()}
        short = {i: math.ceil((self.slots[i].length + steps[i]) / T) - len(self.slots[i].pages) for i in steps}
        wanted = collections.Counter()
        for i, m in short.items():
            wanted[self._replica(i)] += max(0, m)
        if n > 1 and all(m <= self.pages.available_in(r) for r, m in wanted.items()):
            for i, m in short.items():  # the pages of the next n positions, ahead
                if m > 0:
                    self.slots[i].pages += self.pages.allocate(self.slots[i].request.id, m, self._replica(i))
        else:  # the pool is short: one step, a page per slot that crosses a boundary, preempting if need be
            n = 1
            for i in range(len(self.slots)):
                if self.slots[i] is not None and not self.slots[i].prefilling:
                    self._ensure_page(i)
        self.peak_pages = max(self.peak_pages, len(self.pages.owners))
        live = [i for i in ready() if self.slots[i].length // T < len(self.slots[i].pages)]
        if not live:
            return []
        batch = self._batch_rows(live)  # the slots the loop computes, in its row order
        self.batch_sizes[len(batch)] += 1
        column = {slot: c for c, slot in enumerate(batch)}
        rows = np.zeros((4, len(batch)), np.int32)  # tokens, positions, remaining, slot
        rows[3] = batch
        table = np.full((len(batch), self.pages_per_seq), NULL_PAGE, np.int32)  # idle rows write to the null page
        for i in live:
            s, c = self.slots[i], column[i]
            rows[:3, c] = s.produced[-1], s.length, s.request.params.max_new_tokens - len(s.produced)
            table[c, : len(s.pages)] = s.pages
        if self._table is None or not np.array_equal(self._table[0], table):
            self._table = table, jnp.asarray(table)
        arrays, stops = self._sampling_arrays()
        top = MAX_TOP_LOGPROBS if any(self.slots[i].request.params.logprobs for i in live) else 0
        scored, self.k, self.v, self.seen, self.states = self.gen.run_in_context(
            self._loop,
            self.gen.state,
            jnp.asarray(rows),
            jnp.asarray([n, bool(self.waiting)], np.int32),
            self.k,
            self.v,
            self._table[1],
            self.seen,
            arrays,
            stops,
            top,
            self.states,
        )
        out, lp, top_NBK, ids_NBK = jax.device_get(scored)  # one copy per dispatch
        count = int((out >= 0).any(axis=1).sum())
        self.steps += count
        self.dispatches += 1
        events = []
        for j in range(count):
            for i in live:
                s, c = self.slots[i], column[i]
                if s is None or out[j, c] < 0:
                    continue
                s.length += 1
                events += self._emit(i, int(out[j, c]), float(lp[j, c]), top_NBK[j, c], ids_NBK[j, c])
        for i in live:
            if self.slots[i] is not None:
                self._register(self.slots[i])
        return events

    def _batch_rows(self, live: list[int]) -> list[int]:
        """The slots a decode dispatch computes: the live ones, then idle ones up to a power of two
        (at most every slot), so a step costs what its running requests need rather than what the
        server could hold: one request on 32 slots ran 32 rows per step. The loop compiles once per
        size. Rows 2 to 32 are computed alike by XLA:CPU's matrix products (a row's result does not
        depend on how many there are), so a request's tokens do not change with the load between 2
        and 32 running requests. One row takes the matrix-vector path, which sums in another order:
        a request running alone may part from its batched tokens where two logits all but tie, as
        in vLLM. Padding it to 2 rows would avoid that, at 1.35x the step time on CPU host D
        (benchmarks/RESULTS.md, 2026-12-06). Data-parallel replicas each serve their own range of
        slots, and a hybrid model's recurrent states are laid out per slot: those compute every
        slot, and so does a server built with `fixed_batch=True`, whose requests' tokens then never
        depend on the load at any slot count."""
        S = len(self.slots)
        if self.fixed_batch or self.replicas > 1 or self.states is not None:
            return list(range(S))
        size = min(S, 1 << (len(live) - 1).bit_length())
        if size == S:
            return list(range(S))
        running = set(live)
        idle = [i for i in range(S) if i not in running]
        return sorted(live) + idle[: size - len(live)]

    def _speculate(self) -> list[tuple[Hashable, int]]:
        """One speculative round (speculative.py) for every prefilled slot: the draft proposes
        speculative_k tokens per slot and the target verifies them in one forward. Each slot first
        gets the page of its next position (preempting another request if the pool is dry), then,
        where the pool has them, the pages of the k positions after it; a slot keeps at most the
        tokens its pages cover. After the round the pages past a slot's next position (those of
        rejected positions) go back to the pool."""
        T, k = self.page_size, self.speculative_k

        def ready() -> list[int]:
            return [i for i, s in enumerate(self.slots) if s and not s.prefilling]

        for i in ready():
            if self.slots[i] is not None:  # an earlier slot's page may have preempted it
                self._ensure_page(i)
        for i in ready():
            s = self.slots[i]
            ahead = min(k, s.request.params.max_new_tokens - len(s.produced) - 1)
            m = min(math.ceil((s.length + ahead + 1) / T), self.pages_per_seq) - len(s.pages)
            if 0 < m <= self.pages.available_in(self._replica(i)):
                s.pages += self.pages.allocate(s.request.id, m, self._replica(i))
        self.peak_pages = max(self.peak_pages, len(self.pages.owners))
        live = [i for i in ready() if self.slots[i].length // T < len(self.slots[i].pages)]
        if not live:
            return []
        B = len(self.slots)
        rows = np.zeros((3, B), np.int32)  # prev, last, position
        limit = np.zeros(B, np.int32)  # idle rows emit nothing
        table = np.full((B, self.pages_per_seq), NULL_PAGE, np.int32)
        for i in live:
            s = self.slots[i]
            rows[:, i] = s.tokens()[s.length - 1], s.produced[-1], s.length
            limit[i] = min(s.request.params.max_new_tokens - len(s.produced), len(s.pages) * T - s.length)
            table[i, : len(s.pages)] = s.pages
        if self._table is None or not np.array_equal(self._table[0], table):
            self._table = table, jnp.asarray(table)
        arrays, stops = self._sampling_arrays()
        top = MAX_TOP_LOGPROBS if any(self.slots[i].request.params.logprobs for i in live) else 0
        out, self.k, self.v, self.draft_pool, self.seen = self.gen.run_in_context(
            self._round,
            top,
            self.gen.state,
            self.drafter.weights(),
            self.k,
            self.v,
            self.draft_pool,
            self._table[1],
            Rows(*jnp.asarray(rows)),
            jnp.asarray(limit),
            stops,
            arrays,
            self.seen,
        )
        tokens, emitted, accepted, lp, top_BJK, ids_BJK = jax.device_get(
            (out.tokens_BJ, out.emitted_B, out.accepted_B, out.logprobs_BJ, out.top_BJK, out.ids_BJK)
        )
        self.spec.add(k, emitted, accepted)
        self.steps += 1
        self.dispatches += 1
        events = []
        for i in live:
            for j in range(emitted[i]):
                if self.slots[i] is None:
                    break
                self.slots[i].length += 1
                events += self._emit(i, int(tokens[i, j]), float(lp[i, j]), top_BJK[i, j], ids_BJK[i, j])
            s = self.slots[i]
            if s is None:
                continue
            keep = math.ceil((s.length + 1) / T)
            if len(s.pages) > keep:
                self.pages.release(s.request.id, s.pages[keep:])
                self.spec.released_pages += len(s.pages) - keep
                s.pages = s.pages[:keep]
            self._register(s)
        return events

    def _round_fn(self, top, state, weights, k, v, draft, table_BP, rows, limit_B, stop_BS, arrays, seen_BV):
        """`speculative_round` over the paged pool; the draft's pool shares the target's page table."""
        out, cache, draft, seen_BV = speculative_round(
            self.gen,
            self.drafter,
            self.speculative_k,
            top,
            state,
            weights,
            PagedKVCache(k, v, table_BP),
            with_table(draft, table_BP),
            rows,
            limit_B,
            stop_BS,
            arrays,
            seen_BV,
        )
        return out, cache.k, cache.v, draft, seen_BV

    def _register(self, s: _Live) -> None:
        """Enters the sequence's newly completed full pages into the prefix cache."""
        if not self.prefix_caching:
            return
        full = s.length // self.page_size
        if full <= len(s.digests):
            return
        T = self.page_size
        start = len(s.digests)
        new = page_digests(s.tokens()[start * T : full * T], T, s.digests[-1] if s.digests else b"")
        for page, digest in zip(s.pages[start:full], new):
            self.pages.register(page, digest)
        s.digests += new

    def _ensure_page(self, i: int) -> bool:
        """Gives slot i the page its next position needs, preempting another request if none is free."""
        s = self.slots[i]
        replica = self._replica(i)
        while s.length // self.page_size >= len(s.pages):
            page = self.pages.allocate(s.request.id, 1, replica)
            if page is not None:
                s.pages += page
                self.peak_pages = max(self.peak_pages, len(self.pages.owners))
                return True
            victims = [j for j, o in enumerate(self.slots) if o is not None and j != i and self._replica(j) == replica]
            if not victims:
                return False
            self._preempt(max(victims, key=lambda j: self.slots[j].admitted))
        return True

    def _preempt(self, j: int) -> None:
        s = self.slots[j]
        self.waiting.appendleft((s.request, s.produced))
        self._free(j)
        self.preemptions += 1

    def _free(self, slot: int) -> None:
        s = self.slots[slot]
        self.pages.release(s.request.id, s.pages)
        self.slots[slot] = None
        self._arrays = None

    def _emit(
        self, slot: int, token: int, logprob: float, top_K: np.ndarray, ids_K: np.ndarray
    ) -> list[tuple[Hashable, int]]:
        """Records a sampled token, its log-probability and the alternatives its request asked for (of
        the top_K / ids_K computed); frees the slot when its request is done."""
        s = self.slots[slot]
        s.produced.append(token)
        p = s.request.params
        scores = self._scores[s.request.id]
        alternatives = [(int(t), float(x)) for t, x in zip(ids_K[: p.logprobs], top_K[: p.logprobs])]
        scores.logprobs.append(logprob)
        if p.logprobs:
            scores.top.append(alternatives)
        self.last_scores.append((logprob, alternatives))
        finish = "stop" if token in p.stop_tokens else "length" if len(s.produced) >= p.max_new_tokens else None
        if finish:
            del self._scores[s.request.id]
            self.results[s.request.id] = Result(s.request.id, s.produced, finish, None, scores.logprobs, scores.top)
            self._free(slot)
        return [(s.request.id, token)]

    def _sampling_arrays(self) -> tuple[SamplingArrays, jax.Array]:
        """Each slot's sampling settings and stop tokens (B, S), padded with -1 (matches no token).

        S is a power of two: the decode loop compiles once per S, so stop lists of any lengths (the
        HTTP body's up to 64 ids, plus the model's own) cost one compile per power of two, not one
        per length."""
        if self._arrays is None:
            idle = SamplingParams(temperature=0.0)
            params = [s.request.params if s else idle for s in self.slots]
            widest = max([1] + [len(p.stop_tokens) for p in params])
            stops = np.full((len(params), 1 << (widest - 1).bit_length()), -1, np.int32)
            for i, p in enumerate(params):
                stops[i, : len(p.stop_tokens)] = p.stop_tokens
            self._arrays = SamplingArrays.stack(params), jnp.asarray(stops)
        return self._arrays
