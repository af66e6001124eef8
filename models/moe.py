"""A Mixture-of-Experts decoder LM: the dense Transformer with MoE feed-forward layers.

Attention, norms, embedding and head are the dense model's own
(models/transformer.py); the layers that `moe.first_dense_layers` (the leading k, as
in DeepSeek-V3) or `moe.dense_layers` (any, as Qwen2-MoE's decoder_sparse_step and
mlp_only_layers give) name keep the dense SwiGLU, the others route each token to
`top_k` of `n_experts` experts (models/layers/moe.py).

The layers are built as runs of consecutive layers of one kind (`MoEConfig.layer_runs`),
each run stacked and scanned: one program body per run, whatever its depth. Leading dense
layers (or none) give the runs `dense_blocks` and `moe_blocks`, the names such models
always had; an interleaved pattern gets one attribute per run (`dense_blocks_0`,
`moe_blocks_1`, ...), each run a scan of its own (a step-2 pattern compiles one body per
layer, as an unrolled model would). Stacking all MoE layers in one array and slicing it
per run would keep two names for every pattern, but a slice of a stacked parameter
copies it in the forward pass and pads its gradient to the whole stack in the backward.

`apply` returns the logits and the routing statistics averaged over the MoE
layers: the load-balancing and z losses (the trainer adds them to the
objective with the config's coefficients), the fraction of dropped
assignments, and the per-expert load, per layer and averaged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from meshwork.config_sections import ModelConfig
from meshwork.models.layers.embed import Embed
from meshwork.models.layers.moe import MoE
from meshwork.models.layers.moe_routing import RouterBias, updated_router_bias
from meshwork.models.mtp import add_mtp_stats, make_mtp
from meshwork.models.transformer import (
    ACT_BLD,
    REMAT_POLICIES,
    Block,
    LMHead,
    LMOutputs,
    apply_layers,
    decode_layers,
    embed_scale,
    residual_out_std,
    stack_layers,
)
from meshwork.sharding.parallel import with_logical_constraint


class MoEBlock(Block):
    """Pre-norm block: attention, then a routed mixture of SwiGLU experts."""

    def __init__(
        self, cfg: ModelConfig, *, dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs, linear: bool = False
    ):
        super().__init__(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs, mlp=False, linear=linear)
        self.moe = MoE(
            cfg.d_model,
            cfg.moe,
            init_std=cfg.init_std,
            out_std=residual_out_std(cfg),
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )

    def __call__(
        self,
        x_BLD: jax.Array,
        positions_BL: jax.Array | None = None,
        segment_ids_BL: jax.Array | None = None,
        *,
        noise_key: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        x_BLD = x_BLD + self.attn(self.attn_norm(x_BLD), positions_BL, segment_ids_BL)
        x_BLD = with_logical_constraint(x_BLD, ACT_BLD)
        y_BLD, stats = self.moe(self.mlp_norm(x_BLD), noise_key=noise_key)
        return with_logical_constraint(x_BLD + y_BLD, ACT_BLD), stats

    def feed_forward(self, x_BLD: jax.Array) -> jax.Array:
        return self.moe(x_BLD)[0]  # inference (`Block.decode`): no routing statistics


class MoETransformer(LMOutputs, nnx.Module):
    """tokens (B, L) int -> logits (B, L, V) float32, with MoE feed-forward layers."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        remat: str = "none",
        rngs: nnx.Rngs,
    ):
        if remat not in ("none", *REMAT_POLICIES):
            raise ValueError(f"remat={remat!r}; choose none, {', '.join(REMAT_POLICIES)}")
        self.cfg, self.dtype, self.remat = cfg, dtype, remat
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.embed = Embed(cfg.vocab_size, cfg.d_model, init_std=cfg.init_std, rngs=rngs, scale=embed_scale(cfg), **kw)
        self.runs = cfg.layer_runs()
        if not any(run.moe for run in self.runs):
            raise ValueError(f"model.moe leaves no MoE layer in {cfg.n_layers} layers; use model.kind=transformer")
        for run in self.runs:
            block = functools.partial(MoEBlock if run.moe else Block, linear=run.linear)
            setattr(self, run.name, stack_layers(lambda r, block=block: block(cfg, rngs=r, **kw), run.count, rngs))
        self.head = LMHead(cfg, rngs=rngs, **kw)
        # DeepSeek-V3's MTP module's block is of the kind of the model's last layer.
        mtp_block = MoEBlock if self.runs[-1].moe else Block
        self.mtp = make_mtp(cfg, lambda r: mtp_block(cfg, rngs=r, **kw), rngs=rngs, **kw)

    def apply_hidden(
        self,
        tokens_BL: jax.Array,
        positions_BL: jax.Array | None = None,
        *,
        noise_key: jax.Array | None = None,
        segment_ids_BL: jax.Array | None = None,
        targets_BL: jax.Array | None = None,
        loss_mask_BL: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`apply` without the output projection: (final-normed hidden states, routing statistics),
        as `Transformer.apply_hidden`."""
        x_BLD = with_logical_constraint(self.embed(tokens_BL), ACT_BLD)
        # One key per MoE layer, drawn for all of them at once: each layer's noise does not depend on
        # how the layers are grouped into runs.
        keys = (
            jax.random.split(noise_key, self.cfg.moe.n_moe_layers(self.cfg.n_layers)) if noise_key is not None else None
        )
        per_run, done = [], 0
        for run in self.runs:
            graphdef, stacked = nnx.split(getattr(self, run.name))
            if not run.moe:
                x_BLD = apply_layers(
                    graphdef,
                    stacked,
                    x_BLD,
                    positions_BL,
                    self.remat,
                    segment_ids_BL=segment_ids_BL,
                    first_layer=run.start,
                )
                continue
            run_keys = keys[done : done + run.count] if keys is not None else None
            x_BLD, stats = self._moe_layers(graphdef, stacked, x_BLD, positions_BL, segment_ids_BL, run_keys, run.start)
            per_run.append(stats)
            done += run.count
        # Each statistic with a leading axis over the MoE layers, in layer order.
        stats = jax.tree.map(lambda *xs: jnp.concatenate(xs), *per_run)
        stats = add_mtp_stats(
            self,
            x_BLD,
            routing_summary(stats),
            tokens_BL=tokens_BL,
            positions_BL=positions_BL,
            segment_ids_BL=segment_ids_BL,
            noise_key=noise_key,
            targets_BL=targets_BL,
            loss_mask_BL=loss_mask_BL,
        )
        return self.head.final_norm(x_BLD), stats

    def _moe_layers(
        self,
        graphdef: nnx.GraphDef,
        stacked: nnx.State,
        x_BLD: jax.Array,
        positions_BL: jax.Array | None,
        segment_ids_BL: jax.Array | None,
        keys: jax.Array | None,
        first_layer: int | None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """One run of stacked MoE blocks (lax.scan): x, and each statistic stacked over the run's layers.
        `first_layer`: the model's index of the run's first layer (each layer's copy gets its own; None
        where it is not known: pipeline stages)."""

        def layer(x_BLD, xs):
            layer_state, key, index = xs
            block = nnx.merge(graphdef, layer_state)
            if index is not None:
                block.set_attributes(layer_index=index, raise_if_not_found=False)
            return block(x_BLD, positions_BL, segment_ids_BL, noise_key=key)

        if self.remat != "none":
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[self.remat], prevent_cse=False)
        n = jax.tree.leaves(stacked)[0].shape[0]
        indices = first_layer + jnp.arange(n) if first_layer is not None else None
        return jax.lax.scan(layer, x_BLD, (stacked, keys, indices))

    def __call__(self, tokens_BL: jax.Array, positions_BL: jax.Array | None = None) -> jax.Array:
        return self.apply(tokens_BL, positions_BL)[0]

    def layer_stacks(self) -> tuple[str, ...]:
        """The attributes holding stacked blocks that `decode` runs (src/meshwork/engine/per_layer.py)."""
        return tuple(run.name for run in self.runs)

    def decode(self, tokens_BL: jax.Array, positions_BL: jax.Array, cache, hidden: bool = False):
        """Inference with a KV cache, as `Transformer.decode` (`hidden`: also the pre-norm hidden states)."""
        x_BLD = with_logical_constraint(self.embed(tokens_BL), ACT_BLD)
        linear = set(self.cfg.linear_layers)
        for run in self.runs:  # the cache holds every layer; a run writes its layers' slices
            # Attention layers' KV and linear layers' states are each numbered within their kind.
            slot = sum((i in linear) == run.linear for i in range(run.start))
            x_BLD, cache = decode_layers(
                *nnx.split(getattr(self, run.name)),
                x_BLD,
                positions_BL,
                cache,
                first_layer=run.start,
                first_slot=slot,
                linear=run.linear,
            )
        logits_BLV = self.head(x_BLD, self.embed)
        return (logits_BLV, x_BLD, cache) if hidden else (logits_BLV, cache)

    def aux_coefficients(self) -> dict[str, float]:
        mtp = {"mtp_loss": self.cfg.mtp.loss_coef} if self.mtp is not None else {}
        return {"aux_loss": self.cfg.moe.aux_loss_coef, "z_loss": self.cfg.moe.z_loss_coef, **mtp}

    def updated_buffers(self, buffers: nnx.State, stats: dict[str, jax.Array]) -> nnx.State:
        """DeepSeek-V3's auxiliary-loss-free balancing: after each step every MoE
        layer's selection bias moves toward its under-loaded experts."""
        rate = self.cfg.moe.bias_update_rate
        if not rate or self.cfg.moe.router != "sigmoid":
            return buffers
        new, done = {}, 0
        for run in (r for r in self.runs if r.moe):  # load_per_layer's rows are the MoE layers in order
            biases = nnx.state(getattr(self, run.name), RouterBias)
            new[run.name] = {
                "moe": {
                    "router_bias": jax.vmap(updated_router_bias, in_axes=(0, 0, None))(
                        biases["moe"]["router_bias"][...], stats["load_per_layer"][done : done + run.count], rate
                    )
                }
            }
            done += run.count
        if "mtp_load_per_layer" in stats:  # the MTP modules' MoE blocks balance the same way
            new["mtp"] = {
                j: {"block": {"moe": {"router_bias": updated_router_bias(bias, stats["mtp_load_per_layer"][j], rate)}}}
                for j, bias in enumerate(m.block.moe.router_bias[...] for m in self.mtp)
            }
        out = jax.tree.map(lambda x: x, buffers)
        nnx.replace_by_pure_dict(out, new)
        return out


def routing_summary(stats: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The model's statistics from its MoE layers' (each with a leading axis over those layers,
    in layer order): scalars averaged over the layers, the per-layer load kept for the
    aux-loss-free bias update and the load plot, and the imbalance `load_cv`."""
    out = {k: v.mean(axis=0) for k, v in stats.items()}
    out["load_per_layer"] = stats["load"]
    # Imbalance, per layer then averaged: the coefficient of variation of the
    # experts' loads (0 when every expert gets the same share).
    out["load_cv"] = (stats["load"].std(axis=-1) / stats["load"].mean(axis=-1)).mean()
    return out
