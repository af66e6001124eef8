"""MLA and MoE-with-MTP models train the same on any mesh, learn, and resume bit for bit.

The step comparisons reuse test_sharded_step.py's harness (a few steps of lm_tiny's corpus on 8
simulated devices against one device). MLA's latent is shared by the heads, so tensor parallelism
splits the up-projections' heads (`wq`, `wkv_b`, `wo`) and leaves `wkv_a` whole.
"""

import jax
import numpy as np
import pytest
from conftest import ROOT, tiny_overrides
from test_sharded_step import Lazy, assert_same_step, one_step

from meshwork.config import ConfigError, load_config
from meshwork.run.metrics import read_metrics
from meshwork.train.loop import train

MLA = ["model.mla={q_lora_rank: 24, kv_lora_rank: 16, qk_nope_head_dim: 8, qk_rope_head_dim: 8, v_head_dim: 12}"]
MOE_MTP = [
    *MLA,
    "model.kind=moe",
    "model.moe={n_experts: 4, top_k: 2, d_expert: 32, n_shared_experts: 1, router: sigmoid, n_groups: 2, "
    "topk_groups: 1, routed_scaling_factor: 2.5, first_dense_layers: 1, bias_update_rate: 0.001, "
    "aux_loss_coef: 0.0, z_loss_coef: 0.0}",
    "model.mtp.depth=2",
]
LAYOUTS = {
    "mla fsdp": (MLA, ["rules.preset=fsdp", "mesh.data=2", "mesh.fsdp=4"]),
    "mla tp+cp": (MLA, ["rules.preset=cp+tp", "mesh.data=2", "mesh.sequence=2", "mesh.tensor=2"]),
    "moe+mtp fsdp+tp+ep": (MOE_MTP, ["rules.preset=fsdp+tp+ep", "mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"]),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return Lazy(lambda model: one_step(tmp_path_factory.mktemp("ref"), ["mesh.data=1", *LAYOUTS[model][0]], 1))


MARKS = {
    "mla tp+cp": [pytest.mark.slow],
    # Two compiles (8 devices and its one-device reference) of a MoE model with an MTP MoE block, ~27 s
    # cold: the quick tier keeps the MLA step under fsdp; MTP's losses are test_mtp_losses_* below.
    "moe+mtp fsdp+tp+ep": [pytest.mark.slow],
}


@pytest.mark.parametrize("layout", [pytest.param(name, marks=MARKS.get(name, [])) for name in LAYOUTS])
def test_step_on_8_devices_equals_one_device(tmp_path, references, layout):
    model, mesh = LAYOUTS[layout]
    got = one_step(tmp_path, [*mesh, *model], 8)
    attn = got[2].params["blocks" if model is MLA else "moe_blocks"]["attn"]
    specs = {k: tuple(attn[k].sharding.spec) for k in ("wkv_a", "wkv_b")}
    if "tp" in layout:  # heads split over tensor, the latent projection not
        assert specs["wkv_b"][2] == "tensor" and "tensor" not in specs["wkv_a"]
    if model is MOE_MTP:
        assert {"mtp_loss", "mtp_loss_1", "mtp_loss_2"} <= set(got[0])
        assert got[2].params["mtp"][0]["block"]["moe"]["w_up"].sharding.spec[0] == "expert"
        # The MTP block's selection bias moves aux-loss-free like the model's, and equally on one device.
        bias = [np.asarray(r[2].buffers["mtp"][0]["block"]["moe"]["router_bias"]) for r in (got, references[layout])]
        assert np.abs(bias[0]).max() > 0 and got[0]["mtp_load_per_layer"].shape == (2, 4)
        np.testing.assert_allclose(bias[0], bias[1], atol=1e-6)
    assert_same_step(got, references[layout], param_atol=1e-5)
    np.testing.assert_allclose(
        got[0]["mtp_loss"] if model is MOE_MTP else 0, references[layout][0].get("mtp_loss", 0), rtol=1e-5
    )


@pytest.mark.slow  # three compiles of a MoE+MTP run (straight, stopped, resumed): ~35 s
def test_mtp_loss_falls_and_resume_is_bitwise_exact(tmp_path):
    common = [*MOE_MTP, "model.mtp.depth=1", "train.steps=24", "checkpoint.every=12", "log.every=1"]
    common += ["log.eval_every=12", "mesh.data=8"]

    def cfg(d, *extra):
        return load_config(ROOT / "configs/lm_tiny.yaml", [*tiny_overrides(tmp_path / d), *common, *extra])

    straight = train(cfg("straight"))
    train(cfg("resumed", "train.stop_after=12"))
    resumed = train(cfg("resumed"))
    assert resumed["resumed_from"] == 12
    rows = [r for r in read_metrics(tmp_path / "straight") if "mtp_loss_1" in r and "loss" in r]
    first, last = np.mean([r["mtp_loss_1"] for r in rows[:4]]), np.mean([r["mtp_loss_1"] for r in rows[-4:]])
    assert last < first - 0.3, (first, last)
    assert [r["mtp_loss_1"] for r in rows] == [
        r["mtp_loss_1"] for r in read_metrics(tmp_path / "resumed") if "mtp_loss_1" in r and "loss" in r
    ]
    for a, b in zip(jax.tree.leaves(straight["state"]), jax.tree.leaves(resumed["state"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["model.mtp.depth=1", "mesh.stage=2", "train.pipeline=gpipe", "rules.preset=pp"], "mtp"),
        ([*MLA, "finetune.method=prefix"], "prefix"),
    ],
)
def test_unsupported_combinations_are_refused(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match) as info:
        load_config(ROOT / "configs/lm_tiny.yaml", [*tiny_overrides(tmp_path), *overrides])
    assert "\n" not in str(info.value)


def test_lora_on_mla_projections_decodes_like_the_full_forward():
    """LoRA on MLA's own projections (q_a, q_b, kv_a, kv_b, o): the absorbed decode folds the merged
    kv_b into the query and output sides, so the cached logits equal the full forward's."""
    import jax.numpy as jnp
    from flax import nnx

    from meshwork.config_sections import MLAConfig, ModelConfig
    from meshwork.engine.kv_cache import KVCache
    from meshwork.models.lora import add_lora
    from meshwork.models.transformer import Transformer

    mla = MLAConfig(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, mla=mla)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    add_lora(model, ["q_a", "q_b", "kv_a", "kv_b", "o"], rank=4, alpha=8.0, rngs=nnx.Rngs(1))
    for w in (model.blocks.attn.wkv_b, model.blocks.attn.wq_b):  # B starts at zero: make the deltas count
        w.lora_b[...] = 0.1 * jax.random.normal(jax.random.key(2), w.lora_b.shape)
    tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, 64)
    cached, _ = model.decode(tokens, jnp.broadcast_to(jnp.arange(6), (2, 6)), KVCache.zeros(cfg, 2, 8))
    assert float(jnp.abs(cached - model(tokens)).max()) < 1e-5
    with pytest.raises(ValueError, match="no 'k' projection"):
        add_lora(model, ["k"], rank=4, alpha=8.0, rngs=nnx.Rngs(1))


def test_mtp_losses_equal_a_position_by_position_reference():
    """mtp_loss_k is the mean, over positions i whose target t_{i+k+1} lies in the row and counts (loss
    mask), of the cross-entropy of module k's logits at i: computed here position by position from the
    modules themselves; the fused loss (train.loss_chunk) gives the same objective."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from meshwork.config_sections import MLAConfig, ModelConfig, MTPConfig
    from meshwork.models.transformer import Transformer
    from meshwork.objectives.next_token import next_token_loss

    mla = MLAConfig(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=8)
    cfg = ModelConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=2, d_ff=32, mla=mla, mtp=MTPConfig(depth=2))
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, 40)
    mask = jnp.ones((2, 9), jnp.int32).at[1, 6:].set(0)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask}
    _, stats = model.apply(batch["inputs"], targets_BL=batch["targets"], loss_mask_BL=mask)

    h = model._trunk(batch["inputs"], None, None, None)
    pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
    for k, module in enumerate(model.mtp, start=1):
        ahead = jnp.concatenate([batch["inputs"][:, k:], jnp.zeros((2, k), jnp.int32)], axis=1)
        h, _ = module(h, model.embed(ahead), pos, None)
        logits = model.head.project(module.out_norm(h), model.embed)
        terms = [
            optax.softmax_cross_entropy_with_integer_labels(logits[b, i], batch["targets"][b, i + k])
            for b in range(2)
            for i in range(9 - k)
            if mask[b, i + k]
        ]
        np.testing.assert_allclose(stats[f"mtp_loss_{k}"], np.mean(terms), rtol=1e-6)
    np.testing.assert_allclose(stats["mtp_loss"], (stats["mtp_loss_1"] + stats["mtp_loss_2"]) / 2, rtol=1e-6)

    graphdef, params, buffers = nnx.split(model, nnx.Param, ...)
    plain, _ = next_token_loss(graphdef)(params, buffers, batch)
    fused, _ = next_token_loss(graphdef, 6)(params, buffers, batch)
    np.testing.assert_allclose(fused, plain, rtol=1e-6)
