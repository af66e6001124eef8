"""Bottleneck adapters (Houlsby et al., 2019) and prefix tuning (Li & Liang, 2021).

Two ways of fine-tuning the dense Transformer (models/transformer.py) that keep
every base weight frozen and add a few trainable variables to each layer,
stacked on the leading `layers` axis like the blocks they belong to:

- `add_adapters`: after attention and after the MLP, the sublayer's output h
  becomes h + up(gelu(down(h))) before the residual add (`Block.attn_adapter`,
  `Block.mlp_adapter`). `up` starts at zero, so the model is unchanged at step 0.
- `add_prefixes`: each layer gets s trainable key and value vectors per
  key/value head (`Attention.prefix`); every query attends to all s of them
  plus its own causal past. With `hidden` > 0 the prefixes are the output of a
  per-layer reparameterization MLP (embedding (s, D) -> tanh MLP -> 2 G K),
  which Li & Liang found trains more stably; Li & Liang (and Hugging Face
  peft) share one MLP across layers instead, with an output of size n_layers 2 G K.

RoPE and prefixes: the prefix keys are not rotated, which is the same as
placing all of them at position 0, while the tokens keep their positions
0..L-1; so on the tokens the base model computes exactly what it did before,
and a query at position t sees the prefixes at relative distance t.

    model = build_model(cfg)
    add_adapters(model, rank=8, rngs=nnx.Rngs(0))       # or add_prefixes(model, 8, 0, rngs=...)
    trainable = nnx.split(model, AdapterParam, ...)[1]   # the only variables the optimizer sees

models/lora.py `apply_finetune` calls these by config.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from meshwork.models.layers.params import matmul, normal, param
from meshwork.models.transformer import Transformer, stack_layers


class AdapterParam(nnx.Param):
    """A weight of a bottleneck adapter: the trainable variables of finetune.method=adapter."""


class PrefixParam(nnx.Param):
    """A prefix-tuning variable (prefixes, or their reparameterization): trainable for method=prefix."""


def _zeros(key, shape, dtype):
    del key
    return jnp.zeros(shape, dtype)


class Adapter(nnx.Module):
    """h -> h + up(gelu(down(h) + b_down)) + b_up, a bottleneck of width `rank` (one layer's)."""

    def __init__(self, d_model: int, rank: int, *, dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        D, r = d_model, rank
        self.w_down = param(
            normal(1 / math.sqrt(D)), rngs.params(), (D, r), param_dtype, ("embed", "lora_rank"), AdapterParam
        )
        self.b_down = param(_zeros, rngs.params(), (r,), param_dtype, ("lora_rank",), AdapterParam)
        # Zero up-projection: the adapter starts as the identity (Houlsby's near-identity init, exactly).
        self.w_up = param(_zeros, rngs.params(), (r, D), param_dtype, ("lora_rank", "embed"), AdapterParam)
        self.b_up = param(_zeros, rngs.params(), (D,), param_dtype, ("embed",), AdapterParam)
        self.dtype = dtype

    def __call__(self, h_BLD: jax.Array) -> jax.Array:
        z_BLr = jax.nn.gelu(matmul("BLD,Dr->BLr", h_BLD, self.w_down, self.dtype) + self.b_down[...].astype(self.dtype))
        return h_BLD + matmul("BLr,rD->BLD", z_BLr, self.w_up, self.dtype) + self.b_up[...].astype(self.dtype)


class Prefix(nnx.Module):
    """One layer's trainable key/value prefixes, and the attention that reads them.

    hidden = 0: the prefixes themselves are the variables, `keys` and `values`
    of shape (s, G, K), s = prefix_len: the prefix's share of the key positions S. hidden > 0: an
    embedding (s, D) goes through tanh(e W1 + b1) W2 + b2 to (s, 2, G, K) (Li & Liang's
    reparameterization; the einsum spells the keys/values pair J, as it takes letters only).
    """

    def __init__(
        self,
        prefix_len: int,
        n_kv_heads: int,
        head_dim: int,
        d_model: int,
        hidden: int,
        *,
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        s, G, K, D = prefix_len, n_kv_heads, head_dim, d_model
        kv_names = (None, "kv_heads", "head_dim")
        if hidden == 0:
            # N(0, 1), like the embedding table peft trains for prefixes.
            self.keys = param(normal(1.0), rngs.params(), (s, G, K), param_dtype, kv_names, PrefixParam)
            self.values = param(normal(1.0), rngs.params(), (s, G, K), param_dtype, kv_names, PrefixParam)
        else:
            self.embedding = param(normal(1.0), rngs.params(), (s, D), param_dtype, (None, "embed"), PrefixParam)
            self.w1 = param(
                normal(1 / math.sqrt(D)), rngs.params(), (D, hidden), param_dtype, ("embed", None), PrefixParam
            )
            self.b1 = param(_zeros, rngs.params(), (hidden,), param_dtype, (None,), PrefixParam)
            self.w2 = param(
                normal(1 / math.sqrt(hidden)),
                rngs.params(),
                (hidden, 2, G, K),
                param_dtype,
                (None, None, "kv_heads", "head_dim"),
                PrefixParam,
            )
            self.b2 = param(_zeros, rngs.params(), (2, G, K), param_dtype, (None, "kv_heads", "head_dim"), PrefixParam)
        self.hidden, self.dtype = hidden, dtype

    def keys_values(self) -> tuple[jax.Array, jax.Array]:
        """The prefix keys and values, each (s, G, K), in the compute dtype."""
        if self.hidden == 0:
            return self.keys[...].astype(self.dtype), self.values[...].astype(self.dtype)
        e_sD = self.embedding[...].astype(self.dtype)
        h_sF = jnp.tanh(matmul("sD,DF->sF", e_sD, self.w1, self.dtype) + self.b1[...].astype(self.dtype))
        kv_s2GK = matmul("sF,FJGK->sJGK", h_sF, self.w2, self.dtype) + self.b2[...].astype(self.dtype)
        return kv_s2GK[:, 0], kv_s2GK[:, 1]

    def attend(
        self, q_BLHK: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array, positions_BL: jax.Array | None
    ) -> jax.Array:
        """Causal attention over [prefixes; keys]: every query sees all s prefixes, then its past.

        The mask is explicit ((B, 1, L, S) booleans, S = s + L), so this runs XLA's attention
        whatever `model.attention` says.
        """
        B, L, _, _ = q_BLHK.shape
        k_sGK, v_sGK = self.keys_values()
        s = k_sGK.shape[0]
        k_BSGK = jnp.concatenate([jnp.broadcast_to(k_sGK, (B, *k_sGK.shape)).astype(k_BLGK.dtype), k_BLGK], axis=1)
        v_BSGK = jnp.concatenate([jnp.broadcast_to(v_sGK, (B, *v_sGK.shape)).astype(v_BLGK.dtype), v_BLGK], axis=1)
        pos_BL = positions_BL if positions_BL is not None else jnp.broadcast_to(jnp.arange(L), (B, L))
        causal_BLL = pos_BL[:, :, None] >= pos_BL[:, None, :]
        mask_B1LS = jnp.concatenate([jnp.ones((B, L, s), bool), causal_BLL], axis=-1)[:, None]
        return jax.nn.dot_product_attention(q_BLHK, k_BSGK, v_BSGK, mask=mask_B1LS)


def require_dense(model: nnx.Module, what: str) -> None:
    """Raises unless `model` is the dense Transformer, the one these methods are built for."""
    if not isinstance(model, Transformer):
        raise ValueError(
            f"{what} is built for the dense Transformer (models/transformer.py), not "
            f"{type(model).__name__}; fine-tune this model with finetune.method=full"
        )


def param_dtype_of(model: Transformer) -> jnp.dtype:
    """The dtype the model stores its weights in (that of its embedding table)."""
    return model.embed.table[...].dtype


def add_adapters(model: Transformer, rank: int, *, rngs: nnx.Rngs) -> None:
    """In place: a bottleneck adapter of width `rank` after every attention and every MLP.

    >>> from meshwork.config_sections import ModelConfig
    >>> m = Transformer(ModelConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64), rngs=nnx.Rngs(0))
    >>> add_adapters(m, 4, rngs=nnx.Rngs(1))
    >>> m.blocks.attn_adapter.w_down.shape     # (layers, D, r)
    (2, 32, 4)
    """
    require_dense(model, "finetune.method=adapter")
    if model.blocks.attn_adapter is not None:
        raise ValueError("the model already has adapters; build the base model again to add new ones")
    cfg, kw = model.cfg, dict(dtype=model.dtype, param_dtype=param_dtype_of(model))
    model.blocks.attn_adapter = stack_layers(lambda r: Adapter(cfg.d_model, rank, **kw, rngs=r), cfg.n_layers, rngs)
    model.blocks.mlp_adapter = stack_layers(lambda r: Adapter(cfg.d_model, rank, **kw, rngs=r), cfg.n_layers, rngs)


def add_prefixes(model: Transformer, prefix_len: int, hidden: int = 0, *, rngs: nnx.Rngs) -> None:
    """In place: `prefix_len` trainable key/value positions in every layer's attention
    (through a reparameterization MLP of width `hidden` when it is > 0).

    >>> from meshwork.config_sections import ModelConfig
    >>> m = Transformer(ModelConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64), rngs=nnx.Rngs(0))
    >>> add_prefixes(m, 5, rngs=nnx.Rngs(1))
    >>> m.blocks.attn.prefix.keys.shape        # (layers, s, G, K)
    (2, 5, 1, 16)
    """
    require_dense(model, "finetune.method=prefix")
    if model.blocks.attn.prefix is not None:
        raise ValueError("the model already has prefixes; build the base model again to add new ones")
    cfg = model.cfg
    model.blocks.attn.prefix = stack_layers(
        lambda r: Prefix(
            prefix_len,
            cfg.n_kv_heads,
            cfg.resolved_head_dim,
            cfg.d_model,
            hidden,
            dtype=model.dtype,
            param_dtype=param_dtype_of(model),
            rngs=r,
        ),
        cfg.n_layers,
        rngs,
    )
