"""Fused, chunked LM-head cross-entropy: the loss from hidden states and the head weight, without
ever holding the (B*L, V) float32 logits or their gradient.

The plain path (`next_token.token_cross_entropy` on the head's logits) keeps the full logits for
the backward pass, and its backward builds a second array of that size (softmax - onehot):
at a 128k vocabulary these two are the largest activations of a step. Here the token rows
are processed `chunk` at a time inside a `lax.scan`. The loss is a scalar, so its gradient is
known up to one factor while the forward pass runs: under differentiation (`jax.custom_vjp`'s
forward rule) each chunk's logits are turned into (softmax - onehot) * weight at once and
multiplied into dh and dW, as Liger-Kernel's fused linear cross-entropy does; the backward
rule only scales them by the incoming cotangent. Three matmuls of the head's size per step,
as in the plain path, and no (rows, V) array outlives its chunk. (Recomputing the logits in
the backward instead, as a plain remat would, costs a fourth: 26% of a step at vocabulary
32,000 and d 256 on a CPU.) Without differentiation (evaluation) only the loss is computed.

Chunk c takes rows c, c + C, c + 2C, ... (C chunks in all), not a contiguous block: with the
batch split over devices each chunk then holds rows of every device, so no device idles
while another works through its block (the same striding as train/step.py's microbatches).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from meshwork.matmul import f32_product
from meshwork.sharding.parallel import current_rules, with_logical_constraint
from meshwork.sharding.rules import compiler_axes, split_axes

ACT_NV = ("act_batch", "act_vocab")  # a chunk's logits: rows split like the batch, vocabulary like the head
W_DV = ("embed", "vocab")  # the head weight's logical axes (tied: the embedding table's, transposed)
W_GATHERED = (None, "vocab")  # the weight as every chunk reads it: whole, but for a vocabulary split
PARTIAL_DV = ("act_batch", None, "act_vocab")  # one (D, V) partial sum of dW per device that holds rows


def fused_cross_entropy(h_BLD: jax.Array, w_DV: jax.Array, targets_BL: jax.Array,
                        loss_mask_BL: jax.Array | None = None, *, chunk: int,
                        dtype: jnp.dtype | None = None) -> jax.Array:
    """Mean next-token cross-entropy of logits = h @ w, computed `chunk` token rows at a time.

    Equals `token_cross_entropy(h @ w, batch)` (next_token.py), its mask semantics included (the mean
    over the rows where `loss_mask_BL` is 1, or over all rows without a mask), and so do its
    gradients with respect to h and w. `dtype`: the matmul's operand dtype (the model's compute
    dtype; None: h's); the products accumulate, and the logsumexp runs, in float32.
    `chunk` need not divide B*L (the last chunk is padded with rows of weight 0).

    >>> h, w = jnp.ones((2, 8, 4)), jnp.ones((4, 16))
    >>> round(float(fused_cross_entropy(h, w, jnp.zeros((2, 8), jnp.int32), chunk=5)), 4)  # uniform: log 16
    2.7726
    """
    if chunk < 1:
        raise ValueError(f"chunk={chunk}; give a positive number of token rows per chunk")
    B, L, D = h_BLD.shape
    N = B * L
    dtype = dtype or h_BLD.dtype
    if loss_mask_BL is None:
        weight_N = jnp.full((N,), 1.0 / N, jnp.float32)
    else:
        mask_N = loss_mask_BL.reshape(N).astype(jnp.float32)
        weight_N = mask_N / jnp.maximum(mask_N.sum(), 1.0)
    chunk = min(chunk, N)
    C = -(-N // chunk)  # number of chunks
    pad = C * chunk - N
    h_ND = h_BLD.reshape(N, D).astype(dtype)
    t_N = targets_BL.reshape(N).astype(jnp.int32)
    if pad:
        h_ND = jnp.pad(h_ND, ((0, pad), (0, 0)))
        t_N, weight_N = jnp.pad(t_N, (0, pad)), jnp.pad(weight_N, (0, pad))
    # Row r*C + c goes to chunk c: (chunk, C, ...) -> (C, chunk, ...).
    strided = lambda x: x.reshape(chunk, C, *x.shape[1:]).swapaxes(0, 1)  # noqa: E731
    parts = _row_shards()
    parts = parts if chunk % parts == 0 else 1
    return _chunked_ce(parts, strided(h_ND), w_DV.astype(dtype), strided(t_N), strided(weight_N))


def _row_shards() -> int:
    """How many devices split the token rows (the batch's axes of the current rules and mesh)."""
    rules, mesh = current_rules(), jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty:
        return 1
    return math.prod(mesh.shape[a] for a in compiler_axes(split_axes("act_batch", rules, mesh.shape)))


def _chunk_logits(h_ND: jax.Array, w_DV: jax.Array) -> jax.Array:
    logits_NV = jnp.einsum("ND,DV->NV", h_ND, w_DV, preferred_element_type=jnp.float32)
    return with_logical_constraint(logits_NV, ACT_NV)


def _target_logit(logits_NV: jax.Array, t_N: jax.Array) -> jax.Array:
    return jnp.take_along_axis(logits_NV, t_N[:, None], axis=-1)[:, 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked_ce(parts: int, h_CND: jax.Array, w_DV: jax.Array, t_CN: jax.Array, weight_CN: jax.Array) -> jax.Array:
    del parts
    return _forward(h_CND, w_DV, t_CN, weight_CN)[0]


def _forward(h_CND, w_DV, t_CN, weight_CN):
    def body(total, xs):
        h_ND, t_N, weight_N = xs
        logits_NV = _chunk_logits(h_ND, w_DV)
        lse_N = jax.nn.logsumexp(logits_NV, axis=-1)
        ce_N = lse_N - _target_logit(logits_NV, t_N)
        return total + (ce_N * weight_N).sum(), lse_N

    loss, lse_CN = jax.lax.scan(body, jnp.zeros((), jnp.float32), (h_CND, t_CN, weight_CN))
    return loss, lse_CN


def _fwd(parts, h_CND, w_DV, t_CN, weight_CN):
    """The loss and, in the same pass over the chunks, its gradients for a cotangent of 1.

    dW is summed per row shard: each chunk's rows are grouped by the `parts` devices that hold
    them, and each device adds its rows' product into its own (D, V) float32 partial sum. The
    partial sums are added across devices once, after the last chunk; constraining each chunk's
    dW to the weight's layout instead cost a (D, V) all-reduce per chunk. One sum shared by all
    devices (parts = 1) also keeps the reduction out of the loop, but measured 7% slower at the
    MaxText-matched shape on 2 CPU devices (1010 against 938 ms per step, interleaved in one
    process, 2026-12-03) with 12% more temp memory (141 against 126 MiB)."""
    D, V = w_DV.shape
    # Gathered once, inside the custom VJP: left to the partitioner, the first chunk and the scan
    # over the rest each gathered the FSDP-split weight; constrained outside, the constraint's
    # transpose gathered dW back in full.
    w_DV = with_logical_constraint(w_DV, W_GATHERED)

    def chunk(h_ND, t_N, weight_N):
        """(loss, dW, dh) of one chunk."""
        logits_NV = _chunk_logits(h_ND, w_DV)
        lse_N = jax.nn.logsumexp(logits_NV, axis=-1)
        loss = ((lse_N - _target_logit(logits_NV, t_N)) * weight_N).sum()
        # d(loss)/d(logits) of this chunk: (softmax - onehot) * the row's weight.
        p_NV = jnp.exp(logits_NV - lse_N[:, None])
        dlogits_NV = (p_NV - jax.nn.one_hot(t_N, V, dtype=jnp.float32)) * weight_N[:, None]
        dlogits_NV = with_logical_constraint(dlogits_NV, ACT_NV).astype(h_ND.dtype)
        dh_ND = jnp.einsum("NV,DV->ND", dlogits_NV, w_DV, preferred_element_type=jnp.float32)
        dw_PDV = f32_product("PND,PNV->PDV", h_ND.reshape(parts, -1, D), dlogits_NV.reshape(parts, -1, V))
        return loss, with_logical_constraint(dw_PDV, PARTIAL_DV), dh_ND.astype(h_ND.dtype)

    def body(carry, xs):
        loss, dw_PDV, dh_ND = chunk(*xs)
        return (carry[0] + loss, carry[1] + dw_PDV), dh_ND

    # The first chunk outside the scan starts the sums: no zero-filled (D, V) buffer to add to.
    loss, dw_PDV, dh_ND = chunk(h_CND[0], t_CN[0], weight_CN[0])
    dh_CND = dh_ND[None]
    if h_CND.shape[0] > 1:
        (loss, dw_PDV), dh_rest = jax.lax.scan(body, (loss, dw_PDV), (h_CND[1:], t_CN[1:], weight_CN[1:]))
        dh_CND = jnp.concatenate([dh_CND, dh_rest])
    # Laid out like the weight: under FSDP the partial sums are reduce-scattered to the owners.
    dw_DV = with_logical_constraint(dw_PDV.sum(0), W_DV)
    # Residuals: the two gradients (the sizes of h and w), never a (rows, V) array.
    return loss, (dh_CND, dw_DV)


def _bwd(parts, res, g):
    del parts
    dh_CND, dw_DV = res  # h and w share the compute dtype (fused_cross_entropy casts both)
    return (dh_CND * g).astype(dh_CND.dtype), (dw_DV * g).astype(dh_CND.dtype), None, None


_chunked_ce.defvjp(_fwd, _bwd)

