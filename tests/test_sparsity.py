"""Pruning (models/sparsity.py): exact 2:4 and unstructured masks, a compact 2:4 format whose
bytes and products are exact, a model that runs on it, and masked fine-tuning that keeps the mask."""

import doctest
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, tiny_overrides
from flax import nnx

import meshwork.models.quantize as qz
import meshwork.models.sparsity as sp
from meshwork.config import load_config
from meshwork.config_sections import ModelConfig
from meshwork.models.layers.quantized import parse_spec
from meshwork.models.quantize import weight_bytes
from meshwork.models.sparsity import (
    Sparse24Weight,
    compact_24,
    compact_bytes,
    compact_model,
    mask_24,
    matmul_24_gather,
    prune_model,
    prune_weight,
    unstructured_mask,
)
from meshwork.models.transformer import Transformer
from meshwork.train.sparse_recovery import recover

SIZES = dict(B=2, L=3, D=64, H=4, G=2, K=32, F=96, V=64)
SPECS = sorted({*qz.ATTENTION_SPECS.values(), *qz.MLP_SPECS.values(), *qz.HEAD_SPECS.values()})


def operands(spec, seed=0, layers=None):
    x_letters, w_letters, _ = parse_spec(spec)
    kx, kw = jax.random.split(jax.random.key(seed))
    w_shape = ((layers,) if layers else ()) + tuple(SIZES[c] for c in w_letters)
    return jax.random.normal(kx, [SIZES[c] for c in x_letters]), jax.random.normal(kw, w_shape) * 0.05


def tiny_model():
    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, tie_embeddings=False)
    return Transformer(cfg, rngs=nnx.Rngs(0))


def test_docstring_examples():
    assert doctest.testmod(sp, optionflags=doctest.ELLIPSIS).failed == 0


# ---------------------------------------------------------------- masks


@functools.cache
def pruned_and_products(spec):
    """One compile per spec: a stacked weight (3 layers) 2:4-pruned, its compact form densified, and
    layer 0's product through the compact matmul (sliced as the layer scan slices it) and dense."""
    x, w = operands(spec, seed=1, layers=3)

    @jax.jit
    def run(x, w):
        pruned, mask = prune_weight(w, spec, "2:4")
        c = compact_24(w, spec)
        layer0 = jax.tree.map(lambda a: a[0], c)
        dense = jnp.einsum(spec, x, pruned[0], precision="highest")
        return pruned, mask, c.densify(), dense, layer0.matmul(spec, x, jnp.float32)

    return (w, *run(x, w))


@pytest.mark.parametrize("spec", SPECS)
def test_24_mask_keeps_the_two_largest_of_every_four_inputs(spec):
    w, pruned, mask, *_ = pruned_and_products(spec)
    axis = sp.input_axis(spec, w.ndim)
    groups = np.moveaxis(np.asarray(mask), axis, -1).reshape(-1, 4)
    assert (groups.sum(-1) == 2).all()  # exactly 2 zeros in every group of 4 along the input dim
    mags = np.abs(np.moveaxis(np.asarray(w), axis, -1).reshape(-1, 4))
    kept_min = np.where(groups, mags, np.inf).min(-1)
    dropped_max = np.where(groups, -np.inf, mags).max(-1)
    assert (kept_min >= dropped_max).all()  # the 2 kept are the 2 largest |w|
    np.testing.assert_array_equal(np.asarray(pruned), np.where(mask, w, 0))


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.5, 0.9])
def test_unstructured_zeroes_exactly_the_fraction_per_matrix(fraction):
    _, w = operands("BLD,DF->BLF", layers=3)
    w = w.at[0, :4, 0].set(0.0)  # ties at zero do not change the count
    pruned, mask = prune_weight(w, "BLD,DF->BLF", "unstructured", fraction)
    n = SIZES["D"] * SIZES["F"]
    for layer in range(3):  # each layer is its own matrix, with its own threshold
        assert int((~mask[layer]).sum()) == round(fraction * n)
        assert int((pruned[layer] == 0).sum()) == max(round(fraction * n), 4 if layer == 0 else 0)
        m = np.abs(np.asarray(w[layer]))
        if 0 < fraction:
            assert m[~np.asarray(mask[layer])].max() <= m[np.asarray(mask[layer])].min()


def test_prune_rejects_bad_input_with_the_fix():
    with pytest.raises(ValueError, match="choose one of unstructured, 2:4"):
        prune_weight(jnp.ones((8, 8)), "TD,DF->TF", "1:4")
    with pytest.raises(ValueError, match="multiple of 8"):
        mask_24(jnp.ones((12, 8)), axis=0)
    with pytest.raises(ValueError, match="between 0 and 1"):
        unstructured_mask(jnp.ones((8, 8)), 1.5)


# ---------------------------------------------------------------- compact 2:4


@pytest.mark.parametrize("spec", SPECS)
def test_compact_matmul_equals_dense_matmul_of_the_masked_weight(spec):
    _, pruned, _, densified, dense, got = pruned_and_products(spec)
    np.testing.assert_array_equal(densified, pruned)  # the round trip is exact
    err = float(jnp.max(jnp.abs(got - dense)))
    assert err <= 1e-6 * max(1.0, float(jnp.max(jnp.abs(dense)))), err


def test_gather_matmul_never_building_the_dense_weight_matches():
    kx, kw = jax.random.split(jax.random.key(2))
    x, w = jax.random.normal(kx, (5, 128)), jax.random.normal(kw, (128, 96))
    c = compact_24(w, "TD,DF->TF")
    dense = jnp.dot(x, c.densify(), precision="highest")
    got = matmul_24_gather(x, c)
    assert float(jnp.max(jnp.abs(got - dense))) <= 1e-6 * float(jnp.max(jnp.abs(dense)))
    # The program holds no (D, F) array: only the (T, D/2, F) gathered inputs.
    hlo = matmul_24_gather.lower(x, c).compile().as_text()
    assert "f32[128,96]" not in hlo


@pytest.mark.parametrize("dtype, fraction", [(jnp.float32, 0.5 + 1 / 32), (jnp.bfloat16, 0.5 + 1 / 16)])
def test_compact_bytes_are_half_the_values_plus_two_bits_per_kept_value(dtype, fraction):
    w = jax.random.normal(jax.random.key(3), (2, 128, 96)).astype(dtype)
    c = compact_24(w, "BLD,DF->BLF")
    assert c.values.dtype == dtype and c.indices.dtype == jnp.uint8
    dense = w.size * jnp.dtype(dtype).itemsize
    assert c.values.nbytes == dense // 2
    assert c.indices.nbytes * 8 == (w.size // 2) * 2  # 2 bits per kept value
    assert c.nbytes == dense * fraction  # f32: 17/32 = 0.53125 of dense; bf16: 9/16
    assert compact_bytes(w.shape, dtype) == {
        "values": c.values.nbytes,
        "indices": c.indices.nbytes,
        "total": c.nbytes,
        "dense": dense,
    }


def test_index_packing_round_trips():
    idx = jax.random.randint(jax.random.key(4), (3, 16), 0, 4)
    packed = sp.pack_indices(idx)
    assert packed.shape == (3, 4) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(sp.unpack_indices(packed), idx)


# ---------------------------------------------------------------- models


def test_prune_model_and_compact_model_run_the_same_pruned_model():
    model = tiny_model()
    tokens = jax.random.randint(jax.random.key(5), (2, 16), 0, 64)
    before = weight_bytes(model)
    for method, fraction in [("unstructured", 0.5), ("2:4", 0.5)]:
        params, masks = prune_model(model, method, fraction)
        assert set(masks) == {s.path for s in qz.projection_sites(model)}
        flat = {sp._path_str(p): v for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
        for path, mask in masks.items():
            np.testing.assert_array_equal(flat[path] == 0, ~mask)
            assert float(mask.mean()) == 0.5
    # model itself is untouched; the pruned one is a copy updated with the params
    assert not any(float(v) for v in sp.sparsity(model).values())
    pruned = nnx.clone(model)
    nnx.update(pruned, params)  # the 2:4 params
    compact = nnx.clone(pruned)
    compact_model(compact)
    assert all(isinstance(s.param.get_value(), Sparse24Weight) for s in qz.projection_sites(compact))
    forward = jax.jit(lambda m, t: m(t))
    np.testing.assert_allclose(forward(compact, tokens), forward(pruned, tokens), atol=1e-5, rtol=1e-5)
    after = weight_bytes(compact)
    assert after["projections"] * 32 == before["projections"] * 17
    assert after["other"] == before["other"]


def test_masked_finetuning_keeps_the_mask(tmp_path):
    cfg = load_config(
        ROOT / "configs/lm_tiny.yaml",
        [*tiny_overrides(tmp_path), "mesh.data=1", "train.steps=3", "optimizer.lr=1e-3", "optimizer.warmup_steps=0"],
    )
    from meshwork.models.build import build_model

    model = build_model(cfg)
    params, masks = prune_model(model, "2:4")
    out, losses = recover(cfg, params, masks, devices=jax.devices()[:1])
    assert len(losses) == 3 and all(np.isfinite(losses))
    flat_in = {sp._path_str(p): v for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    flat_out = {sp._path_str(p): v for p, v in jax.tree_util.tree_flatten_with_path(out)[0]}
    for path, mask in masks.items():
        np.testing.assert_array_equal(flat_out[path][~mask], 0)  # pruned weights stayed zero
        assert not np.array_equal(flat_out[path][mask], flat_in[path][mask])  # the kept ones trained
