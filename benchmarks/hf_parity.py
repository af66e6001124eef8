"""Max |logit difference| between meshwork's import of the golden Hugging Face checkpoints and
transformers' own logits, per family and sequence length, and whether meshwork's greedy tokens
through its KV cache equal transformers' (goldens: tests/fixtures/hf/<model>/golden.npz, written by
tests/fixtures/make_hf_golden.py; the scaled-RoPE Llamas in tests/fixtures/hf/llama_rope/<type>/,
written by tests/fixtures/make_rope_model_golden.py), as tests/test_hf_parity.py,
tests/test_hf_rope_parity.py and tests/test_hf_generate.py read them.

    python benchmarks/hf_parity.py       # ~2 min on 2 CPU cores, float32
"""

from __future__ import annotations

import json
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from meshwork.engine.generate import Generator  # noqa: E402
from meshwork.engine.sampling import SamplingParams  # noqa: E402
from meshwork.models.hf import model_from_hf  # noqa: E402

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "tests/fixtures/hf"
# (folder, RoPE, the golden's lengths: "" is the (2, 16) batch, else logits_<L>)
FAMILIES = [
    (name, "default", {16: "", 1: "_1", 7: "_7"})
    for name in (
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "qwen2_moe_step2",
        "qwen2_moe_mlp_only",
    )
]
FAMILIES += [
    (f"llama_rope/{t}", t.split("_")[-1], {1: "_1", 7: "_7", 40: "_40"})
    for t in ("llama3", "linear", "dynamic", "yarn", "qwen2_yarn", "qwen3_yarn")
]


def main() -> None:
    versions = json.loads((FIXTURES / "versions.json").read_text()) if (FIXTURES / "versions.json").exists() else {}
    print(
        f"jax {jax.__version__} ({jax.devices()[0].platform}); golden files from transformers "
        f"{versions.get('transformers')}, torch {versions.get('torch')}"
    )
    print(
        "| model | RoPE | length | max abs logit | max abs error | relative to max logit | greedy 16 equal |\n"
        "|---|---|---|---|---|---|---|"
    )
    for name, rope, lengths in FAMILIES:
        golden = np.load(FIXTURES / name / "golden.npz")
        _, model = model_from_hf(FIXTURES / name)
        greedy = ""
        if "generated" in golden.files:
            n = len(golden["generated"])
            got = Generator(model).generate(
                [golden["prompt"][0].tolist()], SamplingParams(temperature=0.0, max_new_tokens=n)
            )[0]
            greedy = f"{got == golden['generated'].tolist()} ({n})"
        for length, suffix in lengths.items():
            want = golden["logits" + suffix]
            logits = np.asarray(model(golden["input_ids" + suffix]))
            err, top = float(np.abs(logits - want).max()), float(np.abs(want).max())
            print(f"| {name} | {rope} | {length} | {top:.3f} | {err:.1e} | {err / top:.1e} | {greedy} |")


if __name__ == "__main__":
    main()
