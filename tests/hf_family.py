"""Checks every Hugging Face family's tests make of a transformers-written fixture folder
(tests/fixtures/hf/<name>): logits at given lengths against golden.npz, greedy tokens through the
serving engine, and the export round trip to the bit."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file

from meshwork.engine.sampling import SamplingParams
from meshwork.engine.serving import Request, Server
from meshwork.inference.hf_export import export_hf
from meshwork.models.hf import load_hf_checkpoint, load_hf_config


def assert_logits_match(name: str, model, golden, lengths=(1, 7, 24), tolerance: float = 1e-5) -> None:
    """max |logit error| / max |logit| <= tolerance at each length (printed, for the closing numbers)."""
    forward = jax.jit(lambda t: model(t))
    for n in lengths:
        want = golden[f"logits_{n}"]
        err = np.abs(np.asarray(forward(jnp.asarray(golden[f"input_ids_{n}"]))) - want).max() / np.abs(want).max()
        print(f"{name} L={n}: max |logit error| / max |logit| = {err:.1e}")
        assert err <= tolerance, (name, n)


def assert_greedy_tokens(name: str, model, golden, prompts: int = 2, new_tokens: int = 16, **server) -> Server:
    """`prompts` copies of the golden prompt through a Server(**server) give transformers' greedy tokens."""
    engine = Server(model, **{"slots": 2, "max_len": 64, "page_size": 4, **server})
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    prompt = golden["prompt"][0].tolist()
    results = engine.run([Request(i, prompt, params) for i in range(prompts)])
    for i in range(prompts):
        assert list(results[i].tokens) == golden["generated"][:new_tokens].tolist(), name
    return engine


def assert_export_round_trip(folder: pathlib.Path, cfg, model, out: pathlib.Path) -> None:
    """Load -> export -> load gives the same parameters bit for bit, the file comes back tensor for
    tensor, and the exported config reads back as the same model config."""
    exported = export_hf(cfg, model, out)
    _, first = load_hf_checkpoint(folder)
    _, again = load_hf_checkpoint(exported)
    assert jax.tree.structure(first) == jax.tree.structure(again)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)
    want, got = load_file(folder / "model.safetensors"), load_file(exported / "model.safetensors")
    assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)
    assert load_hf_config(exported) == cfg
