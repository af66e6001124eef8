"""A weight product whose forward and backward matmuls all take operands in the compute dtype
and accumulate in float32.

`jnp.einsum(spec, x, w)` on bfloat16 operands returns bfloat16, and its transposes (the
backward pass's two products) do too. A GPU accumulates such products in float32 anyway;
XLA:CPU instead upcasts both operands to float32 and runs a float32 matmul, so bf16 compute
costs extra conversions and runs at the float32 rate. Asking for float32 accumulation
explicitly (`preferred_element_type`) fixes the forward, but JAX's transpose of that product
then multiplies a float32 cotangent by a bfloat16 operand, which XLA:CPU upcasts again. Here a
`custom_vjp` keeps the cotangent in the compute dtype, so all three products are
bf16 x bf16 -> f32, which XLA:CPU runs natively at twice the float32 rate (measured on this
machine: a 4-layer SwiGLU stack's forward and backward 1.7x faster on jax 0.10, 4.8x on 0.12);
the values equal the plain einsum's, rounded once to the compute dtype.

Every output is tagged `MATMUL` (jax.ad_checkpoint.checkpoint_name), and the remat policies
(models/transformer.py) save or offload the products by this name: the value in the compute
dtype, where jax.checkpoint_policies.dots_saveable alone would keep the float32 accumulator
inside the custom_vjp (twice the bytes). Being a custom_vjp, it has no forward-mode derivative
(jax.jvp, jacfwd); nothing in meshwork takes one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from meshwork.matmul import f32_product

MATMUL = "weight_matmul"


def weight_einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`einsum(spec, x, w)` for x and w of one dtype, accumulated in float32, in that dtype.

    `spec` is a two-operand einsum without indices summed inside one operand
    (e.g. "BLD,DHK->BLHK"); anything else falls back to jnp.einsum."""
    return checkpoint_name(mixed_einsum(spec, x, w), MATMUL)


def mixed_einsum(spec: str, x: jax.Array, w: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """weight_einsum without the remat name, for products of two activations (attention's scores
    and its weighted values), which the remat policies must not save as weight products.
    `out_dtype`: the result's dtype (default x's), e.g. float32 scores for a softmax; the backward
    products still read the cotangent rounded to x's dtype."""
    ins, _, out = spec.replace(" ", "").partition("->")
    xs, _, ws = ins.partition(",")
    plain = (
        not out
        or x.dtype != w.dtype
        or set(xs) - set(ws + out)
        or set(ws) - set(xs + out)
        or any(len(set(s)) != len(s) for s in (xs, ws, out))
    )
    if plain:
        return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)
    return _einsum(f"{xs},{ws}->{out}", jnp.dtype(out_dtype or x.dtype), x, w)


def _forward_product(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    return f32_product(spec, x, w).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _einsum(spec: str, out_dtype: jnp.dtype, x: jax.Array, w: jax.Array) -> jax.Array:
    return f32_product(spec, x, w).astype(out_dtype)


def _einsum_fwd(spec: str, out_dtype: jnp.dtype, x: jax.Array, w: jax.Array):
    return f32_product(spec, x, w).astype(out_dtype), (x, w)


def _einsum_bwd(spec: str, out_dtype: jnp.dtype, residuals, ct: jax.Array):
    x, w = residuals
    (xs, ws), out = spec.split("->")[0].split(","), spec.split("->")[1]
    ct = ct.astype(x.dtype)
    return _forward_product(f"{out},{ws}->{xs}", ct, w), _forward_product(f"{xs},{out}->{ws}", x, ct)


_einsum.defvjp(_einsum_fwd, _einsum_bwd)
