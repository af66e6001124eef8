"""A Hugging Face Llama checkpoint greedy-generates the tokens transformers' `generate` gives,
in one batch of prompts of different lengths and through the CLI; and every family's fixture
(Qwen2-MoE with dense layers between its MoE layers too) its 16 greedy tokens through
meshwork's KV cache (goldens from tests/fixtures/make_hf_golden.py)."""

import json

import numpy as np
import pytest
from conftest import ROOT
from flax import nnx

from meshwork.engine.generate import Generator
from meshwork.engine.sampling import SamplingParams
from meshwork.inference.cli import main
from meshwork.models.hf import model_from_hf

LLAMA = ROOT / "tests/fixtures/hf/llama"


def golden():
    g = json.loads((LLAMA / "generate_golden.json").read_text())
    return g["input_ids"], [out[len(inp) :] for inp, out in zip(g["input_ids"], g["output_ids"])], g["max_new_tokens"]


def test_greedy_generation_matches_transformers():
    prompts, expected, n = golden()
    _, model = model_from_hf(LLAMA)
    got = Generator(model).generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=n, stop_tokens=(2,)))
    assert got == expected


def test_cli_generates_from_an_hf_directory(capsys):
    prompts, expected, n = golden()
    argv = ["lm", "--hf", str(LLAMA), "--temperature", "0", "--max-new-tokens", str(n)]
    assert main(argv + ["--prompt-ids", ",".join(map(str, prompts[1]))]) == 0
    # No tokenizer ships with the fixture, so the ids are printed.
    assert capsys.readouterr().out.split() == [str(t) for t in prompts[1] + expected[1]]


def test_attention_switch_runs_an_hf_directory_on_the_pallas_kernels(capsys):
    """`--attention pallas` builds the folder's model with Pallas attention: one prompt decodes with
    flash-decoding, the serving loop reads its paged cache with the paged-attention kernel; both
    generate what transformers does."""
    from meshwork.engine.serving import Request, Server
    from meshwork.inference.lm import load_lm
    from meshwork.models.layers.attention import Attention

    model, _, _ = load_lm(None, str(LLAMA), "pallas")
    assert {m.impl for _, m in nnx.iter_graph(model) if isinstance(m, Attention)} == {"pallas"}
    prompts, expected, n = golden()
    params = SamplingParams(temperature=0.0, max_new_tokens=n, stop_tokens=(2,))
    results = Server(model, slots=2, max_len=64).run(Request(i, p, params) for i, p in enumerate(prompts[:2]))
    assert [results[i].tokens for i in range(2)] == expected[:2]
    argv = ["lm", "--hf", str(LLAMA), "--temperature", "0", "--max-new-tokens", str(n), "--attention", "pallas"]
    assert main(argv + ["--prompt-ids", ",".join(map(str, prompts[1]))]) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in prompts[1] + expected[1]]


# Quick tier: Llama (its prefill and decode are compiled by the tests above already), a MoE, and
# the Qwen2-MoE whose KV cache is written by four runs of layers (dense, MoE, dense, MoE).
QUICK = ["llama", "qwen3_moe", "qwen2_moe_step2"]
FAMILIES = [
    "llama",
    "mixtral",
    "qwen2_moe",
    "qwen2",
    "qwen3",
    "mistral",
    "qwen3_moe",
    "qwen2_moe_step2",
    "qwen2_moe_mlp_only",
]


@pytest.mark.parametrize("name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in FAMILIES])
def test_greedy_16_tokens_match_transformers(name):
    golden = np.load(ROOT / "tests/fixtures/hf" / name / "golden.npz")
    _, model = model_from_hf(ROOT / "tests/fixtures/hf" / name)
    n = len(golden["generated"])
    got = Generator(model).generate([golden["prompt"][0].tolist()], SamplingParams(temperature=0.0, max_new_tokens=n))
    assert n == 16 and got[0] == golden["generated"].tolist()
