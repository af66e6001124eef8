"""A LoRA run's adapter in PEFT's format: the base's Hugging Face weights plus PEFT's
(lora_alpha / r) lora_B @ lora_A are exactly the Hugging Face weights of the merged model.
(tests/fixtures/check_peft_export.py loads the files with peft itself; peft is not a test
requirement.)"""

import json

import jax
import numpy as np
import pytest
from conftest import ROOT
from flax import nnx
from safetensors.numpy import load_file

from meshwork.config import load_config
from meshwork.inference.hf_export import export_hf
from meshwork.inference.peft_export import PEFT_MODULES, export_peft
from meshwork.models.build import build_model
from meshwork.models.lora import merge_lora

SMALL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=96"]


def lora_model(targets, seed=0):
    """A lora_tiny-shaped model with random base weights and random (nonzero) LoRA factors."""
    cfg = load_config(
        ROOT / "configs/lora_tiny.yaml",
        [*SMALL, f"finetune.targets=[{', '.join(targets)}]", "finetune.rank=4", "finetune.alpha=12"],
    )
    model = build_model(cfg, seed=seed)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(seed)
    state = jax.tree.map(lambda x: (rng.standard_normal(x.shape) / np.sqrt(x.shape[-1])).astype(np.float32), state)
    return cfg, nnx.merge(graphdef, state)


def base_params(model):
    """The base weights as a plain model's parameter tree (each LoRA site replaced by its frozen W0)."""

    def strip(node):
        if isinstance(node, dict):
            return strip(node["base"]) if "base" in node else {k: strip(v) for k, v in node.items()}
        return node

    return strip(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("targets", [["q", "v"], ["k", "o", "gate", "up", "down"]], ids=["q,v", "k,o,mlp"])
def test_base_plus_the_peft_delta_is_the_merged_model(tmp_path, targets):
    cfg, model = lora_model(targets)
    base = load_file(export_hf(cfg.model, base_params(model), tmp_path / "base") / "model.safetensors")
    adapter_dir = export_peft(cfg, model, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    adapter = load_file(adapter_dir / "adapter_model.safetensors")
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 12.0)
    assert config["target_modules"] == sorted(PEFT_MODULES[t][1] for t in targets)
    assert len(adapter) == 2 * len(targets) * cfg.model.n_layers

    merge_lora(model)
    merged = load_file(
        export_hf(cfg.model, nnx.to_pure_dict(nnx.state(model, nnx.Param)), tmp_path / "merged") / "model.safetensors"
    )
    scale = config["lora_alpha"] / config["r"]
    changed = set()
    for name, w in base.items():
        prefix = "base_model.model." + name.removesuffix(".weight")
        if f"{prefix}.lora_A.weight" in adapter:
            a, b = adapter[f"{prefix}.lora_A.weight"], adapter[f"{prefix}.lora_B.weight"]
            assert a.shape == (4, w.shape[1]) and b.shape == (w.shape[0], 4), name
            w = w + scale * b @ a
            changed.add(name)
        np.testing.assert_allclose(w, merged[name], rtol=0, atol=1e-5, err_msg=name)
    assert len(changed) == len(targets) * cfg.model.n_layers


def test_only_a_lora_run_exports(tmp_path):
    cfg, model = lora_model(["q"])
    with pytest.raises(ValueError, match="finetune.method='qlora': only a lora run's adapter"):
        export_peft(
            cfg.model_copy(update={"finetune": cfg.finetune.model_copy(update={"method": "qlora"})}), model, tmp_path
        )
    assert not any(tmp_path.iterdir())
