"""Log-probabilities and n choices: the engine's per-token log-probabilities equal a trainer-side
forward pass over the same tokens (float32, 1e-5), for greedy and sampled requests with prefix
caching and chunked prefill on, without changing a sampled token; top_logprobs are the k largest of
the full log-softmax; through the real `openai` client, completions' and chat's logprobs (streamed or
not) parse into its typed objects and equal the engine's; `n` choices share the prompt's pages
(prefix caching) and bad values get a 400 naming the field. One HTTP server for the file."""

import http.client
import json
import threading
import time
import urllib.parse
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob
from openai.types.completion_choice import Logprobs

from meshwork.engine.sampling import SamplingParams
from meshwork.engine.serving import Request, Server
from meshwork.inference.http_server import Limits, create_app
from meshwork.inference.serve_cli import ThreadedServer, load_served
from meshwork.inference.serve_engine import Engine

TEXT = (
    "import os\nimport sys\n\ndef main(argv):\n    for arg in argv:\n        print(arg)\n    return 0\n\n"
    "class Parser:\n    def __init__(self, text):\n        self.text = text\n"
)
SERVER = dict(slots=4, page_size=8, max_len=64)
TOL = 1e-5


@pytest.fixture(scope="module")
def s(lm_tiny_runs):
    model, served = load_served(str(lm_tiny_runs["1dev"]["run_dir"]))
    engine = Engine(Server(model, prefix_caching=True, **SERVER), max_queue=16)
    server = ThreadedServer(create_app(engine, served, Limits(max_tokens=32)))
    url = server.__enter__()
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    forward = jax.jit(lambda tokens_1L: jax.nn.log_softmax(model.apply(tokens_1L)[0].astype(jnp.float32), axis=-1))
    yield SimpleNamespace(model=model, served=served, engine=engine, url=url, client=client, forward=forward)
    server.__exit__()


def trainer_logprobs(s, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """(len(tokens), V) log_softmax rows predicting each generated token: one forward pass of the model
    over prompt + tokens, as the trainer's next-token objective computes them."""
    seq = list(prompt) + list(tokens)
    padded = np.zeros((1, 64), np.int32)  # one shape: one compile
    padded[0, : len(seq)] = seq
    logp_LV = np.asarray(s.forward(jnp.asarray(padded)))[0]
    return logp_LV[len(prompt) - 1 : len(seq) - 1]


def picked(rows_TV: np.ndarray, tokens: list[int]) -> np.ndarray:
    return rows_TV[np.arange(len(tokens)), tokens]


def engine_result(s, prompt: list[int], params: SamplingParams):
    """The Result of one request run by the HTTP server's own engine (its thread, its compiled programs)."""
    done, out = threading.Event(), {}

    def sink(kind, x):
        if kind == "done":
            out["result"] = x
            done.set()

    s.engine.submit(Request(f"direct-{time.monotonic_ns()}", prompt, params), sink)
    assert done.wait(60)
    return out["result"]


def test_engine_logprobs_equal_the_trainers_and_leave_sampled_tokens_unchanged(s):
    # Every slot every step: a row's numbers then do not depend on how many requests run (one alone
    # takes XLA's matrix-vector path, serving.py `_batch_rows`), so the two runs can agree bit for bit.
    server = Server(s.model, prefix_caching=True, prefill_chunk=8, fixed_batch=True, **SERVER)
    ids = s.served.encode(TEXT)
    prompts = [ids[:21], ids[:21] + ids[30:34], ids[5:17]]  # the second shares the first's full pages

    def requests(tag, logprobs):
        return [
            Request(f"{tag}greedy", prompts[0], SamplingParams(temperature=0.0, max_new_tokens=12)),
            Request(f"{tag}sampled", prompts[1], SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_new_tokens=12)),
            Request(
                f"{tag}top", prompts[2], SamplingParams(temperature=0.8, seed=7, max_new_tokens=12, logprobs=logprobs)
            ),
        ]

    plain = server.run(requests("a-", 0))
    asked = server.run(requests("b-", 5))
    assert server.cached_tokens > 0  # the second run found the first's pages
    worst = 0.0
    for name, prompt in zip(("greedy", "sampled", "top"), prompts):
        a, b = plain[f"a-{name}"], asked[f"b-{name}"]
        assert a.tokens == b.tokens and len(a.tokens) == len(a.logprobs)  # logprobs change no sampled token
        rows = trainer_logprobs(s, prompt, b.tokens)
        worst = max(worst, float(np.abs(np.asarray(b.logprobs) - picked(rows, b.tokens)).max()))
        assert a.logprobs == b.logprobs
    top = asked["b-top"]
    assert plain["a-top"].top_logprobs == [] and len(top.top_logprobs) == len(top.tokens)
    rows = trainer_logprobs(s, prompts[2], top.tokens)
    for row, alternatives, token, logprob in zip(rows, top.top_logprobs, top.tokens, top.logprobs):
        ids_K, values_K = [t for t, _ in alternatives], np.array([v for _, v in alternatives])
        assert ids_K == list(np.argsort(-row, stable=True)[:5])  # the 5 largest of the full log-softmax
        assert np.all(np.diff(values_K) <= 0) and np.abs(values_K - row[ids_K]).max() < TOL
        if token in ids_K:
            assert abs(values_K[ids_K.index(token)] - logprob) < 1e-6
    print(f"max |engine - trainer| log-probability: {worst:.2e}")
    assert worst < TOL


def test_completions_logprobs_streamed_or_not_equal_the_engines(s):
    prompt = s.served.encode("def main(argv):\n")
    ref = engine_result(s, prompt, SamplingParams(temperature=0.0, max_new_tokens=8, stop_tokens=tuple(s.served.stops)))
    r = s.client.completions.create(
        model=s.served.name, prompt="def main(argv):\n", max_tokens=8, temperature=0, logprobs=3
    )
    choice = r.choices[0]
    lp = choice.logprobs
    assert isinstance(lp, Logprobs) and choice.model_extra["token_ids"] == ref.tokens
    assert np.abs(np.array(lp.token_logprobs) - ref.logprobs).max() < TOL
    assert lp.tokens == [s.served.token_text(t) for t in ref.tokens]
    assert all(
        len(top) <= 4 and top[tok] == logprob
        for top, tok, logprob in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs)
    )
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in s.client.completions.create(
        model=s.served.name, prompt="def main(argv):\n", max_tokens=8, temperature=0, logprobs=3, stream=True
    ):
        if chunk.choices[0].logprobs is not None:
            for key in streamed:
                streamed[key] += getattr(chunk.choices[0].logprobs, key)
    assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
    assert np.abs(np.array(streamed["token_logprobs"]) - lp.token_logprobs).max() < TOL
    # Without logprobs, none are returned.
    assert s.client.completions.create(model=s.served.name, prompt="a", max_tokens=2).choices[0].logprobs is None


def test_chat_logprobs_streamed_or_not_equal_the_engines(s):
    messages = [{"role": "user", "content": "def main("}]
    r = s.client.chat.completions.create(
        model=s.served.name, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    tokens = r.choices[0].model_extra["token_ids"]
    prompt = s.served.encode(s.served.render_chat(messages)[0])
    ref = engine_result(s, prompt, SamplingParams(temperature=0.0, max_new_tokens=8, stop_tokens=tuple(s.served.stops)))
    assert tokens == ref.tokens and all(isinstance(c, ChatCompletionTokenLogprob) for c in content)
    assert np.abs(np.array([c.logprob for c in content]) - ref.logprobs).max() < TOL
    rows = trainer_logprobs(s, prompt, tokens)
    for c, row in zip(content, rows):
        assert len(c.top_logprobs) == 2 and bytes(c.bytes).decode() == c.token
        assert [t.token for t in c.top_logprobs] == [
            s.served.token_text(int(i)) for i in np.argsort(-row, stable=True)[:2]
        ]
    streamed = []
    for chunk in s.client.chat.completions.create(
        model=s.served.name, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2, stream=True
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    # The same tokens and alternatives; the values within float32 noise (the second run reads the first's
    # pages from the prefix cache, so its prefill is computed in other shapes).
    assert [(c.token, [t.token for t in c.top_logprobs]) for c in streamed] == [
        (c.token, [t.token for t in c.top_logprobs]) for c in content
    ]
    assert np.abs(np.array([c.logprob for c in streamed]) - [c.logprob for c in content]).max() < TOL


def test_n_choices_differ_when_sampled_agree_when_greedy_and_share_the_prompts_pages(s):
    c, name = s.client, s.served.name
    r = c.completions.create(model=name, prompt="def ", max_tokens=8, temperature=1.0, seed=3, n=3, logprobs=0)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    ids = [ch.model_extra["token_ids"] for ch in r.choices]
    assert len({tuple(i) for i in ids}) > 1
    assert r.usage.prompt_tokens == len(s.served.encode("def ")) and r.usage.completion_tokens == sum(map(len, ids))
    # Choice i samples with seed + i: choice 1 of seed 3 is choice 0 of seed 4.
    again = c.completions.create(model=name, prompt="def ", max_tokens=8, temperature=1.0, seed=4)
    assert again.choices[0].model_extra["token_ids"] == ids[1]
    greedy = c.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "x"}], max_tokens=6, temperature=0, n=3
    )
    assert [ch.index for ch in greedy.choices] == [0, 1, 2]
    assert len({ch.message.content for ch in greedy.choices}) == 1
    streamed = {}
    for chunk in c.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "x"}], max_tokens=6, temperature=0, n=2, stream=True
    ):
        for ch in chunk.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + (ch.delta.content or "")
    assert streamed == {0: greedy.choices[0].message.content, 1: greedy.choices[0].message.content}
    # Pages: 40-token prompts (5 pages of 8), 4 new tokens: n=4 shares the 4 full prompt pages.
    ids = s.served.encode(TEXT)
    server = s.engine.server
    peaks = []
    for prompt, n in ((ids[:40], 1), (ids[40:80], 4)):
        wait_idle(s)
        server.peak_pages = 0
        c.completions.create(model=name, prompt=prompt, max_tokens=4, temperature=0, n=n)
        peaks.append(server.peak_pages)
    print(f"pages in use: n=1 {peaks[0]}, n=4 {peaks[1]} (4 separate prompts: {4 * peaks[0]})")
    assert peaks[1] < 4 * peaks[0]


def wait_idle(s, timeout: float = 30.0) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        health = s.engine.stats()
        if health["slots_live"] == health["pages_held"] == health["queued"] == 0:
            return health
        time.sleep(0.05)
    raise AssertionError(f"the pool never emptied: {health}")


def test_a_client_that_leaves_cancels_all_n_choices(s):
    before = wait_idle(s)
    host, port = urllib.parse.urlsplit(s.url).netloc.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"prompt": "import", "max_tokens": 32, "temperature": 0, "stream": True, "n": 3, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    data = 0
    while data < 6:
        data += response.readline().startswith(b"data: ")
    conn.sock.shutdown(2)
    conn.close()
    after = wait_idle(s)
    assert after["cancelled"] == before["cancelled"] + 3 and after["completed"] == before["completed"]


@pytest.mark.parametrize(
    "chat, fields, param",
    [
        (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (True, {"top_logprobs": 2}, "top_logprobs"),
        (False, {"logprobs": 6}, "logprobs"),
        (False, {"n": 0}, "n"),
        (False, {"n": SERVER["slots"] + 1}, "n"),
        (True, {"n": SERVER["slots"] + 1}, "n"),
    ],
)
def test_bad_logprobs_and_n_get_400_naming_the_field(s, chat, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        if chat:
            s.client.chat.completions.create(
                model=s.served.name, messages=[{"role": "user", "content": "a"}], max_tokens=2, **fields
            )
        else:
            s.client.completions.create(model=s.served.name, prompt="a", max_tokens=2, **fields)
    error = refused.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert error["type"] == "invalid_request_error" and "\n" not in error["message"]
