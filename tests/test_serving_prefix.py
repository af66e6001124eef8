"""Serving without recomputation or per-token overhead: the prefix cache (shared, reference-counted
pages evicted LRU), chunked prefill between decode steps, several decode steps per dispatch that stop on
a stop token, and cancellation. Every request still gets exactly its solo greedy tokens."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshwork.engine.generate import Generator
from meshwork.engine.kv_cache import NULL_PAGE
from meshwork.engine.sampling import TOP_K_BOUND, SamplingArrays, SamplingParams, sample, sample_reference
from meshwork.engine.serving import PageAllocator, Request, Server, page_digests
from meshwork.inference.runs import load_run

TEXT = (
    b"import os\nimport sys\n\ndef main(argv):\n    for arg in argv:\n        print(arg)\n"
    b"class Config:\n    def __init__(self, path):\n        self.path = path\n        self.items = {}\n"
    b"    def load(self):\n        with open(self.path) as f:\n            return f.read()\n"
) * 3


@pytest.fixture(scope="module")
def model(lm_tiny_runs):
    return load_run(lm_tiny_runs["1dev"]["run_dir"])[1]


@pytest.fixture(scope="module")
def gen(model):
    return Generator(model)


def solo(gen, requests, max_len=288):
    """Each request generated alone (one cache length for all: one compile per prompt bucket)."""
    return {r.id: gen.generate([r.prompt], r.params, max_len)[0] for r in requests}


def check_pool(server: Server) -> None:
    """Each held page is held once per live sequence listing it; free, cached-idle and held pages
    partition the pool; the null page is in none."""
    holders = collections.Counter(p for pages in server.live_pages().values() for p in pages)
    alloc = server.pages
    assert {p: len(o) for p, o in alloc.owners.items()} == dict(holders)
    parts = [set(alloc.free), set(alloc.lru), set(alloc.owners)]
    assert sum(map(len, parts)) == alloc.n_pages - 1 and set.union(*parts) == set(range(1, alloc.n_pages))
    assert not set(alloc.lru) & set(alloc.owners)


def test_page_allocator_shares_counts_and_evicts_least_recently_released():
    pages = PageAllocator(6)  # pages 1..5
    d = page_digests(list(range(12)), 4)  # 3 full pages
    assert len(d) == 3 and page_digests(list(range(11)), 4) == d[:2]
    assert page_digests([9] + list(range(1, 12)), 4)[1] != d[1]  # chained: page 1's digest covers page 0
    a = pages.allocate("a", 3)
    for p, digest in zip(a, d):
        pages.register(p, digest)
    assert pages.lookup(d) == a and pages.lookup(page_digests([9] + list(range(1, 12)), 4)) == []
    pages.share("b", a[:2])
    pages.release("a", a)
    assert set(pages.lru) == {a[2]} and pages.owners == {a[0]: ["b"], a[1]: ["b"]}
    with pytest.raises(RuntimeError, match="does not own"):
        pages.release("a", a[:1])
    pages.release("b", [a[1]])
    pages.release("b", [a[0]])
    assert list(pages.lru) == [a[2], a[1], a[0]] and pages.available == 5
    # 2 free pages, then the least recently released cached ones, in that order.
    c = pages.allocate("c", 4)
    assert set(c[:2]) == set(range(1, 6)) - set(a) and c[2:] == [a[2], a[1]] and pages.evictions == 2
    assert pages.lookup(d) == [a[0]]  # a[1] was evicted: the run stops there
    assert pages.allocate("c", 2) is None and pages.available == 1


def test_prefix_cache_16_requests_sharing_256_tokens(model, gen):
    """A shared-prefix load: 16 requests, one 256-token prefix, 8 tokens of their own each."""
    T, prefix = 16, list(TEXT[:256])
    requests = [
        Request(
            f"r{i}", prefix + list(TEXT[300 + 8 * i : 308 + 8 * i]), SamplingParams(temperature=0.0, max_new_tokens=4)
        )
        for i in range(16)
    ]
    stats, alone = {}, solo(gen, requests)
    for caching in (False, True):
        server = Server(model, slots=16, page_size=T, max_len=288, n_pages=16 * 18 + 1, prefix_caching=caching)
        for r in requests:
            server.submit(r)
        while server.waiting or any(server.slots):
            server.step()
            check_pool(server)
        stats[caching] = server.prefill_tokens, server.cached_tokens, server.peak_pages
        assert {rid: res.tokens for rid, res in server.results.items()} == alone
        assert not server.live_pages() and server.pages.available == server.pages.n_pages - 1
    # Without: every prompt computed and stored whole (17 pages each: 264 tokens and the next position).
    assert stats[False] == (16 * 264, 0, 16 * 17)
    # With: the first request computes its prompt; the others find 16 full pages and compute 8 tokens.
    assert stats[True] == (264 + 15 * 8, 15 * 256, 16 + 16 * 1)


@pytest.mark.slow  # 16 s; the quick tier keeps the 16 x 256 sharing and chunked prefill
def test_prefix_pages_outlive_their_request_and_resume_preempted_requests(model, gen):
    """Cached pages of a finished request serve a later one; with a pool that runs dry, requests are
    preempted and cached pages evicted, and every request still gets its solo tokens."""
    T = 4
    first = Request("first", list(TEXT[:30]), SamplingParams(temperature=0.0, max_new_tokens=6))
    later = Request("later", list(TEXT[:22]) + list(TEXT[60:65]), SamplingParams(temperature=0.0, max_new_tokens=5))
    server = Server(model, slots=2, page_size=T, max_len=64, prefix_caching=True)
    server.run([first])
    assert server.prefill_tokens == 30
    server.run([later])
    assert server.cached_tokens == 20 and server.prefill_tokens == 30 + 7  # pages 0..4 (tokens 0..19) reused
    assert {k: v.tokens for k, v in server.results.items()} == solo(gen, [first, later])
    # A pool that runs dry: preempted requests resume on what they cached before.
    reqs = [
        Request(f"p{i}", list(TEXT[7 * i : 7 * i + 18]), SamplingParams(temperature=0.0, max_new_tokens=14))
        for i in range(4)
    ]
    server = Server(model, slots=3, page_size=T, max_len=64, n_pages=17, prefix_caching=True)
    for r in reqs:
        server.submit(r)
    while server.waiting or any(server.slots):
        server.step()
        check_pool(server)
    assert server.preemptions >= 1 and server.pages.evictions > 0
    assert {k: v.tokens for k, v in server.results.items()} == solo(gen, reqs)


def test_chunked_prefill_keeps_others_decoding_and_equals_unchunked(model, gen):
    short = [
        Request(f"s{i}", list(TEXT[10 * i : 10 * i + 12]), SamplingParams(temperature=0.0, max_new_tokens=24))
        for i in range(2)
    ]
    long = Request("long", list(TEXT[:160]), SamplingParams(temperature=0.0, max_new_tokens=6))
    results, during = {}, {}
    for chunk in (None, 32):
        server = Server(model, slots=3, page_size=8, max_len=192, prefill_chunk=chunk, steps_per_dispatch=4)
        for r in short:
            server.submit(r)
        server.step()  # the short ones are running
        server.submit(long)
        during[chunk] = 0
        while server.waiting or any(server.slots):
            prefilling = any(s and s.request.id == "long" and not s.produced for s in server.slots) or any(
                r.id == "long" for r, _ in server.waiting
            )
            events = server.step()
            if prefilling:
                during[chunk] += sum(rid != "long" for rid, _ in events)
        results[chunk] = {rid: res.tokens for rid, res in server.results.items()}
        if chunk:
            assert server.prefill_tokens == 2 * 12 + 160
    assert results[32] == results[None] == solo(gen, [*short, long])
    # Unchunked, the 160-token prompt is prefilled in the step that admits it; chunked in 32-token
    # pieces over 5 steps, with a decode step for the others after each piece.
    assert during[32] >= 2 * 4 + during[None]


def test_several_decode_steps_per_dispatch_stop_on_stop_tokens(model, gen):
    base = [
        Request(f"r{i}", list(TEXT[13 * i : 13 * i + 9 + i]), SamplingParams(temperature=0.0, max_new_tokens=20))
        for i in range(3)
    ]
    alone = solo(gen, base)
    stop = alone["r1"][5]  # r1 stops at its first occurrence of this token
    cut = alone["r1"].index(stop) + 1
    requests = [
        base[0],
        Request("r1", base[1].prompt, SamplingParams(temperature=0.0, max_new_tokens=20, stop_tokens=(stop,))),
        base[2],
    ]
    server = Server(model, slots=3, page_size=8, max_len=64, steps_per_dispatch=8)
    results = server.run(requests)
    assert results["r1"].tokens == alone["r1"][:cut] and results["r1"].finish == "stop"
    assert results["r0"].tokens == alone["r0"] and results["r2"].tokens == alone["r2"]
    # 1 + 8 + 8 + 2 steps: one step in the dispatch after the prompts' prefill (their first tokens go
    # out then, not after a burst), then whole dispatches; not one dispatch per token.
    assert server.steps == 19 and server.dispatches == 4
    one = Server(model, slots=3, page_size=8, max_len=64, steps_per_dispatch=1)
    assert {k: v.tokens for k, v in one.run(requests).items()} == {k: v.tokens for k, v in results.items()}
    assert one.dispatches == one.steps == 19


def test_cancel_frees_the_slot_and_pages(model, gen):
    requests = [
        Request(f"r{i}", list(TEXT[5 * i : 5 * i + 20]), SamplingParams(temperature=0.0, max_new_tokens=30))
        for i in range(3)
    ]
    server = Server(model, slots=2, page_size=8, max_len=64, steps_per_dispatch=4, prefix_caching=True)
    for r in requests:
        server.submit(r)
    server.step()  # prefill (the first token) and one decode step
    server.step()  # a dispatch of 4 steps
    assert server.cancel("r0") and server.cancel("r2")  # one running, one waiting
    assert not server.cancel("r0") and not server.cancel("nobody")
    assert server.results["r0"].finish == "cancelled" and len(server.results["r0"].tokens) == 6
    assert server.results["r2"].finish == "cancelled" and server.results["r2"].tokens == []
    check_pool(server)
    results = server.run()
    assert results["r1"].tokens == solo(gen, requests[1:2])["r1"]
    assert not server.live_pages() and server.pages.available == server.pages.n_pages - 1
    assert NULL_PAGE not in server.pages.owners


def test_sampler_without_a_sort_draws_what_the_full_sort_draws():
    """Greedy, top-k within and past the lax.top_k bound, nuclei that close inside it and flat ones that
    need the threshold search, penalties: token for token the reference's draws (no ties here)."""
    rng = np.random.default_rng(0)
    V, B = 300, 480
    params = [
        SamplingParams(
            temperature=float(rng.choice([0.0, 0.5, 1.0, 3.0])),
            top_k=int(rng.choice([0, 1, 5, TOP_K_BOUND, TOP_K_BOUND + 1, 100, V - 1, V, 1000])),
            top_p=float(rng.choice([1.0, 0.9, 0.5, 0.99])),
            repetition_penalty=float(rng.choice([1.0, 1.3])),
            seed=i,
        )
        for i in range(B)
    ]
    scale_B1 = rng.choice([0.01, 1.0, 5.0], size=(B, 1))  # 0.01: nearly flat, nuclei of ~V tokens
    logits = jnp.asarray(rng.normal(size=(B, V)) * scale_B1, jnp.float32)
    seen, positions = jnp.asarray(rng.random((B, V)) < 0.2), jnp.asarray(rng.integers(0, 1000, B))
    arrays = SamplingArrays.stack(params)
    fast = np.asarray(jax.jit(sample)(logits, positions, arrays, seen))
    np.testing.assert_array_equal(fast, np.asarray(jax.jit(sample_reference)(logits, positions, arrays, seen)))
    # The threshold search was needed: sampled rows whose k or nucleus reaches past the bound.
    wide = [
        p.temperature > 0 and (TOP_K_BOUND < p.top_k < V or (p.top_k in (0, V, 1000) and p.top_p < 1) and s < 0.1)
        for p, s in zip(params, scale_B1[:, 0])
    ]
    assert sum(wide) > 20


def test_sampler_compiles_without_a_sort():
    arrays = SamplingArrays.stack([SamplingParams(top_p=0.9)] * 4)
    args = jnp.zeros((4, 1000)), jnp.zeros(4, jnp.int32), arrays
    sorts = [
        len(re.findall(r"\bsort\(", jax.jit(f).lower(*args).compile().as_text())) for f in (sample, sample_reference)
    ]
    assert sorts == [0, 1]
