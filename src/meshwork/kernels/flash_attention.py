"""Flash attention as Pallas kernels, beside a pure-JAX reference with the same signature.

One kernel body serves every backend: Triton on GPU, Mosaic on TPU, the Pallas
interpreter on CPU. A program owns one query block (forward, dQ) or one key
block (dK/dV) and loops over the other sequence inside the kernel with
`lax.fori_loop`, whose bounds skip the blocks that causality or the sliding
window mask out entirely. The forward keeps float32 running max / sum /
accumulator (online softmax) and saves the log-sum-exp; the backward
recomputes the probabilities from it, with delta = rowsum(dO * O).

Grouped-query attention never repeats K/V: the forward and dQ programs of
query head h read kv head h // (H/G) through the BlockSpec index map, and the
dK/dV program of kv head g loops over its H/G query heads.

Layouts. GPU and CPU read q/k/v/o in the model's (B, L, H, K) layout (a
strided block, no transpose); TPU needs the two minor block dims to be
(sequence, head_dim), so there the arrays are transposed to (B, H, L, K).
The kernel refs have the same shapes either way, so the body is shared.

Limits. A program sees the whole other sequence of its head(s) as one block
and slices it in the loop. On GPU that block is only a pointer. On TPU it is
a double-buffered VMEM buffer: forward/dQ hold K and V of one head (8*S*K
bytes in bf16: 8 MiB at S=8192, K=128), dK/dV hold q and dO of a whole group
(8*(H/G)*L*K bytes: 64 MiB at H/G=8), past the default scoped VMEM limit, so
long GQA sequences need `vmem_limit_bytes` raised or shorter blocks of work.
A TPU variant that moves the inner loop onto an "arbitrary" grid axis with
scratch accumulators would lift this; it would be a second kernel body.

    >>> q = jnp.ones((1, 64, 4, 32)); k = v = jnp.ones((1, 64, 2, 32))
    >>> flash_attention(q, k, v, causal=True).shape   # interpret mode on CPU
    (1, 64, 4, 32)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltr

F32 = jnp.float32
# A finite "minus infinity" for masked scores: with -inf, a row that has not
# yet seen a visible key would compute exp(-inf - -inf) = NaN when rescaling.
MASKED = -1e30


# --------------------------------------------------------------------------
# Backends and block sizes
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Query / key block lengths of the forward and of the two backward kernels."""
    q: int
    kv: int
    bwd_q: int
    bwd_kv: int


# Starting points, not tuned on hardware. GPU: 128x64 forward tiles are the
# usual Triton FlashAttention-2 choice; the backward holds two accumulators so
# it takes 64x64. TPU: the key block is the lane dim of the score tile
# (multiple of 128); bigger tiles amortize the ~0.35 us per-step overhead.
# CPU: the interpreter pays per grid step, so few large blocks are fastest.
DEFAULT_BLOCKS = {
    "gpu": BlockSizes(q=128, kv=64, bwd_q=64, bwd_kv=64),
    "tpu": BlockSizes(q=512, kv=512, bwd_q=256, bwd_kv=512),
    "cpu": BlockSizes(q=128, kv=128, bwd_q=128, bwd_kv=128),
}


def resolve_backend(backend: str | None, interpret=None) -> tuple[str, object]:
    """("gpu" | "tpu" | "cpu", interpret) from the arguments and the default device.

    >>> resolve_backend(None, None)   # on a CPU-only machine
    ('cpu', True)
    """
    backend = {"cuda": "gpu", "rocm": "gpu"}.get(backend, backend) or jax.default_backend()
    if backend not in DEFAULT_BLOCKS:
        raise ValueError(f"Pallas backend {backend!r} is unknown; use 'gpu' (Triton), 'tpu' (Mosaic) or 'cpu'")
    if interpret is None:
        interpret = backend == "cpu"
    if backend == "cpu" and not interpret:
        raise ValueError("Pallas runs on CPU only in interpret mode; pass interpret=True (or None)")
    # An interpreter object (pltpu.InterpretParams: NaN-filled memory, out-of-bounds
    # checks, shuffled parallel grid) passes through to pallas_call as is.
    return backend, interpret if not isinstance(interpret, (bool, int)) else bool(interpret)


def compiler_params(backend: str, grid_rank: int, head_dim: int, *, num_warps: int | None = None,
                    num_stages: int | None = None):
    """Backend compiler parameters; they also select Triton, since jax>=0.10 defaults GPU to Mosaic GPU.

    num_warps / num_stages: Triton launch parameters (None: 4 warps up to head_dim 64, else 8; 2 stages);
    ignored on TPU and CPU.
    """
    if backend == "gpu":
        return pltr.CompilerParams(num_warps=(4 if head_dim <= 64 else 8) if num_warps is None else num_warps,
                                   num_stages=2 if num_stages is None else num_stages)
    if backend == "tpu":
        # Every program writes its own output block: no grid axis carries state.
        return pltpu.CompilerParams(dimension_semantics=("parallel",) * grid_rank)
    return None


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def fit_block(block: int, n: int, backend: str, *, lanes: bool = False) -> int:
    """A legal block length for a sequence of n: never longer than needed, aligned for the backend.

    Triton tensors must have power-of-two sizes and tl.dot dims >= 16; Mosaic
    wants sublane multiples of 16 (bf16 packs two rows per sublane) and, for
    the lane dim of a tile, 128.
    """
    if block < 1:
        raise ValueError(f"block size must be positive, got {block}")
    if backend == "gpu":
        return min(pl.next_power_of_2(max(block, 16)), pl.next_power_of_2(max(n, 16)))
    align = (128 if lanes else 16) if backend == "tpu" else 8
    return min(round_up(block, align), round_up(n, align))


def _run(kernel, cfg, *, grid, in_specs, out_specs, out_shape, args, name):
    """pl.pallas_call with the backend's parameters; with cfg.poison, outputs start as NaN.

    Poisoning passes NaN-filled buffers aliased to the outputs, so a tile the
    kernel never writes stays NaN on every backend (GPU/TPU memory is not
    zeroed either); the tests use it to prove every output element is written.
    """
    aliases = {}
    if cfg.poison:
        n_in, n_out = len(args), len(out_shape)
        args = (*args, *(jnp.full(s.shape, jnp.nan, s.dtype) for s in out_shape))
        in_specs = [*in_specs, *out_specs]
        aliases = {n_in + i: i for i in range(n_out)}
        body = kernel

        def kernel(*refs):  # the aliased inputs are never read
            body(*refs[:n_in], *refs[n_in + n_out:])
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          input_output_aliases=aliases, interpret=cfg.interpret, name=name,
                          compiler_params=compiler_params(cfg.backend, len(grid), cfg.head_dim,
                                                          num_warps=getattr(cfg, "num_warps", None),
                                                          num_stages=getattr(cfg, "num_stages", None)))(*args)


# --------------------------------------------------------------------------
# Kernel bodies (shared by all backends)
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Config:
    causal: bool
    window: int | None
    scale: float
    q_len: int        # real (unpadded) lengths: rows/cols beyond are masked
    kv_len: int
    blocks: BlockSizes
    rep: int          # query heads per kv head, H // G
    head_dim: int     # padded head dim
    backend: str
    interpret: object  # bool or pltpu.InterpretParams (hashable)
    heads_major: bool  # arrays in (B, H, L, K) (TPU) instead of (B, L, H, K)
    segmented: bool
    poison: bool = False
    num_warps: int | None = None   # Triton launch parameters (GPU only; None: compiler_params' defaults)
    num_stages: int | None = None

    @property
    def padded_q_len(self) -> int:  # whole blocks of both the forward and the backward
        return round_up(self.q_len, math.lcm(self.blocks.q, self.blocks.bwd_q))

    @property
    def padded_kv_len(self) -> int:
        return round_up(self.kv_len, math.lcm(self.blocks.kv, self.blocks.bwd_kv))


def _dot(a, b, contract, precision):
    """a @ b with float32 accumulation; contract=(i, j) names the contracted dims of a and b."""
    return lax.dot_general(a, b, ((contract[:1], contract[1:]), ((), ())),
                           preferred_element_type=F32, precision=precision)


def _precision(dtype):
    # float32 inputs are compared to a float32 reference: keep Triton off TF32
    # and TPU off single-pass bf16. bfloat16 inputs run at native precision.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def _visible(cfg, q_start, kv_start, bq, bk, seg_q=None, seg_kv=None):
    """(bq, bk) bool: which keys each query of this tile may attend to."""
    rows = q_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    cols = kv_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    mask = (rows < cfg.q_len) & (cols < cfg.kv_len)
    if cfg.causal:
        mask &= cols <= rows
    if cfg.window is not None:
        mask &= cols > rows - cfg.window
    if seg_q is not None:
        mask &= seg_q == seg_kv  # (bq, 1) == (1, bk)
    return mask


def _div(a, b):
    # Operands are non-negative, so truncation is floor division; jnp's `//`
    # lowers through sign(), which Mosaic can only lower on a real TPU.
    return lax.div(a, jnp.int32(b))


def _kv_block_range(cfg, q_start, bq, bk):
    """Key blocks [lo, hi) that hold any key visible to queries q_start..q_start+bq-1."""
    hi = pl.cdiv(cfg.kv_len, bk)
    if cfg.causal:
        hi = jnp.minimum(hi, _div(q_start + bq - 1, bk) + 1)
    lo = 0
    if cfg.window is not None:
        lo = _div(jnp.maximum(q_start - cfg.window + 1, 0), bk)
    return lo, hi


def _q_block_range(cfg, kv_start, bq, bk):
    """Query blocks [lo, hi) holding any query that sees a key in kv_start..kv_start+bk-1."""
    hi = pl.cdiv(cfg.q_len, bq)
    if cfg.window is not None:
        hi = jnp.minimum(hi, _div(kv_start + bk - 1 + cfg.window - 1, bq) + 1)
    lo = _div(kv_start, bq) if cfg.causal else 0
    return lo, hi


def _split_refs(refs, n_in, segmented):
    ins, outs = refs[:n_in], refs[n_in:]
    if segmented:
        return ins[:-2], ins[-2], ins[-1], outs
    return ins, None, None, outs


def _fwd_kernel(*refs, cfg: _Config):
    (q_ref, k_ref, v_ref), sq_ref, skv_ref, (o_ref, lse_ref) = _split_refs(refs, 3 + 2 * cfg.segmented, cfg.segmented)
    bq, bk = cfg.blocks.q, cfg.blocks.kv
    q_start = pl.program_id(2) * bq
    q = q_ref[...]
    prec = _precision(q.dtype)
    seg_q = sq_ref[...] if cfg.segmented else None

    def step(j, carry):
        m, l, acc = carry
        kv_start = pl.multiple_of(j * bk, bk)
        k, v = k_ref[pl.ds(kv_start, bk), :], v_ref[pl.ds(kv_start, bk), :]
        s = _dot(q, k, (1, 1), prec) * cfg.scale
        mask = _visible(cfg, q_start, kv_start, bq, bk, seg_q, skv_ref[j] if cfg.segmented else None)
        s = jnp.where(mask, s, MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        # where(), not just the finite MASKED: a row with no visible key yet
        # has m_new == MASKED and would otherwise count exp(0) = 1 per key.
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
        acc = alpha * acc + _dot(p.astype(v.dtype), v, (1, 0), prec)
        return m_new, l, acc

    init = (jnp.full((bq, 1), MASKED, F32), jnp.zeros((bq, 1), F32), jnp.zeros((bq, cfg.head_dim), F32))
    m, l, acc = lax.fori_loop(*_kv_block_range(cfg, q_start, bq, bk), step, init)
    # A row that sees no key (padding, or a segment absent from the keys)
    # outputs 0; lse = +inf makes the backward's exp(s - lse) vanish for it.
    empty = l == 0.0
    l = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc / l).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log(l))


def _dq_kernel(*refs, cfg: _Config):
    ins, sq_ref, skv_ref, (dq_ref,) = _split_refs(refs, 6 + 2 * cfg.segmented, cfg.segmented)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
    bq, bk = cfg.blocks.bwd_q, cfg.blocks.bwd_kv
    q_start = pl.program_id(2) * bq
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    prec = _precision(q.dtype)
    seg_q = sq_ref[...] if cfg.segmented else None

    def step(j, dq):
        kv_start = pl.multiple_of(j * bk, bk)
        k, v = k_ref[pl.ds(kv_start, bk), :], v_ref[pl.ds(kv_start, bk), :]
        mask = _visible(cfg, q_start, kv_start, bq, bk, seg_q, skv_ref[j] if cfg.segmented else None)
        p = jnp.where(mask, jnp.exp(_dot(q, k, (1, 1), prec) * cfg.scale - lse), 0.0)
        ds = p * (_dot(do, v, (1, 1), prec) - delta)
        return dq + _dot(ds.astype(k.dtype), k, (1, 0), prec)

    dq = lax.fori_loop(*_kv_block_range(cfg, q_start, bq, bk), step, jnp.zeros((bq, cfg.head_dim), F32))
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkdv_kernel(*refs, cfg: _Config):
    ins, sq_ref, skv_ref, (dk_ref, dv_ref) = _split_refs(refs, 6 + 2 * cfg.segmented, cfg.segmented)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
    bq, bk = cfg.blocks.bwd_q, cfg.blocks.bwd_kv
    kv_start = pl.program_id(2) * bk
    k, v = k_ref[...], v_ref[...]
    prec = _precision(k.dtype)
    seg_kv = skv_ref[...] if cfg.segmented else None

    def rows(ref, r, start):  # query rows of head r of this group, in either layout
        return ref[r, pl.ds(start, bq), :] if cfg.heads_major else ref[pl.ds(start, bq), r, :]

    def head(r, carry):
        def step(i, carry):
            dk, dv = carry
            q_start = pl.multiple_of(i * bq, bq)
            q, do = rows(q_ref, r, q_start), rows(do_ref, r, q_start)
            lse, delta = lse_ref[r, pl.ds(q_start, bq), :], delta_ref[r, pl.ds(q_start, bq), :]
            seg_q = sq_ref[pl.ds(q_start, bq), :] if cfg.segmented else None
            mask = _visible(cfg, q_start, kv_start, bq, bk, seg_q, seg_kv)
            p = jnp.where(mask, jnp.exp(_dot(q, k, (1, 1), prec) * cfg.scale - lse), 0.0)
            dv = dv + _dot(p.astype(do.dtype), do, (0, 0), prec)
            ds = p * (_dot(do, v, (1, 1), prec) - delta)
            dk = dk + _dot(ds.astype(q.dtype), q, (0, 0), prec)
            return dk, dv
        return lax.fori_loop(*_q_block_range(cfg, kv_start, bq, bk), step, carry)

    zeros = jnp.zeros((bk, cfg.head_dim), F32)
    dk, dv = lax.fori_loop(0, cfg.rep, head, (zeros, zeros))
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# --------------------------------------------------------------------------
# pallas_call wiring: grids and BlockSpecs per layout
# --------------------------------------------------------------------------

def _seq_spec(cfg, block, index):
    """BlockSpec of `block` rows of one head of a q/k/v/o-shaped array; index(b, h, i) -> (head, row block)."""
    def index_map(b, h, i):
        head, blk = index(b, h, i)
        return (b, head, blk, 0) if cfg.heads_major else (b, blk, head, 0)
    shape = (None, None, block, cfg.head_dim) if cfg.heads_major else (None, block, None, cfg.head_dim)
    return pl.BlockSpec(shape, index_map)


def _group_spec(cfg, seq):
    """All rep query heads of kv head g, whole sequence: (rep, L, K) or (L, rep, K)."""
    if cfg.heads_major:
        return pl.BlockSpec((None, cfg.rep, seq, cfg.head_dim), lambda b, g, j: (b, g, 0, 0))
    return pl.BlockSpec((None, seq, cfg.rep, cfg.head_dim), lambda b, g, j: (b, 0, g, 0))


def _seg_args(cfg, seg_q, seg_kv, bq, bk, per_kv_block):
    """Segment ids as a (bq, 1) query column and (1, bk) key rows, the shapes the mask compares."""
    if not cfg.segmented:
        return (), ()
    B, L = seg_q.shape
    S = seg_kv.shape[1]
    col, rows = seg_q[:, :, None], seg_kv.reshape(B, S // bk, 1, bk)
    if per_kv_block:  # dK/dV: whole query column, this key block's row
        specs = [pl.BlockSpec((None, L, 1), lambda b, g, j: (b, 0, 0)),
                 pl.BlockSpec((None, None, 1, bk), lambda b, g, j: (b, j, 0, 0))]
    else:  # forward / dQ: this query block's column, every key row
        specs = [pl.BlockSpec((None, bq, 1), lambda b, h, i: (b, i, 0)),
                 pl.BlockSpec((None, S // bk, 1, bk), lambda b, h, i: (b, 0, 0, 0))]
    return (col, rows), specs


def _forward(q, k, v, seg_q, seg_kv, cfg):
    B, H = q.shape[0], q.shape[1 if cfg.heads_major else 2]
    L, S = q.shape[2 if cfg.heads_major else 1], k.shape[2 if cfg.heads_major else 1]
    bq = cfg.blocks.q
    rep = cfg.rep
    seg_args, seg_specs = _seg_args(cfg, seg_q, seg_kv, bq, cfg.blocks.kv, per_kv_block=False)
    return _run(
        functools.partial(_fwd_kernel, cfg=cfg), cfg, grid=(B, H, L // bq), name="flash_attention_fwd",
        in_specs=[_seq_spec(cfg, bq, lambda b, h, i: (h, i)),
                  _seq_spec(cfg, S, lambda b, h, i: (_div(h, rep), 0)),
                  _seq_spec(cfg, S, lambda b, h, i: (_div(h, rep), 0)), *seg_specs],
        out_specs=[_seq_spec(cfg, bq, lambda b, h, i: (h, i)),
                   pl.BlockSpec((None, None, bq, 1), lambda b, h, i: (b, h, i, 0))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, L, 1), F32)],
        args=(q, k, v, *seg_args))


def _backward(q, k, v, seg_q, seg_kv, o, lse, do, cfg):
    B, H = q.shape[0], q.shape[1 if cfg.heads_major else 2]
    L, S = q.shape[2 if cfg.heads_major else 1], k.shape[2 if cfg.heads_major else 1]
    G, rep = H // cfg.rep, cfg.rep
    bq, bk = cfg.blocks.bwd_q, cfg.blocks.bwd_kv
    delta = jnp.sum(o.astype(F32) * do.astype(F32), axis=-1)
    delta = (delta if cfg.heads_major else delta.transpose(0, 2, 1))[..., None]  # (B, H, L, 1) like lse

    seg_args, seg_specs = _seg_args(cfg, seg_q, seg_kv, bq, bk, per_kv_block=False)
    row_stat = pl.BlockSpec((None, None, bq, 1), lambda b, h, i: (b, h, i, 0))
    (dq,) = _run(
        functools.partial(_dq_kernel, cfg=cfg), cfg, grid=(B, H, L // bq), name="flash_attention_dq",
        in_specs=[_seq_spec(cfg, bq, lambda b, h, i: (h, i)),
                  _seq_spec(cfg, S, lambda b, h, i: (_div(h, rep), 0)),
                  _seq_spec(cfg, S, lambda b, h, i: (_div(h, rep), 0)),
                  _seq_spec(cfg, bq, lambda b, h, i: (h, i)), row_stat, row_stat, *seg_specs],
        out_specs=[_seq_spec(cfg, bq, lambda b, h, i: (h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)],
        args=(q, k, v, do, lse, delta, *seg_args))

    seg_args, seg_specs = _seg_args(cfg, seg_q, seg_kv, bq, bk, per_kv_block=True)
    group_stat = pl.BlockSpec((None, rep, L, 1), lambda b, g, j: (b, g, 0, 0))
    kv_block = _seq_spec(cfg, bk, lambda b, g, j: (g, j))
    dk, dv = _run(
        functools.partial(_dkdv_kernel, cfg=cfg), cfg, grid=(B, G, S // bk), name="flash_attention_dkdv",
        in_specs=[_group_spec(cfg, L), kv_block, kv_block, _group_spec(cfg, L), group_stat, group_stat,
                  *seg_specs],
        out_specs=[kv_block, kv_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        args=(q, k, v, do, lse, delta, *seg_args))
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, seg_q, seg_kv, cfg):
    return _forward(q, k, v, seg_q, seg_kv, cfg)[0]


def _flash_fwd(q, k, v, seg_q, seg_kv, cfg):
    o, lse = _forward(q, k, v, seg_q, seg_kv, cfg)
    return o, (q, k, v, seg_q, seg_kv, o, lse)


def _flash_bwd(cfg, residuals, do):
    q, k, v, seg_q, seg_kv, o, lse = residuals
    return (*_backward(q, k, v, seg_q, seg_kv, o, lse, do, cfg), None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------

def _check_args(q_BLHK, k_BSGK, v_BSGK, causal, segment_ids_q, segment_ids_kv, window):
    if q_BLHK.ndim != 4 or k_BSGK.ndim != 4 or k_BSGK.shape != v_BSGK.shape:
        raise ValueError(f"attention wants q (B, L, H, K) and k, v (B, S, G, K); got q {q_BLHK.shape}, "
                         f"k {k_BSGK.shape}, v {v_BSGK.shape}")
    (B, L, H, K), (Bk, S, G, Kk) = q_BLHK.shape, k_BSGK.shape
    if B != Bk or K != Kk or H % G:
        raise ValueError(f"q {q_BLHK.shape} and k/v {k_BSGK.shape} disagree: batch and head_dim must match and "
                         f"the {H} query heads must be a multiple of the {G} kv heads")
    if (segment_ids_q is None) != (segment_ids_kv is None):
        raise ValueError("pass both segment_ids_q and segment_ids_kv, or neither")
    if segment_ids_q is not None and (segment_ids_q.shape != (B, L) or segment_ids_kv.shape != (B, S)):
        raise ValueError(f"segment ids must be (B, L) = {(B, L)} and (B, S) = {(B, S)}; got "
                         f"{segment_ids_q.shape} and {segment_ids_kv.shape}")
    if window is not None and (not causal or window < 1):
        raise ValueError(f"window={window} needs causal=True and window >= 1 (key j is visible to query i "
                         f"iff i - window < j <= i)")


def flash_attention(q_BLHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array, *, causal: bool = True,
                    scale: float | None = None, segment_ids_q: jax.Array | None = None,
                    segment_ids_kv: jax.Array | None = None, window: int | None = None,
                    block_q: int | None = None, block_kv: int | None = None, num_warps: int | None = None,
                    num_stages: int | None = None, backend: str | None = None,
                    interpret: bool | None = None) -> jax.Array:
    """softmax(q k^T * scale + mask) v without materializing the L x S scores; differentiable.

    G kv heads serve H/G query heads each (query head h uses kv head h // (H/G)).
    Mask: query i sees key j iff j <= i (causal; positions 0.., aligned at the
    start), i - window < j (window), segment_ids_q[i] == segment_ids_kv[j]
    (packed sequences). A query that sees no key outputs 0.
    scale: default 1/sqrt(K). block_q / block_kv: override DEFAULT_BLOCKS[backend]
    for all three kernels (rounded to what the backend accepts). Lengths need
    not be multiples of the blocks: the inputs are padded and the pad masked.
    num_warps / num_stages: Triton launch parameters of all three kernels on
    GPU (default: 4 warps for head_dim <= 64, else 8; 2 stages); ignored on
    TPU and CPU.
    backend: "gpu" | "tpu" | "cpu" (default: jax.default_backend());
    interpret: run the Pallas interpreter (default: only on CPU).

    >>> q = jnp.ones((2, 96, 8, 32)); k = v = jnp.ones((2, 96, 2, 32))
    >>> seg = jnp.repeat(jnp.array([[0, 1]]), 48, axis=1).repeat(2, axis=0)
    >>> flash_attention(q, k, v, segment_ids_q=seg, segment_ids_kv=seg, window=16).shape
    (2, 96, 8, 32)
    """
    _check_args(q_BLHK, k_BSGK, v_BSGK, causal, segment_ids_q, segment_ids_kv, window)
    cfg = _plan(q_BLHK.shape, k_BSGK.shape, causal=causal, scale=scale, window=window,
                segmented=segment_ids_q is not None, block_q=block_q, block_kv=block_kv, num_warps=num_warps,
                num_stages=num_stages, backend=backend, interpret=interpret)
    q, k, v, seg_q, seg_kv = _pad_inputs(q_BLHK, k_BSGK, v_BSGK, segment_ids_q, segment_ids_kv, cfg)
    # Padding and transposes stay outside the custom_vjp: autodiff undoes them for free.
    o = _flash(q, k, v, seg_q, seg_kv, cfg)
    o = o.transpose(0, 2, 1, 3) if cfg.heads_major else o
    return o[:, :cfg.q_len, :, :q_BLHK.shape[3]]


def _plan(q_shape, k_shape, *, causal, scale, window, segmented, block_q, block_kv, backend, interpret,
          num_warps=None, num_stages=None) -> _Config:
    """The static configuration: backend, legal block sizes, padded head dim."""
    backend, interpret = resolve_backend(backend, interpret)
    (_, L, H, K), (_, S, G, _) = q_shape, k_shape
    d = DEFAULT_BLOCKS[backend]
    bq_f, bq_b = (fit_block(block_q or b, L, backend) for b in (d.q, d.bwd_q))
    bk_f, bk_b = (fit_block(block_kv or b, S, backend, lanes=True) for b in (d.kv, d.bwd_kv))
    # Triton tensors need power-of-two sizes >= 16; zero columns change no score.
    Kp = max(16, pl.next_power_of_2(K)) if backend == "gpu" else K
    return _Config(causal=causal, window=window, scale=float(K ** -0.5 if scale is None else scale), q_len=L,
                   kv_len=S, blocks=BlockSizes(bq_f, bk_f, bq_b, bk_b), rep=H // G, head_dim=Kp, backend=backend,
                   interpret=interpret, heads_major=backend == "tpu", segmented=segmented,
                   # Triton-only: dropped elsewhere so TPU/CPU configs (and their traces) do not vary with them.
                   num_warps=num_warps if backend == "gpu" else None,
                   num_stages=num_stages if backend == "gpu" else None)


def _pad_inputs(q, k, v, seg_q, seg_kv, cfg):
    """Pad sequences to whole blocks and the head dim to cfg.head_dim; TPU: (B, L, H, K) -> (B, H, L, K)."""
    Lp, Sp, K = cfg.padded_q_len, cfg.padded_kv_len, q.shape[3]

    def prep(x, n):
        x = jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, cfg.head_dim - K)))
        return x.transpose(0, 2, 1, 3) if cfg.heads_major else x

    if cfg.segmented:  # the pad is masked by position anyway; any id will do
        seg_q = jnp.pad(seg_q.astype(jnp.int32), ((0, 0), (0, Lp - cfg.q_len)))
        seg_kv = jnp.pad(seg_kv.astype(jnp.int32), ((0, 0), (0, Sp - cfg.kv_len)))
    return prep(q, Lp), prep(k, Sp), prep(v, Sp), seg_q, seg_kv


def flash_attention_reference(q_BLHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array, *, causal: bool = True,
                              scale: float | None = None, segment_ids_q: jax.Array | None = None,
                              segment_ids_kv: jax.Array | None = None, window: int | None = None,
                              block_q: int | None = None, block_kv: int | None = None,
                              backend: str | None = None, interpret: bool | None = None) -> jax.Array:
    """`flash_attention` in plain JAX, materializing the (L, S) scores in float32; same signature and mask.

    Block/backend arguments are accepted and ignored so the two swap freely.

    >>> q = jnp.ones((1, 8, 2, 4)); k = v = jnp.ones((1, 8, 1, 4))
    >>> flash_attention_reference(q, k, v).shape
    (1, 8, 2, 4)
    """
    del block_q, block_kv, backend, interpret
    _check_args(q_BLHK, k_BSGK, v_BSGK, causal, segment_ids_q, segment_ids_kv, window)
    (B, L, H, K), (_, S, G, _) = q_BLHK.shape, k_BSGK.shape
    scale = K ** -0.5 if scale is None else scale
    q_BLGRK = q_BLHK.astype(F32).reshape(B, L, G, H // G, K)
    s_BGRLS = jnp.einsum("BLGRK,BSGK->BGRLS", q_BLGRK, k_BSGK.astype(F32), precision="highest") * scale
    i, j = jnp.arange(L)[:, None], jnp.arange(S)[None, :]
    mask_BLS = jnp.ones((1, L, S), bool)
    if causal:
        mask_BLS &= j <= i
    if window is not None:
        mask_BLS &= j > i - window
    if segment_ids_q is not None:
        mask_BLS &= segment_ids_q[:, :, None] == segment_ids_kv[:, None, :]
    mask = mask_BLS[:, None, None]
    s_BGRLS = jnp.where(mask, s_BGRLS, MASKED)
    p = jnp.where(mask, jnp.exp(s_BGRLS - jnp.max(s_BGRLS, axis=-1, keepdims=True)), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(l == 0.0, 1.0, l)  # rows that see no key output 0, as in the kernel
    o_BLGRK = jnp.einsum("BGRLS,BSGK->BLGRK", p, v_BSGK.astype(F32), precision="highest")
    return o_BLGRK.reshape(B, L, H, K).astype(q_BLHK.dtype)
