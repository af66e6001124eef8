"""Multi-token prediction (DeepSeek-V3): extra modules that predict tokens further ahead.

Module k (k = 1..D, `model.mtp.depth`) at position i combines the previous depth's hidden state
h^{k-1}_i (h^0: the main model's residual stream after its last block, before the final norm) with
the embedding of the token k places ahead, t_{i+k}:

    h'_i  = W_proj [RMSNorm_e(Emb(t_{i+k})); RMSNorm_h(h^{k-1}_i)]       (2D -> D)
    h^k_i = Block_k(h')                                                (causal over i, RoPE at i)
    logits^k_i = Head(RMSNorm_out(h^k_i))        predicting t_{i+k+1} = targets[i+k]

The embedding and the head's projection are the model's own (shared); each module has its own
two input norms, projection, block (a MoE block when the model's last layer routes to experts,
as in DeepSeek-V3; its load, `mtp_load_per_layer`, moves its selection bias like the model's) and
output norm. The training objective adds `loss_coef` times the mean over
depths of the modules' cross-entropies; positions whose target lies past the row's end (or in
another packed document, or outside the loss mask) do not count.

In decoding the modules are a draft for speculative decoding: `mtp_decode` runs module k over
new positions with its own KV-cache layer (appended after the model's layers), from the hidden
states the model's `decode(..., hidden=True)` returned.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from meshwork.config_sections import ModelConfig
from meshwork.models.layers.norm import RMSNorm
from meshwork.models.layers.params import matmul, normal, param
from meshwork.sharding.parallel import with_logical_constraint

ACT_BLD = ("act_batch", "act_norm_seq", "act_embed")


class MTPModule(nnx.Module):
    """One depth: input norms, the (2D -> D) projection, a block, the output norm."""

    def __init__(
        self, cfg: ModelConfig, block: nnx.Module, *, dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs
    ):
        D = cfg.d_model
        norm = dict(eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.embed_norm, self.hidden_norm = RMSNorm(D, **norm), RMSNorm(D, **norm)
        self.proj = param(normal(cfg.init_std), rngs.params(), (2 * D, D), param_dtype, (None, "embed"))
        self.block = block
        self.out_norm = RMSNorm(D, **norm)
        self.dtype = dtype

    def combine(self, h_BLD: jax.Array, emb_BLD: jax.Array) -> jax.Array:
        """The block's input: the projection of the normed embedding and normed hidden state, concatenated."""
        x_BLE = jnp.concatenate([self.embed_norm(emb_BLD), self.hidden_norm(h_BLD)], axis=-1)
        return with_logical_constraint(matmul("BLE,ED->BLD", x_BLE, self.proj, self.dtype), ACT_BLD)

    def __call__(self, h_BLD, emb_BLD, positions_BL, segment_ids_BL, noise_key=None) -> tuple[jax.Array, dict]:
        """(the block's output, its routing statistics: {} for a dense block)."""
        x_BLD = self.combine(h_BLD, emb_BLD)
        if hasattr(self.block, "moe"):
            return self.block(x_BLD, positions_BL, segment_ids_BL, noise_key=noise_key)
        return self.block(x_BLD, positions_BL, segment_ids_BL), {}


def make_mtp(cfg: ModelConfig, make_block, *, dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs):
    """`cfg.mtp.depth` modules (an nnx.List), each around `make_block(rngs)`; None without MTP."""
    if not cfg.mtp.depth:
        return None
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    return nnx.List([MTPModule(cfg, make_block(rngs), **kw) for _ in range(cfg.mtp.depth)])


def _ahead(x_BL: jax.Array, k: int, fill=0) -> jax.Array:
    """x shifted k places to the left (x[i + k] at i), `fill` in the last k places."""
    return jnp.concatenate([x_BL[:, k:], jnp.full((x_BL.shape[0], k), fill, x_BL.dtype)], axis=1)


def mtp_losses(
    modules,
    h_BLD: jax.Array,
    *,
    tokens_BL: jax.Array,
    targets_BL: jax.Array,
    embed,
    project,
    positions_BL: jax.Array | None = None,
    segment_ids_BL: jax.Array | None = None,
    loss_mask_BL: jax.Array | None = None,
    noise_key: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """{"mtp_loss": the mean over depths, "mtp_loss_k": depth k's cross-entropy} of the modules run
    on the trunk's hidden states `h_BLD` (before the final norm). `embed`: the token embedding;
    `project`: the head's projection of normed hidden states to logits."""
    B, L = tokens_BL.shape
    pos_BL = positions_BL if positions_BL is not None else jnp.broadcast_to(jnp.arange(L), (B, L))
    keys = jax.random.split(noise_key, len(modules)) if noise_key is not None else [None] * len(modules)
    stats, loads = {}, []
    for k, (module, key) in enumerate(zip(modules, keys), start=1):
        valid_BL = jnp.broadcast_to(jnp.arange(L) < L - k, (B, L))
        if loss_mask_BL is not None:
            valid_BL &= _ahead(loss_mask_BL, k).astype(bool)
        if segment_ids_BL is not None:
            valid_BL &= _ahead(segment_ids_BL, k) == segment_ids_BL
        h_BLD, routing = module(h_BLD, embed(_ahead(tokens_BL, k)), pos_BL, segment_ids_BL, key)
        if "load" in routing:
            loads.append(routing["load"])
        logits_BLV = project(module.out_norm(h_BLD))
        ce_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, _ahead(targets_BL, k))
        w_BL = valid_BL.astype(ce_BL.dtype)
        stats[f"mtp_loss_{k}"] = (ce_BL * w_BL).sum() / jnp.maximum(w_BL.sum(), 1.0)
    stats["mtp_loss"] = sum(stats.values()) / len(modules)
    if loads:  # each MoE module's per-expert load, for its selection bias (MoETransformer.updated_buffers)
        stats["mtp_load_per_layer"] = jnp.stack(loads)
    return stats


def add_mtp_stats(model, x_BLD, stats, *, tokens_BL, positions_BL, segment_ids_BL, noise_key, targets_BL, loss_mask_BL):
    """`stats` with the MTP losses of `model` (a Transformer or MoETransformer) added, when it has MTP
    modules and the caller gave the targets (training and evaluation; never in decoding)."""
    if model.mtp is None or targets_BL is None:
        return stats
    mtp = mtp_losses(
        model.mtp,
        x_BLD,
        tokens_BL=tokens_BL,
        targets_BL=targets_BL,
        embed=model.embed,
        project=lambda h_BLD: model.head.project(h_BLD, model.embed),
        positions_BL=positions_BL,
        segment_ids_BL=segment_ids_BL,
        loss_mask_BL=loss_mask_BL,
        noise_key=jax.random.fold_in(noise_key, 1) if noise_key is not None else None,
    )
    return {**stats, **mtp}


def mtp_decode(model, h_BLD, tokens_BL, positions_BL, cache, depth: int = 0):
    """Module `depth` of `model` over new positions: (logits (B, L, V), its hidden states, the cache).

    At position p it takes the previous depth's hidden state at p (`h_BLD`: the model's pre-norm
    residual stream for depth 0, module depth - 1's output otherwise) and the token depth + 1 places
    ahead (`tokens_BL`), predicting the one after it; its keys and values go in cache layer
    n_layers + depth. (The MTP draft, engine/mtp_draft.py, uses depth 0.)"""
    module = model.mtp[depth]
    x_BLD = module.combine(h_BLD, model.embed(tokens_BL))
    h_BLD, kv = module.block.decode(x_BLD, positions_BL, cache.layer(model.cfg.n_layers + depth))
    return model.head.project(module.out_norm(h_BLD), model.embed), h_BLD, kv.cache
