"""models/layers/causal_blocks.py: causal attention by query blocks equals the plain formula
(values and gradients), skips the masked keys' work (FLOPs read from the compiled program), and
is what the bf16 xla attention path runs on long enough sequences."""

import functools

import jax
import jax.numpy as jnp
import pytest

from meshwork.models.layers import attention, attention_local
from meshwork.models.layers.causal_blocks import QUERY_BLOCK, causal_blocks

F32, BF16 = jnp.float32, jnp.bfloat16


def _qkv(B, L, G, R, K, seed=0, dtype=F32):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(kq, (B, L, G, R, K)).astype(dtype),
        jax.random.normal(kk, (B, L, G, K)).astype(dtype),
        jax.random.normal(kv, (B, L, G, K)).astype(dtype),
    )


formula = functools.partial(attention_local.softmax_weighted_values, scale=0.25)


def _plain(q, k, v):
    L = q.shape[1]
    return formula(q, k, v, jnp.tril(jnp.ones((L, L), bool)))


def _loss(attn):
    r = jax.random.normal(jax.random.key(9), (2, 40, 2, 3, 16))  # a fixed cotangent
    return lambda q, k, v: jnp.sum(attn(q, k, v).astype(F32) * r[:, : q.shape[1]])


@pytest.mark.parametrize("block", [8, 16, 40])  # 40: one block, the plain formula
def test_blocks_equal_the_plain_formula_values_and_grads(block):
    """L = 40 is not a multiple of 16: the last block is shorter."""
    q, k, v = _qkv(2, 40, 2, 3, 16)
    blocked = functools.partial(causal_blocks, formula, block=block)
    # Jitted: op by op, the blocks' backward dispatches hundreds of small ops (20 s on 2 cores).
    got = [jax.jit(blocked)(q, k, v), *jax.jit(jax.grad(_loss(blocked), (0, 1, 2)))(q, k, v)]
    want = [_plain(q, k, v), *jax.grad(_loss(_plain), (0, 1, 2))(q, k, v)]
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert float(jnp.max(jnp.abs(g - w))) <= 1e-5 * float(jnp.max(jnp.abs(w)))


def _flops(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


@pytest.mark.parametrize("n_blocks", [2, 4, 8])  # 8: seq 512, the d 512 benchmark
def test_masked_keys_are_not_computed(n_blocks):
    """Forward and backward of n blocks cost about (n + 1) / 2n of the plain formula's FLOPs."""
    q, k, v = _qkv(1, 64 * n_blocks, 1, 2, 32)
    blocked = functools.partial(causal_blocks, formula, block=64)
    fwd = _flops(blocked, q, k, v) / _flops(_plain, q, k, v)
    bwd = _flops(jax.grad(_loss_any(blocked), (0, 1, 2)), q, k, v) / _flops(
        jax.grad(_loss_any(_plain), (0, 1, 2)), q, k, v
    )
    expected = (n_blocks + 1) / (2 * n_blocks)
    print(f"{n_blocks} blocks: forward {fwd:.3f}, backward {bwd:.3f} of the plain FLOPs; expected {expected:.3f}")
    assert expected - 0.05 < fwd < expected + 0.05 and expected - 0.05 < bwd < expected + 0.05


def _loss_any(attn):
    return lambda q, k, v: jnp.sum(attn(q, k, v).astype(F32) ** 2)


def test_bf16_xla_attention_runs_blocks_and_tracks_f32():
    """attend(impl="xla") in bf16 at L = 2 * QUERY_BLOCK: the compiled program has the blocked
    form's FLOPs, and its output is as close to the float32 plain result as the unblocked bf16 one."""
    B, L, H, G, K = 1, 2 * QUERY_BLOCK, 4, 2, 16
    q, k, v = (x.reshape(B, L, -1, K) for x in _qkv(B, L, G, H // G, K))
    q = q.reshape(B, L, H, K)
    bf = [x.astype(BF16) for x in (q, k, v)]
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    got = attention.attend(*bf)
    mask = jnp.tril(jnp.ones((L, L), bool))[None, None]
    unblocked = attention_local.explicit_attention(*bf, mask, causal=True, scale=None)
    err = lambda a: float(jnp.linalg.norm(a.astype(F32) - want) / jnp.linalg.norm(want))  # noqa: E731
    print("relative error vs f32: blocked", err(got), "unblocked", err(unblocked))
    assert err(got) <= 1.2 * err(unblocked) + 1e-4
    ratio = _flops(lambda *a: attention.attend(*a), *bf) / _flops(
        lambda *a: attention_local.explicit_attention(*a, mask, causal=True, scale=None), *bf
    )
    assert ratio < 0.85, ratio
