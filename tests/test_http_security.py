"""The server on a network: an API key checked on every /v1 route (the real `openai` client gets 401
in OpenAI's shape without it, with a wrong one or one of another length), never logged; no open bind
without a key; bodies refused over the limit before they are read whole; connections that send
nothing closed while a client is served; a request past its time limit cancelled, its slot and
pages freed. (slow) The same through `python3 -m inference serve` as a process: the warning of
--allow-unauthenticated, a 64 MiB body's 413 and the process's resident memory, SIGTERM."""

import json
import logging
import resource
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

import openai
import pytest
from conftest import ROOT
from test_http_server import fetch, wait_idle

from meshwork.config import ConfigError
from meshwork.engine.serving import Server
from meshwork.inference.cli import main
from meshwork.inference.http_guard import KEY_ENV, check_bind, is_loopback, resolve_api_key
from meshwork.inference.http_server import Limits, create_app
from meshwork.inference.serve_cli import ThreadedServer, load_served
from meshwork.inference.serve_engine import Engine

KEY = "sk-meshwork-test-0123456789abcdef"
BODY_LIMIT = 64 * 1024


class Secured:
    """lm_tiny behind a key, with a small body limit and a short read timeout."""

    def __init__(self, checkpoint):
        model, self.served = load_served(str(checkpoint))
        self.engine = Engine(Server(model, slots=2, page_size=8, max_len=128), max_queue=8)
        self.limits = Limits(
            max_tokens=100, max_body_bytes=BODY_LIMIT, max_messages=4, request_timeout=120, read_timeout=30
        )
        self.http = ThreadedServer(create_app(self.engine, self.served, self.limits, api_key=KEY), read_timeout=1.0)
        self.url = self.http.__enter__()

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def health(self):
        return fetch(self.url + "/health")[1]

    def address(self) -> tuple[str, int]:
        host, port = urllib.parse.urlsplit(self.url).netloc.split(":")
        return host, int(port)


@pytest.fixture(scope="module")
def secured(lm_tiny_runs):
    s = Secured(lm_tiny_runs["1dev"]["run_dir"])
    s.client().completions.create(model=s.served.name, prompt="def", max_tokens=2)  # compiled before any timing
    yield s
    s.http.__exit__()


def _raw(s: Secured, method: str, path: str, headers: dict | None = None, body: bytes = b"") -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of one request over a plain socket connection."""
    import http.client

    conn = http.client.HTTPConnection(*s.address(), timeout=30)
    conn.request(method, path, body or None, headers or {})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, json.loads(data) if data else {}, dict(r.getheaders())


def test_no_key_a_wrong_key_and_another_length_get_401_in_openais_shape(secured, caplog):
    caplog.set_level(logging.WARNING)
    name = secured.served.name
    for key in ("sk-wrong-key-of-the-same-length-0", "short", KEY + "x"):
        with pytest.raises(openai.AuthenticationError) as e:
            secured.client(key).completions.create(model=name, prompt="def", max_tokens=2)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        assert set(e.value.body) == {"message", "type", "param", "code"}, e.value.body
    with pytest.raises(openai.AuthenticationError):  # the client's header emptied: no key at all
        openai.OpenAI(
            base_url=secured.url + "/v1", api_key="unused", default_headers={"Authorization": ""}, max_retries=0
        ).models.list()
    for method, path in (
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/nothing"),
        ("GET", "/docs"),
    ):
        status, body, headers = _raw(secured, method, path)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", (path, status, body)
        assert headers.get("www-authenticate") == "Bearer"
    status, body, _ = _raw(secured, "GET", "/v1/models", {"Authorization": "Basic " + KEY})  # not a bearer token
    assert status == 401
    assert fetch(secured.url + "/health")[0] == 200  # open to probes
    refusals = [r.getMessage() for r in caplog.records if r.name == "meshwork.serve"]
    assert len(refusals) == 9 and all("401" in m for m in refusals), refusals
    assert not any(KEY in m or "sk-wrong" in m or "short" in m for m in refusals)


def test_the_right_key_serves_completions_chat_and_streams(secured):
    c, name = secured.client(), secured.served.name
    whole = c.completions.create(model=name, prompt="import", max_tokens=6, temperature=0)
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(model=name, prompt="import", max_tokens=6, temperature=0, stream=True)
    )
    assert whole.choices[0].text == streamed and whole.usage.completion_tokens == 6
    chat = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].message.role == "assistant"
    assert [m.id for m in c.models.list().data] == [name]
    status, body, _ = _raw(secured, "GET", "/v1/nothing", {"Authorization": f"Bearer {KEY}"})
    assert status == 404 and body["error"]["code"] == "not_found"  # past the key, the app's own answers


def test_more_messages_than_the_servers_limit_get_400(secured):
    messages = [{"role": "user", "content": "hi"}] * 5  # the fixture's --max-messages is 4
    with pytest.raises(openai.BadRequestError) as e:
        secured.client().chat.completions.create(model=secured.served.name, messages=messages, max_tokens=2)
    assert e.value.body["param"] == "messages" and "at most 4" in e.value.body["message"], e.value.body
    ok = secured.client().chat.completions.create(model=secured.served.name, messages=messages[:4], max_tokens=2)
    assert ok.choices[0].message.role == "assistant"


def test_key_sources_and_open_binds(tmp_path):
    path = tmp_path / "key"
    path.write_text(KEY + "\n")
    assert resolve_api_key(None, str(path), {}) == KEY
    assert resolve_api_key(KEY, None, {KEY_ENV: KEY}) == KEY
    assert resolve_api_key(None, None, {}) is None
    for flag, file, env, word in (
        ("a", None, {KEY_ENV: "b"}, "different"),
        ("", None, {}, "empty"),
        (None, str(tmp_path / "missing"), {}, "cannot read"),
    ):
        with pytest.raises(ConfigError, match=word):
            resolve_api_key(flag, file, env)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::")
    assert check_bind("0.0.0.0", KEY, False) is None and check_bind("127.0.0.1", None, False) is None
    assert "without an API key" in check_bind("0.0.0.0", None, True)


@pytest.mark.parametrize(
    "flags, word",
    [
        (["--host", "0.0.0.0"], "no API key is set"),
        (["--host", "::"], "no API key is set"),
        (["--api-key", ""], "empty"),
        (["--max-body-bytes", "0"], "--max-body-bytes"),
        (["--max-messages", "0"], "--max-messages"),
        (["--request-timeout", "nan"], "--request-timeout"),
        (["--read-timeout", "-1"], "--read-timeout"),
    ],
)
def test_refused_serve_flags_exit_2_with_one_line(lm_tiny_runs, capsys, flags, word):
    code = main(["serve", "--checkpoint", str(lm_tiny_runs["1dev"]["run_dir"]), "--port", "0", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and word in err[0], err


def _send_body(address: tuple[str, int], total: int, chunked: bool) -> tuple[int, dict]:
    """POSTs a `total`-byte body to the server at `address`, 1 MiB at a time (the same buffer: the
    client holds one), reading the answer whenever it comes; (status, JSON body)."""
    sock = socket.create_connection(address, timeout=30)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\n{framing}\r\n\r\n".encode()
    )
    piece = b"[" * 2**20
    try:
        for _ in range(total // len(piece)):
            sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n" if chunked else piece)
    except OSError:  # the server answered and closed before the last byte: what it should do
        pass
    head, _, rest = sock.recv(65536).partition(b"\r\n\r\n")
    sock.close()
    status = int(head.split()[1])
    body = rest.split(b"\r\n", 1)[1] if chunked and rest[:1] != b"{" else rest
    return status, json.loads(body[: body.rfind(b"}") + 1])


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_gets_413_before_it_is_read(secured, chunked):
    status, body = _send_body(secured.address(), 64 * 2**20, chunked)
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    assert f"{BODY_LIMIT:,} bytes" in body["error"]["message"]
    assert secured.health()["status"] == "ok"


def test_idle_connections_are_closed_while_a_client_is_served(secured):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    idle = [socket.create_connection(secured.address(), timeout=10) for _ in range(1000)]
    trickle = socket.create_connection(secured.address(), timeout=10)
    trickle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
    start = time.monotonic()
    served = secured.client().completions.create(model=secured.served.name, prompt="def", max_tokens=2)
    assert len(served.choices[0].text) > 0
    closed = 0
    for sock in [*idle, trickle]:
        sock.settimeout(max(0.1, 10 - (time.monotonic() - start)))
        try:
            closed += sock.recv(1) == b""
        except OSError:
            pass
        sock.close()
    assert closed == 1001, f"{closed} of 1001 idle connections closed by the 1 s read timeout"


def test_a_request_past_its_time_limit_is_cancelled_and_its_pages_freed(secured):
    server, step = secured.engine.server, secured.engine.server.step
    slow = lambda *a, **kw: (time.sleep(0.3), step(*a, **kw))[1]  # noqa: E731
    server.step, secured.limits.request_timeout = slow, 1.0
    c, name = secured.client(), secured.served.name
    try:
        errors = []

        def whole():  # two run (the server's two slots); the third waits in the queue and times out there
            try:
                c.completions.create(model=name, prompt="import", max_tokens=100, extra_body={"ignore_eos": True})
            except openai.APIStatusError as e:
                errors.append((e.status_code, e.code, e.response.headers.get("x-should-retry")))

        threads = [threading.Thread(target=whole) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stream = c.completions.create(
            model=name, prompt="import", max_tokens=100, stream=True, extra_body={"ignore_eos": True}
        )
        with pytest.raises(openai.APIError, match="request-timeout"):
            for _ in stream:
                pass
    finally:
        del server.step  # the class's method again
        secured.limits.request_timeout = 120
    assert errors == [(504, "request_timeout", "false")] * 3, errors
    health = wait_idle(secured)
    assert health["pages_free"] + health["pages_cached"] == health["pages_total"], health


@pytest.mark.slow
def test_an_exposed_server_process_warns_refuses_a_large_body_in_bounded_memory_and_stops(lm_tiny_runs):
    """`python3 -m inference serve --host 0.0.0.0 --allow-unauthenticated` as its own process: the
    warning, a 64 MiB body (declared and chunked) refused with 413 while the process's resident
    memory grows by less than twice the default limit (4 MiB), and SIGTERM's exit 0."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "inference", "serve", "--checkpoint", str(lm_tiny_runs["1dev"]["run_dir"])]
        + ["--host", "0.0.0.0", "--port", "0", "--allow-unauthenticated"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = proc.stdout.readline()
        port = int(first.split("/v1")[0].rsplit(":", 1)[1])

        def rss(field: str) -> int:
            line = next(ln for ln in open(f"/proc/{proc.pid}/status") if ln.startswith(field))
            return int(line.split()[1]) * 1024

        assert fetch(f"http://127.0.0.1:{port}/health")[0] == 200  # the handlers' first use done before measuring
        before = rss("VmRSS")
        with open(f"/proc/{proc.pid}/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) restarts from here, not from the model's loading
        for chunked in (False, True):
            status, body = _send_body(("127.0.0.1", port), 64 * 2**20, chunked)
            assert status == 413 and body["error"]["code"] == "request_too_large"
        grown = rss("VmHWM") - before
        print(
            f"resident memory: {before / 2**20:.1f} MiB before, peak +{grown / 2**20:.2f} MiB after two 64 MiB bodies"
        )
        assert grown < 2 * 4 * 2**20
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    assert err.splitlines()[0].startswith("warning: serving 0.0.0.0 without an API key"), err
    assert proc.returncode == 0, err
