"""A LoRA run's adapter in PEFT's format (adapter_config.json + adapter_model.safetensors).

PEFT (Hugging Face's parameter-efficient fine-tuning library) adds to a
transformers Linear of weight W (out, in) the delta (lora_alpha / r) B A, with
`lora_A.weight` (r, in) and `lora_B.weight` (out, r). meshwork's LoRA (models/lora.py)
computes x W0 + (alpha / r) (x A) B with A (inputs..., r) and B (r, outputs...), in the
layout `models.hf.layout` maps to Hugging Face by flattening the inputs and the
outputs and transposing. The delta is linear in that map, so the factors map the same
way: A_peft = flat(A).T and B_peft = flat(B).T, and B_peft A_peft = T(A B) exactly.

    export_peft(cfg, model, "out/adapter", base_model="out/base_hf")
    # peft: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("out/base_hf"), "out/adapter")

The base is the run's `finetune.base`, exported with `python3 -m inference export-hf`.
tests/fixtures/check_peft_export.py loads both with peft and compares logits (it needs
torch, transformers and peft, so it is a script, not a test).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from meshwork.models.lora import TARGETS, LoRA

# finetune.targets name -> (the Llama submodule, its Linear), as transformers names them.
PEFT_MODULES = {
    "q": ("self_attn", "q_proj"),
    "k": ("self_attn", "k_proj"),
    "v": ("self_attn", "v_proj"),
    "o": ("self_attn", "o_proj"),
    "gate": ("mlp", "gate_proj"),
    "up": ("mlp", "up_proj"),
    "down": ("mlp", "down_proj"),
}


def peft_tensors(model: nnx.Module, targets: list[str]) -> dict[str, np.ndarray]:
    """{PEFT tensor name: array} for the LoRA factors of `model` at `targets`."""
    tensors = {}
    for target in targets:
        if target not in TARGETS:
            raise ValueError(
                f"finetune.targets has {target!r}, a projection of multi-head latent attention, which PEFT's "
                "Llama layout cannot name; export the merged model with export-hf instead"
            )
        sub, attr, _ = TARGETS[target]
        lora = getattr(getattr(model.blocks, sub), attr)
        if not isinstance(lora, LoRA):
            raise ValueError(f"finetune.targets has {target!r}, but blocks/{sub}/{attr} holds no LoRA factors")
        a, b = np.asarray(lora.lora_a[...]), np.asarray(lora.lora_b[...])  # (layers, in..., r), (layers, r, out...)
        module, linear = PEFT_MODULES[target]
        for i in range(a.shape[0]):
            prefix = f"base_model.model.model.layers.{i}.{module}.{linear}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, lora.rank).T)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(lora.rank, -1).T)
    return tensors


def peft_config(ft: Any, base_model: str) -> dict[str, Any]:
    """adapter_config.json for a `finetune:` config section of method lora."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": ft.rank,
        "lora_alpha": ft.alpha,
        "lora_dropout": ft.dropout,
        "bias": "none",
        "target_modules": sorted(PEFT_MODULES[t][1] for t in ft.targets),
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }


def export_peft(
    cfg: Any, model: nnx.Module, out_dir: str | pathlib.Path, *, base_model: str | None = None
) -> pathlib.Path:
    """Writes `out_dir`/adapter_config.json and `out_dir`/adapter_model.safetensors for the LoRA run
    whose config is `cfg` (the run's whole config) and whose model (with its LoRA factors) is `model`.
    ValueError names what PEFT on a Llama base cannot express."""
    ft = cfg.finetune
    if ft.method != "lora":
        raise ValueError(
            f"finetune.method={ft.method!r}: only a lora run's adapter has a PEFT form here "
            "(a qlora adapter was trained against the 4-bit base, not the base PEFT would load)"
        )
    if cfg.model.kind != "transformer":
        # Llama, Mistral, Qwen2 and Qwen3 name their projections alike (q_proj ... down_proj), so
        # one adapter layout serves every dense family `export-hf` writes.
        raise ValueError(
            f"model.kind={cfg.model.kind}: the base must be a dense transformer (Llama, Mistral, "
            "Qwen2 or Qwen3 form), which `export-hf` writes"
        )
    tensors = peft_tensors(model, list(ft.targets))
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = base_model or str(ft.base)
    (out / "adapter_config.json").write_text(json.dumps(peft_config(ft, base), indent=2) + "\n")
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    return out
