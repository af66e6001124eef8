"""Max |logit difference| between meshwork's import of the golden Hugging Face checkpoints and
transformers' own logits (tests/fixtures/hf/<model>/golden.npz, written by
tests/fixtures/make_hf_golden.py), as tests/test_hf_parity.py reads them.

    python benchmarks/hf_parity.py       # ~20 s on CPU, float32
"""

from __future__ import annotations

import json
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from meshwork.models.hf import model_from_hf  # noqa: E402

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "tests/fixtures/hf"


def main() -> None:
    versions = json.loads((FIXTURES / "versions.json").read_text()) if (FIXTURES / "versions.json").exists() else {}
    print(f"jax {jax.__version__} ({jax.devices()[0].platform}); golden files from {versions}")
    print("| model | input ids | max abs logit | max abs error | relative to max logit |\n|---|---|---|---|---|")
    for name in ("llama", "mixtral", "qwen2_moe"):
        golden = np.load(FIXTURES / name / "golden.npz")
        _, model = model_from_hf(FIXTURES / name)
        logits = np.asarray(model(golden["input_ids"]))
        err, top = float(np.abs(logits - golden["logits"]).max()), float(np.abs(golden["logits"]).max())
        print(f"| {name} | {tuple(golden['input_ids'].shape)} | {top:.3f} | {err:.2e} | {err / top:.1e} |")


if __name__ == "__main__":
    main()
