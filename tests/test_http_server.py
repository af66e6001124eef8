"""The OpenAI-compatible HTTP server, through the official `openai` client over real HTTP (uvicorn on
127.0.0.1): 32 concurrent greedy requests each get their solo tokens, streamed or not, while 10 bad
ones get 4xx errors in OpenAI's shape; chat goes through the checkpoint's template (or the plain
fallback); a client that leaves frees its slot and pages; bad command lines exit 2; SIGTERM lets a
running stream finish and exits 0."""

import argparse
import concurrent.futures
import http.client
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from conftest import ROOT, hf_folder
from flax import nnx

from meshwork.config import ConfigError, load_config
from meshwork.engine.generate import Generator
from meshwork.engine.kv_cache import cache_bytes_per_token
from meshwork.engine.sampling import SamplingParams
from meshwork.engine.serving import Request, Server
from meshwork.inference.cli import main
from meshwork.inference.http_server import Limits, create_app
from meshwork.inference.runs import load_run
from meshwork.inference.serve_cli import ThreadedServer, default_pages, load_served, sharable
from meshwork.inference.serve_engine import Engine, QueueFull
from meshwork.models.build import build_model

MAX_TOKENS = {"lm_tiny": 100, "hf_llama": 48}  # the servers' --max-tokens
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def fetch(url: str, body: bytes | dict | None = None, timeout: float = 30) -> tuple[int, dict]:
    """(status, JSON body) of a GET, or of a POST when `body` is given (a dict is sent as JSON)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class Served:
    def __init__(self, name, checkpoint, *, max_len: int, page_size: int, slots: int = 8):
        self.model, self.served = load_served(str(checkpoint))
        self.max_tokens, self.max_len = MAX_TOKENS[name], max_len
        self.engine = Engine(Server(self.model, slots=slots, page_size=page_size, max_len=max_len), max_queue=64)
        self.http = ThreadedServer(create_app(self.engine, self.served, Limits(max_tokens=self.max_tokens)))
        self.url = self.http.__enter__()
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        self.gen = Generator(self.model)

    def solo(self, ids, max_tokens):
        """The tokens a greedy run of this prompt alone gives (the reference)."""
        params = SamplingParams(temperature=0.0, max_new_tokens=max_tokens, stop_tokens=tuple(self.served.stops))
        return self.gen.generate([ids], params, self.max_len)[0]  # one cache length: fewer compiles

    def text(self, tokens):
        return self.served.decode([t for t in tokens if t not in self.served.stops])

    def health(self):
        return fetch(self.url + "/health")[1]


@pytest.fixture(scope="module")
def servers(lm_tiny_runs, tmp_path_factory):
    run_dir = lm_tiny_runs["1dev"]["run_dir"]  # trained here, in the fixture's setup, not in a test's call
    made = {}

    def get(name):
        if name not in made:
            if name == "lm_tiny":
                made[name] = Served(name, run_dir, max_len=128, page_size=8)
            else:
                made[name] = Served(
                    name, hf_folder(tmp_path_factory.mktemp("hf") / "llama", TEMPLATE), max_len=64, page_size=4
                )
        return made[name]

    yield get
    for s in made.values():
        s.http.__exit__()


TEXT = (
    "import os\nimport sys\n\ndef main(argv):\n    for arg in argv:\n        print(arg)\n    return 0\n\n"
    "class Parser:\n    def __init__(self, text):\n        self.text = text\n"
)
WORDS = "the cat sat on a mat and the dog ran to the old tree by a river "


def bad_requests(s: Served, chat_model: str):
    """Ten requests the server must refuse with a 4xx, each as a thunk."""
    c, too_long = s.client, "x" * 200
    return [
        lambda: c.completions.create(model=chat_model, prompt="a", max_tokens=s.max_tokens + 1),
        lambda: c.completions.create(model="not-this-one", prompt="a", max_tokens=4),
        lambda: c.completions.create(model=chat_model, prompt="a", max_tokens=4, n=0),
        lambda: c.completions.create(model=chat_model, prompt=[], max_tokens=4),
        lambda: c.completions.create(model=chat_model, prompt=too_long, max_tokens=4),
        lambda: c.completions.create(model=chat_model, prompt="a", max_tokens=4, temperature=-1),
        lambda: c.completions.create(model=chat_model, prompt=[5, 100000], max_tokens=4),
        lambda: c.completions.create(model=chat_model, prompt="a", max_tokens=4, stop=["a", "b", "c", "d", "e"]),
        lambda: c.chat.completions.create(model=chat_model, messages=[], max_tokens=4),
        lambda: fetch(s.url + "/v1/completions", b"{not json"),
    ]


@pytest.mark.parametrize("name", [pytest.param("lm_tiny", marks=pytest.mark.slow), "hf_llama"])
def test_concurrent_requests_get_their_solo_tokens_and_bad_ones_4xx(servers, name):
    s = servers(name)
    model_id = s.client.models.list().data[0].id
    assert model_id == s.served.name
    corpus = TEXT if name == "lm_tiny" else WORDS * 3
    limit = 30 if name == "lm_tiny" else 20  # prompt characters (two prompt buckets: fewer compiles)
    jobs = []
    for i in range(32):
        start, length = (7 * i) % 40, 1 + (11 * i) % limit
        prompt, max_tokens, stream = (
            corpus[start : start + length],
            1 + (5 * i) % (24 if name == "lm_tiny" else 12),
            i % 2,
        )
        jobs.append((prompt, max_tokens, bool(stream)))

    def good(prompt, max_tokens, stream):
        if not stream:
            r = s.client.completions.create(model=model_id, prompt=prompt, max_tokens=max_tokens, temperature=0)
            return r.choices[0].model_extra["token_ids"], r.choices[0].text, r.choices[0].finish_reason
        ids, text, finish = [], "", None
        for chunk in s.client.completions.create(
            model=model_id, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
        ):
            ids += chunk.choices[0].model_extra["token_ids"]
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return ids, text, finish

    def bad(thunk):
        try:
            r = thunk()
        except openai.APIStatusError as e:
            return e.status_code, e.response.json()
        return r  # fetch's (status, body)

    with concurrent.futures.ThreadPoolExecutor(42) as pool:
        bads = bad_requests(s, model_id)
        futures = (
            [pool.submit(good, *job) for job in jobs[:16]]
            + [pool.submit(bad, b) for b in bads]
            + [pool.submit(good, *job) for job in jobs[16:]]
        )
        results = [f.result() for f in futures]
    goods, errors = results[:16] + results[26:], results[16:26]
    for (prompt, max_tokens, _), (ids, text, finish) in zip(jobs, goods):
        alone = s.solo(s.served.encode(prompt), max_tokens)
        assert ids == alone, prompt
        assert text == s.text(alone)
        assert finish == ("stop" if alone[-1] in s.served.stops else "length")
    for status, body in errors:
        assert 400 <= status < 500 and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["message"]
    assert [status for status, _ in errors] == [400, 404, 400, 400, 400, 400, 400, 400, 400, 400]
    health = s.health()
    assert health["slots_live"] == health["pages_held"] == health["queued"] == 0, health


def test_chat_uses_the_checkpoints_template(servers):
    import jinja2.sandbox

    s = servers("hf_llama")
    messages = [{"role": "system", "content": "the dog"}, {"role": "user", "content": "a cat sat"}]
    rendered = (
        jinja2.sandbox.ImmutableSandboxedEnvironment()
        .from_string(TEMPLATE)
        .render(messages=messages, add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    )
    ids = s.served.tokenizer.tok.encode(rendered, add_special_tokens=False).ids
    alone = s.solo(ids, 10)
    whole = s.client.chat.completions.create(model=s.served.name, messages=messages, max_tokens=10, temperature=0)
    assert whole.choices[0].model_extra["token_ids"] == alone
    assert whole.choices[0].message.content == s.text(alone) and whole.usage.prompt_tokens == len(ids)
    chunks = list(
        s.client.chat.completions.create(
            model=s.served.name,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == s.text(alone)
    assert chunks[-1].usage.completion_tokens == len(alone)


def test_chat_without_a_template_uses_the_plain_fallback(servers):
    s = servers("lm_tiny")
    ids = list(s.served.encode("user: def main(\nassistant:"))
    r = s.client.chat.completions.create(
        model=s.served.name, messages=[{"role": "user", "content": "def main("}], max_tokens=8, temperature=0
    )
    assert r.choices[0].model_extra["token_ids"] == s.solo(ids, 8)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_end_the_text_before_them_and_free_the_slot(servers, stream):
    """A stop string taken from the middle of a solo run's text: the reply is that text up to it
    (streamed chunks too, never a piece of the stop string), finish "stop", and the request is
    cancelled there, so its slot and pages come back."""
    s = servers("lm_tiny")
    prompt = "def main(argv):\n    "
    alone = s.text(s.solo(s.served.encode(prompt), 40))
    stop = alone[12:15]
    assert len(stop) == 3
    cut = alone[: alone.find(stop)]
    kw = dict(model=s.served.name, prompt=prompt, max_tokens=40, temperature=0, stop=["never there", stop])
    if stream:
        chunks = list(s.client.completions.create(**kw, stream=True))
        text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        r = s.client.completions.create(**kw)
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    assert (text, finish) == (cut, "stop")
    wait_idle(s)


def wait_idle(s: Served, timeout: float = 30.0) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        health = s.health()
        if health["slots_live"] == health["pages_held"] == health["queued"] == 0:
            return health
        time.sleep(0.05)
    raise AssertionError(f"the pool never emptied: {health}")


def test_a_client_that_disconnects_frees_its_slot_and_pages(servers):
    s = servers("lm_tiny")
    before = wait_idle(s)
    # Streaming: read three tokens of a 100-token request, then hang up.
    host, port = urllib.parse.urlsplit(s.url).netloc.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({"prompt": "import", "max_tokens": s.max_tokens, "temperature": 0, "stream": True}),
        {"Content-Type": "application/json"},
    )
    response = conn.getresponse()
    assert response.status == 200
    data = 0
    while data < 3:
        data += response.readline().startswith(b"data: ")
    assert s.health()["slots_live"] == 1
    conn.sock.shutdown(2)  # hang up (close() alone would leave the socket to the response object)
    conn.close()
    after = wait_idle(s)
    assert after["cancelled"] == before["cancelled"] + 1 and after["completed"] == before["completed"]
    assert after["pages_free"] + after["pages_cached"] == after["pages_total"]
    # Not streaming: the client hangs up while its request is queued or running (or, rarely, just
    # done: either way it leaves nothing behind).
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({"prompt": "x" * 20, "max_tokens": s.max_tokens, "temperature": 0}),
        {"Content-Type": "application/json"},
    )
    time.sleep(0.02)
    conn.sock.shutdown(2)
    conn.close()
    last = wait_idle(s)
    assert last["cancelled"] + last["completed"] == after["cancelled"] + after["completed"] + 1
    assert last["pages_free"] + last["pages_cached"] == last["pages_total"]


def test_the_queue_limit_refuses_what_does_not_fit(servers):
    s = servers("lm_tiny")
    engine = Engine(s.engine.server, max_queue=2)  # never started: requests stay queued
    engine.submit(Request("a", [1]), lambda *_: None)
    engine.submit(Request("b", [1]), lambda *_: None)
    with pytest.raises(QueueFull, match="--max-queue"):
        engine.submit(Request("c", [1]), lambda *_: None)


def test_unknown_routes_and_models_answer_in_openais_error_shape(servers):
    s = servers("lm_tiny")
    status, body = fetch(s.url + "/v1/nothing")
    assert status == 404 and body["error"]["code"] == "not_found"
    status, body = fetch(s.url + "/v1/completions", {"model": "gpt-4", "prompt": "a"})
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    assert s.health()["status"] == "ok"


def test_bad_fields_get_400_in_openais_shape_naming_the_field(servers):
    """The pydantic bodies (types, OpenAI fields not implemented) and the engine's one validator
    (vocabulary, cache length, --max-tokens, sampling values): each a 400 whose `param` names the field."""
    s = servers("lm_tiny")
    chat = [{"role": "user", "content": "a"}]
    for path, body, param in [
        ("/v1/completions", {"prompt": "a", "max_tokens": 4.5}, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "a", "stream_options": 5}, "stream_options"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 4, "top_p": 1.5}, "top_p"),
        ("/v1/completions", {"prompt": [5, 100000], "max_tokens": 4}, "prompt"),
        ("/v1/completions", {"prompt": "a", "max_tokens": s.max_tokens + 1}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 200}]}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": chat, "max_completion_tokens": s.max_tokens + 1},
            "max_completion_tokens",
        ),
    ]:
        status, reply = fetch(s.url + path, body)
        assert status == 400 and reply["error"]["param"] == param, (body, reply)
        assert reply["error"]["type"] == "invalid_request_error" and "\n" not in reply["error"]["message"]
        assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert s.health()["queued"] == 0


def test_bad_command_lines_exit_2_with_one_line(tmp_path, lm_tiny_runs, capsys):
    def serve(*argv):
        code = main(["serve", *argv])
        return code, capsys.readouterr().err.strip().splitlines()

    run_dir = str(lm_tiny_runs["1dev"]["run_dir"])
    code, err = serve("--checkpoint", str(tmp_path), "--port", "0")
    assert code == 2 and len(err) == 1 and "neither config.yaml" in err[0]
    code, err = serve("--checkpoint", run_dir, "--port", "70000")
    assert code == 2 and len(err) == 1 and "--port 70000" in err[0]
    code, err = serve("--checkpoint", run_dir, "--slots", "0")
    assert code == 2 and len(err) == 1 and "--slots 0" in err[0]
    code, err = serve("--checkpoint", run_dir, "--data", "3")  # 8 devices here
    assert code == 2 and len(err) == 1 and "--data 3 x --tensor 1 = 3 devices" in err[0]
    code, err = serve("--checkpoint", run_dir, "--data", "4", "--tensor", "2", "--slots", "6")
    assert code == 2 and len(err) == 1 and "give a multiple of 4" in err[0]
    code, err = serve("--checkpoint", run_dir, "--prefill-chunk", "-1")
    assert code == 2 and len(err) == 1 and "--prefill-chunk -1" in err[0]
    code, err = serve("--checkpoint", run_dir, "--kv-cache-gib", "0")
    assert code == 2 and len(err) == 1 and "--kv-cache-gib 0.0" in err[0]
    code, err = serve("--checkpoint", run_dir, "--port", "0", "--kv-cache-gib", "0.0001")  # 3 pages of lm_tiny's
    assert code == 2 and len(err) == 1 and "fewer than one --max-len 512 sequence" in err[0]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, err = serve("--checkpoint", run_dir, "--port", str(taken.getsockname()[1]))
    assert code == 2 and len(err) == 1 and "cannot listen there" in err[0]


def test_the_kv_pool_is_sized_from_memory(lm_tiny_runs):
    """Without --pages, every slot gets --max-len of pages unless --kv-cache-gib (per device) holds
    fewer; under --data the pages are counted per replica and under --tensor a device holds part of
    each page's heads."""
    model = load_run(lm_tiny_runs["1dev"]["run_dir"])[1]
    page = 16 * cache_bytes_per_token(model.cfg, model.dtype)

    def pages(gib=None, **kw):
        args = dict(slots=4, max_len=64, page_size=16, data=1, tensor=1, kv_cache_gib=gib) | kw
        return default_pages(argparse.Namespace(**args), model)

    assert pages() == 4 * 4 + 1  # every slot at max_len, and the null page
    assert pages(10.5 * page / 2**30) == 10  # what the budget holds
    assert pages(10.5 * page / 2**30, data=2, slots=8) == 20  # per replica
    assert pages(10.5 * page / 2**30, tensor=2) == 17  # half of each page per device: 21 fit
    with pytest.raises(ConfigError, match="fewer than one --max-len 64 sequence"):
        pages(4.5 * page / 2**30)


def test_prefix_caching_is_on_by_default_where_pages_can_be_shared(lm_tiny_runs):
    """`serve` shares prefix pages unless the model keeps per-sequence recurrent states (linear
    attention layers) or a draft speculates (Server refuses both with prefix caching)."""
    model = load_run(lm_tiny_runs["1dev"]["run_dir"])[1]
    hybrid = build_model(load_config(ROOT / "configs/qwen3_next_tiny.yaml"))
    assert sharable(model, None) and not sharable(model, object()) and not sharable(hybrid, None)
    with pytest.raises(ConfigError, match="linear-attention"):
        Server(hybrid, slots=2, max_len=32, prefix_caching=True)


def test_serving_in_bfloat16_holds_bfloat16_and_predicts_as_float32(lm_tiny_runs, tmp_path):
    """`serve --dtype bfloat16`: a run's weights (cast from its float32 checkpoint) and a Hugging Face
    folder's are bfloat16, so is the page pool; on held-out text the run's next-token loss is within
    0.5% of float32's and its top-1 predictions agree on at least 97% of positions (measured: +0.00%,
    99.32% on other text, benchmarks/RESULTS.md)."""
    run_dir = str(lm_tiny_runs["1dev"]["run_dir"])
    text = np.frombuffer((ROOT / "README.md").read_bytes()[: 4 * 129], np.uint8).reshape(4, 129).astype(np.int32)
    losses, top1 = {}, {}
    for dtype in ("float32", "bfloat16"):
        model = load_served(run_dir, dtype=None if dtype == "float32" else dtype)[0]
        assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype(dtype)}
        assert Server(model, slots=2, max_len=64).k.dtype == jnp.dtype(dtype)
        gen = Generator(model)
        logits, _ = gen.forward(text[:, :-1], np.broadcast_to(np.arange(128), (4, 128)), gen.new_cache(4, 128))
        log_p = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), -1))
        losses[dtype] = -np.take_along_axis(log_p, text[:, 1:, None], -1).mean()
        top1[dtype] = log_p.argmax(-1)
    assert abs(losses["bfloat16"] / losses["float32"] - 1) < 0.005
    assert (top1["bfloat16"] == top1["float32"]).mean() >= 0.97
    hf = load_served(str(hf_folder(tmp_path / "llama", "")), dtype="bfloat16")[0]
    assert {x.dtype for x in jax.tree.leaves(nnx.state(hf, nnx.Param))} == {jnp.dtype("bfloat16")}


@pytest.mark.slow
def test_sigterm_lets_a_running_stream_finish_and_exits_0(lm_tiny_runs):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inference",
            "serve",
            "--checkpoint",
            str(lm_tiny_runs["1dev"]["run_dir"]),
            "--port",
            "0",
            "--max-len",
            "128",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = proc.stdout.readline().split(" on ")[1].split()[0]
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(
            model=client.models.list().data[0].id, prompt="def ", max_tokens=100, temperature=0, stream=True
        )
        first = next(iter(stream))
        proc.send_signal(signal.SIGTERM)
        rest = list(stream)
        assert rest[-1].choices[0].finish_reason == "length"
        assert (
            len(first.choices[0].model_extra["token_ids"])
            + sum(len(c.choices[0].model_extra["token_ids"]) for c in rest)
            == 100
        )
        assert proc.wait(60) == 0
    finally:
        proc.kill()
