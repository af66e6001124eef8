"""The roofline model: FLOPs and HBM bytes per op, and which of the two bounds it.

An op does `flops` arithmetic and moves `bytes` between HBM and the chip. Its
arithmetic intensity is flops / bytes; on a device with peak FLOP/s P and HBM
bandwidth W it runs in at least

    time = max(flops / P, bytes / W)

and attains min(P, intensity * W) FLOP/s. It is compute-bound when its
intensity reaches the ridge point P / W, memory-bound below it (Williams,
Waterman & Patterson, "Roofline: an insightful visual performance model for
multicore architectures", CACM 2009; the JAX scaling book, part 1 "All about
rooflines").

Bytes count each operand read once and each output written once: the ideal
reuse a well-tiled kernel achieves (a matmul does not re-read its inputs per
output tile; flash attention never writes the scores to HBM). Real kernels move
more, so these are lower bounds on time.

    >>> from meshwork.perf.hardware import get_hardware
    >>> h100 = get_hardware("h100")
    >>> bound(matmul(8192, 8192, 8192), h100)          # 2730 FLOPs/byte
    'compute'
    >>> bound(matmul(1, 8192, 8192), h100)             # decode: ~1 FLOP/byte
    'memory'

Pure Python: no jax, no devices.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Literal

from meshwork.config import ConfigError

if TYPE_CHECKING:
    from meshwork.config_sections import ModelConfig
    from meshwork.perf.hardware import Accelerator

# Bytes per element; jax dtype names are accepted too.
DTYPE_BYTES: dict[str, int] = {
    "fp32": 4,
    "float32": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "fp8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}
# The names `Accelerator.peak_flops` uses.
_PEAK_KEY = {
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "bf16",
    "fp16": "bf16",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of `dtype` ("bf16", "fp32", "fp8", or a jax name such as "bfloat16")."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPE_BYTES)}") from None


@dataclasses.dataclass(frozen=True)
class Op:
    """One kernel's work: `flops` arithmetic operations and `bytes` of HBM traffic.

    Example: `Op("add", flops=1e6, bytes=6e6).intensity` is 1/6 FLOPs/byte.
    """

    name: str
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per HBM byte (inf for an op that moves nothing)."""
        return self.flops / self.bytes if self.bytes else math.inf


# --------------------------------------------------------------------------
# Ops
# --------------------------------------------------------------------------


def matmul(m: int, k: int, n: int, dtype: str = "bf16", name: str = "matmul") -> Op:
    """(M, K) @ (K, N): 2MKN FLOPs; bytes (MK + KN + MN) * itemsize.

    Intensity 2MKN / (2(MK + KN + MN)) in bf16; for a square n it is n/3, and
    for a matrix-vector product (M = 1) about 1.
    Example: `matmul(4096, 4096, 4096).intensity` is 4096 / 3 = 1365.3.
    """
    return Op(name, 2.0 * m * k * n, float(m * k + k * n + m * n) * dtype_bytes(dtype))


def batched_matmul(b: int, m: int, k: int, n: int, dtype: str = "bf16", name: str = "batched_matmul") -> Op:
    """b independent (M, K) @ (K, N) products, both operands batched (as in attention's QK^T).

    2bMKN FLOPs, b(MK + KN + MN) * itemsize bytes: the intensity of one product.
    A weight shared across the batch is `matmul(b * m, k, n)` instead, whose
    intensity grows with b.
    """
    return Op(name, 2.0 * b * m * k * n, float(b) * (m * k + k * n + m * n) * dtype_bytes(dtype))


def attention(
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    head_dim: int,
    *,
    kv_heads: int | None = None,
    causal: bool = False,
    flash: bool = True,
    dtype: str = "bf16",
    name: str = "attention",
) -> Op:
    """softmax(Q K^T) V over B batch, H query heads, L queries, S keys, K head dim.

    FLOPs: 2BHLSK for Q K^T plus 2BHLSK for P V = 4BHLSK, halved when causal
    (a flash kernel skips the masked blocks; the softmax's ~5 FLOPs per score
    are left out, as in the usual MFU count).
    Bytes, flash (scores stay on chip): Q and O (B L H K each) and K, V
    (B S G K each, G = kv_heads for grouped-query attention), once each.
    Bytes, naive (flash=False): also the B H L S scores, written by Q K^T, read
    and written by the softmax, and read by P V: 4 BHLS more elements, causal or
    not (the mask does not shrink the materialized matrix).

    Example: flash attention's intensity grows with the sequence (~L for
    L = S); the naive one's stays near K / 2 for long sequences.
    """
    kv_heads = heads if kv_heads is None else kv_heads
    flops = 4.0 * batch * heads * q_len * kv_len * head_dim * (0.5 if causal else 1.0)
    elems = 2 * batch * q_len * heads * head_dim + 2 * batch * kv_len * kv_heads * head_dim
    if not flash:
        elems += 4 * batch * heads * q_len * kv_len
    return Op(name, flops, float(elems) * dtype_bytes(dtype))


def elementwise(
    n: int,
    n_inputs: int = 1,
    *,
    n_outputs: int = 1,
    flops_per_element: float = 1.0,
    dtype: str = "bf16",
    name: str = "elementwise",
) -> Op:
    """An elementwise op over n elements: n * flops_per_element FLOPs, (n_inputs + n_outputs) n elements moved.

    Example: a bf16 residual add `elementwise(n, 2)` has intensity 1/6.
    """
    return Op(name, n * flops_per_element, float(n) * (n_inputs + n_outputs) * dtype_bytes(dtype))


def reduction(n: int, n_out: int = 1, *, dtype: str = "bf16", name: str = "reduction") -> Op:
    """Reduce n elements to n_out (a sum over an axis): n - n_out adds, n + n_out elements moved."""
    return Op(name, float(n - n_out), float(n + n_out) * dtype_bytes(dtype))


def layout(n: int, *, dtype: str = "bf16", name: str = "transpose") -> Op:
    """A transpose, copy or reshape that materializes: 0 FLOPs, n elements read and n written."""
    return Op(name, 0.0, 2.0 * n * dtype_bytes(dtype))


# --------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------


def peak(accelerator: Accelerator, dtype: str = "bf16") -> float:
    """Dense peak FLOP/s of `accelerator` for `dtype` (jax names accepted)."""
    return accelerator.flops(_PEAK_KEY.get(dtype, dtype))


def attainable_flops(op: Op, accelerator: Accelerator, dtype: str = "bf16") -> float:
    """min(peak, intensity * HBM bandwidth): the roofline's height at the op's intensity."""
    return min(peak(accelerator, dtype), op.intensity * accelerator.hbm_bandwidth)


def op_time(op: Op, accelerator: Accelerator, dtype: str = "bf16") -> float:
    """Lower bound on seconds: max(flops / peak, bytes / HBM bandwidth), compute and traffic overlapped."""
    return max(op.flops / peak(accelerator, dtype), op.bytes / accelerator.hbm_bandwidth)


def bound(op: Op, accelerator: Accelerator, dtype: str = "bf16") -> Literal["compute", "memory"]:
    """ "compute" if the op's intensity reaches the ridge point peak / bandwidth, else "memory"."""
    return "compute" if op.intensity >= peak(accelerator, dtype) / accelerator.hbm_bandwidth else "memory"


# --------------------------------------------------------------------------
# One transformer layer
# --------------------------------------------------------------------------


def transformer_layer_ops(
    model: ModelConfig, batch: int, seq: int, *, dtype: str = "bf16", causal: bool = True, flash: bool = True
) -> list[Op]:
    """The forward ops of one pre-norm block of `models.transformer` (GQA + RoPE, SwiGLU MLP).

    T = batch * seq tokens, D = d_model, H / G query / kv heads of size K,
    F = d_ff. Each projection is one matmul over all T tokens (its weight read
    once); norms, RoPE, the SwiGLU gate and residual adds are elementwise, and
    the attention core is `attention(...)`. Every tensor is in `dtype`. For
    decode, pass seq=1 and use `attention(..., q_len=1, kv_len=context)`.

        >>> from meshwork.config_sections import ModelConfig
        >>> [op.name for op in transformer_layer_ops(ModelConfig(), 8, 128)][:3]
        ['attn_norm', 'q_proj', 'k_proj']
    """
    t, d, f = batch * seq, model.d_model, model.d_ff
    h, g, k = model.n_heads, model.n_kv_heads, model.resolved_head_dim
    kw = dict(dtype=dtype)
    return [
        # RMSNorm: square, mean, rsqrt, scale: ~4 FLOPs per element, x and the output moved.
        elementwise(t * d, 1, flops_per_element=4, name="attn_norm", **kw),
        matmul(t, d, h * k, name="q_proj", **kw),
        matmul(t, d, g * k, name="k_proj", **kw),
        matmul(t, d, g * k, name="v_proj", **kw),
        # RoPE on q and k: a rotation is ~3 FLOPs per element (two products, one sum).
        elementwise(t * (h + g) * k, 1, flops_per_element=3, name="rope", **kw),
        attention(batch, h, seq, seq, k, kv_heads=g, causal=causal, flash=flash, **kw),
        matmul(t, h * k, d, name="o_proj", **kw),
        elementwise(t * d, 2, name="attn_residual", **kw),
        elementwise(t * d, 1, flops_per_element=4, name="mlp_norm", **kw),
        matmul(t, d, f, name="mlp_gate", **kw),
        matmul(t, d, f, name="mlp_up", **kw),
        # silu(gate) * up: ~5 FLOPs per element (exp, add, divide, two products).
        elementwise(t * f, 2, flops_per_element=5, name="swiglu", **kw),
        matmul(t, f, d, name="mlp_down", **kw),
        elementwise(t * d, 2, name="mlp_residual", **kw),
    ]


def lm_head_op(model: ModelConfig, batch: int, seq: int, *, dtype: str = "bf16") -> Op:
    """The output projection (T, D) @ (D, V) over all tokens."""
    return matmul(batch * seq, model.d_model, model.vocab_size, dtype=dtype, name="lm_head")


def summarize(ops: list[Op], accelerator: Accelerator, dtype: str = "bf16") -> list[dict]:
    """One row per op: name, flops, bytes, intensity, bound, seconds, share of the total time.

    A table for a planner or a report; `sum(r["seconds"] for r in rows)` is the
    roofline estimate with no overlap between ops.
    """
    times = [op_time(op, accelerator, dtype) for op in ops]
    total = sum(times) or 1.0
    return [
        dict(
            name=op.name,
            flops=op.flops,
            bytes=op.bytes,
            intensity=op.intensity,
            bound=bound(op, accelerator, dtype),
            seconds=s,
            share=s / total,
        )
        for op, s in zip(ops, times)
    ]


# --------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------


def roofline_plot(ops: list[Op], accelerator: Accelerator, path: str, dtype: str = "bf16") -> str:
    """Write a log-log roofline PNG of `ops` on `accelerator` to `path`; returns `path`.

    The roof is min(peak, intensity * bandwidth); each op is a point at its
    intensity and attainable FLOP/s, labelled with its name.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p, w = peak(accelerator, dtype), accelerator.hbm_bandwidth
    finite = [op.intensity for op in ops if 0 < op.intensity < math.inf]
    lo = min(finite + [p / w]) / 4
    hi = max(finite + [p / w]) * 4
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.loglog(
        xs,
        [min(p, x * w) for x in xs],
        color="black",
        lw=1.5,
        label=f"{accelerator.name} {dtype}: {p / 1e12:.0f} TFLOP/s, {w / 1e12:.2f} TB/s",
    )
    ax.axvline(p / w, color="gray", ls=":", lw=1)
    # Ops of equal intensity (gate and up, the two residual adds) share a point and a label.
    points: dict[float, list[Op]] = {}
    for op in ops:
        if 0 < op.intensity < math.inf:
            points.setdefault(round(math.log10(op.intensity), 2), []).append(op)
    for i, group in enumerate(sorted(points.values(), key=lambda g: g[0].intensity)):
        x = group[0].intensity
        y = attainable_flops(group[0], accelerator, dtype)
        ax.scatter([x], [y], s=18, color="tab:red" if bound(group[0], accelerator, dtype) == "memory" else "tab:blue")
        ax.annotate(
            ", ".join(op.name for op in group),
            (x, y),
            textcoords="offset points",
            xytext=(4, -12 - 9 * (i % 3)),
            fontsize=7,
        )
    ax.set_xlabel("arithmetic intensity (FLOPs / HBM byte)")
    ax.set_ylabel("attainable FLOP/s")
    ax.set_title(f"roofline, ridge at {p / w:.0f} FLOPs/byte")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
