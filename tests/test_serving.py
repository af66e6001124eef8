"""Continuous batching: every request gets the tokens it gets alone, pages are never shared and
always come back, and bad requests are answered with an error while the rest are served."""

import pytest

from meshwork.engine.generate import Generator
from meshwork.engine.kv_cache import NULL_PAGE
from meshwork.engine.sampling import SamplingParams
from meshwork.engine.serving import Request, Server
from meshwork.inference.runs import load_run

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)


@pytest.fixture(scope="module")
def model(lm_tiny_runs):
    return load_run(lm_tiny_runs["1dev"]["run_dir"])[1]


@pytest.fixture(scope="module")
def gen(model):
    """Generation without batching, the reference (compiled once for the module)."""
    return Generator(model)


@pytest.fixture(scope="module")
def requests():
    text = b"import os\nimport sys\n\ndef main(argv):\n    for arg in argv:\n        print(arg)\n"
    starts_lengths = [(0, 4), (3, 21), (10, 2), (20, 37), (5, 9), (30, 14)]
    budgets = [10, 4, 14, 7, 10, 12]
    return [
        Request(f"r{i}", list(text[s : s + n]), SamplingParams(temperature=0.0, max_new_tokens=m))
        for i, ((s, n), m) in enumerate(zip(starts_lengths, budgets))
    ]


def check_pages(server: Server) -> None:
    """No page is held by two live sequences; the null page by none; free + held = the pool."""
    held = [p for pages in server.live_pages().values() for p in pages]
    assert len(held) == len(set(held)) and NULL_PAGE not in held
    assert sorted(held + list(server.pages.free)) == list(range(1, server.pages.n_pages))


def test_continuous_batching_gives_each_request_its_tokens_alone(model, gen, requests):
    alone = {r.id: gen.generate([r.prompt], r.params)[0] for r in requests}
    # 3 slots for 6 requests, and a pool too small for 3 long sequences: requests join as others
    # leave, and the pool runs dry so that someone is preempted and resumed.
    server = Server(model, slots=3, page_size=4, max_len=64, n_pages=15)
    for r in requests:
        server.submit(r)
    joined_mid_run = set()
    while server.waiting or any(server.slots):
        before = set(server.live_pages())
        server.step()
        check_pages(server)
        if server.steps > 1:
            joined_mid_run |= set(server.live_pages()) - before
    assert {rid: res.tokens for rid, res in server.results.items()} == alone
    assert all(
        server.results[r.id].finish == "length" and len(server.results[r.id].tokens) == r.params.max_new_tokens
        for r in requests
    )
    assert joined_mid_run, "no request joined between decode steps"
    assert server.preemptions >= 1
    # Everything went back to the pool; at its peak the pool held less than slots x max_len would.
    assert not server.live_pages() and len(server.pages.free) == server.pages.n_pages - 1
    assert server.peak_pages <= 14 < 3 * server.pages_per_seq


def test_sampled_requests_draw_the_same_tokens_in_a_batch(model, gen, requests):
    """Keys come from (seed, position): batch company and preemption do not change a draw."""
    params = [SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=i, max_new_tokens=8) for i in range(4)]
    reqs = [Request(r.id, r.prompt, p) for r, p in zip(requests, params)]
    alone = {r.id: gen.generate([r.prompt], r.params)[0] for r in reqs}
    results = Server(model, slots=2, page_size=4, max_len=64, n_pages=16).run(reqs)
    assert {rid: res.tokens for rid, res in results.items()} == alone


def test_bad_requests_get_an_error_and_the_rest_are_served(model, gen, requests):
    server = Server(model, slots=2, page_size=8, max_len=48)
    bad = {
        "empty": Request("empty", [], GREEDY),
        "too_long": Request("too_long", [65] * 45, GREEDY),  # 45 + 10 new > 48
        "foreign_ids": Request("foreign_ids", [65, 70000, 66], GREEDY),  # another tokenizer's ids
        "bad_top_p": Request("bad_top_p", [65, 66], SamplingParams(top_p=1.5)),
    }
    good = requests[:3]
    server.submit(good[0])
    with pytest.raises(ValueError, match="already in use"):
        server.submit(Request(good[0].id, [1, 2], GREEDY))
    results = server.run([*bad.values(), good[1], good[2]])
    for name, why in [
        ("empty", "empty prompt"),
        ("too_long", "exceeds the cache"),
        ("foreign_ids", "another tokenizer"),
        ("bad_top_p", "top_p"),
    ]:
        assert results[name].finish == "error" and why in results[name].error, results[name]
        assert "\n" not in results[name].error
    for r in good:
        assert results[r.id].tokens == gen.generate([r.prompt], r.params)[0]
    assert len(results) == len(bad) + len(good)


def test_a_dispatch_computes_the_running_requests_and_the_first_token_comes_after_one_step(model, gen, requests):
    """On 8 slots, one running request decodes 1 row a step, three 4 and five all 8 (a power of two:
    the cost of a step follows the load, not the slots), each request getting its solo
    tokens; and the step that prefills a prompt returns its first token with one decode step after
    it, not a dispatch of 8."""
    alone = {r.id: gen.generate([r.prompt], r.params)[0] for r in requests}
    server = Server(model, slots=8, page_size=4, max_len=64, steps_per_dispatch=8)
    first = requests[0]
    server.submit(first)
    assert [rid for rid, _ in server.step()] == [first.id, first.id]  # the prefill's token, one step's
    assert len(server.step()) == 8  # then whole dispatches
    server.run()
    assert set(server.batch_sizes) == {1}
    for n, rows in ((3, 4), (5, 8)):
        server.batch_sizes.clear()
        batch = requests[1 : 1 + n]
        results = server.run([Request(f"{r.id} of {n}", r.prompt, r.params) for r in batch])
        assert {r.id: results[f"{r.id} of {n}"].tokens for r in batch} == {r.id: alone[r.id] for r in batch}
        assert max(server.batch_sizes) == rows  # fewer as requests finish


def test_each_first_token_goes_out_as_its_prompt_is_prefilled(model, gen, requests):
    """With `on_events` (the serving thread's delivery), of three prompts prefilled in one step each
    first token is handed over as its own prefill ends, while the prompts after it still wait:
    not after the last prompt and a decode step. The tokens are still the solo ones."""
    server = Server(model, slots=4, page_size=4, max_len=64, prefill_chunk=256)
    handed = []

    def on_events(events, scores):
        waiting = [s.request.id for s in server.slots if s and s.prefilling]
        handed.append((events, len(scores), waiting))

    server.on_events = on_events
    batch = requests[:3]
    for r in batch:
        server.submit(r)
    rest = server.step()
    assert [[rid for rid, _ in e] for e, _, _ in handed] == [[r.id] for r in batch]
    assert [n for _, n, _ in handed] == [1, 1, 1]  # each token with its scores
    assert [w for _, _, w in handed] == [[r.id for r in batch[k + 1 :]] for k in range(3)]
    assert [rid for rid, _ in rest] == [r.id for r in batch]  # the step's one decode step
    tokens = {r.id: [e[0][1]] for r, (e, _, _) in zip(batch, handed)}
    for rid, token in rest:
        tokens[rid].append(token)
    for r in batch:
        assert tokens[r.id] == gen.generate([r.prompt], r.params)[0][:2]
