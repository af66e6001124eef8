"""The MoE LM: parameter counts from config alone, training with balanced
experts, the auxiliary-loss-free bias update, and dense layers anywhere among
the MoE layers (`moe.dense_layers`: runs of stacked layers)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, optimized_override, tiny_overrides
from flax import nnx

from meshwork.config import ConfigError, load_config
from meshwork.config_sections import ModelConfig, MoEConfig
from meshwork.models.build import build_model
from meshwork.models.layers.moe_routing import RouterBias
from meshwork.models.moe import MoETransformer
from meshwork.perf.flops import gqa_attention_params, lm_param_counts, mla_attention_params, param_counts
from meshwork.perf.planner_weights import model_weights
from meshwork.run.metrics import read_metrics
from meshwork.train.loop import train


def actual_params(cfg) -> int:
    model = nnx.eval_shape(lambda: build_model(cfg))
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model.kind=moe"],
        [
            "model.kind=moe",
            "model.moe.n_shared_experts=2",
            "model.moe.shared_expert_gate=true",
            "model.moe.first_dense_layers=1",
            "model.tie_embeddings=true",
            "model.qkv_bias=true",
        ],
        ["model.kind=moe", "model.moe.router=noisy", "model.moe.n_shared_experts=1", "model.moe.d_shared=96"],
        ["model.kind=moe", "model.n_layers=4", "model.moe.first_dense_layers=0", "model.moe.dense_layers=[0,2]"],
    ],
    ids=["dense", "moe", "moe-shared-gated-dense-first-tied", "moe-noisy-shared", "moe-interleaved-dense"],
)
def test_param_count_formula_matches_the_model(tmp_path, overrides):
    cfg = load_config(ROOT / "configs/moe_tiny.yaml", [*tiny_overrides(tmp_path), *overrides])
    counts = param_counts(cfg.model)
    # The noisy router's noise weight is a second (D, E) router matrix.
    noise = cfg.model.d_model * cfg.model.moe.n_experts * (cfg.model.kind == "moe" and cfg.model.moe.router == "noisy")
    assert counts["total"] + noise == actual_params(cfg)
    assert counts["activated"] <= counts["total"]


def test_deepseek_v3_and_mixtral_counts_from_their_configs():
    # DeepSeek-V3's config.json numbers; nothing is allocated.
    attention = mla_attention_params(
        7168, 128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
    )
    v3 = lm_param_counts(
        vocab_size=129280,
        d_model=7168,
        n_layers=61,
        attention=attention,
        d_ff=18432,
        tie_embeddings=False,
        n_moe_layers=61 - 3,
        n_experts=256,
        top_k=8,
        d_expert=2048,
        d_shared=2048,
    )
    assert v3["total"] == pytest.approx(671e9, rel=0.005)  # "671B total"
    assert v3["activated"] == pytest.approx(37e9, rel=0.03)  # "37B activated"
    # Mixtral 8x7B: 46.7B total, 12.9B active (Mistral's announcement).
    mixtral = lm_param_counts(
        vocab_size=32000,
        d_model=4096,
        n_layers=32,
        d_ff=0,
        tie_embeddings=False,
        attention=gqa_attention_params(4096, 32, 8, 128),
        n_moe_layers=32,
        n_experts=8,
        top_k=2,
        d_expert=14336,
    )
    assert mixtral["total"] == pytest.approx(46.7e9, rel=0.005)
    assert mixtral["activated"] == pytest.approx(12.9e9, rel=0.01)


STEPS = 60


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    """moe_tiny with and without the load-balancing loss, same seed and steps."""
    out = {}
    for coef in (0.01, 0.0):
        run_dir = tmp_path_factory.mktemp(f"aux{coef}")
        cfg = load_config(
            ROOT / "configs/moe_tiny.yaml",
            [
                f"run.dir={run_dir}",
                f"train.steps={STEPS}",
                "data.seq_len=64",
                f"model.moe.aux_loss_coef={coef}",
                "mesh.data=8",
                f"log.eval_every={STEPS}",
                "log.progress=false",
                "log.tensorboard=false",
                optimized_override(),
            ],
        )
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
    cfg = load_config(
        ROOT / "configs/moe_tiny.yaml",
        [
            *tiny_overrides(tmp_path),
            "model.moe.router=sigmoid",
            "model.moe.bias_update_rate=0.01",
            "model.moe.aux_loss_coef=0",
            "train.steps=1",
            "mesh.data=8",
            "log.every=1",
        ],
    )
    out = train(cfg)
    bias = out["state"].buffers["moe_blocks"]["moe"]["router_bias"]
    assert isinstance(bias, RouterBias)  # a buffer: never touched by the optimizer
    load = np.asarray(read_metrics(tmp_path)[-1]["load_per_layer"])
    assert load.shape == (cfg.model.n_layers - 1, 8)
    # One step from zero: +rate for each layer's under-loaded experts, -rate for the over-loaded.
    np.testing.assert_allclose(np.asarray(bias[...]), 0.01 * np.sign(1 / 8 - load), atol=1e-7)


# ---------------------------------------------------------------- dense layers anywhere


def _model(dense_layers=(1,), **moe):
    cfg = ModelConfig(
        kind="moe",
        vocab_size=64,
        d_model=32,
        n_layers=3,
        n_heads=2,
        n_kv_heads=1,
        d_ff=48,
        moe=MoEConfig(n_experts=4, top_k=2, d_expert=16, capacity_factor=None, dense_layers=dense_layers, **moe),
    )
    return nnx.jit(lambda: MoETransformer(cfg, rngs=nnx.Rngs(0)))()  # eager init of stacked layers is slow


def test_dense_layers_anywhere_run_in_layer_order():
    """MoE, dense, MoE: three runs, each scanned; the model equals its layers applied one by one,
    the KV-cache path gives the same logits, and the statistics have one row per MoE layer."""
    from meshwork.engine.kv_cache import KVCache

    model = _model()
    assert [(r.name, r.moe, r.start, r.count) for r in model.runs] == [
        ("moe_blocks_0", True, 0, 1),
        ("dense_blocks_1", False, 1, 1),
        ("moe_blocks_2", True, 2, 1),
    ]
    assert sorted(nnx.to_pure_dict(nnx.state(model, nnx.Param))) == [
        "dense_blocks_1",
        "embed",
        "head",
        "moe_blocks_0",
        "moe_blocks_2",
    ]
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 64)

    @nnx.jit  # one compile for the three (eager, each operation would compile on its own)
    def forward(model, tokens):
        logits, stats = model.apply(tokens)
        x = model.embed(tokens)
        for run in model.runs:
            graphdef, stacked = nnx.split(getattr(model, run.name))
            for i in range(run.count):
                block = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], stacked))
                x = block(x)[0] if run.moe else block(x)
        cache = KVCache.zeros(model.cfg, batch=2, max_len=8)
        cached, _ = model.decode(tokens, jnp.broadcast_to(jnp.arange(8), (2, 8)), cache)
        return logits, stats, model.head(x, model.embed), cached

    logits, stats, reference, cached = forward(model, tokens)
    assert stats["load_per_layer"].shape == (2, 4)
    np.testing.assert_allclose(np.asarray(reference), np.asarray(logits), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(cached), np.asarray(logits), rtol=1e-5, atol=1e-5)


def test_the_bias_update_reaches_every_moe_run():
    model = _model(router="sigmoid", bias_update_rate=0.01)
    _, _, buffers = nnx.split(model, nnx.Param, ...)
    load = jnp.array([[0.4, 0.1, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4]])
    new = nnx.to_pure_dict(model.updated_buffers(buffers, {"load_per_layer": load}))
    for run, row in (("moe_blocks_0", 0), ("moe_blocks_2", 1)):
        np.testing.assert_allclose(
            np.asarray(new[run]["moe"]["router_bias"][0]), 0.01 * np.sign(0.25 - np.asarray(load[row])), atol=1e-7
        )


def test_the_planner_mirrors_interleaved_runs():
    from meshwork.train.optim import make_optimizer
    from meshwork.train.state import abstract_state

    cfg = load_config(
        ROOT / "configs/moe_tiny.yaml", ["model.moe.first_dense_layers=0", "model.moe.dense_layers=[1,2]"]
    )
    _, abstract = abstract_state(cfg, make_optimizer(cfg.optimizer, 10)[0])
    real = {
        ".".join(map(str, path)): (tuple(v.shape), tuple(v.get_metadata()["out_sharding"]))
        for path, v in nnx.to_flat_state(abstract.params)
    }
    assert {w.path: (w.shape, w.names) for w in model_weights(cfg.model)} == real
    assert {k.split(".")[0] for k in real} == {"embed", "head", "moe_blocks_0", "dense_blocks_1", "moe_blocks_3"}


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["model.moe.dense_layers=[0,2]"],
            "model.moe.dense_layers: \\[0, 2\\] with model.moe.first_dense_layers=1: set one of them",
        ),
        (["model.moe.first_dense_layers=0", "model.moe.dense_layers=[2,0]"], "list each layer once, in increasing"),
        (["model.moe.first_dense_layers=0", "model.moe.dense_layers=[1,1]"], "list each layer once"),
        (
            ["model.moe.first_dense_layers=0", "model.moe.dense_layers=[0,4]"],
            "layer 4 is past the last layer of model.n_layers=4",
        ),
        (["model.moe.first_dense_layers=0", "model.moe.dense_layers=[0,1,2,3]"], "makes every layer dense"),
        (["model.moe.first_dense_layers=4"], "model.moe.first_dense_layers: 4 leaves no MoE layer"),
    ],
)
def test_dense_layer_settings_are_checked(overrides, match):
    with pytest.raises(ConfigError, match=match) as info:
        load_config(ROOT / "configs/moe_tiny.yaml", overrides)
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_interleaved_runs_under_expert_parallelism_equal_one_device(tmp_path):
    """MoE then dense layer (trailing dense: general run names) under fsdp+tp+ep on 8 devices:
    each run's experts are split over `expert` and the step equals the single-device one."""
    from test_sharded_step import assert_same_step, one_step

    moe = [
        "model.kind=moe",
        "model.moe.n_experts=8",
        "model.moe.top_k=2",
        "model.moe.d_expert=64",
        "model.moe.dense_layers=[1]",
        "model.moe.n_shared_experts=1",
        "model.moe.capacity_factor=1.0",
    ]
    want = one_step(tmp_path / "one", ["mesh.data=1", *moe], 1)
    got = one_step(
        tmp_path / "ep", [*moe, "rules.preset=fsdp+tp+ep", "mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"], 8
    )
    assert sorted(got[2].params) == ["dense_blocks_1", "embed", "head", "moe_blocks_0"]
    assert got[2].params["moe_blocks_0"]["moe"]["w_up"].sharding.spec[1] == "expert"
    assert "all-to-all" in got[3].step_fn.as_text()
    assert_same_step(got, want)


def test_layer_run_doctests():
    import doctest

    import meshwork.config_sections

    assert doctest.testmod(meshwork.config_sections).failed == 0
