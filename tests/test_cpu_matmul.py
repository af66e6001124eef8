"""The C++ matmul kernel XLA:CPU calls for decode's projections (kernels/cpu_matmul.py), the packed
weight format models read it through (models/layers/packed.py) and packing a model (models/pack.py).

The kernel is built by the machine's C++ compiler: without one these tests fail, not skip."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshwork.config_sections import ModelConfig
from meshwork.engine.generate import Generator
from meshwork.engine.kv_cache import KVCache
from meshwork.engine.sampling import SamplingParams
from meshwork.kernels import cpu_matmul
from meshwork.models.layers.packed import PackedWeight, pack_weight
from meshwork.models.pack import pack_for_cpu_decode
from meshwork.models.transformer import Transformer

CALL = f'custom_call_target="{cpu_matmul.TARGET}"'


def compiled(fn, *args):
    """`fn` compiled for `args`: run it, and count its kernel calls in `.as_text()`."""
    return jax.jit(fn).lower(*args).compile()


@pytest.mark.parametrize("M", [1, 6, 43])
def test_packed_product_equals_float64_reference_with_padded_columns(M):
    """K not a multiple of the vector width, N not one of the tile width (zero-padded columns cut off):
    the kernel (one call), and XLA's dot over the tiles when it is switched off; both within float32
    rounding of a float64 product. 43 rows (6 x 6 + 4 + 2 + 1) take every row-group path of the kernel."""
    assert cpu_matmul.available(), cpu_matmul.unavailable_reason()
    K, N = 72, 100
    rng = np.random.default_rng(M)
    x, w = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((K, N)).astype(np.float32)
    tiles = cpu_matmul.pack(jnp.asarray(w))
    assert tiles.shape == (2, K, cpu_matmul.TILE)
    np.testing.assert_array_equal(cpu_matmul.unpack(tiles, N), w)
    want = x.astype(np.float64) @ w.astype(np.float64)

    def product(x, t):
        return cpu_matmul.matmul(x, t, N)

    kernel = compiled(product, x, tiles)
    assert kernel.as_text().count(CALL) == 1
    np.testing.assert_allclose(kernel(x, tiles), want, rtol=0, atol=2e-5 * np.abs(want).max())
    with cpu_matmul.disabled():  # a new function: jax.jit would reuse `product`'s trace

        def xla_product(x, t):
            return cpu_matmul.matmul(x, t, N)

        xla = compiled(xla_product, x, tiles)
        assert xla.as_text().count(CALL) == 0
        np.testing.assert_allclose(xla(x, tiles), want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_a_rows_result_does_not_depend_on_its_batch():
    """Batches of 2, 3, 5, 7 and 13 rows (every row-group path of the kernel: 6, 4, 2 and 1 rows) give
    row r the bits it gets alone."""
    K, N = 64, 3 * cpu_matmul.TILE
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((13, K)), jnp.float32)
    tiles = cpu_matmul.pack(jnp.asarray(rng.standard_normal((K, N)), jnp.float32))
    product = jax.jit(lambda x: cpu_matmul.matmul(x, tiles, N))
    alone = np.stack([np.asarray(product(x[r : r + 1]))[0] for r in range(13)])
    for M in (2, 3, 5, 7, 13):
        np.testing.assert_array_equal(np.asarray(product(x[:M])), alone[:M], err_msg=f"batch {M}")


@pytest.mark.parametrize(
    "spec, shape, x_shape",
    [
        ("BLD,DHK->BLHK", (3, 24, 4, 8), (2, 3, 24)),  # wq, stacked over 3 layers: read per layer
        ("BLHK,HKD->BLD", (4, 8, 40), (2, 3, 4, 8)),  # wo: two contracted dims
    ],
)
def test_packed_weight_reads_like_the_einsum(spec, shape, x_shape):
    """A projection's spec goes through the kernel; a spec reading the weight another way (output dims
    in another order) gets it unpacked, and still the einsum's values."""
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    packed = pack_weight(w, spec)
    assert packed.shape == w.shape
    layer_w, layer_p = (w[1], jax.tree.map(lambda t: t[1], packed)) if len(shape) == 4 else (w, packed)
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
    product = compiled(lambda x, p: p.matmul(spec, x, jnp.float32), x, layer_p)
    assert product.as_text().count(CALL) == 1
    np.testing.assert_allclose(product(x, layer_p), jnp.einsum(spec, x, layer_w), rtol=1e-5, atol=1e-5)
    ins, out = spec.split("->")
    other = f"{ins}->{out[:2]}{out[2:][::-1]}"
    np.testing.assert_allclose(
        layer_p.matmul(other, x, jnp.float32), jnp.einsum(other, x, layer_w), rtol=1e-5, atol=1e-5
    )
    with pytest.raises(ValueError, match="sliced per layer"):
        (packed if len(shape) == 4 else jax.tree.map(lambda t: t[None], packed)).matmul(spec, x, jnp.float32)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_packed_model_gives_the_plain_ones_logits_with_one_kernel_call_per_projection(tied):
    """pack_for_cpu_decode swaps every projection of a dense LM (4 attention, 3 MLP per layer, the
    head, tied or not) for a PackedWeight: a generator's compiled forward calls the kernel once per
    projection, and its logits through a KV cache stay within float32 rounding of the plain model's."""
    cfg = ModelConfig(vocab_size=50, d_model=96, n_layers=2, n_heads=3, n_kv_heads=1, d_ff=160, tie_embeddings=tied)
    plain, packed = Transformer(cfg, rngs=nnx.Rngs(0)), Transformer(cfg, rngs=nnx.Rngs(0))
    assert pack_for_cpu_decode(packed) == 8  # stacked: one weight for all layers, and the head
    assert isinstance(packed.blocks.mlp.w_down.get_value(), PackedWeight)
    assert isinstance(packed.head.lm_head.get_value(), PackedWeight) and not packed.head.tied
    assert packed.embed.table.get_value().shape == (cfg.vocab_size, cfg.d_model)  # the lookup's own
    tokens = jnp.asarray([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
    logits, calls = [], []
    for model in (plain, packed):
        gen = Generator(model)
        args = (gen.state, tokens, positions, KVCache.zeros(cfg, 2, 16, jnp.float32))
        forward = compiled(gen.apply, *args)
        calls.append(forward.as_text().count(CALL))
        logits.append(forward(*args)[0])
    assert calls == [0, 7 * cfg.n_layers + 1]
    np.testing.assert_allclose(logits[1], logits[0], rtol=2e-5, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_next"])
def test_packed_hf_families_generate_the_plain_models_tokens(name):
    """Families whose attention differs from the dense LM's (Qwen3-Next: gated attention beside linear
    layers; gpt-oss: sinks, biases, MoE MLPs): packing still gives the plain model's greedy tokens
    (the quick tier checks the mechanism on the dense LM above)."""
    from conftest import ROOT

    from meshwork.models.hf import model_from_hf

    plain, packed = (model_from_hf(ROOT / "tests/fixtures/hf" / name)[1] for _ in range(2))
    assert pack_for_cpu_decode(packed) > 0
    params = SamplingParams(temperature=0, max_new_tokens=6)
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    assert Generator(packed).generate(prompts, params) == Generator(plain).generate(prompts, params)
