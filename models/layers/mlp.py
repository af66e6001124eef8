"""SwiGLU feed-forward (Shazeer, 2020): down(silu(x W_gate) * (x W_up))."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from meshwork.models.layers.params import matmul, normal, param
from meshwork.sharding.collective_matmul import tp_mlp
from meshwork.sharding.rules import current_rules, split_axes, with_logical_constraint

_COLLECTIVE_MATMUL: contextvars.ContextVar[bool] = contextvars.ContextVar("meshwork_collective_matmul",
                                                                          default=False)


@contextlib.contextmanager
def use_collective_matmul(enabled: bool = True) -> Iterator[None]:
    """While tracing, SwiGLU runs as collective matmuls (sharding/collective_matmul.py)
    wherever the rules are Megatron-SP's (config `comm.collective_matmul`); elsewhere,
    and for wrapped weights (LoRA, quantized), it stays the plain layer.

    >>> with use_collective_matmul():
    ...     _COLLECTIVE_MATMUL.get()
    True
    """
    token = _COLLECTIVE_MATMUL.set(enabled)
    try:
        yield
    finally:
        _COLLECTIVE_MATMUL.reset(token)


def _sequence_parallel_axis() -> tuple[str, tuple[str, ...]] | None:
    """(the axis, the batch axes) when one mesh axis splits both the MLP's hidden
    dimension and the residual stream's sequence (and nothing else of the layer), as
    the `sp` preset does; None otherwise, or when collective matmul is off."""
    rules, mesh = current_rules(), jax.sharding.get_abstract_mesh()
    if not _COLLECTIVE_MATMUL.get() or rules is None or mesh.empty or mesh.manual_axes:
        return None  # manual axes: already inside a shard_map (pipeline stages)
    shape = dict(mesh.shape)
    axes = split_axes("mlp", rules, shape)
    if len(axes) != 1 or any(split_axes(n, rules, shape) != axes for n in ("act_mlp", "act_norm_seq")) \
            or split_axes("act_seq", rules, shape) or split_axes("act_embed", rules, shape):
        return None
    return axes[0], split_axes("act_batch", rules, shape)


class SwiGLU(nnx.Module):
    def __init__(self, d_model: int, d_ff: int, *, init_std: float, out_std: float, dtype: jnp.dtype,
                 param_dtype: jnp.dtype, rngs: nnx.Rngs):
        self.w_gate = param(normal(init_std), rngs.params(), (d_model, d_ff), param_dtype, ("embed", "mlp"))
        self.w_up = param(normal(init_std), rngs.params(), (d_model, d_ff), param_dtype, ("embed", "mlp"))
        self.w_down = param(normal(out_std), rngs.params(), (d_ff, d_model), param_dtype, ("mlp", "embed"))
        self.dtype = dtype

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        weights = (self.w_gate, self.w_up, self.w_down)
        layout = _sequence_parallel_axis()
        if layout and all(isinstance(w, nnx.Variable) and isinstance(w.get_value(), jax.Array) for w in weights):
            axis, batch_axes = layout
            return tp_mlp(x_BLD, *(w.get_value().astype(self.dtype) for w in weights),
                          jax.sharding.get_abstract_mesh(), axis_name=axis, batch_axes=batch_axes)
        gate_BLF = matmul("BLD,DF->BLF", x_BLD, self.w_gate, self.dtype)
        up_BLF = matmul("BLD,DF->BLF", x_BLD, self.w_up, self.dtype)
        h_BLF = with_logical_constraint(jax.nn.silu(gate_BLF) * up_BLF, ("act_batch", "act_seq", "act_mlp"))
        return matmul("BLF,FD->BLD", h_BLF, self.w_down, self.dtype)
