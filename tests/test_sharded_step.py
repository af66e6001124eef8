"""Training is the same computation on any mesh, and with or without gradient
accumulation: sharding changes where numbers live, not what they are."""

import jax
import numpy as np
import pytest
from conftest import ROOT, tiny_overrides
from flax import nnx

from meshwork.config import load_config
from meshwork.data.text import train_iterator
from meshwork.train.trainer import build_trainer, check_runtime

# Nonzero lr at step 0: a warmup from 0 would make the compared step a no-op.
STEP_OVERRIDES = ["optimizer.init_lr_ratio=0.1", "optimizer.warmup_steps=10", "model.tie_embeddings=false"]


STEPS = 3


def one_step(tmp_path, overrides, n_devices):
    """Trains STEPS steps on the first batches of the corpus; (last metrics, params, state, trainer)."""
    cfg = load_config(ROOT / "configs/lm_tiny.yaml", [*tiny_overrides(tmp_path), *STEP_OVERRIDES, *overrides])
    devices = jax.devices()[:n_devices]
    files = check_runtime(cfg, devices)
    trainer = build_trainer(cfg, files, devices).compile()
    batches = train_iterator(str(files.train), cfg.data.seq_len, cfg.train.global_batch, seed=0)
    state = trainer.init_state()
    for _ in range(STEPS):
        state, metrics = trainer.step_fn(state, trainer.to_device(next(batches)))
    return jax.device_get(metrics), jax.device_get(state.params), state, trainer


class Lazy(dict):
    """key -> make(key), computed when a test first asks: a tier that runs one variant pays for one reference."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, key):
        self[key] = self.make(key)
        return self[key]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return one_step(tmp_path_factory.mktemp("ref"), ["mesh.data=1"], 1)


def assert_same_step(got, want, param_atol=1e-5):
    (m_got, p_got, *_), (m_want, p_want, *_) = got, want
    np.testing.assert_allclose(m_got["loss"], m_want["loss"], rtol=1e-6)
    np.testing.assert_allclose(m_got["grad_norm"], m_want["grad_norm"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p_got), jax.tree.leaves(p_want)):
        np.testing.assert_allclose(a, b, rtol=0, atol=param_atol)


# Every preset and three hybrids, each on an asymmetric mesh (a symmetric one cannot expose two
# swapped axes). The quick tier runs two hybrids, which between them use every axis (fsdp, tensor,
# sequence) and the zero2, tp and sp rules; the slow tier the rest, cp+tp included (the quick tier's
# context-parallel steps are test_context_parallel's).
HYBRIDS = ("fsdp+tp 2x2x2", "zero2+sp 2x2x2")
LAYOUTS = {
    "dp 2x4": ("dp", dict(data=2, fsdp=4)),
    "zero1 4x2": ("zero1", dict(data=4, fsdp=2)),
    "zero2 2x4": ("zero2", dict(data=2, fsdp=4)),
    "fsdp 2x4": ("fsdp", dict(data=2, fsdp=4)),
    "fsdp 4x2": ("fsdp", dict(data=4, fsdp=2)),
    "tp 4x2": ("tp", dict(data=4, tensor=2)),
    "sp 4x2": ("sp", dict(data=4, tensor=2)),
    "cp 2x4": ("cp", dict(data=2, sequence=4)),
    "fsdp+tp 2x2x2": ("fsdp+tp", dict(data=2, fsdp=2, tensor=2)),
    "cp+tp 2x2x2": ("cp+tp", dict(data=2, sequence=2, tensor=2)),
    "zero2+sp 2x2x2": ("zero2+sp", dict(data=1, fsdp=4, tensor=2)),
}


@pytest.mark.parametrize(
    "layout", [pytest.param(name, marks=[] if name in HYBRIDS else [pytest.mark.slow]) for name in LAYOUTS]
)
def test_sharded_step_equals_single_device(tmp_path, reference, layout):
    preset, sizes = LAYOUTS[layout]
    got = one_step(tmp_path, [*(f"mesh.{k}={v}" for k, v in sizes.items()), f"rules.preset={preset}"], 8)
    # The compared run really was sharded the way the preset says: wq is (layers, embed, heads, head_dim).
    wq = got[2].params["blocks"]["attn"]["wq"]
    expect = (None, "fsdp" if "fsdp" in preset else None, "tensor" if "tp" in preset or "sp" in preset else None)
    assert tuple(wq.sharding.spec)[:3] == expect, wq.sharding.spec
    if "cp" in preset:  # attention really went around the ring
        assert "collective-permute" in got[3].step_fn.as_text()
    assert_same_step(got, reference)


def test_gradient_accumulation_equals_full_batch(tmp_path, reference):
    got = one_step(tmp_path, ["mesh.data=1", "train.microbatches=4"], 1)
    assert_same_step(got, reference)


@pytest.fixture(scope="module")
def references_4_layers(tmp_path_factory):
    return Lazy(
        lambda tied: one_step(
            tmp_path_factory.mktemp("ref4"), ["mesh.data=1", "model.n_layers=4", f"model.tie_embeddings={tied}"], 1
        )
    )


@pytest.mark.parametrize(
    "kind, tied",
    [
        pytest.param("gpipe", False, marks=pytest.mark.slow),
        pytest.param("1f1b", False, marks=pytest.mark.slow),
        pytest.param(
            "1f1b",
            True,
            marks=pytest.mark.over_budget(
                "a pipelined step and its 4-layer 1-device reference compiled: ~14 s cold", seconds=40
            ),
        ),
    ],
)
def test_pipeline_step_equals_single_device(tmp_path, references_4_layers, kind, tied):
    # 4 stages of one layer x 2-way data parallel, 4 microbatches; tied
    # embeddings send the table's gradient through both ends of the pipeline.
    got = one_step(
        tmp_path,
        [
            "model.n_layers=4",
            "mesh.stage=4",
            "mesh.data=2",
            f"train.pipeline={kind}",
            "train.microbatches=4",
            f"model.tie_embeddings={tied}",
        ],
        8,
    )
    wq = got[2].params["blocks"]["attn"]["wq"]
    assert wq.sharding.spec[0] == "stage" and wq.addressable_shards[0].data.shape[0] == 1
    assert_same_step(got, references_4_layers[tied])


MOE = [
    "model.kind=moe",
    "model.moe.n_experts=8",
    "model.moe.top_k=2",
    "model.moe.d_expert=64",
    "model.moe.first_dense_layers=1",
    "model.moe.n_shared_experts=1",
]


@pytest.fixture(scope="module")
def moe_references(tmp_path_factory):
    return Lazy(
        lambda cf: one_step(
            tmp_path_factory.mktemp("moeref"), ["mesh.data=1", *MOE, f"model.moe.capacity_factor={cf}"], 1
        )
    )


@pytest.mark.parametrize(
    "sizes, preset, capacity",
    [
        pytest.param(dict(expert=4, data=2), "ep", "1.0", id="ep 4x2 capacity", marks=pytest.mark.slow),
        pytest.param(dict(expert=8, data=1), "ep", "null", id="ep 8 dropless", marks=pytest.mark.slow),
        pytest.param(
            dict(expert=2, fsdp=2, tensor=2),
            "fsdp+tp+ep",
            "1.0",
            id="fsdp+tp+ep 2x2x2",
            marks=pytest.mark.over_budget(
                "the quick tier's one expert-parallel step: a MoE step compiled on "
                "8 devices beside its 1-device reference, ~20 s cold",
                seconds=45,
            ),
        ),
    ],
)
def test_expert_parallel_moe_step_equals_single_device(tmp_path, moe_references, sizes, preset, capacity):
    got = one_step(
        tmp_path,
        [
            *MOE,
            f"model.moe.capacity_factor={capacity}",
            f"rules.preset={preset}",
            *(f"mesh.{k}={v}" for k, v in sizes.items()),
        ],
        8,
    )
    w_up = got[2].params["moe_blocks"]["moe"]["w_up"]  # (layers, expert, embed, mlp)
    assert w_up.sharding.spec[1] == "expert"
    assert w_up.addressable_shards[0].data.shape[1] == 8 // sizes["expert"]
    hlo = got[3].step_fn.as_text()
    assert "all-to-all" in hlo
    assert_same_step(got, moe_references[capacity])
    np.testing.assert_allclose(got[0]["dropped_fraction"], moe_references[capacity][0]["dropped_fraction"])


@pytest.mark.slow
def test_zero1_with_expert_parallelism_splits_the_dense_optimizer_state_over_experts_too(tmp_path, moe_references):
    """zero1+ep on data 2 x expert 4: a non-expert weight's Adam moments are split 8 ways (data x expert,
    DeepSeek-V3's ZeRO-1 over DP x EP), an expert weight's over its experts and the data axis; the step
    equals one device's."""
    got = one_step(
        tmp_path, [*MOE, "model.moe.capacity_factor=1.0", "rules.preset=zero1+ep", "mesh.data=2", "mesh.expert=4"], 8
    )
    mu = got[2].opt_state[1][0].mu  # optax chain: (clipping's empty state, (adam's state, ...))
    wq, w_up = mu["dense_blocks"]["attn"]["wq"][...], mu["moe_blocks"]["moe"]["w_up"][...]
    assert wq.addressable_shards[0].data.shape[1] == wq.shape[1] // 8
    assert w_up.addressable_shards[0].data.shape[1:3] == (w_up.shape[1] // 4, w_up.shape[2] // 2)
    assert_same_step(got, moe_references["1.0"])


@pytest.mark.parametrize(
    "sizes, preset",
    [
        pytest.param(dict(data=1), "dp", id="1 device", marks=pytest.mark.slow),
        pytest.param(dict(data=2, fsdp=2, tensor=2), "fsdp+tp", id="fsdp+tp 2x2x2"),
    ],
)
def test_pallas_attention_trains_like_xla(tmp_path, reference, sizes, preset):
    # The Pallas kernel runs in interpret mode on CPU; under a mesh, per device in shard_map.
    got = one_step(
        tmp_path,
        ["model.attention=pallas", f"rules.preset={preset}", *(f"mesh.{k}={v}" for k, v in sizes.items())],
        8 if len(sizes) > 1 else 1,
    )
    state, trainer = got[2], got[3]
    model = nnx.merge(trainer.graphdef, state.params, state.buffers)
    assert model.blocks.attn.impl == "pallas"  # the config reached the layer
    assert_same_step(got, reference)
