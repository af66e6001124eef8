"""The planner under multi-head latent attention (model.mla) and multi-token prediction (model.mtp).

Against the built model (its weights, parameter count and XLA's FLOP count) and against what
DeepSeek published about DeepSeek-V3: parameter counts (README_WEIGHTS.md of deepseek-ai/DeepSeek-V3),
the KV cache per token and the training FLOPs per token (Zhao et al. 2025, "Insights into
DeepSeek-V3: Scaling Challenges and Reflections on Hardware for AI Architectures", ISCA '25,
arXiv 2505.09343, Tables 1 and 2). No per-device training memory for DeepSeek-V3 is published
(neither the technical report, arXiv 2412.19437, nor the ISCA paper gives one; the report's
DualPipe table is relative): the published layout is planned from the report's stated precisions
and checked against a closed form of the same.
"""

import jax
import pytest
from conftest import ROOT, tiny_overrides
from flax import nnx

from meshwork.config import load_config
from meshwork.config_sections import MLAConfig, ModelConfig, MTPConfig
from meshwork.perf.flops import (
    attention_flops_per_token,
    mla_padding_flops_per_token,
    mtp_param_counts,
    param_counts,
    train_flops_per_token,
)
from meshwork.perf.planner import layout_problem, memory, step_flops
from meshwork.perf.planner_layout import make_layout
from meshwork.perf.planner_memory import StateBytes, kv_bytes_per_token, kv_cache_bytes, state_memory
from meshwork.perf.planner_weights import model_weights, shard_size

V3 = ROOT / "configs/deepseek_v3.yaml"
MLA_SMALL = ["model.mla.q_lora_rank=24", "model.mla.kv_lora_rank=32"]  # Dq = 48 > Dv = 32: padded values


def _no_mtp(m: ModelConfig) -> ModelConfig:
    return m.model_copy(update={"mtp": MTPConfig(depth=0)})


# --- against the built model --------------------------------------------------------------


@pytest.mark.parametrize(
    "config, extra",
    [
        ("lm_tiny.yaml", ["model.mla.kv_lora_rank=32"]),  # no q-LoRA
        ("lm_tiny.yaml", [*MLA_SMALL, "model.mtp.depth=2"]),
        (
            "moe_tiny.yaml",
            [*MLA_SMALL, "model.mtp.depth=1", "model.moe.n_shared_experts=1", "model.moe.first_dense_layers=1"],
        ),
    ],
    ids=["mla", "mla-qlora-mtp2", "moe-mla-mtp"],
)
def test_weights_and_counts_mirror_the_model(config, extra):
    from meshwork.train.optim import make_optimizer
    from meshwork.train.state import abstract_state

    cfg = load_config(ROOT / "configs" / config, extra)
    _, abstract = abstract_state(cfg, make_optimizer(cfg.optimizer, 10)[0])
    real = {
        ".".join(map(str, path)): (tuple(v.shape), tuple(v.get_metadata()["out_sharding"]))
        for path, v in nnx.to_flat_state(abstract.params)
    }
    assert {w.path: (w.shape, w.names) for w in model_weights(cfg.model)} == real
    n_real = sum(x.size for x in jax.tree.leaves(abstract.params))
    assert param_counts(cfg.model)["total"] == n_real


def test_mla_param_count_equals_the_transformer_built_eagerly():
    from meshwork.models.transformer import Transformer

    m = ModelConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=48,
        mla=MLAConfig(q_lora_rank=16, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
        mtp=MTPConfig(depth=1),
    )  # fmt: skip
    model = Transformer(m, rngs=nnx.Rngs(0))
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    counts = param_counts(m)
    assert counts["total"] == n
    assert (
        counts["mtp"]
        == mtp_param_counts(m)["total"]
        == sum(x.size for x in jax.tree.leaves(nnx.state(model.mtp, nnx.Param)))
    )


@pytest.mark.parametrize("extra", [[], ["model.mtp.depth=1"]], ids=["mla", "mla-mtp"])
def test_mla_flops_match_the_compiled_step(tmp_path, extra):
    """One layer (the scan body XLA counts once is the whole model), values narrower than the
    keys: XLA's count of the compiled train step against the planner's model FLOPs plus the
    expanded form's zero padding."""
    from meshwork.models.build import build_model, split_model
    from meshwork.objectives.next_token import next_token_loss
    from meshwork.sharding.report import compiled_report

    cfg = load_config(
        ROOT / "configs/lm_tiny.yaml", [*tiny_overrides(tmp_path), "model.n_layers=1", *MLA_SMALL, *extra]
    )
    tokens = jax.random.randint(jax.random.key(3), (4, 33), 0, 256)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    graphdef, params, buffers = split_model(build_model(cfg))
    loss_fn = next_token_loss(graphdef)
    grad = jax.jit(jax.grad(lambda p, b: loss_fn(p, buffers, b)[0]))
    xla = compiled_report(grad.lower(params, batch).compile())["flops"]
    B, L = batch["inputs"].shape
    ours = (train_flops_per_token(cfg.model, L) + mla_padding_flops_per_token(cfg.model, L)) * B * L
    # XLA also counts elementwise work (norms, softmax, RoPE, the losses); measured (jax 0.10.2):
    # 1.025 without MTP, 1.026 with one module (1.052 if the padding were left out).
    assert 1.0 <= xla / ours < 1.05, (xla, ours)


# --- the latent cache -----------------------------------------------------------------------


def test_latent_cache_bytes_per_token(capsys):
    from meshwork.engine.kv_cache import cache_bytes_per_token

    v3 = load_config(V3).model
    main = _no_mtp(v3)
    latent = (512 + 64) * 61 * 2
    assert kv_bytes_per_token(main, 2) == latent == cache_bytes_per_token(main, "bfloat16") == 70_272
    # The MTP module's draft layer is one more cached layer (engine/kv_cache.cache_layers).
    assert kv_bytes_per_token(v3, 2) == (512 + 64) * 62 * 2 == cache_bytes_per_token(v3, "bfloat16")
    # The latent cache is replicated over tensor parallelism: its size does not shrink.
    assert kv_cache_bytes(main, 8, 4096, 2, tensor=8) == latent * 8 * 4096
    # The comparison DeepSeek-V2's paper draws: multi-head attention with the same 128 heads of 128.
    mha = _no_mtp(v3).model_copy(update={"mla": None, "n_kv_heads": 128, "head_dim": 128})
    assert kv_bytes_per_token(mha, 2) == 2 * 128 * 128 * 61 * 2
    ratio = kv_bytes_per_token(mha, 2) / kv_bytes_per_token(main, 2)
    assert ratio == pytest.approx(32768 / 576)  # 56.9x
    # ISCA '25 Table 1 (BF16, per token): DeepSeek-V3 70.272 KB, Qwen-2.5 72B 327.680 KB, LLaMA-3.1 405B
    # 516.096 KB; the GQA rows through the same function.
    qwen72 = ModelConfig(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, head_dim=128)
    llama405 = ModelConfig(n_layers=126, d_model=16384, n_heads=128, n_kv_heads=8, head_dim=128)
    assert (kv_bytes_per_token(qwen72, 2), kv_bytes_per_token(llama405, 2)) == (327_680, 516_096)
    with capsys.disabled():
        print(
            f"\nDeepSeek-V3 latent cache {latent:,} B/token vs MHA {kv_bytes_per_token(mha, 2):,} B/token: {ratio:.1f}x"
        )


# --- DeepSeek-V3 against what was published ------------------------------------------------------


def test_deepseek_v3_counts_and_flops_match_the_published_ones():
    v3 = load_config(V3).model
    counts = param_counts(v3)
    # README_WEIGHTS.md: main model 671B; MTP module 11.5B unique parameters (its embedding
    # and head shared); main model activated 36.7B with the embedding and head.
    assert counts["total"] - counts["mtp"] == pytest.approx(671e9, rel=0.005)  # 671.03B
    assert counts["mtp"] == pytest.approx(11.5e9, rel=0.015)  # 11.61B
    assert counts["activated"] - counts["mtp_activated"] == pytest.approx(36.7e9, rel=0.03)  # 37.55B
    # ISCA '25 Table 2: 250 GFLOPs of training per token at sequence length 4096, for the main
    # model. It halves the attention term for the causal mask; PaLM's convention (meshwork's
    # MFU numerator) does not: 281.2 GFLOPs.
    main, T = _no_mtp(v3), 4096
    causal = train_flops_per_token(main, T) - attention_flops_per_token(main, T) / 2
    assert causal == pytest.approx(250e9, rel=0.005)  # 250.4 GFLOPs
    assert train_flops_per_token(main, T) == pytest.approx(281.15e9, rel=1e-3)
    # The expanded form pads values from 128 to 192 dims inside the kernel: counted apart.
    assert mla_padding_flops_per_token(v3, T) == 6 * 62 * 128 * (192 - 128) * T


def test_deepseek_v3_published_layout_state_per_device(capsys):
    """The report's training layout on 2048 GPUs: 16-way pipeline, 64-way expert parallelism,
    ZeRO-1 over the rest (2-way here: 2048 / 16 / 64), no tensor parallelism. Precisions from the
    report (section 3.3.3): FP32 master weights and gradients, BF16 AdamW moments; the BF16
    working copy of the weights is our assumption (the report names FP8 GEMM inputs, not a stored
    copy). 4 + 8 bytes: gradients, master + moments; 2 bytes: the working copy.

    meshwork's pipeline executor runs dense models only, so the planner names the layout as not
    runnable but still accounts for it; its ZeRO-1 rules under expert parallelism shard a non-expert
    weight's master copy and moments over data x expert (2 x 64 = 128, DeepSeek's data-parallel group
    of the non-expert weights), an expert weight's over data (its experts are already split)."""
    cfg = load_config(V3)
    layout = make_layout(stage=16, data=2, expert=64, zero=1, microbatches=15, remat="full")
    assert "pipelines need a dense transformer" in layout_problem(cfg, layout)
    acc = StateBytes(2, 4, 8, "DeepSeek-V3 report: bf16 weights, fp32 grads, fp32 master + bf16 moments")
    got = state_memory(cfg, layout, acc)
    # The closed form, weight by weight: a scanned stack gives each stage ceil(layers / 16) of its
    # layers (3 dense -> 1, 58 MoE -> 4: the most loaded stage), experts 256 / 64 per device, and
    # ZeRO-1 splits the master weights and moments over data x expert = 128 (non-expert weights) or
    # data = 2 (experts); the rest (embedding, head, MTP module) sits whole on every stage.
    weights = model_weights(cfg.model)
    p = sum(
        (w.size // w.shape[0] * -(-w.shape[0] // 16) if w.scanned else w.size) // (64 if "expert" in w.names else 1)
        for w in weights
    )
    assert got["params"] == 2 * p and got["grads"] == 4 * p
    opt = sum(shard_size(w, layout, "opt_state") for w in weights)
    zero = lambda w: 2 if "expert" in w.names else 128  # noqa: E731
    assert opt == sum(
        -(-shard_size(w, layout) // zero(w)) if "embed" in w.names else shard_size(w, layout) for w in weights
    )
    assert got["opt_state"] == 8 * opt
    mem = memory(cfg, layout, acc)
    with capsys.disabled():
        print("\nDeepSeek-V3, stage=16 x data=2 x expert=64, ZeRO-1, per device (GB):")
        print("  " + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in mem.items() if v))
    assert p == pytest.approx(4.58e9, rel=0.01)  # parameters on the most loaded device


def test_deepseek_v3_config_plans_on_1024_devices():
    """configs/deepseek_v3.yaml's own (runnable) layout: experts over 64 devices, ZeRO-1 data
    parallelism over 16 (its batch of 15360 does not split 2048 ways without a pipeline); the
    plan counts MLA's padding (MoE's is zero: dropless) and the MTP module's activations."""
    from meshwork.perf.hardware import get_hardware
    from meshwork.perf.planner import layout_from_config, plan

    cfg = load_config(V3)
    layout = layout_from_config(cfg, 1024)
    assert layout.sizes["expert"] == 64 and layout.sizes["data"] == 16 and layout_problem(cfg, layout) is None
    p = plan(cfg, layout, get_hardware("h100"))
    f = step_flops(cfg, layout)
    tokens = cfg.train.global_batch * cfg.data.seq_len
    assert f["padding"] == mla_padding_flops_per_token(cfg.model, cfg.data.seq_len) * tokens
    assert 0 < p.mfu < 1 and p.memory["mtp"] > 0
