"""Float32-accumulated products of low-precision operands, in the form XLA:CPU runs natively.

Used by the models' weight products (models/layers/mixed_matmul.py) and the fused loss
(objectives/fused_ce.py). tests/test_mixed_matmul.py reads the operand dtypes of every compiled dot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def f32_product(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """`einsum(spec, a, b)` accumulated and returned in float32.

    XLA:CPU's bf16 matmul library does not take a left operand whose one summed index comes
    first (h^T @ g, e.g. "ND,NV->DV", a weight gradient): it upcasts both operands to float32
    and runs a float32 dot, 2.3x slower at (2048 x 256)^T @ (2048 x 32000) on this machine. With
    a second summed index, of size 1, XLA lays the left operand out transposed and keeps bf16."""
    ins, _, out = spec.replace(" ", "").partition("->")
    a_idx, _, b_idx = ins.partition(",")
    summed = [i for i in a_idx if i in b_idx and i not in out]
    if len(summed) == 1 and a_idx[-1] != summed[0] and a.dtype != jnp.float32:
        unit = next(c for c in "ZYXWVUTSRQPONMLKJIHGFEDCBA" if c not in spec)
        spec, a, b = f"{unit}{a_idx},{unit}{b_idx}->{out}", a[None], b[None]
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
