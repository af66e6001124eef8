"""SwiGLU feed-forward (Shazeer, 2020): down(silu(x W_gate) * (x W_up)); GeGLU with `activation`
"gelu_tanh" (Gemma's tanh-approximated gelu in silu's place)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshwork.models.layers.params import matmul, normal, param
from meshwork.sharding.collective_matmul import tp_mlp
from meshwork.sharding.parallel import current_parallel, with_logical_constraint

ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class SwiGLU(nnx.Module):
    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        init_std: float,
        out_std: float,
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
        activation: str = "silu",
    ):
        if activation not in ACTIVATIONS:
            raise ValueError(f"MLP activation {activation!r}; choose {', '.join(ACTIVATIONS)}")
        self.activation = activation
        self.w_gate = param(normal(init_std), rngs.params(), (d_model, d_ff), param_dtype, ("embed", "mlp"))
        self.w_up = param(normal(init_std), rngs.params(), (d_model, d_ff), param_dtype, ("embed", "mlp"))
        self.w_down = param(normal(out_std), rngs.params(), (d_ff, d_model), param_dtype, ("mlp", "embed"))
        self.dtype = dtype

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        weights = (self.w_gate, self.w_up, self.w_down)
        # Collective matmuls where the run asked for them and the rules are Megatron-SP's; never for
        # wrapped weights (LoRA, quantized), which do their own products.
        layout = current_parallel().collective_matmul_axes()
        # The collective-matmul SwiGLU is silu's; GeGLU takes the plain products (which XLA partitions).
        if (
            layout
            and self.activation == "silu"
            and all(isinstance(w, nnx.Variable) and isinstance(w.get_value(), jax.Array) for w in weights)
        ):
            axis, batch_axes = layout
            return tp_mlp(
                x_BLD,
                *(w.get_value().astype(self.dtype) for w in weights),
                jax.sharding.get_abstract_mesh(),
                axis_name=axis,
                batch_axes=batch_axes,
            )
        gate_BLF = matmul("BLD,DF->BLF", x_BLD, self.w_gate, self.dtype)
        up_BLF = matmul("BLD,DF->BLF", x_BLD, self.w_up, self.dtype)
        h_BLF = with_logical_constraint(
            ACTIVATIONS[self.activation](gate_BLF) * up_BLF, ("act_batch", "act_seq", "act_mlp")
        )
        return matmul("BLF,FD->BLD", h_BLF, self.w_down, self.dtype)
