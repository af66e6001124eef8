"""Quantized inference (models/quantize.py): exact formats, exact bytes, small loss rises,
an integer dot for w8a8, and a quantized model sharded like a float one."""

import doctest
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshwork.models.quantize as qz
from meshwork.config_sections import ModelConfig, MoEConfig
from meshwork.data import text as data_lib
from meshwork.evaluation.lm_loss import validation_loss
from meshwork.models.layers.mlp import SwiGLU
from meshwork.models.layers.quantized import (
    Int4Weight,
    Int8Weight,
    W8A8Weight,
    pack_int4,
    parse_spec,
    quantize_activations,
    quantize_weight,
    unpack_int4,
)
from meshwork.models.quantize import quantize_model, weight_bytes
from meshwork.partitioning import param_shardings
from meshwork.sharding.mesh import make_mesh
from meshwork.sharding.parallel import use_rules
from meshwork.sharding.rules import rules_for
from meshwork.train.task import make_task

N_VAL_BATCHES = 4  # the trainer's default log.eval_batches: the same val_loss it logs
# At the precision docs/inference.md states (int8 +0.00%, int4 +0.15% on lm_tiny after 200 steps,
# benchmarks/quantize.py): the suite's 100-step lm_tiny rose int8 +0.001%, int4 +0.054%, w8a8 +0.003%
# (2026-12-05). The bounds were 1%, 5% and 2%: a rise 30x the documented one passed.
MAX_RISE = {"int8": 0.0002, "int4": 0.002, "w8a8": 0.0005}

# Every projection's einsum, with small shapes: B L D H G K F V = 2 3 64 4 2 32 96 64.
SIZES = dict(B=2, L=3, D=64, H=4, G=2, K=32, F=96, V=64)
FORMATS = ("int8", "int4", "w8a8")
SPECS = sorted({*qz.ATTENTION_SPECS.values(), *qz.MLP_SPECS.values(), *qz.HEAD_SPECS.values()})


def operands(spec, seed=0, layers=None):
    x_letters, w_letters, _ = parse_spec(spec)
    kx, kw = jax.random.split(jax.random.key(seed))
    w_shape = ((layers,) if layers else ()) + tuple(SIZES[c] for c in w_letters)
    return (jax.random.normal(kx, [SIZES[c] for c in x_letters]), jax.random.normal(kw, w_shape) * 0.05)


# ---------------------------------------------------------------- formats


def test_docstring_examples():
    assert doctest.testmod(qz, optionflags=doctest.ELLIPSIS).failed == 0


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_int4_pack_unpack_round_trips_exactly(axis):
    shape = [6, 4, 8]
    values = jax.random.randint(jax.random.key(axis % 3), shape, -8, 8).astype(jnp.int8)
    values = values.at[(0,) * 3].set(-8).at[(1,) * 3].set(7)  # both ends of the range
    packed = pack_int4(values, axis)
    assert packed.dtype == jnp.int8
    assert packed.shape[axis] == shape[axis] // 2 and packed.size == values.size // 2
    np.testing.assert_array_equal(unpack_int4(packed, axis), values)


def test_int4_packs_neighbours_into_one_byte():
    # element 2i low nibble, 2i+1 high nibble: a contiguous slice of bytes is a contiguous slice of values
    packed = pack_int4(jnp.array([1, -2, 7, -8], jnp.int8), 0)
    np.testing.assert_array_equal(np.asarray(packed).view(np.uint8), [0xE1, 0x87])


@pytest.mark.parametrize("spec", SPECS)
def test_matmul_equals_einsum_with_dequantized_weight(spec):
    x_letters, _, out = parse_spec(spec)
    contracted = tuple(i for i, c in enumerate(x_letters) if c not in out)

    @jax.jit
    def run(x, w):  # every format in one program: one compile per spec
        results = {}
        for fmt in FORMATS:
            q = quantize_weight(w, spec, fmt)
            x_hat = x
            if fmt == "w8a8":  # the activations are quantized too: dequantize them explicitly as well
                x_q, x_s = quantize_activations(x, contracted)
                x_hat = x_q.astype(jnp.float32) * x_s
            w_hat = q.dequantize()
            # Rounding to the nearest step: the error is at most half a step, per scale.
            step = jnp.repeat(q.scales, q.group_size, axis=q.axis) if fmt == "int4" else q.scales
            results[fmt] = (
                q.matmul(spec, x, jnp.float32),
                jnp.einsum(spec, x_hat, w_hat, precision="highest"),
                jnp.max(jnp.abs(w_hat - w) / step),
                w_hat.shape,
            )
        return results

    x, w = operands(spec)
    for fmt, (got, ref, max_error_in_steps, shape) in run(x, w).items():
        assert shape == w.shape, fmt
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5, err_msg=fmt)
        assert float(max_error_in_steps) <= 0.5 + 1e-5, fmt


@pytest.mark.parametrize("fmt", FORMATS)
def test_stacked_weights_are_quantized_per_layer(fmt):
    spec = "BLHK,HKD->BLD"
    _, w_NHKD = operands(spec, layers=3)
    w_NHKD = w_NHKD * jnp.array([1.0, 10.0, 0.1])[:, None, None, None]  # very different layer ranges
    q = quantize_weight(w_NHKD, spec, fmt)
    for i in range(3):
        layer = jax.tree.map(lambda a: a[i], q)  # what the layer scan sees
        alone = quantize_weight(w_NHKD[i], spec, fmt)
        for a, b in zip(jax.tree.leaves(layer), jax.tree.leaves(alone)):
            np.testing.assert_array_equal(a, b)


def test_formats_and_scale_shapes():
    def q(shape, spec, fmt, **kw):  # shapes and dtypes only: nothing is computed
        return jax.eval_shape(lambda: quantize_weight(jnp.zeros(shape), spec, fmt, **kw))

    q8 = q((2, 64, 4, 32), "BLD,DHK->BLHK", "int8")  # wq with a layers axis: (N, D, H, K)
    assert isinstance(q8, Int8Weight) and q8.values.dtype == jnp.int8 and q8.scales.dtype == jnp.float32
    assert q8.values.shape == (2, 64, 4, 32) and q8.scales.shape == (2, 1, 4, 32)
    q4 = q((2, 64, 4, 32), "BLD,DHK->BLHK", "int4", group_size=16)
    assert isinstance(q4, Int4Weight) and q4.values.dtype == jnp.int8
    assert q4.values.shape == (2, 32, 4, 32) and q4.scales.shape == (2, 4, 4, 32) and q4.group_size == 16
    # wo contracts H and K: per output channel D; int4 groups run along K
    assert q((2, 4, 32, 64), "BLHK,HKD->BLD", "int8").scales.shape == (2, 1, 1, 64)
    assert q((2, 4, 32, 64), "BLHK,HKD->BLD", "int4").scales.shape == (2, 4, 1, 64)
    assert isinstance(q((64, 96), "BLD,DF->BLF", "w8a8"), W8A8Weight)


def test_w8a8_mlp_compiles_to_an_integer_dot():
    mlp = SwiGLU(64, 96, init_std=0.05, out_std=0.05, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    for name, spec in qz.MLP_SPECS.items():
        param = getattr(mlp, name)
        param.set_value(quantize_weight(param.get_value(), spec, "w8a8"))
    gdef, state = nnx.split(mlp)
    x = jax.random.normal(jax.random.key(1), (2, 8, 64))
    hlo = jax.jit(lambda s, x: nnx.merge(gdef, s)(x)).lower(state, x).compile().as_text()
    dots = hlo_dots(hlo)
    assert dots.count(("s32", "s8", "s8")) == 3, dots  # gate, up and down
    assert not any(t != "s32" for t, _, _ in dots), dots


def hlo_dots(hlo: str) -> list[tuple[str, str, str]]:
    """(result, lhs, rhs) element types of every dot/convolution in compiled HLO text,
    operand types looked up in the computation (fusion) that holds the dot."""
    dots = []
    for body in re.findall(r"\{\n(.*?)\n\}", hlo, flags=re.S):
        types = dict(re.findall(r"%(\S+) = (\w+)\[", body))
        for result, lhs, rhs in re.findall(r"= (\w+)\[[^\]]*\]\S* (?:dot|convolution)\(%([^,\s)]+), %([^,\s)]+)", body):
            dots.append((result, types.get(lhs), types.get(rhs)))
    return dots


# ---------------------------------------------------------------- models


def tiny_lm(**moe):
    from meshwork.models.moe import MoETransformer
    from meshwork.models.transformer import Transformer

    cfg = ModelConfig(
        vocab_size=32,
        d_model=64,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        d_ff=96,
        **({"kind": "moe", "moe": MoEConfig(**moe)} if moe else {}),
    )
    # Built under jit: eager init of the stacked (vmapped) layers costs seconds.
    return nnx.jit(lambda: (MoETransformer if moe else Transformer)(cfg, rngs=nnx.Rngs(0)))()


def test_unknown_mode_and_bad_group_size_are_clear_errors():
    model = tiny_lm()
    with pytest.raises(ValueError, match="'int3'; choose one of none, int8, int4, w8a8"):
        quantize_model(model, "int3")
    with pytest.raises(ValueError, match=r"group_size=64 .* divide .*K=32 of blocks/attn/wo"):
        quantize_model(model, "int4", group_size=64)  # head_dim 32: groups along K cannot be 64 long
    with pytest.raises(ValueError, match=r"group_size=24 .* divide .*D=64 of blocks/attn/wq"):
        quantize_model(model, "int4", group_size=24)
    quantize_model(model, "none")
    assert set(qz.describe(model).values()) == {"float32"}
    quantize_model(model, "int8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(model, "int4")


def test_moe_model_quantizes_attention_and_head_but_not_experts():
    model = tiny_lm(n_experts=4, top_k=2, d_expert=32, n_shared_experts=1, first_dense_layers=1)
    quantize_model(model, "w8a8")
    formats = qz.describe(model)
    assert formats["moe_blocks/attn/wq"] == "int8" and formats["head/lm_head"] == "int8"
    assert formats["dense_blocks/mlp/w_down"] == "w8a8"
    assert not any("moe/" in path for path in formats)
    moe = model.moe_blocks.moe
    for p in (moe.w_gate, moe.w_up, moe.w_down, moe.router, moe.shared.w_gate, model.embed.table):
        assert isinstance(p.get_value(), jax.Array)
    gdef, state = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, 32)
    logits = jax.jit(lambda s, t: nnx.merge(gdef, s).apply(t)[0])(state, tokens)
    assert logits.shape == (2, 8, 32) and bool(jnp.isfinite(logits).all())


@pytest.fixture(scope="module")
def trained(lm_tiny_runs):
    from meshwork.inference.runs import load_run

    summary = lm_tiny_runs["1dev"]
    cfg, model, _ = load_run(summary["run_dir"])
    task = make_task(cfg)
    batches = data_lib.eval_batches(str(task.val), cfg.data.seq_len, cfg.train.global_batch, N_VAL_BATCHES)
    return dict(cfg=cfg, model=model, batches=batches, summary=summary)


@pytest.fixture(scope="module")
def quantized(trained):
    """mode -> a quantized copy of the trained model, made on first use."""

    class Models(dict):
        def __missing__(self, mode):
            model = nnx.clone(trained["model"])
            quantize_model(model, mode)
            self[mode] = model
            return model

    return Models()


@pytest.fixture(scope="module")
def val_losses(trained, quantized):
    return {mode: validation_loss(quantized[mode], trained["batches"]) for mode in ("none", *MAX_RISE)}


def test_float_loss_is_the_trainers_val_loss(trained, val_losses):
    logged = trained["summary"]["val_loss"]
    assert val_losses["none"] == pytest.approx(logged[max(logged)], rel=1e-5)


@pytest.mark.parametrize("mode", list(MAX_RISE))
def test_quantized_val_loss_rises_little(mode, val_losses):
    rise = val_losses[mode] / val_losses["none"] - 1
    print(f"{mode}: val loss {val_losses[mode]:.4f} vs {val_losses['none']:.4f} ({rise:+.3%})")
    assert rise < MAX_RISE[mode]


def expected_projection_bytes(model, mode, group_size=32):
    """From the float weights' shapes: int8 n + 4n/C (C contracted inputs per output), int4 n/2 + 4n/g."""
    total = 0
    for site in qz.projection_sites(model):
        shape = site.param.get_value().shape
        _, w_letters, out = parse_spec(site.spec)
        n = math.prod(shape)
        c = math.prod(shape[-len(w_letters) + i] for i, l in enumerate(w_letters) if l not in out)
        total += {"none": 4 * n, "int8": n + 4 * n // c, "w8a8": n + 4 * n // c, "int4": n // 2 + 4 * n // group_size}[
            mode
        ]
    return total


@pytest.mark.parametrize("mode", ["none", "int8", "int4", "w8a8"])
def test_weight_bytes_are_exact(mode, trained, quantized):
    f32 = weight_bytes(trained["model"])
    got = weight_bytes(quantized[mode])
    assert got["projections"] == expected_projection_bytes(trained["model"], mode)
    assert got["projections_f32"] == f32["projections"] == f32["projections_f32"]
    assert got["other"] == f32["other"] and got["total"] == got["projections"] + got["other"]
    scales = {
        "none": 0,
        "int8": f32["projections"] // 128,
        "w8a8": f32["projections"] // 128,
        "int4": f32["projections"] // 32,
    }[mode]  # lm_tiny: every projection contracts >= 128 inputs
    ratio = {"none": 1, "int8": 4, "w8a8": 4, "int4": 8}[mode]
    assert got["projections"] <= f32["projections"] // ratio + scales


@pytest.mark.parametrize("mode", ["int4", "w8a8"])  # w8a8: int8 attention and head, w8a8 MLP
def test_sharded_quantized_model_equals_unsharded(mode, trained, quantized):
    model = quantized[mode]
    mesh, rules = make_mesh({"data": 4, "tensor": 2}), rules_for("tp")
    gdef, state = nnx.split(model)
    tokens = jnp.asarray(trained["batches"][0]["inputs"][:8, :32])
    forward = lambda s, t: nnx.merge(gdef, s)(t)  # noqa: E731
    ref = jax.jit(forward)(state, tokens)
    with jax.set_mesh(mesh), use_rules(rules):
        shardings = param_shardings(state, mesh, rules)
        placed = jax.device_put(state, shardings)
        logits = jax.jit(forward)(placed, tokens)
    # Heads, MLP hidden and vocab are split over tensor=2, including packed values and scales.
    wq, wo, w_down = (placed["blocks"]["attn"]["wq"], placed["blocks"]["attn"]["wo"], placed["blocks"]["mlp"]["w_down"])
    local = lambda a: a.addressable_shards[0].data.shape  # noqa: E731
    N, D, H, K = wq.get_value().shape
    F = w_down.get_value().shape[1]
    if mode == "int4":
        assert local(wq.get_value().values) == (N, D // 2, H // 2, K)
        assert local(wq.get_value().scales) == (N, D // 32, H // 2, K)
        assert local(w_down.get_value().values) == (N, F // 4, D)
        assert local(wo.get_value().scales) == (N, H // 2, 1, D)
    else:
        assert local(wq.get_value().values) == (N, D, H // 2, K)
        assert local(w_down.get_value().values) == (N, F // 2, D)
        assert local(w_down.get_value().scales) == (N, 1, D)  # size-1 mlp dim: replicated
        assert all(a is None for a in shardings["blocks"]["attn"]["wo"].get_value().scales.spec)
    assert local(placed["head"]["lm_head"].get_value().values)[-1] == 128
    if mode == "int4":
        np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=0)
    else:
        # The all-reduced residual stream differs from the single-device one by reassociation
        # (~1e-7), and now and then that moves an activation across a rounding boundary of its
        # int8 grid: one step on one token. Measured: 7 of 256 tokens off by more than 1e-4,
        # at most 0.01 (logits up to 9).
        diff = np.abs(np.asarray(logits) - np.asarray(ref))
        assert diff.max() < 0.05 and (diff.max(-1) > 1e-4).mean() < 0.1
