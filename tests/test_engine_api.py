"""The engine API: the server and the HTTP layer reach the model only through
Generator's public methods; prefill + decode steps give `forward`'s logits and `generate`'s tokens;
one validator refuses each bad request with a RequestError naming the OpenAI field, in Generator,
Server and the HTTP layer alike; the HTTP bodies' pydantic models refuse a bad field the same way;
a request's slot and pages come back on release and cancel."""

import ast
import re

import jax
import numpy as np
import pytest
from conftest import ROOT

from meshwork.config import load_config
from meshwork.engine.generate import Generator
from meshwork.engine.sampling import SamplingArrays, SamplingParams, log_probs
from meshwork.engine.serving import Request, Server
from meshwork.engine.validation import RequestError, RequestLimits, check_request
from meshwork.inference.http_bodies import ChatCompletionRequest, CompletionRequest, parse_body
from meshwork.models.build import build_model

# Page size 8, a cache of 48 positions and 4 pages (3 to hand out): a 30-token request fits the
# cache but not the pool.
SERVER = dict(slots=2, page_size=8, max_len=48, n_pages=4)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4)


@pytest.fixture(scope="module")
def model():
    """An untrained two-layer model: the claims here are about plumbing, not text."""
    cfg = load_config(
        ROOT / "configs/lm_tiny.yaml",
        ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128"],
    )
    return build_model(cfg, seed=3)


@pytest.fixture(scope="module")
def gen(model):
    return Generator(model)


def own(node: ast.expr) -> bool:
    """`self`, `cls` or `super()`: whose private attributes a class may read."""
    return (
        isinstance(node, ast.Name)
        and node.id in ("self", "cls")
        or isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "super"
    )


def test_engine_users_touch_no_private_attribute_of_another_object():
    """`x._name` only where x is self: the server, its thread, the HTTP layer and GRPO's rollouts use
    public methods."""
    users = ["src/meshwork/engine/serving.py", "train/rollouts.py"]
    users += [f"inference/{n}" for n in ("serve_engine.py", "http_server.py", "http_bodies.py", "lm.py", "cli.py")]
    for name in users:
        tree = ast.parse((ROOT / name).read_text())
        private = [
            f"{name}:{node.lineno}: {ast.unparse(node)}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not own(node.value)
        ]
        assert private == [], private


def test_prefill_and_decode_steps_give_forwards_logits_and_generates_tokens(gen):
    prompts, new, max_len = [[5, 9, 200, 3], [17, 4]], 5, 32
    params = [
        SamplingParams(temperature=0.0, max_new_tokens=new),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_new_tokens=new),
    ]
    tokens = np.zeros((2, 16), np.int32)  # right-padded to stream's prompt bucket: the same compiled prefill
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    lengths = np.array([len(p) for p in prompts], np.int32)
    arrays = SamplingArrays.stack(params)
    out = gen.prefill(tokens, lengths, gen.new_cache(2, max_len), arrays)
    sampled, logits = [np.asarray(out.tokens)], [np.asarray(out.logits)]
    for k in range(new - 1):  # row b's token k sits at position lengths[b] + k
        out = gen.decode_step(out.tokens, lengths + k, out.cache, arrays, out.seen)
        sampled.append(np.asarray(out.tokens))
        logits.append(np.asarray(out.logits))
    sampled_BN, logits_BNV = np.stack(sampled, 1), np.stack(logits, 1)
    assert sampled_BN.tolist() == gen.generate(prompts, params, max_len)

    # The same logits from `forward` over each whole sequence, at the positions that sampled them.
    full = np.zeros((2, 16), np.int32)
    for i, p in enumerate(prompts):
        full[i, : len(p) + new] = p + sampled_BN[i].tolist()
    every_BLV, _ = gen.forward(full, np.broadcast_to(np.arange(16), (2, 16)), gen.new_cache(2, max_len))
    want_BNV = np.stack([np.asarray(every_BLV)[i, len(p) - 1 : len(p) - 1 + new] for i, p in enumerate(prompts)])
    np.testing.assert_allclose(logits_BNV, want_BNV, atol=1e-5 * np.abs(want_BNV).max())

    # log_probs: the model's distribution; with the arrays, the one the sampler scaled (temperature 0.8).
    lp_BV = np.asarray(log_probs(out.logits))
    np.testing.assert_allclose(np.exp(lp_BV).sum(-1), 1.0, rtol=1e-5)
    assert lp_BV[0].argmax() == sampled_BN[0, -1]  # the greedy row took the most likely token
    scaled_BV = np.asarray(log_probs(out.logits, arrays))
    np.testing.assert_allclose(scaled_BV[1], np.asarray(jax.nn.log_softmax(out.logits[1] / 0.8)), atol=1e-5)


BAD = [  # prompt, params, OpenAI param, words of the message
    pytest.param([], GREEDY, "prompt", "empty prompt", id="empty"),
    pytest.param([5, 256], GREEDY, "prompt", "outside the model's vocabulary of 256", id="foreign-ids"),
    pytest.param([5] * 48, GREEDY, "prompt", "exceeds the cache length 48", id="prompt-fills-the-cache"),
    pytest.param([5] * 40, SamplingParams(max_new_tokens=10), "max_tokens", "exceeds the cache", id="too-many-new"),
    pytest.param([5] * 26, GREEDY, "max_tokens", "needs up to 4 pages of 8 tokens", id="beyond-the-pool"),
    pytest.param([5], SamplingParams(top_p=1.5), "top_p", "top_p=1.5", id="top-p"),
    pytest.param([5], SamplingParams(temperature=-1.0), "temperature", "temperature=-1.0", id="temperature"),
    pytest.param([5], SamplingParams(top_k=-2), "top_k", "top_k=-2", id="top-k"),
    pytest.param([5], SamplingParams(repetition_penalty=0.0), "repetition_penalty", "repetition_penalty", id="penalty"),
    pytest.param([5], SamplingParams(max_new_tokens=0), "max_tokens", "max_new_tokens=0", id="no-new-tokens"),
    pytest.param([5], SamplingParams(stop_tokens=(999,)), "stop_token_ids", "stop_tokens=[999]", id="stop-ids"),
    pytest.param([5], SamplingParams(seed=-1), "seed", "seed=-1", id="seed"),
]


@pytest.mark.parametrize("prompt, params, param, words", BAD)
def test_one_validator_refuses_each_bad_request_with_its_param(model, gen, prompt, params, param, words):
    server = Server(model, **SERVER)
    with pytest.raises(RequestError) as refused:
        server.check_request(prompt, params)
    assert refused.value.param == param and words in str(refused.value) and "\n" not in str(refused.value)
    server.submit(Request("r", prompt, params))  # the server records the same line as the request's error
    assert server.take_result("r").error == str(refused.value) and not server.busy
    if words.startswith("needs up to"):  # a generator has no pages: it serves this one
        gen.check_request(prompt, params, SERVER["max_len"])
        return
    with pytest.raises(RequestError, match=re.escape(words)):
        gen.check_request(prompt, params, SERVER["max_len"])


def test_limits_of_the_http_server_and_of_memory():
    limits = RequestLimits(256, max_new_tokens=8)
    with pytest.raises(RequestError, match="at most 8 tokens per request") as refused:
        check_request([5], SamplingParams(max_new_tokens=9), limits)
    assert refused.value.param == "max_tokens"
    limits = RequestLimits(256, cache_bytes_per_token=2**20, memory_bytes=2**30)
    with pytest.raises(RequestError, match=r"a KV cache of 2,001 tokens needs 2.0 GiB") as refused:
        check_request([5], SamplingParams(max_new_tokens=2000), limits)
    assert refused.value.param == "max_tokens"
    check_request([5], SamplingParams(max_new_tokens=1000), limits)


@pytest.mark.parametrize(
    "model_type, body, param, words",
    [
        (CompletionRequest, {}, "prompt", "prompt: give a string or a list of token ids"),
        (CompletionRequest, {"prompt": [1, True]}, "prompt", "give a string or a list of token ids"),
        (CompletionRequest, {"prompt": ["a", "b"]}, "prompt", "a batch of 2 prompts"),
        (CompletionRequest, {"prompt": "a", "max_tokens": 4.5}, "max_tokens", "max_tokens=4.5: give an integer"),
        (CompletionRequest, {"prompt": "a", "max_tokens": 0}, "max_tokens", "max_tokens=0: use at least 1"),
        (CompletionRequest, {"prompt": "a", "temperature": "hot"}, "temperature", "give a number"),
        (CompletionRequest, {"prompt": "a", "stream": "yes"}, "stream", "give true or false"),
        (CompletionRequest, {"prompt": "a", "n": 0}, "n", "n=0: ask for at least 1 choice"),
        (CompletionRequest, {"prompt": "a", "stop": list("abcde")}, "stop", "up to 4 non-empty strings"),
        (CompletionRequest, {"prompt": "a", "stop_token_ids": [1, "2"]}, "stop_token_ids", "give an integer"),
        (CompletionRequest, {"prompt": "a", "logprobs": 6}, "logprobs", "logprobs=6: ask for 0 to 5"),
        (CompletionRequest, {"prompt": "a", "presence_penalty": 0.5}, "presence_penalty", "use repetition_penalty"),
        (ChatCompletionRequest, {"messages": []}, "messages", "give a non-empty list of {role, content} objects"),
        (ChatCompletionRequest, {"messages": [{"role": "user"}]}, "messages", "messages[0]: give an object"),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 0},
            "max_completion_tokens",
            "use at least 1",
        ),
    ],
)
def test_pydantic_bodies_refuse_a_bad_field_by_name(model_type, body, param, words):
    with pytest.raises(RequestError) as refused:
        parse_body(model_type, body)
    assert refused.value.param == param and words in str(refused.value) and "\n" not in str(refused.value)


def test_pydantic_bodies_read_what_the_server_accepts():
    body = parse_body(
        CompletionRequest,
        {
            "prompt": [[1, 2]],
            "max_tokens": 3,
            "stop": "x",
            "seed": 7,
            "top_k": 5,
            "ignore_eos": True,
            "stop_token_ids": [9],
            "user": "ignored",
            "n": 1,
        },
    )
    assert body.prompt == [1, 2] and body.stop_strings() == ("x",)
    assert body.sampling(stops=[2], default_max_tokens=16) == SamplingParams(
        temperature=1.0, top_k=5, max_new_tokens=3, stop_tokens=(9,), seed=7
    )
    nulls = parse_body(
        CompletionRequest,
        {
            "prompt": "a",
            "temperature": None,
            "top_p": None,
            "stop": None,
            "max_tokens": None,
            "seed": 1,
            "ignore_eos": None,
        },
    )  # null: the default
    assert nulls.sampling(stops=[2], default_max_tokens=16) == SamplingParams(
        max_new_tokens=16, stop_tokens=(2,), seed=1
    )
    chat = parse_body(
        ChatCompletionRequest,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "a"},
                        {"type": "image_url", "image_url": {"url": "-"}},
                        {"type": "text", "text": "b"},
                    ],
                }
            ],
            "max_tokens": 3,
            "max_completion_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert chat.messages[0].text() == "ab" and chat.max_tokens_field == "max_completion_tokens"
    assert chat.sampling(stops=[2], default_max_tokens=16).max_new_tokens == 5 and chat.include_usage()


def test_release_and_cancel_give_the_slot_and_pages_back(model):
    server = Server(model, **{**SERVER, "n_pages": 16})
    server.submit(Request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=30)))
    server.submit(Request("b", [8, 9], SamplingParams(temperature=0.0, max_new_tokens=30)))
    server.submit(Request("c", [10], SamplingParams(temperature=0.0, max_new_tokens=30)))  # waits: two slots
    events = server.step()
    assert {rid for rid, _ in events} == {"a", "b"} and server.stats()["slots_live"] == 2
    produced = [t for rid, t in events if rid == "a"]
    assert server.release("a") == produced and server.take_result("a") is None  # released: no Result kept
    assert server.cancel("c") and server.take_result("c").finish == "cancelled"  # from the queue
    assert server.cancel("b") and server.take_result("b").finish == "cancelled"
    assert server.release("a") is None and not server.cancel("a") and not server.busy
    stats = server.stats()
    assert stats["slots_live"] == stats["pages_held"] == 0 and stats["pages_free"] == stats["pages_total"]
