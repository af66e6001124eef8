"""A Llama-style decoder-only Transformer LM in Flax NNX.

Pre-norm blocks (RMSNorm -> grouped-query attention with RoPE -> residual,
RMSNorm -> SwiGLU -> residual), stacked along a leading `layers` axis and
applied with `jax.lax.scan`, so the program (and its compile time) has one
block whatever the depth; `remat` picks what the backward pass recomputes.
Decoding from a `Generator` runs the blocks in a loop instead, over weights
split one array per layer (src/meshwork/engine/per_layer.py): a scan copies each
layer's weights every step, which a decode step cannot hide.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from meshwork.config_sections import ModelConfig
from meshwork.engine.per_layer import is_per_layer, layer_slice
from meshwork.models.layers.attention import OUT_PROJ, QKV_PROJ, Attention
from meshwork.models.layers.embed import Embed
from meshwork.models.layers.gated_deltanet import GatedDeltaNet
from meshwork.models.layers.layer_pattern import LayerPattern
from meshwork.models.layers.mixed_matmul import MATMUL
from meshwork.models.layers.mla import MLAttention
from meshwork.models.layers.mlp import SwiGLU
from meshwork.models.layers.norm import RMSNorm
from meshwork.models.layers.params import matmul, normal, param
from meshwork.models.mtp import add_mtp_stats, make_mtp, mtp_decode
from meshwork.partitioning import to_device_memory
from meshwork.sharding.parallel import with_logical_constraint

_cp = jax.checkpoint_policies
# The weight products (models/layers/mixed_matmul.py) run inside a custom_vjp, where the
# dot_general-seeking policies cannot see them: those policies take them by their name, MATMUL.
REMAT_POLICIES = {
    "full": _cp.nothing_saveable,
    "dots_saveable": _cp.save_from_both_policies(_cp.dots_saveable, _cp.save_only_these_names(MATMUL)),
    # The weight matmuls' outputs, not attention's batched (score and value) dots.
    "dots_with_no_batch_dims_saveable": _cp.save_from_both_policies(
        _cp.dots_with_no_batch_dims_saveable, _cp.save_only_these_names(MATMUL)
    ),
    # By the names models/layers/attention.py tags: the q/k/v projections (MaxText's
    # save_qkv_proj) and the attention output projection; everything else is recomputed.
    "save_qkv_proj": _cp.save_only_these_names(*QKV_PROJ),
    "save_out_proj": _cp.save_only_these_names(OUT_PROJ),
    "save_qkv_and_out_proj": _cp.save_only_these_names(*QKV_PROJ, OUT_PROJ),
    # Activation offload: the weight matmuls' outputs go to pinned host memory in the forward
    # pass and come back for the backward pass, instead of staying on the device
    # (dots_saveable) or being recomputed (full); attention's batched dots are recomputed.
    "offload_dots": _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=[MATMUL],
        offload_src="device",
        offload_dst="pinned_host",
    ),
}
ACT_BLD = ("act_batch", "act_norm_seq", "act_embed")  # the residual stream


def residual_out_std(cfg: ModelConfig) -> float:
    """Init scale of the projections that write into the residual stream: smaller,
    so the stream's variance does not grow with depth (GPT-2's 1/sqrt(2L))."""
    return cfg.init_std / math.sqrt(2 * cfg.n_layers)


def embed_scale(cfg: ModelConfig) -> float | None:
    """What token embeddings are multiplied by on input: sqrt(d_model) for Gemma, else nothing."""
    return math.sqrt(cfg.d_model) if cfg.scale_embeddings else None


def make_attention(cfg: ModelConfig, **kw) -> nnx.Module:
    """The attention `cfg` asks for: multi-head latent attention (model.mla) or grouped-query attention."""
    common = dict(
        rope_theta=cfg.rope_theta,
        rope_scaling=cfg.rope_scaling,
        init_std=cfg.init_std,
        out_std=residual_out_std(cfg),
        norm_eps=cfg.norm_eps,
        impl=cfg.attention,
        window=cfg.sliding_window,
    )
    if cfg.mla is not None:
        return MLAttention(cfg.d_model, cfg.n_heads, cfg.mla, **common, **kw)
    pattern = LayerPattern.from_config(cfg)
    return Attention(
        cfg.d_model,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.resolved_head_dim,
        qkv_bias=cfg.qkv_bias,
        qk_norm=cfg.qk_norm,
        pattern=pattern,
        softcap=cfg.attn_logit_softcap,
        sinks=cfg.attention_sinks,
        out_bias=cfg.attention_out_bias,
        scale=cfg.query_pre_attn_scalar**-0.5 if cfg.query_pre_attn_scalar else None,
        norm_offset=cfg.norm_offset,
        output_gate=cfg.attention_output_gate,
        rotary_dim=int(cfg.resolved_head_dim * cfg.partial_rotary_factor),
        **common,
        **kw,
    )


def make_linear_attention(cfg: ModelConfig, **kw) -> nnx.Module:
    """A Gated DeltaNet layer of the shape `cfg.linear_attention` gives (Qwen3-Next's linear layers)."""
    return GatedDeltaNet(
        cfg.d_model,
        cfg.linear_attention,
        init_std=cfg.init_std,
        out_std=residual_out_std(cfg),
        norm_eps=cfg.norm_eps,
        **kw,
    )


class Block(nnx.Module):
    """Pre-norm block: attention, then a SwiGLU MLP (`mlp=False` leaves the
    feed-forward to a subclass, e.g. the MoE block)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
        mlp: bool = True,
        linear: bool = False,
    ):
        """`linear`: the layer's attention is Gated DeltaNet (a hybrid model's linear layers)."""
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm = dict(eps=cfg.norm_eps, offset=cfg.norm_offset, **kw)
        self.attn_norm = RMSNorm(cfg.d_model, **norm)
        self.attn = make_linear_attention(cfg, **kw) if linear else make_attention(cfg, **kw)
        self.linear = linear
        self.mlp_norm = RMSNorm(cfg.d_model, **norm)
        if cfg.sandwich_norm:  # Gemma 2/3: the sublayers' outputs are normed too, before the residual adds
            self.attn_out_norm = RMSNorm(cfg.d_model, **norm)
            self.mlp_out_norm = RMSNorm(cfg.d_model, **norm)
        self.sandwich = cfg.sandwich_norm
        if mlp:
            self.mlp = SwiGLU(
                cfg.d_model,
                cfg.d_ff,
                init_std=cfg.init_std,
                out_std=residual_out_std(cfg),
                activation=cfg.mlp_activation,
                **kw,
            )
        # Bottleneck adapters on the sublayers' outputs (models/adapters.py, set by fine-tuning).
        self.attn_adapter = nnx.data(None)
        self.mlp_adapter = nnx.data(None)

    def __call__(
        self, x_BLD: jax.Array, positions_BL: jax.Array | None = None, segment_ids_BL: jax.Array | None = None
    ) -> jax.Array:
        h_BLD = self._out_norm("attn", self.attn(self.attn_norm(x_BLD), positions_BL, segment_ids_BL))
        x_BLD = x_BLD + self._adapt(self.attn_adapter, h_BLD)
        x_BLD = with_logical_constraint(x_BLD, ACT_BLD)
        h_BLD = self._out_norm("mlp", self.feed_forward(self.mlp_norm(x_BLD)))
        x_BLD = x_BLD + self._adapt(self.mlp_adapter, h_BLD)
        return with_logical_constraint(x_BLD, ACT_BLD)

    def _out_norm(self, sublayer: str, h_BLD: jax.Array) -> jax.Array:
        """A sublayer's output, normed when the model has sandwich norms."""
        return getattr(self, f"{sublayer}_out_norm")(h_BLD) if self.sandwich else h_BLD

    def decode(self, x_BLD: jax.Array, positions_BL: jax.Array, kv) -> tuple[jax.Array, object]:
        """The block over new tokens whose earlier keys/values are in a KV cache (inference):
        (x, the cache with this layer's new keys/values written)."""
        # A linear layer reads and writes its sequences' recurrent states, an attention layer its KV cache.
        cached = self.attn.cached_view if self.linear else self.attn.cached
        h_BLD, kv = cached(self.attn_norm(x_BLD), positions_BL, kv)
        h_BLD = self._out_norm("attn", h_BLD)
        x_BLD = with_logical_constraint(x_BLD + self._adapt(self.attn_adapter, h_BLD), ACT_BLD)
        h_BLD = self._out_norm("mlp", self.feed_forward(self.mlp_norm(x_BLD)))
        x_BLD = x_BLD + self._adapt(self.mlp_adapter, h_BLD)
        return with_logical_constraint(x_BLD, ACT_BLD), kv

    def feed_forward(self, x_BLD: jax.Array) -> jax.Array:
        return self.mlp(x_BLD)

    @staticmethod
    def _adapt(adapter: nnx.Module | None, h_BLD: jax.Array) -> jax.Array:
        return h_BLD if adapter is None else adapter(h_BLD)


def stack_layers(make: Callable[[nnx.Rngs], nnx.Module], n: int, rngs: nnx.Rngs) -> nnx.Module:
    """n copies of `make(rngs)`, each with its own init, stacked on a leading axis named
    `layers` (the metadata transform keeps the logical names aligned with the new axis)."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def build(rngs: nnx.Rngs) -> nnx.Module:
        return make(rngs)

    return build(rngs)


def apply_layers(
    graphdef: nnx.GraphDef,
    stacked: nnx.State,
    x_BLD: jax.Array,
    positions_BL: jax.Array | None,
    remat: str,
    dropout_key: jax.Array | None = None,
    unroll: bool = False,
    segment_ids_BL: jax.Array | None = None,
    first_layer: int | None = 0,
) -> jax.Array:
    """Runs the blocks whose states are stacked on a leading axis, one after another (lax.scan).

    Shared by the model and by pipeline stages, which each run a slice of the stack.
    `unroll`: emit every layer into the program instead of a loop (longer
    compiles; lets XLA fuse and schedule across layers, and undoes remat).
    `dropout_key` (training only) is split into one key per layer, set on that layer's LoRA
    modules for the dropout of their branches (models/lora.py); None runs them deterministically.
    `segment_ids_BL`: the document of each token of packed rows (attention stays within one).
    `first_layer`: the model's index of the first of these layers (each layer's copy gets its own as
    `layer_index`, for stacks whose layers differ in window or RoPE: models/layers/layer_pattern.py);
    None where it is not known (pipeline stages).
    """

    def layer(x_BLD, xs):
        layer_state, key, index = xs
        # Parameter offload: stacked weights that live in host memory are scanned there, and only
        # this layer's slice is brought to the device, when this layer runs (XLA:GPU/TPU; on CPU,
        # where host and device memory are one, jax lowers this device_put to nothing).
        layer_state = jax.tree.map(to_device_memory, layer_state)
        block = nnx.merge(graphdef, layer_state)
        if key is not None:
            # Explicitly, on this layer's fresh copy: every module with a `dropout_key` attribute
            # (models/lora.py's LoRA) gets the layer's key, as flax sets nnx.Dropout's `deterministic`.
            # The key stays an input of this traced function, which jit, scan and remat see (an
            # ambient context variable is invisible to jit's cache), and no layer's call signature
            # carries a key that only the LoRA wrapper reads.
            block.set_attributes(dropout_key=key, raise_if_not_found=False)
        if index is not None:
            block.set_attributes(layer_index=index, raise_if_not_found=False)
        return block(x_BLD, positions_BL, segment_ids_BL), None

    if remat != "none":
        # prevent_cse=False: inside scan there is nothing for CSE to undo.
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[remat], prevent_cse=False)
    n = jax.tree.leaves(stacked)[0].shape[0]
    keys = jax.random.split(dropout_key, n) if dropout_key is not None else None
    indices = first_layer + jnp.arange(n) if first_layer is not None else None
    x_BLD, _ = jax.lax.scan(layer, x_BLD, (stacked, keys, indices), unroll=n if unroll else 1)
    return x_BLD


def decode_layers(
    graphdef: nnx.GraphDef,
    stacked: nnx.State,
    x_BLD: jax.Array,
    positions_BL: jax.Array,
    cache,
    first_layer: int = 0,
    *,
    first_slot: int | None = None,
    linear: bool = False,
) -> tuple[jax.Array, object]:
    """`apply_layers` for inference with a KV cache (src/meshwork/engine/kv_cache.py).

    The whole cache rides in the scan's carry and layer i writes only its own
    slice, so with the cache donated XLA updates it in place; scanning the
    cache as per-layer inputs/outputs instead would build a second copy.
    `first_slot`: the first layer's index in the cache (None: `first_layer`); in a hybrid model the
    attention layers' KV and the `linear` layers' recurrent states are each numbered by their kind.
    """
    first_slot = first_layer if first_slot is None else first_slot

    def layer(carry, xs):
        x_BLD, cache = carry
        layer_state, i, slot = xs
        block = nnx.merge(graphdef, layer_state)
        block.set_attributes(layer_index=i, raise_if_not_found=False)
        view = cache.linear_layer(slot) if linear else cache.layer(slot)
        x_BLD, kv = block.decode(x_BLD, positions_BL, view)
        return (x_BLD, kv.cache), None

    leaves = jax.tree.leaves(stacked, is_leaf=is_per_layer)
    n = leaves[0].shape[0]
    carry = (x_BLD, cache)
    if any(map(is_per_layer, leaves)):
        # One array per layer (engine/per_layer.py): a loop, each layer reading its own weights in place.
        for j in range(n):
            layer_state = jax.tree.map(lambda x: layer_slice(x, j), stacked, is_leaf=is_per_layer)
            carry, _ = layer(carry, (layer_state, jnp.int32(first_layer + j), jnp.int32(first_slot + j)))
        return carry
    xs = (stacked, first_layer + jnp.arange(n), first_slot + jnp.arange(n))
    carry, _ = jax.lax.scan(layer, carry, xs)
    return carry


class LMHead(nnx.Module):
    """Final RMSNorm and the projection to vocabulary logits (float32)."""

    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        self.final_norm = RMSNorm(
            cfg.d_model, eps=cfg.norm_eps, offset=cfg.norm_offset, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        if not cfg.tie_embeddings:
            self.lm_head = param(
                normal(cfg.init_std), rngs.params(), (cfg.d_model, cfg.vocab_size), param_dtype, ("embed", "vocab")
            )
        self.tied, self.dtype, self.softcap = cfg.tie_embeddings, dtype, cfg.final_logit_softcap

    def __call__(self, x_BLD: jax.Array, embed: Embed | None = None) -> jax.Array:
        """`embed`: the input embedding, used as the projection when embeddings are tied."""
        with jax.named_scope("lm_head"):
            return self.project(self.final_norm(x_BLD), embed)

    def project(self, x_BLD: jax.Array, embed: Embed | None = None) -> jax.Array:
        """Logits of hidden states that have been through `final_norm`."""
        if self.tied:
            logits_BLV = embed.attend(x_BLD)
        else:
            logits_BLV = matmul("BLD,DV->BLV", x_BLD, self.lm_head, self.dtype)
        logits_BLV = with_logical_constraint(logits_BLV, ("act_batch", "act_seq", "act_vocab"))
        logits_BLV = logits_BLV.astype(jnp.float32)
        # Gemma 2's final soft-cap, in float32 (transformers caps the float32 logits too).
        return logits_BLV if self.softcap is None else self.softcap * jnp.tanh(logits_BLV / self.softcap)

    def weight_DV(self, embed: Embed | None = None) -> jax.Array:
        """The projection as a (D, V) array (the embedding table transposed when tied): what a
        fused loss multiplies the normed hidden states by (src/meshwork/objectives/fused_ce.py)."""
        w = embed.table if self.tied else self.lm_head
        if not isinstance(w, nnx.Variable) or not isinstance(w.get_value(), jax.Array):
            raise ValueError(
                "train.loss_chunk needs a plain head weight, not a quantized or wrapped one; unset train.loss_chunk"
            )
        return w[...].T if self.tied else w[...]


class LMOutputs:
    """What the dense and the MoE language model share above their trunks (each defines `apply_hidden`,
    `embed`, `head` and `mtp`): the logits, the head's weight, the MTP draft."""

    def apply(
        self,
        tokens_BL: jax.Array,
        positions_BL: jax.Array | None = None,
        *,
        noise_key: jax.Array | None = None,
        segment_ids_BL: jax.Array | None = None,
        targets_BL: jax.Array | None = None,
        loss_mask_BL: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The trainer's entry point, shared by all LMs: (logits, auxiliary statistics).

        The statistics: a MoE model's routing statistics, and the multi-token prediction losses
        (models/mtp.py) when the model has MTP modules and `targets_BL` (with `loss_mask_BL`) are
        given. `noise_key` (the step's randomness, given in training only) draws router noise and the
        dropout of LoRA branches where there are any.
        """
        h_BLD, stats = self.apply_hidden(
            tokens_BL,
            positions_BL,
            noise_key=noise_key,
            segment_ids_BL=segment_ids_BL,
            targets_BL=targets_BL,
            loss_mask_BL=loss_mask_BL,
        )
        return self.head.project(h_BLD, self.embed), stats

    def head_weight(self) -> jax.Array:
        """The output projection, (D, V): logits = apply_hidden(...)[0] @ head_weight()."""
        return self.head.weight_DV(self.embed)

    def mtp_decode(self, hidden_BLD: jax.Array, tokens_BL: jax.Array, positions_BL: jax.Array, cache, depth: int = 0):
        """MTP module `depth` as a draft (models/mtp.py `mtp_decode`): (logits, its hidden states, cache)."""
        return mtp_decode(self, hidden_BLD, tokens_BL, positions_BL, cache, depth)


class Transformer(LMOutputs, nnx.Module):
    """tokens (B, L) int -> logits (B, L, V) float32."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        remat: str = "none",
        scan_layers: bool = True,
        rngs: nnx.Rngs,
    ):
        if remat not in ("none", *REMAT_POLICIES):
            raise ValueError(f"remat={remat!r}; choose none, {', '.join(REMAT_POLICIES)}")
        self.cfg, self.dtype, self.remat, self.scan_layers = cfg, dtype, remat, scan_layers
        self.embed = Embed(
            cfg.vocab_size,
            cfg.d_model,
            init_std=cfg.init_std,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
            scale=embed_scale(cfg),
        )

        self.blocks = stack_layers(
            lambda r: Block(cfg, dtype=dtype, param_dtype=param_dtype, rngs=r), cfg.n_layers, rngs
        )
        self.head = LMHead(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.mtp = make_mtp(
            cfg,
            lambda r: Block(cfg, dtype=dtype, param_dtype=param_dtype, rngs=r),
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )

    def __call__(
        self,
        tokens_BL: jax.Array,
        positions_BL: jax.Array | None = None,
        *,
        dropout_key: jax.Array | None = None,
        segment_ids_BL: jax.Array | None = None,
    ) -> jax.Array:
        """positions_BL: the position of each token when the sequence is laid out in another
        order than 0..L-1 (context parallelism's zigzag); None means 0..L-1.
        dropout_key: training randomness for LoRA dropout (models/lora.py); None: none.
        segment_ids_BL: each token's document when several are packed in a row; None: one."""
        return self.head(self._trunk(tokens_BL, positions_BL, dropout_key, segment_ids_BL), self.embed)

    def _trunk(
        self,
        tokens_BL: jax.Array,
        positions_BL: jax.Array | None,
        dropout_key: jax.Array | None,
        segment_ids_BL: jax.Array | None,
    ) -> jax.Array:
        """Embedding and blocks: the residual stream before the head."""
        x_BLD = with_logical_constraint(self.embed(tokens_BL), ACT_BLD)
        return apply_layers(
            *nnx.split(self.blocks),
            x_BLD,
            positions_BL,
            self.remat,
            dropout_key,
            unroll=not self.scan_layers,
            segment_ids_BL=segment_ids_BL,
        )

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
        """`apply` without the output projection: (final-normed hidden states, statistics), for a
        loss that multiplies them by `head_weight()` itself, chunk by chunk (train.loss_chunk)."""
        x_BLD = self._trunk(tokens_BL, positions_BL, noise_key, segment_ids_BL)
        stats = add_mtp_stats(
            self,
            x_BLD,
            {},
            tokens_BL=tokens_BL,
            positions_BL=positions_BL,
            segment_ids_BL=segment_ids_BL,
            noise_key=noise_key,
            targets_BL=targets_BL,
            loss_mask_BL=loss_mask_BL,
        )
        with jax.named_scope("lm_head"):
            return self.head.final_norm(x_BLD), stats

    def aux_coefficients(self) -> dict[str, float]:
        """Weights of the auxiliary terms `apply` returns in the training objective."""
        return {"mtp_loss": self.cfg.mtp.loss_coef} if self.mtp is not None else {}

    def layer_stacks(self) -> tuple[str, ...]:
        """The attributes holding stacked blocks that `decode` runs (src/meshwork/engine/per_layer.py)."""
        return ("blocks",)

    def decode(self, tokens_BL: jax.Array, positions_BL: jax.Array, cache, hidden: bool = False):
        """Inference: logits of new tokens at `positions_BL`, attending over the keys
        and values `cache` holds for earlier positions; returns (logits, updated cache).
        One call with a whole prompt is the prefill, calls with L=1 are decode steps.
        `hidden`: also return the residual stream before the final norm, (logits, hidden, cache),
        which the MTP modules draft from (models/mtp.py: `mtp_decode`)."""
        x_BLD = with_logical_constraint(self.embed(tokens_BL), ACT_BLD)
        x_BLD, cache = decode_layers(*nnx.split(self.blocks), x_BLD, positions_BL, cache)
        logits_BLV = self.head(x_BLD, self.embed)
        return (logits_BLV, x_BLD, cache) if hidden else (logits_BLV, cache)
