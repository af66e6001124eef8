"""A Hugging Face Llama checkpoint greedy-generates the tokens transformers' `generate` gives,
in one batch of prompts of different lengths and through the CLI (golden from the fixture script)."""

import json

from meshwork.inference.cli import main
from meshwork.inference.generate import Generator
from meshwork.models.hf import model_from_hf
from meshwork.inference.sampling import SamplingParams

from conftest import ROOT

LLAMA = ROOT / "tests/fixtures/hf/llama"


def golden():
    g = json.loads((LLAMA / "generate_golden.json").read_text())
    return g["input_ids"], [out[len(inp):] for inp, out in zip(g["input_ids"], g["output_ids"])], g["max_new_tokens"]


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
