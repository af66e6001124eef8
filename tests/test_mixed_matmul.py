"""models/layers/mixed_matmul.py: `weight_einsum` equals `jnp.einsum` (values and gradients), runs every
product of a bf16 forward and backward as bf16 x bf16 -> f32, falls back to `jnp.einsum` for specs
it does not handle, and its outputs are what the named remat policies save."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshwork.matmul import f32_product
from meshwork.models.layers.attention import attend
from meshwork.models.layers.mixed_matmul import MATMUL, weight_einsum
from meshwork.models.transformer import REMAT_POLICIES

F32, BF16 = jnp.float32, jnp.bfloat16

# spec -> (x shape, w shape): projections in and out of heads, a plain projection, and a batch-like
# index (E, as in per-expert weights) shared by both operands and the output.
SPECS = {
    "BLD,DHK->BLHK": ((2, 3, 8), (8, 4, 5)),
    "BLHK,HKD->BLD": ((2, 3, 4, 5), (4, 5, 8)),
    "BLD,DF->BLF": ((2, 3, 8), (8, 16)),
    "EBD,EDF->EBF": ((3, 4, 8), (3, 8, 6)),
}
# Specs weight_einsum hands to jnp.einsum: an index summed inside one operand.
FALLBACK_SHAPES = {
    "BLD,DF->BF": ((2, 3, 8), (8, 6)),  # L is summed inside x alone
    "BD,DFK->BF": ((2, 8), (8, 6, 3)),  # K is summed inside w alone
}


def _operands(spec: str, dtype, seed: int = 0):
    xs, ws = {**SPECS, **FALLBACK_SHAPES}[spec]
    kx, kw, kr = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, xs, F32).astype(dtype)
    w = jax.random.normal(kw, ws, F32).astype(dtype)
    out_shape = jax.eval_shape(lambda a, b: jnp.einsum(spec, a, b), x, w).shape
    r = jax.random.normal(kr, out_shape, F32)  # the fixed cotangent of the scalar loss
    return x, w, r


def _value_and_grads(product, spec: str):
    """One jitted function: (product(spec, x, w), d/dx and d/dw of sum(product * r))."""

    def loss(x, w, r):
        return jnp.sum(product(spec, x, w).astype(F32) * r)  # a sum, not vdot: no dot of its own

    @jax.jit
    def run(x, w, r):
        return product(spec, x, w), *jax.grad(loss, argnums=(0, 1))(x, w, r)

    return run


def _plain(spec, x, w):
    return jnp.einsum(spec, x, w)


def _rel(scale_of: jax.Array, rel: float) -> float:
    return rel * float(jnp.max(jnp.abs(scale_of.astype(F32))))


@pytest.mark.parametrize("spec", SPECS)
def test_f32_values_and_grads_equal_einsum(spec):
    x, w, r = _operands(spec, F32)
    out, gx, gw = _value_and_grads(weight_einsum, spec)(x, w, r)
    ref, rgx, rgw = _value_and_grads(_plain, spec)(x, w, r)
    for got, want in ((out, ref), (gx, rgx), (gw, rgw)):
        assert got.dtype == F32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=_rel(want, 1e-6))


@pytest.mark.parametrize("spec", SPECS)
def test_bf16_rounds_the_f32_product_once_and_grads_track_f32(spec):
    x, w, r = _operands(spec, BF16)
    out, gx, gw = _value_and_grads(weight_einsum, spec)(x, w, r)
    # The forward: the float32-accumulated product rounded once to bf16, bit for bit.
    want = jnp.einsum(spec, x, w, preferred_element_type=F32).astype(BF16)
    assert out.dtype == BF16
    np.testing.assert_array_equal(np.asarray(out.astype(F32)), np.asarray(want.astype(F32)))
    # The gradients: bf16, and within bf16 rounding of float32 gradients of the same (upcast) values.
    _, rgx, rgw = _value_and_grads(_plain, spec)(x.astype(F32), w.astype(F32), r)
    for got, ref in ((gx, rgx), (gw, rgw)):
        assert got.dtype == BF16 and got.shape == ref.shape
        np.testing.assert_allclose(np.asarray(got.astype(F32)), np.asarray(ref), rtol=2e-2, atol=_rel(ref, 2e-2))
        assert float(jnp.linalg.norm(got.astype(F32) - ref)) <= 2e-2 * float(jnp.linalg.norm(ref))


_DOT = re.compile(r"stablehlo\.dot_general .*: \(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\) -> tensor<[^>]*x(\w+)>")


def _lowered_dots(product, spec: str) -> list[tuple[str, str, str]]:
    """(lhs, rhs, result) element types of every dot_general in the lowered forward + backward."""
    x, w, r = _operands(spec, BF16)
    text = _value_and_grads(product, spec).lower(x, w, r).as_text()
    dots = _DOT.findall(text)
    assert len(dots) == text.count("stablehlo.dot_general"), "a dot_general the pattern did not read"
    return dots


@pytest.mark.parametrize("spec", SPECS)
def test_bf16_forward_and_backward_products_are_bf16_x_bf16_to_f32(spec):
    dots = _lowered_dots(weight_einsum, spec)
    assert len(dots) == 3  # the forward product and the two backward ones
    assert dots == [("bf16", "bf16", "f32")] * 3


def test_the_dtype_check_sees_jaxs_own_upcast_backward():
    """The check above can fail: JAX's transpose of an einsum with float32 accumulation multiplies
    a float32 cotangent, which becomes an f32 x f32 product."""

    def einsum_f32_acc(spec, x, w):
        return jnp.einsum(spec, x, w, preferred_element_type=F32).astype(x.dtype)

    dots = _lowered_dots(einsum_f32_acc, "BLD,DF->BLF")
    assert ("f32", "f32", "f32") in dots


def compiled_dot_operand_types(fn, *args) -> list[tuple[str, str]]:
    """(lhs, rhs) element types of every dot, fused or not, in fn's compiled (XLA:CPU) program."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    types = dict(re.findall(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (\w+)\[", text, flags=re.MULTILINE))
    dots = re.findall(r"= \w+\[[^\]]*\]\S* dot\(%?([\w.\-]+), %?([\w.\-]+)\)", text)
    return [(types[a], types[b]) for a, b in dots]


def test_compiled_backward_has_no_f32_dot():
    """In the compiled (XLA:CPU) program too, every dot, fused or not, reads bf16 operands."""
    spec = "BLD,DHK->BLHK"
    x, w, r = _operands(spec, BF16)
    assert compiled_dot_operand_types(_value_and_grads(weight_einsum, spec), x, w, r) == [("bf16", "bf16")] * 3


def test_f32_product_keeps_a_transposed_left_operand_in_bf16():
    """h^T @ g (a weight gradient, one summed index leading the left operand): XLA:CPU runs
    einsum's version as a float32 dot, f32_product's on the bf16 operands; same values."""
    h = jax.random.normal(jax.random.key(0), (64, 24), BF16)
    g = jax.random.normal(jax.random.key(1), (64, 40), BF16)
    assert compiled_dot_operand_types(lambda h, g: jnp.einsum("ND,NV->DV", h, g, preferred_element_type=F32), h, g) == [
        ("f32", "f32")
    ]
    assert compiled_dot_operand_types(lambda h, g: f32_product("ND,NV->DV", h, g), h, g) == [("bf16", "bf16")]
    want = jnp.einsum("ND,NV->DV", h.astype(F32), g.astype(F32), precision="highest")
    got = f32_product("ND,NV->DV", h, g)
    assert got.dtype == F32
    assert float(jnp.max(jnp.abs(got - want))) <= 1e-6 * float(jnp.max(jnp.abs(want)))


@pytest.mark.parametrize("mask", ["causal", "segments"])
def test_bf16_attention_products_are_bf16_and_track_jax(mask):
    """The xla attention path in bf16 (models/layers/attention.py): every product of the forward
    and backward reads bf16 operands (jax.nn.dot_product_attention's has float32 ones), and its
    values and gradients are as close to the float32 result as JAX's own bf16 attention is."""
    B, L, H, G, K = 2, 32, 4, 2, 16  # grouped: two query heads per key/value head
    q, k, v = (
        jax.random.normal(key, shape)
        for key, shape in zip(jax.random.split(jax.random.key(2), 3), [(B, L, H, K), (B, L, G, K), (B, L, G, K)])
    )
    seg = jnp.repeat(jnp.array([[0, 1], [0, 0]]), L // 2, axis=1) if mask == "segments" else None
    dense_mask = jnp.tril(jnp.ones((L, L), bool))[None, None]
    if seg is not None:
        dense_mask = dense_mask & (seg[:, None, :, None] == seg[:, None, None, :])

    def ours(q, k, v):
        return attend(q, k, v, segment_ids_BL=seg)

    def jaxs(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=dense_mask)

    def loss(attn):
        return lambda q, k, v: (attn(q, k, v).astype(F32) ** 2).sum()

    bf = [x.astype(BF16) for x in (q, k, v)]
    assert all(t == ("bf16", "bf16") for t in compiled_dot_operand_types(jax.grad(loss(ours), (0, 1, 2)), *bf))
    assert ("f32", "f32") in compiled_dot_operand_types(jax.grad(loss(jaxs), (0, 1, 2)), *bf)
    want = [jaxs(q, k, v), *jax.grad(loss(jaxs), (0, 1, 2))(q, k, v)]
    for name, attn in (("ours", ours), ("jax", jaxs)):
        got = [attn(*bf), *jax.grad(loss(attn), (0, 1, 2))(*bf)]
        err = [_rel_err(a, b) for a, b in zip(got, want)]
        print(name, "output, dq, dk, dv relative error vs f32:", err)
        if name == "ours":
            ours_err = err
    assert all(e < 0.02 for e in ours_err) and all(a <= 1.5 * b + 1e-3 for a, b in zip(ours_err, err))


def _rel_err(got, want) -> float:
    return float(jnp.linalg.norm(got.astype(F32) - want) / jnp.linalg.norm(want))


@pytest.mark.parametrize("spec", FALLBACK_SHAPES)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_index_summed_inside_one_operand_falls_back_to_einsum(spec, dtype):
    x, w, r = _operands(spec, dtype)
    got = _value_and_grads(weight_einsum, spec)(x, w, r)
    want = _value_and_grads(_plain, spec)(x, w, r)
    for g, v in zip(got, want):
        assert g.dtype == v.dtype == dtype
        np.testing.assert_array_equal(np.asarray(g.astype(F32)), np.asarray(v.astype(F32)))


def test_operands_of_two_dtypes_fall_back_to_einsum():
    x, w, _ = _operands("BLD,DF->BLF", F32)
    out = weight_einsum("BLD,DF->BLF", x.astype(BF16), w)
    want = jnp.einsum("BLD,DF->BLF", x.astype(BF16), w)
    assert out.dtype == want.dtype == F32
    np.testing.assert_array_equal(out, want)


def _two_products(x, w1, w2):
    h = jnp.sin(weight_einsum("BLD,DF->BLF", x, w1))
    return jnp.sum(jnp.tanh(weight_einsum("BLF,FD->BLD", h, w2)).astype(F32))


def _residuals(capsys, policy, *args) -> list[str]:
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(_two_products, policy=policy), *args)
    return capsys.readouterr().out.strip().splitlines()


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_remat_policies_save_the_named_products(capsys, dtype):
    x, w1, _ = _operands("BLD,DF->BLF", dtype)
    w2 = w1.T * 0.5
    arguments = _residuals(capsys, REMAT_POLICIES["full"], x, w1, w2)
    assert len(arguments) == 3 and all("from the argument" in line for line in arguments), arguments

    short = {F32: "f32", BF16: "bf16"}[dtype]
    for policy in ("dots_with_no_batch_dims_saveable", "dots_saveable"):
        lines = _residuals(capsys, REMAT_POLICIES[policy], x, w1, w2)
        extra = [line for line in lines if "from the argument" not in line]
        # Both products, by their name and in the compute dtype (not their float32 accumulators).
        assert len(extra) == 2, (policy, lines)
        assert all(f"named '{MATMUL}'" in line for line in extra), (policy, lines)
        assert sorted(line.split()[0] for line in extra) == [f"{short}[2,3,16]", f"{short}[2,3,8]"], lines
