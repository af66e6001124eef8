"""Parameter-efficient fine-tuning, model side (models/lora.py, models/adapters.py):
step-0 equality with the base, merge/unmerge, trainable filters and their gradients,
hand parameter counts (src/meshwork/perf/peft_counts.py), QLoRA's 4-bit base, sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ROOT
from flax import nnx

from meshwork.config import load_config
from meshwork.config_sections import FinetuneConfig
from meshwork.models.build import build_model
from meshwork.models.layers.quantized import Int4Weight
from meshwork.models.lora import (
    TARGETS,
    AdapterParam,
    LoRA,
    LoRAParam,
    PrefixParam,
    apply_finetune,
    merge_lora,
    trainable,
    unmerge_lora,
)
from meshwork.models.quantize import quantize_model
from meshwork.models.transformer import apply_layers
from meshwork.partitioning import logical_specs, param_shardings
from meshwork.perf import peft_counts
from meshwork.sharding.mesh import make_mesh
from meshwork.sharding.parallel import use_rules
from meshwork.sharding.rules import rules_for, tree_shardings

# head_dim 16: QLoRA groups (along wo's head_dim too) of 16.
CFG = load_config(
    ROOT / "configs/lm_tiny.yaml",
    ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128"],
)
TOKENS = jax.random.randint(jax.random.key(0), (2, 16), 0, CFG.model.vocab_size)
ALL_TARGETS = list(TARGETS)


def ft(method: str, **kw) -> FinetuneConfig:
    return FinetuneConfig(**{"method": method, "base": "runs/base", "rank": 4, "alpha": 8.0, "group_size": 16, **kw})


def finetuned(f: FinetuneConfig) -> nnx.Module:
    model = build_model(CFG)
    apply_finetune(model, f, nnx.Rngs(1))
    return model


def run(model: nnx.Module, tokens=TOKENS) -> tuple[np.ndarray, float]:
    """(logits of `tokens`, compiled forward FLOPs), from one compile."""
    graphdef, state = nnx.split(model)
    compiled = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)).lower(state, tokens).compile()
    return np.asarray(compiled(state, tokens)), compiled.cost_analysis()["flops"]


def logits(model: nnx.Module, tokens=TOKENS) -> np.ndarray:
    return run(model, tokens)[0]


def loss_and_grad(model: nnx.Module, wrt):
    """A train-ish step, compiled: the next-token loss and its gradient wrt the `wrt` variables
    only; returns (step, trainable params, the rest, step FLOPs)."""
    graphdef, params, rest = nnx.split(model, wrt, ...)

    def loss(params, rest, tokens):
        logits_BLV = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits_BLV, tokens[:, 1:]).mean()

    step = jax.jit(jax.value_and_grad(loss)).lower(params, rest, TOKENS).compile()
    return step, params, rest, step.cost_analysis()["flops"]


def set_lora_b(model: nnx.Module, seed: int = 0) -> None:
    """Simulates training: random B factors (A is random already)."""
    for i, (_, node) in enumerate(nnx.iter_graph(model)):
        if isinstance(node, LoRA):
            b = node.lora_b
            b.set_value(0.05 * jax.random.normal(jax.random.key(seed + i), b.shape, b.get_value().dtype))


@pytest.fixture(scope="module")
def base_run():
    return run(build_model(CFG))


@pytest.fixture(scope="module")
def base_logits(base_run):
    return base_run[0]


@pytest.mark.parametrize("method", ["lora", "adapter"])
def test_step_zero_equals_the_base_exactly(method, base_logits):
    model = finetuned(ft(method, targets=ALL_TARGETS))
    np.testing.assert_array_equal(logits(model), base_logits)


def test_qlora_step_zero_equals_the_int4_base_exactly():
    base = build_model(CFG)
    quantize_model(base, "int4", group_size=16)
    model = finetuned(ft("qlora", targets=ALL_TARGETS))
    assert isinstance(model.blocks.attn.wq.base.get_value(), Int4Weight)
    np.testing.assert_array_equal(logits(model), logits(base))


def test_prefixes_change_the_output(base_logits):
    out = logits(finetuned(ft("prefix", prefix_len=4)))
    assert np.isfinite(out).all() and np.abs(out - base_logits).max() > 1e-3


def test_merge_equals_unmerged_costs_the_base_and_unmerge_restores_w0(base_run):
    base_logits, base_flops = base_run
    model = finetuned(ft("lora", targets=ALL_TARGETS))
    set_lora_b(model)
    w0 = {
        t: np.asarray(getattr(getattr(model.blocks, sub), name).base.get_value())
        for t, (sub, name, _) in TARGETS.items()
    }
    unmerged, unmerged_flops = run(model)
    assert np.abs(unmerged - base_logits).max() > 1e-3  # the deltas do something

    merged_sites = merge_lora(model)
    assert sorted(s.path[-1] for s in merged_sites) == sorted(name for _, name, _ in TARGETS.values())
    assert not any(isinstance(n, LoRA) for _, n in nnx.iter_graph(model))
    assert not nnx.state(model, LoRAParam)
    merged, merged_flops = run(model)
    np.testing.assert_allclose(merged, unmerged, atol=1e-5)
    assert merged_flops == base_flops < unmerged_flops

    unmerge_lora(model, merged_sites)
    for t, (sub, name, _) in TARGETS.items():
        lora = getattr(getattr(model.blocks, sub), name)
        assert isinstance(lora, LoRA)
        np.testing.assert_allclose(np.asarray(lora.base.get_value()), w0[t], atol=1e-6)
    np.testing.assert_allclose(logits(model), unmerged, atol=1e-5)


def test_qlora_merge_dequantizes_and_unmerge_restores_the_4bit_weight():
    model = finetuned(ft("qlora"))
    set_lora_b(model)
    q = model.blocks.attn.wq.base.get_value()
    unmerged = logits(model)
    merged_sites = merge_lora(model)
    assert isinstance(model.blocks.attn.wk.get_value(), Int4Weight)  # not a LoRA target: stays 4-bit
    assert model.blocks.attn.wq.get_value().dtype == jnp.float32  # merged: W0 dequantized + delta
    np.testing.assert_allclose(logits(model), unmerged, atol=1e-5)
    unmerge_lora(model, merged_sites)
    restored = model.blocks.attn.wq.base.get_value()
    assert isinstance(restored, Int4Weight)
    np.testing.assert_array_equal(restored.values, q.values)
    np.testing.assert_array_equal(restored.scales, q.scales)


@pytest.fixture(scope="module")
def full_grad_flops():
    return loss_and_grad(build_model(CFG), trainable(ft("full")))[3]


@pytest.mark.parametrize(
    "f",
    [ft("lora"), ft("qlora", targets=ALL_TARGETS), ft("adapter"), ft("prefix"), ft("prefix", prefix_hidden=16)],
    ids=["lora", "qlora", "adapter", "prefix", "prefix_mlp"],
)
def test_only_the_trainable_variables_train(f, full_grad_flops):
    model = finetuned(f)
    kind = trainable(f)
    assert kind is {"lora": LoRAParam, "qlora": LoRAParam, "adapter": AdapterParam, "prefix": PrefixParam}[f.method]
    step, params, rest, step_flops = loss_and_grad(model, kind)
    # Exactly the hand count, and every trainable variable has the leading layers axis.
    assert sum(x.size for x in jax.tree.leaves(params)) == peft_counts.finetune_params(CFG.model, f)
    for var in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        assert var.shape[0] == CFG.model.n_layers and var.get_metadata()["out_sharding"][0] == "layers"
    assert not any(isinstance(v, kind) for v in jax.tree.leaves(rest, is_leaf=lambda x: isinstance(x, nnx.Variable)))

    loss, grads = step(params, rest, TOKENS)
    flat = jax.tree.leaves(grads)
    assert np.isfinite(float(loss)) and all(np.isfinite(g).all() for g in flat)
    assert sum(float(jnp.abs(g).sum()) for g in flat) > 0
    # The frozen weights get no gradient, so the step does less work than full fine-tuning.
    assert step_flops < full_grad_flops


def test_full_and_none_leave_the_model_alone():
    for method in ("none", "full"):
        model = finetuned(ft(method))
        assert trainable(ft(method)) is nnx.Param
        assert not any(isinstance(n, LoRA) for _, n in nnx.iter_graph(model))


def test_gpt3_175b_lora_counts_match_the_paper():
    assert peft_counts.gpt3_175b_lora(1) == 96 * 2 * 2 * 12288
    assert peft_counts.millions(peft_counts.gpt3_175b_lora(1)) == "4.7M"
    assert peft_counts.millions(peft_counts.gpt3_175b_lora(8)) == "37.7M"


def test_gpt3_175b_adapter_and_prefix_counts():
    """Same shape (96 layers, d_model 12288, 96 heads of 128). Adapters (Houlsby, two per layer,
    with biases): the LoRA paper's Table 4 lists Adapter^H at 7.1M (r=1) and 40.1M (r=8)."""
    gpt3 = dict(n_layers=96, d_model=12288)
    assert peft_counts.millions(peft_counts.adapter_params(**gpt3, rank=1)) == "7.1M"
    assert peft_counts.millions(peft_counts.adapter_params(**gpt3, rank=8)) == "40.1M"
    # Prefix tuning of keys and values, 16 positions per layer: 96 x 16 x 2 x 12288 = 37.7M;
    # through a 512-wide reparameterization MLP it trains far more (the MLPs), 1.83B.
    direct = peft_counts.prefix_params(**gpt3, n_kv_heads=96, head_dim=128, prefix_len=16)
    assert direct == 96 * 16 * 2 * 12288
    mlp = peft_counts.prefix_params(**gpt3, n_kv_heads=96, head_dim=128, prefix_len=16, prefix_hidden=512)
    assert mlp == 96 * (16 * 12288 + 12288 * 512 + 512 + 512 * 2 * 12288 + 2 * 12288)


def test_count_formulas_equal_the_built_models():
    for f in (
        ft("lora", targets=ALL_TARGETS, rank=3),
        ft("qlora", targets=["k", "o", "down"], rank=2),
        ft("adapter", rank=5),
        ft("prefix", prefix_len=3),
        ft("prefix", prefix_len=3, prefix_hidden=7),
    ):
        model = nnx.eval_shape(lambda: finetuned(f))
        n = sum(x.size for x in jax.tree.leaves(nnx.state(model, trainable(f))))
        assert n == peft_counts.finetune_params(CFG.model, f), f


def test_qlora_frozen_weights_take_an_eighth_plus_scales():
    f = ft("qlora", targets=ALL_TARGETS)
    model = finetuned(f)
    n = f32_bytes = q_bytes = 0
    for _, node in nnx.iter_graph(model.blocks):
        if isinstance(node, LoRA):
            q = node.base.get_value()
            assert isinstance(q, Int4Weight) and q.group_size == f.group_size
            size = int(np.prod(q.shape))
            n, f32_bytes, q_bytes = n + 1, f32_bytes + 4 * size, q_bytes + q.nbytes
            assert q.values.nbytes == size // 2 and q.scales.nbytes == 4 * size // f.group_size
    assert n == len(TARGETS)
    assert q_bytes == f32_bytes // 8 + f32_bytes // f.group_size


def test_lora_dropout_draws_from_the_training_key_only():
    model = finetuned(ft("lora", dropout=0.5))
    set_lora_b(model)
    graphdef, state = nnx.split(model)
    apply = jax.jit(lambda s, t, k: nnx.merge(graphdef, s).apply(t, noise_key=k)[0])
    evaluate = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    k0, k1 = jax.random.key(0), jax.random.key(1)
    a, b, c = apply(state, TOKENS, k0), apply(state, TOKENS, k0), apply(state, TOKENS, k1)
    np.testing.assert_array_equal(a, b)
    assert np.abs(np.asarray(a - c)).max() > 1e-4
    no_dropout = finetuned(ft("lora"))
    set_lora_b(no_dropout)
    np.testing.assert_array_equal(evaluate(state, TOKENS), logits(no_dropout))


def test_lora_dropout_keys_are_set_per_layer_under_scan_and_remat():
    """apply_layers splits the key, one per layer, and sets it on that layer's LoRA modules: under
    lax.scan and remat it equals doing so by hand, layer by layer, and not one key for every layer.
    The key is no part of the model's state. (No key: test_lora_dropout_draws_from_the_training_key_only.)"""
    model = finetuned(ft("lora", dropout=0.5))
    set_lora_b(model)
    n = CFG.model.n_layers
    graphdef, stacked = nnx.split(model.blocks)
    x_BLD = jax.random.normal(jax.random.key(2), (2, 16, CFG.model.d_model))
    key = jax.random.key(3)

    @jax.jit
    def scanned(x_BLD, key):
        return apply_layers(graphdef, stacked, x_BLD, None, "full", dropout_key=key)

    @jax.jit
    def by_hand(x_BLD, keys):
        for i in range(n):
            block = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], stacked))
            for _, node in nnx.iter_graph(block):
                if isinstance(node, LoRA) and keys is not None:
                    node.dropout_key = keys[i]
            x_BLD = block(x_BLD)
        return x_BLD

    out = scanned(x_BLD, key)
    np.testing.assert_allclose(out, by_hand(x_BLD, jax.random.split(key, n)), atol=1e-5)
    assert np.abs(np.asarray(out - by_hand(x_BLD, jnp.stack([key] * n)))).max() > 1e-3
    np.testing.assert_array_equal(out, scanned(x_BLD, key))
    assert np.abs(np.asarray(out - scanned(x_BLD, jax.random.key(4)))).max() > 1e-3
    assert not any("dropout_key" in map(str, path) for path, _ in nnx.to_flat_state(nnx.state(model)))


def test_unsupported_combinations_fail_clearly():
    with pytest.raises(ValueError, match="finetune.dropout"):
        finetuned(ft("adapter", dropout=0.1))
    with pytest.raises(ValueError, match="group_size"):
        finetuned(ft("qlora", group_size=6))
    model = finetuned(ft("prefix"))
    with pytest.raises(NotImplementedError, match="prefix"):
        model.blocks.attn.cached(jnp.zeros((1, 1, CFG.model.d_model)), jnp.zeros((1, 1), jnp.int32), None)
    model = finetuned(ft("lora"))
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_finetune(model, ft("lora"), nnx.Rngs(2))


@pytest.mark.parametrize("method", ["lora", "qlora", "adapter", "prefix"])
def test_sharded_over_fsdp_equals_one_device(method):
    f = ft(method, targets=ALL_TARGETS)
    model = finetuned(f)
    set_lora_b(model)
    # fsdp also splits the batch (act_batch): 8 rows, one per device. jax 0.12 refuses to
    # return an output XLA split unevenly (2 rows over 8 devices); 0.10 replicated it.
    tokens = jax.random.randint(jax.random.key(0), (8, 16), 0, CFG.model.vocab_size)
    expected = logits(model, tokens)
    mesh, rules = make_mesh({"fsdp": 8}), rules_for("fsdp")
    graphdef, state = nnx.split(model)
    # A 4-bit weight's scale dims may not divide by the mesh: quantize's shardings replicate those.
    shardings = (
        param_shardings(state, mesh, rules) if method == "qlora" else tree_shardings(logical_specs(state), mesh, rules)
    )
    state = jax.device_put(state, shardings)
    if method in ("lora", "qlora"):
        a = state["blocks"]["attn"]["wq"]["lora_a"].get_value()  # (layers, embed, lora_rank)
        assert a.sharding.shard_shape(a.shape) == (CFG.model.n_layers, CFG.model.d_model // 8, f.rank)
    with jax.set_mesh(mesh), use_rules(rules):
        out = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5)
