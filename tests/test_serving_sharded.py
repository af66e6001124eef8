"""Sharded serving on 8 devices: the page pool split over `data` (each data-parallel replica serves
its own rows from its own pages) and kv heads over `tensor`, through `shard_map` around the cache
write and the attention (kernel or gather). Every request gets the one-device server's tokens, each
device holds 1/(data x tensor) of the pool, and the compiled decode loop moves no page between
devices."""

import concurrent.futures
import re

import jax
import numpy as np
import pytest
from conftest import ROOT

from meshwork.config import ConfigError, load_config
from meshwork.engine.sampling import SamplingParams
from meshwork.engine.serving import Request, Server
from meshwork.inference.http_server import Limits, Served, create_app
from meshwork.inference.serve_cli import ThreadedServer
from meshwork.inference.serve_engine import Engine
from meshwork.models.build import build_model
from meshwork.sharding.mesh import make_mesh
from meshwork.sharding.rules import rules_for

DATA, TENSOR = 4, 2
SERVER = dict(slots=8, page_size=8, max_len=128, prefix_caching=True, prefill_chunk=32)
SYSTEM = list(range(40, 80))  # a shared 40-token prefix: five full pages for the prefix cache


def small_model(impl: str):
    cfg = load_config(
        ROOT / "configs/lm_tiny.yaml",
        [
            "model.d_model=64",
            "model.n_layers=2",
            "model.n_heads=4",
            "model.n_kv_heads=2",
            "model.d_ff=128",
            f"model.attention={impl}",
        ],
    )
    return build_model(cfg, seed=3)


@pytest.fixture(scope="module")
def requests():
    """Ragged prompts, half with the shared prefix, greedy and sampled, long enough to cross pages."""
    rng = np.random.default_rng(11)
    out = []
    for i in range(12):
        prompt = [int(t) for t in rng.integers(0, 256, int(rng.integers(3, 50)))]
        out.append(
            Request(
                f"r{i}",
                SYSTEM + prompt if i % 2 else prompt,
                SamplingParams(
                    temperature=0.0 if i % 3 else 0.9, top_p=0.9, seed=i, max_new_tokens=int(rng.integers(2, 24))
                ),
            )
        )
    return out


def serve(model, requests, mesh=None, **kw):
    server = Server(model, mesh=mesh, rules=rules_for("tp") if mesh is not None else None, **{**SERVER, **kw})
    results = server.run(requests)
    assert not server.live_pages() and server.pages.available == server.pages.usable
    return server, {rid: r.tokens for rid, r in results.items()}


def collective_shapes(hlo: str) -> list[tuple[str, list[int]]]:
    """(op, result dims) of every collective in an optimized HLO text."""
    ops = re.findall(
        r"= \w+\[([\d,]*)\]\{[\d,]*\} (all-gather|all-reduce|collective-permute|all-to-all|"
        r"reduce-scatter)(?:-start)?\(",
        hlo,
    )
    return [(op, [int(d) for d in dims.split(",") if d]) for dims, op in ops]


@pytest.fixture(scope="module", params=["xla", pytest.param("pallas", marks=pytest.mark.slow)])
def runs(request, requests):
    """(the one-device tokens, the data 4 x tensor 2 server and its tokens) for one attention impl.
    4 slots and 15 pages per replica (14 to hand out, as many as the longest request needs): the
    replicas' requests cannot all grow, so some are preempted."""
    model = small_model(request.param)
    _, alone = serve(model, requests)
    server, sharded = serve(model, requests, make_mesh({"data": DATA, "tensor": TENSOR}), slots=16, n_pages=DATA * 15)
    return alone, server, sharded


@pytest.mark.over_budget(
    "the serving engine's programs compiled for data 4 x tensor 2 and for one device: ~16 s cold", seconds=40
)
def test_sharded_server_equals_one_device(runs):
    """data 4 x tensor 2: the same tokens for every request, with prefix caching, chunked prefill and
    preemption inside a replica; the pool's shards hold 1/8 of it each."""
    alone, server, sharded = runs
    assert sharded == alone
    assert server.preemptions > 0 and server.cached_tokens > 0

    L, N, T, G, K = server.k.shape
    assert N == DATA * 15
    shards = {s.data.shape for s in server.k.addressable_shards}
    assert shards == {(L, N // DATA, T, G // TENSOR, K)}
    assert sum(s.data.nbytes for s in server.k.addressable_shards) == server.k.nbytes  # no copy anywhere


def test_sharded_server_over_http_with_the_openai_client(runs, requests):
    """The sharded server behind the OpenAI API: 12 concurrent clients (greedy and sampled, streamed
    or not) each get the one-device tokens."""
    import openai  # the test extra's: a missing one is an error, not a skip

    alone, server, _ = runs
    engine = Engine(server, max_queue=64)  # the app's lifespan starts and stops it
    served = Served("sharded", None)  # no tokenizer: prompts go as token ids

    def ask(client, r, stream):
        p = r.params
        kw = dict(
            model="sharded",
            prompt=list(r.prompt),
            max_tokens=p.max_new_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            seed=p.seed,
        )
        if not stream:
            return client.completions.create(**kw).choices[0].model_extra["token_ids"]
        return [
            t
            for chunk in client.completions.create(**kw, stream=True)
            for t in chunk.choices[0].model_extra["token_ids"]
        ]

    with ThreadedServer(create_app(engine, served, Limits(max_tokens=64))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="-")
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            got = list(pool.map(lambda ir: ask(client, ir[1], ir[0] % 2), enumerate(requests)))
    assert {r.id: ids for r, ids in zip(requests, got)} == alone
    assert not server.live_pages() and server.pages.available == server.pages.usable


def test_decode_loop_moves_no_pages():
    """The compiled decode loop's collectives (tensor-parallel sums, the sampler's batch) never carry
    pages: each device reads and writes only its own share of the pool."""
    model = small_model("xla")
    server = Server(model, mesh=make_mesh({"data": DATA, "tensor": TENSOR}), rules=rules_for("tp"), **SERVER)
    loop, seen = server._loop, {}

    def spy(*args):  # the decode loop's arguments, as shapes and shardings, for lowering it again
        seen["args"] = [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array) and isinstance(x.sharding, jax.sharding.NamedSharding)
            else jax.ShapeDtypeStruct(x.shape, x.dtype)
            if isinstance(x, jax.Array)
            else x
            for x in jax.tree.leaves(args)
        ]
        seen["tree"] = jax.tree.structure(args)
        return loop(*args)

    server._loop = spy
    server.run([Request("a", list(range(20)), SamplingParams(temperature=0.0, max_new_tokens=12))])
    args = jax.tree.unflatten(seen["tree"], seen["args"])
    hlo = server.gen.run_in_context(lambda *a: loop.lower(*a).compile().as_text(), *args)
    L, N, T, G, K = server.k.shape
    collectives = collective_shapes(hlo)
    assert collectives, "the tensor-parallel layers must sum across tensor"
    page_like = [
        (op, dims)
        for op, dims in collectives
        if dims[-3:] in ([T, G, K], [T, G // TENSOR, K]) or N in dims or N // DATA in dims
    ]
    assert page_like == []


def test_slots_must_split_over_the_replicas():
    model = small_model("xla")
    with pytest.raises(ConfigError, match="slots=6 cannot be split over 4 data-parallel replicas"):
        Server(model, mesh=make_mesh({"data": DATA, "tensor": TENSOR}), rules=rules_for("tp"), **{**SERVER, "slots": 6})
