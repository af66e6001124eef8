"""What every Pallas kernel here needs besides its algorithm: backend choice, block alignment, launch, dots.

One kernel body serves every backend: Triton on GPU, Mosaic on TPU, the Pallas
interpreter on CPU. This module holds what differs per backend (which one runs,
its compiler parameters, the block lengths it accepts, the `pallas_call` that
launches a kernel) and the arithmetic helpers the kernel bodies and the
pure-JAX references share (float32-accumulating dots, the masked-score value,
Gemma 2's soft cap, the references' softmax with gpt-oss's sinks).

    >>> resolve_backend("cuda", None)
    ('gpu', False)
    >>> fit_block(100, 40, "gpu"), round_up(40, 16)
    (64, 48)
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltr

from meshwork.kernels.score_modifiers import soft_cap  # noqa: F401  (the kernels' one soft-cap)

F32 = jnp.float32
# A finite "minus infinity" for masked scores: with -inf, a row that has not
# yet seen a visible key would compute exp(-inf - -inf) = NaN when rescaling.
MASKED = -1e30
BACKENDS = ("gpu", "tpu", "cpu")


def resolve_backend(backend: str | None, interpret=None) -> tuple[str, object]:
    """("gpu" | "tpu" | "cpu", interpret) from the arguments and the default device.

    >>> resolve_backend(None, None)   # on a CPU-only machine
    ('cpu', True)
    """
    backend = {"cuda": "gpu", "rocm": "gpu"}.get(backend, backend) or jax.default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"Pallas backend {backend!r} is unknown; use 'gpu' (Triton), 'tpu' (Mosaic) or 'cpu'")
    if interpret is None:
        interpret = backend == "cpu"
    if backend == "cpu" and not interpret:
        raise ValueError("Pallas runs on CPU only in interpret mode; pass interpret=True (or None)")
    # An interpreter object (pltpu.InterpretParams: NaN-filled memory, out-of-bounds
    # checks, shuffled parallel grid) passes through to pallas_call as is.
    return backend, interpret if not isinstance(interpret, (bool, int)) else bool(interpret)


# The chip a lowering for a platform targets when none is attached: in jax 0.12, Pallas's
# Triton lowering and some Mosaic rules read the chip (compute capability, TPU generation) from
# the abstract mesh's device, else from the default device, which on a CPU host is no target.
# The H200 is the GPU this project tunes on; a v5e is the TPU the tuning
# table's example names.
ABSTRACT_DEVICES = {
    "cuda": jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu"),
    "tpu": jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu"),
}


@contextlib.contextmanager
def lowering_target(platform: str):
    """Lets `.lower(lowering_platforms=(platform,))` run on a machine without that device.

    Sets the platform's abstract device on the current abstract mesh (same axes); a no-op for a
    platform without an entry in ABSTRACT_DEVICES or when that device is the default backend.
    Wrap the trace too: a `Traced` lowers under the abstract mesh it was traced under.
    """
    device = ABSTRACT_DEVICES.get(platform)
    if device is None or jax.default_backend() == device.platform:
        yield
        return
    mesh = jax.sharding.get_abstract_mesh()
    with jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh(mesh.axis_sizes, mesh.axis_names, axis_types=mesh.axis_types, abstract_device=device)
    ):
        yield


def compiler_params(
    backend: str, grid_rank: int, head_dim: int, *, num_warps: int | None = None, num_stages: int | None = None
):
    """Backend compiler parameters; they also select Triton, since jax>=0.10 defaults GPU to Mosaic GPU.

    num_warps / num_stages: Triton launch parameters (None: 4 warps up to head_dim 128, else 8, as the
    H200 tuning run found fastest at 128; 2 stages); ignored on TPU and CPU.
    """
    if backend == "gpu":
        return pltr.CompilerParams(
            num_warps=(4 if head_dim <= 128 else 8) if num_warps is None else num_warps,
            num_stages=2 if num_stages is None else num_stages,
        )
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


def launch(kernel, cfg, *, grid, in_specs, out_specs, out_shape, args, name):
    """pl.pallas_call with the backend's parameters; with cfg.poison, outputs start as NaN.

    cfg: the kernel's static configuration; read here are backend, interpret,
    head_dim, poison and, when present, num_warps / num_stages.

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
            body(*refs[:n_in], *refs[n_in + n_out :])

    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=cfg.interpret,
        name=name,
        compiler_params=compiler_params(
            cfg.backend,
            len(grid),
            cfg.head_dim,
            num_warps=getattr(cfg, "num_warps", None),
            num_stages=getattr(cfg, "num_stages", None),
        ),
    )(*args)


def dot(a, b, contract, precision):
    """a @ b with float32 accumulation; contract=(i, j) names the contracted dims of a and b."""
    return lax.dot_general(
        a, b, ((contract[:1], contract[1:]), ((), ())), preferred_element_type=F32, precision=precision
    )


def dot_precision(dtype):
    """The dot precision for inputs of `dtype`."""
    # float32 inputs are compared to a float32 reference: keep Triton off TF32
    # and TPU off single-pass bf16. bfloat16 inputs run at native precision.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def masked_softmax(scores, mask, sink=None):
    """The references' softmax over the last axis, in the scores' dtype (float32 there).

    Entries where `mask` is False weigh 0 and a row with no visible entry is all
    0. sink: one more logit per row (broadcastable to scores[..., :1]) that joins
    the denominator but weighs no value (gpt-oss's attention sinks), which equals
    Hugging Face's softmax over the scores with the sink appended as a column,
    the column then dropped.

    >>> masked_softmax(jnp.zeros((1, 2)), jnp.array([[True, True]]), sink=jnp.zeros((1, 1)))
    Array([[0.33333334, 0.33333334]], dtype=float32)
    """
    scores = jnp.where(mask, scores, MASKED)
    m = jnp.max(scores, axis=-1, keepdims=True)
    if sink is not None:
        m = jnp.maximum(m, sink)
    m = lax.stop_gradient(m)  # any m gives the same ratio; not differentiating it keeps the gradients clean
    p = jnp.where(mask, jnp.exp(scores - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    if sink is not None:
        l = l + jnp.exp(sink - m)
    return p / jnp.where(l == 0.0, 1.0, l)


def check_features(softcap, sinks, H):
    """Raises unless softcap is None or positive and sinks None or (H,), one logit per query head."""
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap={softcap}: the cap must be a positive number (Gemma 2 uses 50.0), or None for none")
    if sinks is not None and jnp.shape(sinks) != (H,):
        raise ValueError(
            f"sinks has shape {jnp.shape(sinks)}; attention sinks are one logit per query head, shape ({H},)"
        )


def floor_div(a, b):
    """a // b for non-negative int32 indices, in kernel bodies and BlockSpec index maps."""
    # Operands are non-negative, so truncation is floor division; jnp's `//`
    # lowers through sign(), which Mosaic can only lower on a real TPU.
    return lax.div(a, jnp.int32(b))
