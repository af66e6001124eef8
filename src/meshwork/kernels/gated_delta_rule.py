"""The gated delta rule (Yang, Kautz & Hatamizadeh, 2024; Qwen3-Next's linear attention) as pure JAX.

Per value head, a state S (K_key x K_value, float32) is decayed, corrected toward the new value
and read by the query, token by token:

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,    o_t = S_t^T q_t

`recurrent_gated_delta_rule` runs exactly that (a scan over tokens: decoding, and the reference);
`chunked_gated_delta_rule` runs the same recurrence a chunk of C tokens at a time (the WY/UT form
of DeltaNet): inside a chunk everything is C x C and C x K matmuls plus one unit-lower-triangular
solve, and only the C-times-shorter scan over chunks is sequential. It is the training and prefill
form. Both take the arguments of FLA's `chunk_gated_delta_rule` (queries and keys with G heads,
each serving R = H / G consecutive value heads, as transformers' `repeat_interleave`), return
(o, final state), and accept packed documents: `segment_ids_BL` restarts the state where the id
changes, so each document computes what it computes alone.

This file sits in kernels/ because it is the reference a Pallas kernel of the chunked form would sit
beside with the same signature (benchmarks/gated_deltanet_gpu.py measures whether XLA's
compilation of it is enough); models/layers/gated_deltanet.py holds the layer around it.

Shape letters: B batch, L tokens, G query/key heads, H value heads, K a head's width (the keys'
for q and k, the values' for v and o; the state is (B, H, K_key, K_value)), C chunks and l the
tokens of one chunk.

    >>> B, L, G, H, K = 1, 10, 1, 2, 4
    >>> q = k = jnp.ones((B, L, G, K)) / 2; v = jnp.ones((B, L, H, K))
    >>> g = jnp.full((B, L, H), -0.1); beta = jnp.full((B, L, H), 0.5)
    >>> o, s = chunked_gated_delta_rule(q, k, v, g, beta, chunk_size=4)
    >>> o2, s2 = recurrent_gated_delta_rule(q, k, v, g, beta)
    >>> o.shape, s.shape, bool(jnp.allclose(o, o2, atol=1e-6)), bool(jnp.allclose(s, s2, atol=1e-6))
    ((1, 10, 2, 4), (1, 2, 4, 4), True, True)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def expand_to_value_heads(q_BLGK, k_BLGK, v_BLHK, g_BLH, beta_BLH, scale):
    """Float32 copies with q and k repeated to the value heads (head h reads key head h // R) and
    q scaled (K_key^-1/2 unless `scale` says otherwise)."""
    H, G = v_BLHK.shape[2], k_BLGK.shape[2]
    if H % G:
        raise ValueError(f"value heads ({H}) must be a multiple of query/key heads ({G})")
    scale = q_BLGK.shape[-1] ** -0.5 if scale is None else scale
    q_BLHK = jnp.repeat(q_BLGK.astype(F32) * scale, H // G, axis=2)
    k_BLHK = jnp.repeat(k_BLGK.astype(F32), H // G, axis=2)
    return q_BLHK, k_BLHK, v_BLHK.astype(F32), g_BLH.astype(F32), beta_BLH.astype(F32)


def _zero_state(v_BLHK, k_BLGK, initial_state_BHKK):
    B, _, H, Kv = v_BLHK.shape
    if initial_state_BHKK is None:
        return jnp.zeros((B, H, k_BLGK.shape[-1], Kv), F32)
    return initial_state_BHKK.astype(F32)


def recurrent_gated_delta_rule(
    q_BLGK: jax.Array,
    k_BLGK: jax.Array,
    v_BLHK: jax.Array,
    g_BLH: jax.Array,
    beta_BLH: jax.Array,
    initial_state_BHKK: jax.Array | None = None,
    *,
    scale: float | None = None,
    segment_ids_BL: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule token by token: (o (B, L, H, K_value) in v's dtype, final state (B, H,
    K_key, K_value) float32).

    q, k: (B, L, G, K_key), already L2-normalized if the model wants it (Qwen3-Next does);
    v: (B, L, H, K_value); g: (B, L, H), the log of each token's decay (<= 0); beta: (B, L, H), the
    write strength in (0, 1). initial_state: the state before the first token (zeros if None).
    segment_ids_BL: packed documents; the state restarts from zeros where the id changes (the
    initial state belongs to the first token's document).
    """
    q_BLHK, k_BLHK, v32_BLHK, g_BLH, beta_BLH = expand_to_value_heads(q_BLGK, k_BLGK, v_BLHK, g_BLH, beta_BLH, scale)
    state_BHKK = _zero_state(v_BLHK, k_BLGK, initial_state_BHKK)
    B, L = v_BLHK.shape[:2]
    if segment_ids_BL is None:
        restart_BL = jnp.zeros((B, L), bool)
    else:
        restart_BL = jnp.pad(segment_ids_BL[:, 1:] != segment_ids_BL[:, :-1], ((0, 0), (1, 0)))

    def step(state_BHKK, xs):
        q_BHK, k_BHK, v_BHK, g_BH, beta_BH, restart_B = xs
        state_BHKK = jnp.where(restart_B[:, None, None, None], 0.0, state_BHKK)
        state_BHKK = state_BHKK * jnp.exp(g_BH)[..., None, None]
        remembered_BHK = jnp.sum(state_BHKK * k_BHK[..., :, None], axis=-2)
        delta_BHK = (v_BHK - remembered_BHK) * beta_BH[..., None]
        state_BHKK = state_BHKK + k_BHK[..., :, None] * delta_BHK[..., None, :]
        return state_BHKK, jnp.sum(state_BHKK * q_BHK[..., :, None], axis=-2)

    time_major = [jnp.moveaxis(t, 1, 0) for t in (q_BLHK, k_BLHK, v32_BLHK, g_BLH, beta_BLH, restart_BL)]
    state_BHKK, o_LBHK = jax.lax.scan(step, state_BHKK, time_major)
    return jnp.moveaxis(o_LBHK, 0, 1).astype(v_BLHK.dtype), state_BHKK


def chunked_gated_delta_rule(
    q_BLGK: jax.Array,
    k_BLGK: jax.Array,
    v_BLHK: jax.Array,
    g_BLH: jax.Array,
    beta_BLH: jax.Array,
    chunk_size: int = 64,
    initial_state_BHKK: jax.Array | None = None,
    *,
    scale: float | None = None,
    segment_ids_BL: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`recurrent_gated_delta_rule` (same arguments and results) computed `chunk_size` tokens at a time.

    The sequence is padded to a multiple of the chunk with tokens that neither decay nor write
    (g = 0, beta = 0), so the final state is the last real token's. Within a chunk, with
    gc_i = g_1 + ... + g_i and Gamma_ij = exp(gc_i - gc_j) for i >= j:
      T = (I + strictly_lower(beta_i k_i.k_j Gamma_ij))^-1   (`unit_lower_solve`)
      u = T beta v,  w = T beta k exp(gc)                     (the chunk's writes, before the old state)
      v_new = u - w S,  o = (q exp(gc)) S + (q k^T o Gamma) v_new,
      S' = exp(gc_C) S + (k exp(gc_C - gc))^T v_new.
    Every exponent is <= 0, so nothing overflows however strong the decay.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    q_BLHK, k_BLHK, v32_BLHK, g_BLH, beta_BLH = expand_to_value_heads(q_BLGK, k_BLGK, v_BLHK, g_BLH, beta_BLH, scale)
    terms = intra_chunk_terms(q_BLHK, k_BLHK, v32_BLHK, g_BLH, beta_BLH, chunk_size, segment_ids_BL)
    o_BLHK, state_BHKK = inter_chunk_scan(terms, _zero_state(v_BLHK, k_BLGK, initial_state_BHKK))
    return o_BLHK[:, : v_BLHK.shape[1]].astype(v_BLHK.dtype), state_BHKK


def intra_chunk_terms(q_BLHK, k_BLHK, v_BLHK, g_BLH, beta_BLH, chunk_size, segment_ids_BL=None) -> tuple:
    """Everything of the chunked form that the chunks compute independently (all but the scan), from
    float32 inputs whose q and k are already repeated to the H value heads and q scaled: (u, w,
    q_read, attn, k_write, keep) with chunks on axis 2, (B, H, C, l, ...) and keep (B, H, C); the
    sequence zero-padded to C l. The part a Pallas kernel would fuse (one chunk per program)."""
    B, L, H, _ = v_BLHK.shape
    l = chunk_size
    pad = -L % l
    C = (L + pad) // l
    seg_BL = jnp.zeros((B, L), jnp.int32) if segment_ids_BL is None else segment_ids_BL
    seg_BL = jnp.pad(seg_BL, ((0, 0), (0, pad)), mode="edge")  # padding continues the last document

    def chunks(x_BL):  # (B, L, H, ...) -> (B, H, C, l, ...), zero-padded
        x_BL = jnp.pad(x_BL, [(0, 0), (0, pad)] + [(0, 0)] * (x_BL.ndim - 2))
        x = x_BL.reshape(B, C, l, *x_BL.shape[2:])
        return jnp.moveaxis(x, 3, 1)

    q_BHClK, k_BHClK, v_BHClK = chunks(q_BLHK), chunks(k_BLHK), chunks(v_BLHK)
    g_BHCl, beta_BHCl = chunks(g_BLH), chunks(beta_BLH)
    seg_BCl = seg_BL.reshape(B, C, l)
    # The document the state entering each chunk belongs to: the previous chunk's last token's
    # (the first token's for chunk 0, whose entering state is `initial_state`).
    prev_seg_BC = jnp.concatenate([seg_BCl[:, :1, 0], seg_BCl[:, :-1, -1]], axis=1)
    reads_state_B1Cl = (seg_BCl == prev_seg_BC[..., None])[:, None]  # the token's document began earlier
    writes_state_B1Cl = (seg_BCl == seg_BCl[..., -1:])[:, None]  # the token's document reaches the chunk's end
    same_doc_B1Cll = (seg_BCl[..., :, None] == seg_BCl[..., None, :])[:, None]

    gc_BHCl = jnp.cumsum(g_BHCl, axis=-1)
    causal_ll = jnp.tril(jnp.ones((l, l), bool))
    visible_BHCll = causal_ll & same_doc_B1Cll
    # where(..., exp(where(...))): exp of the masked (positive) differences would overflow and give
    # NaN gradients through the outer where.
    diff_BHCll = gc_BHCl[..., :, None] - gc_BHCl[..., None, :]
    decay_BHCll = jnp.where(visible_BHCll, jnp.exp(jnp.where(visible_BHCll, diff_BHCll, 0.0)), 0.0)

    kbeta_BHClK = k_BHClK * beta_BHCl[..., None]
    strict_ll = jnp.tril(jnp.ones((l, l), bool), -1)
    lower_BHCll = jnp.where(strict_ll, (kbeta_BHClK @ jnp.swapaxes(k_BHClK, -1, -2)) * decay_BHCll, 0.0)
    in_state_BHCl = jnp.where(reads_state_B1Cl, jnp.exp(gc_BHCl), 0.0)
    rhs_BHClK = jnp.concatenate([v_BHClK * beta_BHCl[..., None], kbeta_BHClK * in_state_BHCl[..., None]], axis=-1)
    solved_BHClK = unit_lower_solve(lower_BHCll, rhs_BHClK)
    Kv = v_BLHK.shape[-1]
    u_BHClK, w_BHClK = solved_BHClK[..., :Kv], solved_BHClK[..., Kv:]
    attn_BHCll = (q_BHClK @ jnp.swapaxes(k_BHClK, -1, -2)) * decay_BHCll
    q_read_BHClK = q_BHClK * in_state_BHCl[..., None]
    gc_last_BHC1 = gc_BHCl[..., -1:]
    to_end_BHCl = jnp.where(writes_state_B1Cl, jnp.exp(gc_last_BHC1 - gc_BHCl), 0.0)
    k_write_BHClK = k_BHClK * to_end_BHCl[..., None]
    keep_BHC = jnp.where(reads_state_B1Cl[..., -1], jnp.exp(gc_last_BHC1[..., 0]), 0.0)
    return u_BHClK, w_BHClK, q_read_BHClK, attn_BHCll, k_write_BHClK, keep_BHC


def unit_lower_solve(strict_lower_Nll: jax.Array, rhs_NlK: jax.Array) -> jax.Array:
    """x with (I + S) x = rhs, S strictly lower triangular (batched over leading dims), by matrix
    products alone: S is nilpotent, so (I + S)^-1 = (I - S)(I + S^2)(I + S^4)... up to the power l - 1,
    log2(l) squarings and products. Not `lax.linalg.triangular_solve`: on CPU that is a LAPACK call,
    which deadlocked intermittently (idle threads) inside XLA's thread pool under autodiff here; on
    GPU these are tensor-core matmuls of chunk-sized tiles.

    >>> s = jnp.array([[0.0, 0.0], [0.5, 0.0]]); x = unit_lower_solve(s, jnp.array([[1.0], [1.0]]))
    >>> [round(float(v), 3) for v in x[:, 0]]
    [1.0, 0.5]
    """
    l = strict_lower_Nll.shape[-1]
    power = -strict_lower_Nll  # (-S)^1
    x = rhs_NlK + power @ rhs_NlK  # (I - S) rhs: the powers below 2
    covered = 2
    while covered < l:
        power = power @ power  # (-S)^covered
        x = x + power @ x  # now the powers below 2 covered
        covered *= 2
    return x


def inter_chunk_scan(terms: tuple, state_BHKK: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The sequential part of the chunked form: carries the state across chunks; (o (B, C l, H, K_value)
    float32, final state)."""
    u_BHClK = terms[0]
    B, H, C, l, Kv = u_BHClK.shape

    def step(state_BHKK, xs):
        u_BHlK, w_BHlK, q_BHlK, attn_BHll, k_BHlK, keep_BH = xs
        v_new_BHlK = u_BHlK - w_BHlK @ state_BHKK
        o_BHlK = q_BHlK @ state_BHKK + attn_BHll @ v_new_BHlK
        state_BHKK = state_BHKK * keep_BH[..., None, None] + jnp.swapaxes(k_BHlK, -1, -2) @ v_new_BHlK
        return state_BHKK, o_BHlK

    state_BHKK, o_CBHlK = jax.lax.scan(step, state_BHKK, [jnp.moveaxis(t, 2, 0) for t in terms])
    return jnp.transpose(o_CBHlK, (1, 0, 3, 2, 4)).reshape(B, C * l, H, Kv), state_BHKK
