"""An image UNet (the DDPM denoiser of Ho et al., 2020) in Flax NNX, laid out like diffusers' UNet2DModel.

    x (B, H, W, C) NHWC, timesteps (B,), class labels (B,) or None -> prediction (B, H, W, C) float32

Levels of `block_out_channels` go down by stride-2 convolutions and back up
by nearest-neighbour 2x upsampling + conv; every resnet (and attention) output
on the way down is a skip connection, concatenated (channels last) to the
input of one resnet on the way up. A sinusoidal timestep embedding goes
through a linear-SiLU-linear MLP, a class embedding is added to it, and each
resnet adds a projection of SiLU(embedding) after its first convolution.

The modules and parameters mirror UNet2DModel one to one (conv_in,
time_embedding.linear_1/2, class_embedding, down_blocks[i].resnets[j] /
.attentions[j] / .downsample, mid_block, up_blocks[i]..., conv_norm_out,
conv_out), so `inference/diffusers_import.py` maps a diffusers checkpoint onto
them by renaming and transposing only.

Shape letters as in docs/architecture.md#shape-letters: B batch, HWC an image's height, width
and channels (always together, as in jax's conv layouts); attention reads the H*W pixels as L
tokens whose width D is the channels, in H heads of K; D is also the time embedding's width.
Weights name their output channels `embed` (what FSDP splits); see
sharding/rules.py for the other names.

Patch-parallel forward (DistriFusion). The same modules run on one horizontal
patch of the image per device when a sampler traces them under a
`meshwork.diffusion.patch_exchange.PatchExchange` (meshwork.diffusion.distrifusion):
3x3 convs take halo rows from the neighbouring patches instead of zero padding,
GroupNorm combines the patches' statistics, and attention's local queries see
the keys/values of the whole image. Without one, nothing changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from meshwork.config_sections import UNetConfig
from meshwork.diffusion import patch_exchange
from meshwork.models.layers.attention import attend
from meshwork.models.layers.params import param
from meshwork.sharding.parallel import with_logical_constraint

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
}
ACT_BHWC = ("act_batch", "act_height", "act_width", "act_channels")
ACT_BD = ("act_batch", "act_embed")  # the time (+ class) embedding
F32 = jnp.float32


def _fan_in_uniform(in_axis, out_axis):
    """PyTorch's default Conv2d/Linear init, U(+-1/sqrt(fan_in)): a from-scratch run then starts
    where a diffusers one would."""
    return nnx.initializers.variance_scaling(1 / 3, "fan_in", "uniform", in_axis=in_axis, out_axis=out_axis)


class Conv(nnx.Module):
    """k x k convolution with bias, 'same' padding, optional stride; HWIO kernel."""

    def __init__(
        self,
        c_in: int,
        c_out: int,
        k: int = 3,
        *,
        stride: int = 1,
        names: Sequence[str] = ("conv_kh", "conv_kw", "channels_in", "embed"),
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        self.kernel = param(_fan_in_uniform(-2, -1), rngs.params(), (k, k, c_in, c_out), param_dtype, names)
        self.bias = param(nnx.initializers.zeros, rngs.params(), (c_out,), param_dtype, (names[3],))
        self.stride, self.pad, self.dtype = stride, k // 2, dtype

    def __call__(self, x_BHWC: jax.Array) -> jax.Array:
        p = self.pad
        rows = (p, p)
        exchange = patch_exchange.active()
        if exchange is not None and p:
            # DistriFusion: x is one horizontal patch; the rows beyond its edges come from the
            # neighbouring patches (a halo) instead of zero padding.
            x_BHWC, rows = exchange.halo(x_BHWC, p, self.stride), (0, 0)
        y_BHWC = jax.lax.conv_general_dilated(
            x_BHWC.astype(self.dtype),
            self.kernel[...].astype(self.dtype),
            (self.stride, self.stride),
            (rows, (p, p)),
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )
        return y_BHWC + self.bias[...].astype(self.dtype)


class Dense(nnx.Module):
    """x W + b with W stored (in, out)."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        names: Sequence[str] = ("channels_in", "embed"),
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        self.kernel = param(_fan_in_uniform(0, 1), rngs.params(), (d_in, d_out), param_dtype, names)
        self.bias = param(nnx.initializers.zeros, rngs.params(), (d_out,), param_dtype, (names[1],))
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        return x.astype(self.dtype) @ self.kernel[...].astype(self.dtype) + self.bias[...].astype(self.dtype)


class GroupNorm(nnx.Module):
    """GroupNorm (Wu & He, 2018) over NHWC: each group of C/G consecutive channels is
    normalized over (H, W, C/G) with the biased variance, then scaled and shifted per channel."""

    def __init__(
        self,
        channels: int,
        groups: int,
        *,
        eps: float,
        name: str = "embed",
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        if channels % groups:
            raise ValueError(
                f"GroupNorm: {channels} channels do not split into norm_num_groups={groups} groups; "
                "make every channel count a multiple of model.unet.norm_num_groups"
            )
        self.scale = param(nnx.initializers.ones, rngs.params(), (channels,), param_dtype, (name,))
        self.bias = param(nnx.initializers.zeros, rngs.params(), (channels,), param_dtype, (name,))
        self.groups, self.eps, self.dtype = groups, eps, dtype

    def __call__(self, x_BHWC: jax.Array) -> jax.Array:
        B, H, W, C = x_BHWC.shape
        # Statistics in float32 whatever the compute dtype: a bf16 mean over H*W*C/G values drifts.
        x = x_BHWC.astype(F32).reshape(B, H, W, self.groups, C // self.groups)
        exchange = patch_exchange.active()
        if exchange is None:
            mean = x.mean(axis=(1, 2, 4), keepdims=True)
            var = jnp.square(x - mean).mean(axis=(1, 2, 4), keepdims=True)
        else:  # DistriFusion: x is one patch; the statistics are the whole image's
            mean, var = exchange.group_moments(x)
        y_BHWC = ((x - mean) * jax.lax.rsqrt(var + self.eps)).reshape(B, H, W, C)
        return (y_BHWC * self.scale[...].astype(F32) + self.bias[...].astype(F32)).astype(self.dtype)


def timestep_embedding(
    t_B: jax.Array, dim: int, *, flip_sin_to_cos: bool, freq_shift: float, max_period: float = 10000.0
) -> jax.Array:
    """Sinusoidal embedding (B, dim) float32 of (possibly fractional) timesteps.

    Frequencies f_i = max_period ** (-i / (dim/2 - freq_shift)), i < dim/2; the
    embedding is [sin(t f), cos(t f)], or [cos, sin] with flip_sin_to_cos (the
    DDPM code's order, diffusers' default for UNet2DModel); an odd dim gets a zero column.

    >>> timestep_embedding(jnp.array([0.0]), 4, flip_sin_to_cos=True, freq_shift=0).tolist()
    [[1.0, 1.0, 0.0, 0.0]]
    """
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=F32) / (half - freq_shift))
    angles = t_B.astype(F32)[:, None] * freqs[None, :]  # (B, dim // 2)
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    emb = jnp.concatenate([cos, sin] if flip_sin_to_cos else [sin, cos], axis=-1)
    return jnp.pad(emb, ((0, 0), (0, dim % 2)))


class TimeEmbedding(nnx.Module):
    """linear_2(SiLU(linear_1(sinusoidal(t)))): (B,) -> (B, D), D the time embedding's width."""

    def __init__(self, d_in: int, d_time: int, *, dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.linear_1 = Dense(d_in, d_time, **kw)
        self.linear_2 = Dense(d_time, d_time, **kw)

    def __call__(self, emb: jax.Array) -> jax.Array:
        return self.linear_2(jax.nn.silu(self.linear_1(emb)))


class ClassEmbedding(nnx.Module):
    def __init__(self, n_classes: int, d_time: int, *, dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        # N(0, 1) rows, as nn.Embedding starts.
        self.embedding = param(
            nnx.initializers.normal(1.0), rngs.params(), (n_classes, d_time), param_dtype, ("classes", "embed")
        )
        self.dtype = dtype

    def __call__(self, labels_B: jax.Array) -> jax.Array:
        # Gather FSDP's split of the table first, so the looked-up rows follow the labels' batch split.
        table_ND = with_logical_constraint(self.embedding[...], ("classes", "act_embed"))
        return jnp.take(table_ND, labels_B, axis=0).astype(self.dtype)


class ResnetBlock(nnx.Module):
    """x + conv2(SiLU(GN(conv1(SiLU(GN(x))) + proj(SiLU(temb))))), the skip through a 1x1 conv
    when the channel count changes (diffusers' ResnetBlock2D, 'default' time conditioning)."""

    def __init__(
        self,
        c_in: int,
        c_out: int,
        d_time: int,
        *,
        groups: int,
        eps: float,
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.norm1 = GroupNorm(c_in, groups, eps=eps, name="channels_in", **kw)
        self.conv1 = Conv(c_in, c_out, **kw)
        self.time_emb_proj = Dense(d_time, c_out, **kw)
        self.norm2 = GroupNorm(c_out, groups, eps=eps, **kw)
        self.conv2 = Conv(c_out, c_out, **kw)
        self.conv_shortcut = Conv(c_in, c_out, 1, **kw) if c_in != c_out else None

    def __call__(self, x_BHWC: jax.Array, temb_BD: jax.Array) -> jax.Array:
        h_BHWC = self.conv1(jax.nn.silu(self.norm1(x_BHWC)))
        h_BHWC = h_BHWC + self.time_emb_proj(jax.nn.silu(temb_BD))[:, None, None, :]
        h_BHWC = self.conv2(jax.nn.silu(self.norm2(h_BHWC)))
        skip_BHWC = self.conv_shortcut(x_BHWC) if self.conv_shortcut is not None else x_BHWC
        return with_logical_constraint(skip_BHWC.astype(h_BHWC.dtype) + h_BHWC, ACT_BHWC)


class SpatialAttention(nnx.Module):
    """x + out(MHA(GN(x))) over the H*W positions as tokens, C / head_dim heads, no mask.

    The attention itself goes through `models.layers.attention.attend`, so the
    same kernels (XLA, Pallas flash attention, cuDNN) serve the UNet and the LMs.
    """

    def __init__(
        self,
        channels: int,
        head_dim: int,
        *,
        groups: int,
        eps: float,
        impl: str,
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        if channels % head_dim:
            raise ValueError(
                f"attention over {channels} channels cannot have heads of "
                f"model.unet.attention_head_dim={head_dim}; pick a divisor of {channels}"
            )
        D, H, K = channels, channels // head_dim, head_dim
        self.group_norm = GroupNorm(D, groups, eps=eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        qkv_init, out_init = _fan_in_uniform(0, (1, 2)), _fan_in_uniform((0, 1), 2)
        zeros = nnx.initializers.zeros
        for name in ("wq", "wk", "wv"):
            setattr(self, name, param(qkv_init, rngs.params(), (D, H, K), param_dtype, ("embed", "heads", "head_dim")))
            setattr(self, "b" + name[1], param(zeros, rngs.params(), (H, K), param_dtype, ("heads", "head_dim")))
        self.wo = param(out_init, rngs.params(), (H, K, D), param_dtype, ("heads", "head_dim", "embed"))
        self.bo = param(zeros, rngs.params(), (D,), param_dtype, ("embed",))
        self.impl, self.dtype = impl, dtype

    def __call__(self, x_BHWC: jax.Array) -> jax.Array:
        B, height, width, D = x_BHWC.shape  # the image's channels are the attention's model width
        w = lambda p: p[...].astype(self.dtype)  # noqa: E731
        h_BLD = self.group_norm(x_BHWC).reshape(B, height * width, D)
        act = ("act_batch", "act_seq", "act_heads", "act_head_dim")
        q_BLHK = with_logical_constraint(jnp.einsum("BLD,DHK->BLHK", h_BLD, w(self.wq)) + w(self.bq), act)
        k_BLHK = with_logical_constraint(jnp.einsum("BLD,DHK->BLHK", h_BLD, w(self.wk)) + w(self.bk), act)
        v_BLHK = with_logical_constraint(jnp.einsum("BLD,DHK->BLHK", h_BLD, w(self.wv)) + w(self.bv), act)
        exchange = patch_exchange.active()
        if exchange is not None:
            # DistriFusion: the queries are this patch's; keys and values cover the whole image.
            k_BLHK, v_BLHK = exchange.keys_values(k_BLHK, v_BLHK)
        o_BLHK = attend(q_BLHK, k_BLHK, v_BLHK, causal=False, impl=self.impl)
        # Contracting K, then H: the summation order jnp.einsum picks for the letters this was first
        # written with ("BLNK,NKC->BLC"; it sorts the contracted letters), kept so results stay bit-identical.
        out_BLD = jax.lax.dot_general(o_BLHK, w(self.wo), (((3, 2), (1, 0)), ((), ()))) + w(self.bo)
        return with_logical_constraint(x_BHWC.astype(self.dtype) + out_BLD.reshape(B, height, width, D), ACT_BHWC)


class Level(nnx.Module):
    """One resolution level of the down or up path: resnets, each optionally followed by
    attention, then an optional resampling conv (`downsample` stride 2 / `upsample` after 2x
    nearest-neighbour). The mid block is a Level too: resnet, [attention], resnet."""

    def __init__(
        self,
        resnets: list[ResnetBlock],
        attentions: list[SpatialAttention],
        downsample: Conv | None = None,
        upsample: Conv | None = None,
    ):
        self.resnets, self.attentions = nnx.List(resnets), nnx.List(attentions)
        self.downsample, self.upsample = downsample, upsample


class UNet(nnx.Module):
    """x_BHWC, t_B, labels_B -> out_BHWC float32 (see the module docstring).

    attention: the `attend` kernel (model.attention: xla | pallas | cudnn | reference).
    remat: what each resnet / attention block keeps for the backward pass
    ("none", "full", "dots_saveable"); the blocks are not scanned (every level
    has other shapes), so each is its own jax.checkpoint.

    >>> m = UNet(UNetConfig(block_out_channels=[16, 32], num_class_embeds=10), rngs=nnx.Rngs(0))
    >>> m(jnp.zeros((2, 16, 16, 1)), jnp.array([10, 500]), jnp.array([3, 7])).shape
    (2, 16, 16, 1)
    """

    def __init__(
        self,
        cfg: UNetConfig,
        *,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        remat: str = "none",
        attention: str = "xla",
        rngs: nnx.Rngs,
    ):
        if remat not in ("none", *REMAT_POLICIES):
            raise ValueError(f"remat={remat!r}; choose none, {', '.join(REMAT_POLICIES)}")
        chans, n = list(cfg.block_out_channels), len(cfg.block_out_channels)
        if not (len(cfg.down_block_types) == len(cfg.up_block_types) == n):
            raise ValueError(
                f"model.unet: {n} block_out_channels, {len(cfg.down_block_types)} down_block_types "
                f"and {len(cfg.up_block_types)} up_block_types; give one of each per level"
            )
        self.cfg, self.dtype, self.remat = cfg, dtype, remat
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm = dict(groups=cfg.norm_num_groups, eps=cfg.norm_eps)
        d_time = 4 * chans[0]

        def resnet(c_in, c_out):
            return ResnetBlock(c_in, c_out, d_time, **norm, **kw)

        def attn(c):
            return SpatialAttention(c, cfg.attention_head_dim, impl=attention, **norm, **kw)

        self.conv_in = Conv(cfg.in_channels, chans[0], names=("conv_kh", "conv_kw", "image_channels", "embed"), **kw)
        self.time_embedding = TimeEmbedding(chans[0], d_time, **kw)
        self.class_embedding = (
            ClassEmbedding(cfg.num_class_embeds, d_time, **kw) if cfg.num_class_embeds is not None else None
        )

        skips = [chans[0]]  # channels of every tensor the down path hands to the up path, in order
        down, c = [], chans[0]
        for i, kind in enumerate(cfg.down_block_types):
            resnets, attentions = [], []
            for _ in range(cfg.layers_per_block):
                resnets.append(resnet(c, chans[i]))
                c = chans[i]
                if kind == "AttnDownBlock2D":
                    attentions.append(attn(c))
                skips.append(c)
            downsample = Conv(c, c, stride=2, **kw) if i < n - 1 else None
            if downsample is not None:
                skips.append(c)
            down.append(Level(resnets, attentions, downsample=downsample))
        self.down_blocks = nnx.List(down)

        self.mid_block = Level([resnet(c, c), resnet(c, c)], [attn(c)] if cfg.mid_block_attention else [])

        up = []
        for i, kind in enumerate(cfg.up_block_types):
            c_out = chans[n - 1 - i]
            resnets, attentions = [], []
            for _ in range(cfg.layers_per_block + 1):
                resnets.append(resnet(c + skips.pop(), c_out))
                c = c_out
                if kind == "AttnUpBlock2D":
                    attentions.append(attn(c))
            up.append(Level(resnets, attentions, upsample=Conv(c, c, **kw) if i < n - 1 else None))
        self.up_blocks = nnx.List(up)

        self.conv_norm_out = GroupNorm(chans[0], cfg.norm_num_groups, eps=cfg.norm_eps, **kw)
        self.conv_out = Conv(chans[0], cfg.out_channels, names=("conv_kh", "conv_kw", "embed", "image_channels"), **kw)

    def _run(self, block: nnx.Module, *args: jax.Array) -> jax.Array:
        # A patch-parallel forward is inference (nothing to recompute) and records the values it
        # exchanges for the next step, which must not be tracers of a checkpointed sub-trace.
        if self.remat == "none" or patch_exchange.active() is not None:
            return block(*args)
        # Tree mode (graph=False): the block goes in as a pytree and nothing is written back into
        # its Variables afterwards. Graph mode writes them back, which fails (TraceContextError)
        # whenever the UNet was merged in an outer trace and is called in an inner one, as the
        # samplers do (weights merged under jit, called inside fori_loop). The blocks hold
        # weights only, no state that a forward changes, so there is nothing to write back.
        return nnx.remat(lambda b, *a: b(*a), policy=REMAT_POLICIES[self.remat], graph=False)(block, *args)

    def __call__(self, x_BHWC: jax.Array, t_B: jax.Array, labels_B: jax.Array | None = None) -> jax.Array:
        """t_B: timesteps (int or float; a scalar is broadcast); labels_B: class ids when
        num_class_embeds is set (required then, refused otherwise)."""
        cfg = self.cfg
        B = x_BHWC.shape[0]
        if (labels_B is None) != (self.class_embedding is None):
            raise ValueError(
                "UNet with num_class_embeds=None takes no labels"
                if labels_B is not None
                else f"UNet is class-conditional (num_class_embeds={cfg.num_class_embeds}): pass labels_B; "
                "for unconditional samples pass the null class you reserved"
            )
        t_B = jnp.broadcast_to(jnp.asarray(t_B), (B,))
        emb = timestep_embedding(
            t_B, cfg.block_out_channels[0], flip_sin_to_cos=cfg.flip_sin_to_cos, freq_shift=cfg.freq_shift
        )
        temb_BD = self.time_embedding(emb)
        if self.class_embedding is not None:
            temb_BD = temb_BD + self.class_embedding(labels_B)
        temb_BD = with_logical_constraint(temb_BD, ACT_BD)

        x_BHWC = with_logical_constraint(self.conv_in(x_BHWC), ACT_BHWC)
        skips = [x_BHWC]
        for level in self.down_blocks:
            for j, res in enumerate(level.resnets):
                x_BHWC = self._run(res, x_BHWC, temb_BD)
                if level.attentions:
                    x_BHWC = self._run(level.attentions[j], x_BHWC)
                skips.append(x_BHWC)
            if level.downsample is not None:
                x_BHWC = with_logical_constraint(level.downsample(x_BHWC), ACT_BHWC)
                skips.append(x_BHWC)

        mid = self.mid_block
        x_BHWC = self._run(mid.resnets[0], x_BHWC, temb_BD)
        if mid.attentions:
            x_BHWC = self._run(mid.attentions[0], x_BHWC)
        x_BHWC = self._run(mid.resnets[1], x_BHWC, temb_BD)

        for level in self.up_blocks:
            for j, res in enumerate(level.resnets):
                skip_BHWC = skips.pop()
                x_BHWC = jnp.concatenate([x_BHWC, skip_BHWC.astype(x_BHWC.dtype)], axis=-1)
                x_BHWC = self._run(res, x_BHWC, temb_BD)
                if level.attentions:
                    x_BHWC = self._run(level.attentions[j], x_BHWC)
            if level.upsample is not None:
                x_BHWC = jnp.repeat(jnp.repeat(x_BHWC, 2, axis=1), 2, axis=2)
                x_BHWC = with_logical_constraint(level.upsample(x_BHWC), ACT_BHWC)

        out_BHWC = self.conv_out(jax.nn.silu(self.conv_norm_out(x_BHWC)))
        return with_logical_constraint(out_BHWC, ACT_BHWC).astype(F32)
