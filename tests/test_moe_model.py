"""The MoE LM: parameter counts from config alone, training with balanced
experts, and the auxiliary-loss-free bias update."""

import jax
import numpy as np
import pytest
from flax import nnx

from meshwork.config import load_config
from meshwork.perf.flops import gqa_attention_params, lm_param_counts, mla_attention_params, param_counts
from meshwork.run.metrics import read_metrics
from meshwork.models.layers.moe_routing import RouterBias
from meshwork.train.loop import train
from meshwork.models.build import build_model

from conftest import ROOT, optimized_override, tiny_overrides


def actual_params(cfg) -> int:
    model = nnx.eval_shape(lambda: build_model(cfg))
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("overrides", [
    [],
    ["model.kind=moe"],
    ["model.kind=moe", "model.moe.n_shared_experts=2", "model.moe.shared_expert_gate=true",
     "model.moe.first_dense_layers=1", "model.tie_embeddings=true", "model.qkv_bias=true"],
    ["model.kind=moe", "model.moe.router=noisy", "model.moe.n_shared_experts=1", "model.moe.d_shared=96"],
], ids=["dense", "moe", "moe-shared-gated-dense-first-tied", "moe-noisy-shared"])
def test_param_count_formula_matches_the_model(tmp_path, overrides):
    cfg = load_config(ROOT / "configs/moe_tiny.yaml", [*tiny_overrides(tmp_path), *overrides])
    counts = param_counts(cfg.model)
    # The noisy router's noise weight is a second (D, E) router matrix.
    noise = cfg.model.d_model * cfg.model.moe.n_experts * (cfg.model.kind == "moe" and cfg.model.moe.router == "noisy")
    assert counts["total"] + noise == actual_params(cfg)
    assert counts["activated"] <= counts["total"]


def test_deepseek_v3_and_mixtral_counts_from_their_configs():
    # DeepSeek-V3's config.json numbers; nothing is allocated.
    attention = mla_attention_params(7168, 128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                     qk_rope_head_dim=64, v_head_dim=128)
    v3 = lm_param_counts(vocab_size=129280, d_model=7168, n_layers=61, attention=attention, d_ff=18432,
                         tie_embeddings=False, n_moe_layers=61 - 3, n_experts=256, top_k=8, d_expert=2048,
                         d_shared=2048)
    assert v3["total"] == pytest.approx(671e9, rel=0.005)      # "671B total"
    assert v3["activated"] == pytest.approx(37e9, rel=0.03)    # "37B activated"
    # Mixtral 8x7B: 46.7B total, 12.9B active (Mistral's announcement).
    mixtral = lm_param_counts(vocab_size=32000, d_model=4096, n_layers=32, d_ff=0, tie_embeddings=False,
                              attention=gqa_attention_params(4096, 32, 8, 128), n_moe_layers=32, n_experts=8,
                              top_k=2, d_expert=14336)
    assert mixtral["total"] == pytest.approx(46.7e9, rel=0.005)
    assert mixtral["activated"] == pytest.approx(12.9e9, rel=0.01)


STEPS = 60


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    """moe_tiny with and without the load-balancing loss, same seed and steps."""
    out = {}
    for coef in (0.01, 0.0):
        run_dir = tmp_path_factory.mktemp(f"aux{coef}")
        cfg = load_config(ROOT / "configs/moe_tiny.yaml", [
            f"run.dir={run_dir}", f"train.steps={STEPS}", "data.seq_len=64", f"model.moe.aux_loss_coef={coef}",
            "mesh.data=8", f"log.eval_every={STEPS}", "log.progress=false", "log.tensorboard=false",
            optimized_override()])
        out[coef] = (train(cfg), [r for r in read_metrics(run_dir) if "load_cv" in r])
    return out


@pytest.mark.slow
def test_moe_tiny_learns_and_the_aux_loss_balances_experts(moe_runs):
    for summary, rows in moe_runs.values():
        assert summary["val_loss"][STEPS] < summary["val_loss"][0] - 2.0
        assert rows[-1]["step"] == STEPS and len(rows[-1]["load"]) == 8
        assert abs(sum(rows[-1]["load"]) - 1) < 1e-5
    cv_on = moe_runs[0.01][1][-1]["load_cv"]
    cv_off = moe_runs[0.0][1][-1]["load_cv"]
    assert cv_on < 0.5 * cv_off, (cv_on, cv_off)
    # Balanced experts drop fewer tokens at the same capacity factor.
    assert moe_runs[0.01][1][-1]["dropped_fraction"] < moe_runs[0.0][1][-1]["dropped_fraction"]


def test_aux_loss_free_bias_moves_toward_underloaded_experts(tmp_path):
    cfg = load_config(ROOT / "configs/moe_tiny.yaml", [
        *tiny_overrides(tmp_path), "model.moe.router=sigmoid", "model.moe.bias_update_rate=0.01",
        "model.moe.aux_loss_coef=0", "train.steps=1", "mesh.data=8", "log.every=1"])
    out = train(cfg)
    bias = out["state"]["buffers"]["moe_blocks"]["moe"]["router_bias"]
    assert isinstance(bias, RouterBias)  # a buffer: never touched by the optimizer
    load = np.asarray(read_metrics(tmp_path)[-1]["load_per_layer"])
    assert load.shape == (cfg.model.n_layers - 1, 8)
    # One step from zero: +rate for each layer's under-loaded experts, -rate for the over-loaded.
    np.testing.assert_allclose(np.asarray(bias[...]), 0.01 * np.sign(1 / 8 - load), atol=1e-7)
