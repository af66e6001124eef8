"""Continuous batching over a paged KV cache: requests join and leave the running batch between decode steps.

    server = Server(model, slots=8, page_size=16, max_len=512)
    results = server.run([Request("a", prompt_ids), Request("b", other_ids, SamplingParams(top_p=0.9))])
    results["a"].tokens, results["a"].finish        # "stop", "length" or "error"

The batch has a fixed number of slots; each decode step advances every live
slot by one token. Between steps, finished requests leave (their slot and
pages are freed) and waiting requests are prefilled into free slots, so a
short request never waits for the longest one in its batch (Orca's
iteration-level scheduling).

Memory is a pool of fixed-size pages (kv_cache.PagedKVCache). A request gets
the pages its prompt needs when admitted and one more page each time its
length crosses a page boundary; so the pool holds what live sequences use,
not slots x max_len. When a sequence needs a page and none is free, the most
recently admitted other request is preempted: its pages are freed and it goes
back to the front of the queue, to be prefilled again from its prompt and the
tokens it already produced (vLLM's recompute preemption). Sampling keys
depend only on (seed, position), so a preempted request continues exactly as
it would have.

A bad request (empty, longer than the cache, token ids outside the
vocabulary, bad sampling settings) gets a Result with finish "error" and a
one-line reason; the others keep being served.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Hashable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from meshwork.config import ConfigError
from meshwork.inference.generate import PROMPT_BUCKET, Generator
from meshwork.inference.kv_cache import NULL_PAGE, PagedKVCache
from meshwork.inference.sampling import SamplingArrays, SamplingParams
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
    finish: str                 # "stop" (a stop token, included), "length" (max_new_tokens) or "error"
    error: str | None = None


class PageAllocator:
    """Pages 1..n-1 of the pool (0 is the null page); each page belongs to at most one sequence."""

    def __init__(self, n_pages: int):
        self.n_pages = n_pages
        self.free: collections.deque[int] = collections.deque(range(1, n_pages))
        self.owner: dict[int, Hashable] = {}

    def allocate(self, owner: Hashable, n: int) -> list[int] | None:
        """n pages for `owner`, or None (nothing taken) when fewer are free."""
        if n > len(self.free):
            return None
        pages = [self.free.popleft() for _ in range(n)]
        self.owner.update(dict.fromkeys(pages, owner))
        return pages

    def release(self, owner: Hashable, pages: Iterable[int]) -> None:
        for p in pages:
            if self.owner.pop(p, None) != owner:
                raise RuntimeError(f"page {p} released by {owner!r}, which does not own it")
            self.free.append(p)


@dataclasses.dataclass
class _Live:
    request: Request
    pages: list[int]
    length: int          # tokens whose keys/values are cached (positions 0..length-1)
    produced: list[int]  # sampled so far; the last one is fed at position `length` next
    admitted: int        # admission order, for choosing whom to preempt


class Server:
    """A continuous-batching generation server over one model (see the module docstring)."""

    def __init__(self, model: nnx.Module, *, slots: int = 8, page_size: int = 16, max_len: int = 512,
                 n_pages: int | None = None, mesh: Mesh | None = None, rules: Rules | None = None,
                 cache_dtype: jnp.dtype | None = None):
        self.gen = Generator(model, mesh=mesh, rules=rules, cache_dtype=cache_dtype)
        self.cfg, self.page_size, self.max_len = self.gen.cfg, page_size, max_len
        self.pages_per_seq = math.ceil(max_len / page_size)
        # Default pool: half of what slots x max_len would need, plus the null page.
        n_pages = n_pages or slots * self.pages_per_seq // 2 + 1
        sharding = PagedKVCache.shardings(mesh, rules).k if mesh is not None else None
        pool = PagedKVCache.zeros(self.cfg, n_pages, page_size, slots, self.pages_per_seq,
                                  self.gen.cache_dtype, sharding)
        self.k, self.v = pool.k, pool.v
        self.seen = jnp.zeros((slots, self.cfg.vocab_size), bool)
        self.pages = PageAllocator(n_pages)
        self.slots: list[_Live | None] = [None] * slots
        self.waiting: collections.deque[tuple[Request, list[int]]] = collections.deque()
        self.results: dict[Hashable, Result] = {}
        self.steps = self.preemptions = self.peak_pages = 0
        self._admitted = 0
        self._arrays: SamplingArrays | None = None
        self._set_seen = jax.jit(lambda seen, row, slot: seen.at[slot].set(row), donate_argnums=0)

    # -- requests ---------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queues a request, or records its error Result at once if it cannot be served.

        Ids key the results, so reusing one is the caller's bug: ValueError, nothing queued.
        """
        if request.id in self.results or any(r.id == request.id for r, _ in self.waiting) or \
                any(s and s.request.id == request.id for s in self.slots):
            raise ValueError(f"request id {request.id!r} is already in use")
        try:
            request.params.check(self.cfg.vocab_size)
            self.gen.check_prompt(request.prompt, request.params.max_new_tokens, self.max_len)
            worst = math.ceil((len(request.prompt) + request.params.max_new_tokens) / self.page_size)
            if worst > self.pages.n_pages - 1:
                raise ConfigError(f"request needs up to {worst} pages of {self.page_size} tokens but the pool has "
                                  f"{self.pages.n_pages - 1}; raise n_pages or shorten the request")
        except ConfigError as e:
            self.results[request.id] = Result(request.id, [], "error", str(e))
            return
        self.waiting.append((request, []))

    def run(self, requests: Iterable[Request] = (),
            on_token: Callable[[Hashable, int], None] | None = None) -> dict[Hashable, Result]:
        """Submits `requests` and steps until nothing is live or waiting; returns all results."""
        for r in requests:
            self.submit(r)
        while self.waiting or any(self.slots):
            for rid, token in self.step():
                if on_token:
                    on_token(rid, token)
        return self.results

    def live_pages(self) -> dict[Hashable, list[int]]:
        return {s.request.id: list(s.pages) for s in self.slots if s}

    # -- one iteration ------------------------------------------------------------

    def step(self) -> list[tuple[Hashable, int]]:
        """Admits what fits, then one decode step for every live slot: the (request id, token) sampled."""
        events = self._admit()
        for i in range(len(self.slots)):  # a page for the position each live slot writes next
            if self.slots[i] is not None:
                self._ensure_page(i)
        live = [i for i, s in enumerate(self.slots) if s and s.length // self.page_size < len(s.pages)]
        if not live:
            return events
        B = len(self.slots)
        tokens, positions = np.zeros(B, np.int32), np.zeros(B, np.int32)
        table = np.full((B, self.pages_per_seq), NULL_PAGE, np.int32)  # idle rows write to the null page
        for i in live:
            s = self.slots[i]
            tokens[i], positions[i] = s.produced[-1], s.length
            table[i, :len(s.pages)] = s.pages
        # The Generator's jitted decode step, over the paged cache (built anew each step: the page
        # table changes between steps; the pool arrays are donated and updated in place).
        out, _, cache, self.seen = self.gen._in_context(
            self.gen._decode, self.gen.state, jnp.asarray(tokens), jnp.asarray(positions),
            PagedKVCache(self.k, self.v, jnp.asarray(table)), self._sampling_arrays(), self.seen)
        self.k, self.v = cache.k, cache.v
        self.steps += 1
        out = np.asarray(out)
        for i in live:
            s = self.slots[i]
            s.length += 1
            events += self._emit(i, int(out[i]))
        return events

    def _admit(self) -> list[tuple[Hashable, int]]:
        events = []
        while self.waiting and None in self.slots:
            request, produced = self.waiting[0]
            # A preempted request resumes from its prompt plus what it produced, bar the pending last token.
            context = list(request.prompt) + produced[:-1]
            pages = self.pages.allocate(request.id, math.ceil((len(context) + 1) / self.page_size))
            if pages is None:
                break
            self.waiting.popleft()
            slot = self.slots.index(None)
            self.slots[slot] = _Live(request, pages, len(context), list(produced), self._admitted)
            self._admitted += 1
            self._arrays = None
            self.peak_pages = max(self.peak_pages, len(self.pages.owner))
            L = min(round_up(len(context), PROMPT_BUCKET), self.pages_per_seq * self.page_size)
            tokens = np.zeros((1, L), np.int32)
            tokens[0, :len(context)] = context
            table = np.full((1, self.pages_per_seq), NULL_PAGE, np.int32)
            table[0, :len(pages)] = pages
            token, _, cache, seen_1V = self.gen._in_context(
                self.gen._prefill, self.gen.state, jnp.asarray(tokens), jnp.asarray([len(context)], np.int32),
                PagedKVCache(self.k, self.v, jnp.asarray(table)), SamplingArrays.stack([request.params]))
            self.k, self.v = cache.k, cache.v
            self.seen = self._set_seen(self.seen, seen_1V[0], slot)
            if not produced:  # a fresh request: the prefill sampled its first token
                events += self._emit(slot, int(np.asarray(token)[0]))
        return events

    def _ensure_page(self, i: int) -> bool:
        """Gives slot i the page its next position needs, preempting another request if none is free."""
        s = self.slots[i]
        while s.length // self.page_size >= len(s.pages):
            page = self.pages.allocate(s.request.id, 1)
            if page is not None:
                s.pages += page
                self.peak_pages = max(self.peak_pages, len(self.pages.owner))
                return True
            victims = [j for j, o in enumerate(self.slots) if o is not None and j != i]
            if not victims:
                return False
            self._preempt(max(victims, key=lambda j: self.slots[j].admitted))
        return True

    def _preempt(self, j: int) -> None:
        s = self.slots[j]
        self.pages.release(s.request.id, s.pages)
        self.waiting.appendleft((s.request, s.produced))
        self.slots[j] = None
        self._arrays = None
        self.preemptions += 1

    def _emit(self, slot: int, token: int) -> list[tuple[Hashable, int]]:
        """Records a sampled token; frees the slot when its request is done."""
        s = self.slots[slot]
        s.produced.append(token)
        p = s.request.params
        finish = "stop" if token in p.stop_tokens else "length" if len(s.produced) >= p.max_new_tokens else None
        if finish:
            self.results[s.request.id] = Result(s.request.id, s.produced, finish)
            self.pages.release(s.request.id, s.pages)
            self.slots[slot] = None
            self._arrays = None
        return [(s.request.id, token)]

    def _sampling_arrays(self) -> SamplingArrays:
        if self._arrays is None:
            idle = SamplingParams(temperature=0.0)
            self._arrays = SamplingArrays.stack([s.request.params if s else idle for s in self.slots])
        return self._arrays
