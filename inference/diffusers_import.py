"""diffusers UNet2DModel checkpoints (config.json + safetensors) as meshwork UNets.

Reads a UNet2DModel directory as `save_pretrained` writes it (or a pipeline
directory with a `unet/` folder), memory-mapped with safetensors (numpy; no
torch, no diffusers), into the parameter tree of `models/unet.py`:

    cfg, params = load_diffusers_unet("path/to/unet")   # UNetConfig, nested dict of numpy
    model = build_unet(cfg, params)                     # models.unet.UNet
    eps_BHWC = model(x_BHWC, t_B, labels_B)             # NHWC; diffusers takes NCHW

The mapping is one to one: conv weights OIHW -> HWIO, linear (out, in) ->
(in, out), attention to_q/to_k/to_v (C, C) -> (C, heads, head_dim) and
to_out.0 -> (heads, head_dim, C), group norms weight/bias -> scale/bias.
Checked to 1e-4 on float32 outputs by tests/test_unet.py.

Supported: DownBlock2D / AttnDownBlock2D, UpBlock2D / AttnUpBlock2D, the
UNetMidBlock2D with or without attention, positional (sinusoidal) time
embedding, class conditioning through `num_class_embeds`. Settings that
change the forward pass and that meshwork does not implement (Fourier time
embedding, scale-shift time conditioning, skip blocks, resnet resampling,
other activations, ...) raise a ValueError naming the key; dropout is
training-only and ignored.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from typing import Any

import jax.numpy as jnp
import ml_dtypes  # noqa: F401  registers bfloat16 with numpy, so bf16 checkpoints read as numpy
import numpy as np
from flax import nnx

from meshwork.config_sections import UNetConfig
from meshwork.models.hf import apply_params
from meshwork.models.hf.files import TensorReader

WEIGHTS = "diffusion_pytorch_model.safetensors"
_DOWN = ("DownBlock2D", "AttnDownBlock2D")
_UP = ("UpBlock2D", "AttnUpBlock2D")


# ---------------------------------------------------------------- config


def config_from_diffusers(d: dict[str, Any]) -> UNetConfig:
    """The meshwork UNetConfig for a UNet2DModel config.json dict (diffusers' defaults fill gaps).

    >>> cfg = config_from_diffusers({"_class_name": "UNet2DModel", "sample_size": 32, "in_channels": 3,
    ...     "out_channels": 3, "block_out_channels": [64, 128], "down_block_types": ["DownBlock2D",
    ...     "AttnDownBlock2D"], "up_block_types": ["AttnUpBlock2D", "UpBlock2D"], "norm_num_groups": 32})
    >>> cfg.layers_per_block, cfg.attention_head_dim, cfg.mid_block_attention
    (2, 8, True)
    """
    c = dict(d)

    def refuse(key: str, default: Any, ok: bool | None = None, why: str = "") -> Any:
        value = c.get(key, default)
        if not (value == default if ok is None else ok):
            raise ValueError(f"UNet2DModel config {key}={value!r}: {why or f'meshwork implements only {default!r}'}")
        return value

    refuse(
        "_class_name",
        "UNet2DModel",
        c.get("_class_name", "UNet2DModel") == "UNet2DModel",
        "meshwork reads UNet2DModel checkpoints (no text conditioning)",
    )
    refuse("center_input_sample", False)
    refuse("time_embedding_type", "positional")
    refuse("mid_block_type", "UNetMidBlock2D")
    refuse("mid_block_scale_factor", 1)
    refuse("downsample_padding", 1)
    refuse("downsample_type", "conv")
    refuse("upsample_type", "conv")
    refuse("act_fn", "silu")
    refuse("resnet_time_scale_shift", "default")
    refuse("class_embed_type", None)
    chans = [int(ch) for ch in c.get("block_out_channels", (224, 448, 672, 896))]
    refuse(
        "time_embedding_dim",
        None,
        c.get("time_embedding_dim") in (None, 4 * chans[0]),
        f"meshwork's time embedding is 4 * block_out_channels[0] = {4 * chans[0]} wide",
    )
    groups = refuse(
        "norm_num_groups",
        32,
        c.get("norm_num_groups", 32) is not None,
        "set the group count explicitly (meshwork does not derive it from the channels)",
    )
    refuse(
        "attn_norm_num_groups",
        None,
        c.get("attn_norm_num_groups") in (None, groups),
        f"attention group norms use norm_num_groups={groups} in meshwork",
    )
    head_dim = refuse(
        "attention_head_dim",
        8,
        c.get("attention_head_dim", 8) is not None,
        "meshwork needs a fixed attention_head_dim (None means one head of every width)",
    )
    down = list(c.get("down_block_types", ("DownBlock2D",) + ("AttnDownBlock2D",) * 3))
    up = list(c.get("up_block_types", ("AttnUpBlock2D",) * 3 + ("UpBlock2D",)))
    refuse("down_block_types", down, all(b in _DOWN for b in down), f"blocks must be among {_DOWN}")
    refuse("up_block_types", up, all(b in _UP for b in up), f"blocks must be among {_UP}")
    size = c.get("sample_size") or 32
    if isinstance(size, list | tuple):
        refuse("sample_size", size, len(size) == 2 and size[0] == size[1], "meshwork's images are square")
        size = size[0]
    return UNetConfig(
        sample_size=int(size),
        in_channels=c.get("in_channels", 3),
        out_channels=c.get("out_channels", 3),
        block_out_channels=chans,
        down_block_types=down,
        up_block_types=up,
        layers_per_block=c.get("layers_per_block", 2),
        norm_num_groups=groups,
        norm_eps=c.get("norm_eps", 1e-5),
        attention_head_dim=head_dim,
        mid_block_attention=bool(c.get("add_attention", True)),
        num_class_embeds=c.get("num_class_embeds"),
        flip_sin_to_cos=c.get("flip_sin_to_cos", True),
        freq_shift=c.get("freq_shift", 0),
    )


# ---------------------------------------------------------------- weights


class _Tensors(TensorReader):
    """The diffusers layout: convolutions, linears and norms with biases."""

    def conv(self, prefix: str, c_in: int, c_out: int, k: int = 3) -> dict[str, np.ndarray]:
        """nn.Conv2d (out, in, kh, kw) -> HWIO."""
        return {
            "kernel": self.get(prefix + ".weight", (c_out, c_in, k, k)).transpose(2, 3, 1, 0),
            "bias": self.get(prefix + ".bias", (c_out,)),
        }

    def linear(self, prefix: str, d_in: int, d_out: int) -> dict[str, np.ndarray]:
        """nn.Linear (out, in) -> (in, out)."""
        return {"kernel": self.get(prefix + ".weight", (d_out, d_in)).T, "bias": self.get(prefix + ".bias", (d_out,))}

    def norm(self, prefix: str, c: int) -> dict[str, np.ndarray]:
        return {"scale": self.get(prefix + ".weight", (c,)), "bias": self.get(prefix + ".bias", (c,))}


def _resnet(t: _Tensors, p: str, c_in: int, c_out: int, d_time: int) -> dict[str, Any]:
    out = {
        "norm1": t.norm(p + ".norm1", c_in),
        "conv1": t.conv(p + ".conv1", c_in, c_out),
        "time_emb_proj": t.linear(p + ".time_emb_proj", d_time, c_out),
        "norm2": t.norm(p + ".norm2", c_out),
        "conv2": t.conv(p + ".conv2", c_out, c_out),
    }
    if c_in != c_out:
        out["conv_shortcut"] = t.conv(p + ".conv_shortcut", c_in, c_out, k=1)
    return out


def _attention(t: _Tensors, p: str, c: int, head_dim: int) -> dict[str, Any]:
    # Projection outputs are head-major (head n owns rows n*K .. n*K+K-1), as `attend` splits them.
    N, K = c // head_dim, head_dim
    out: dict[str, Any] = {"group_norm": t.norm(p + ".group_norm", c)}
    for ours, theirs in (("q", "to_q"), ("k", "to_k"), ("v", "to_v")):
        lin = t.linear(f"{p}.{theirs}", c, c)
        out["w" + ours], out["b" + ours] = lin["kernel"].reshape(c, N, K), lin["bias"].reshape(N, K)
    lin = t.linear(p + ".to_out.0", c, c)
    out["wo"], out["bo"] = lin["kernel"].reshape(N, K, c), lin["bias"]
    return out


def _params(t: _Tensors, cfg: UNetConfig) -> dict[str, Any]:
    """The pure-dict parameter tree of models.unet.UNet(cfg), walking the levels as it builds them."""
    chans, n, L = cfg.block_out_channels, len(cfg.block_out_channels), cfg.layers_per_block
    d_time, hd = 4 * chans[0], cfg.attention_head_dim
    params: dict[str, Any] = {
        "conv_in": t.conv("conv_in", cfg.in_channels, chans[0]),
        "time_embedding": {
            "linear_1": t.linear("time_embedding.linear_1", chans[0], d_time),
            "linear_2": t.linear("time_embedding.linear_2", d_time, d_time),
        },
        "conv_norm_out": t.norm("conv_norm_out", chans[0]),
        "conv_out": t.conv("conv_out", chans[0], cfg.out_channels),
    }
    if cfg.num_class_embeds is not None:
        params["class_embedding"] = {"embedding": t.get("class_embedding.weight", (cfg.num_class_embeds, d_time))}

    skips, c, down = [chans[0]], chans[0], {}
    for i, kind in enumerate(cfg.down_block_types):
        p, level = f"down_blocks.{i}", {"resnets": {}, "attentions": {}}
        for j in range(L):
            level["resnets"][j] = _resnet(t, f"{p}.resnets.{j}", c, chans[i], d_time)
            c = chans[i]
            if kind == "AttnDownBlock2D":
                level["attentions"][j] = _attention(t, f"{p}.attentions.{j}", c, hd)
            skips.append(c)
        if i < n - 1:
            level["downsample"] = t.conv(f"{p}.downsamplers.0.conv", c, c)
            skips.append(c)
        down[i] = level
    params["down_blocks"] = down

    mid = {"resnets": {j: _resnet(t, f"mid_block.resnets.{j}", c, c, d_time) for j in range(2)}, "attentions": {}}
    if cfg.mid_block_attention:
        mid["attentions"][0] = _attention(t, "mid_block.attentions.0", c, hd)
    params["mid_block"] = mid

    up = {}
    for i, kind in enumerate(cfg.up_block_types):
        p, level, c_out = f"up_blocks.{i}", {"resnets": {}, "attentions": {}}, chans[n - 1 - i]
        for j in range(L + 1):
            level["resnets"][j] = _resnet(t, f"{p}.resnets.{j}", c + skips.pop(), c_out, d_time)
            c = c_out
            if kind == "AttnUpBlock2D":
                level["attentions"][j] = _attention(t, f"{p}.attentions.{j}", c, hd)
        if i < n - 1:
            level["upsample"] = t.conv(f"{p}.upsamplers.0.conv", c, c)
        up[i] = level
    params["up_blocks"] = up
    return _drop_empty(params)


def _drop_empty(tree: dict[str, Any]) -> dict[str, Any]:
    """Removes empty sub-dicts (a level without attention has no attention parameters)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            v = _drop_empty(v)
            if not v:
                continue
        out[k] = v
    return out


def _unet_dir(path: pathlib.Path) -> pathlib.Path:
    if path.is_file():
        path = path.parent
    if not (path / "config.json").is_file() and (path / "unet" / "config.json").is_file():
        path = path / "unet"  # a pipeline directory
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: no config.json; pass a diffusers UNet2DModel directory (or a pipeline's)")
    return path


def _weight_files(path: pathlib.Path) -> list[pathlib.Path]:
    index = path / (WEIGHTS + ".index.json")
    if index.is_file():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    if (path / WEIGHTS).is_file():
        return [path / WEIGHTS]
    variants = sorted(path.glob("diffusion_pytorch_model.*.safetensors"))  # e.g. the fp16 variant alone
    if len(variants) == 1:
        return variants
    raise ValueError(
        f"{path}: expected {WEIGHTS} (or exactly one variant such as .fp16), found "
        f"{[v.name for v in variants] or 'none'}; convert .bin weights to safetensors first"
    )


def load_diffusers_unet(path: str | pathlib.Path) -> tuple[UNetConfig, dict[str, Any]]:
    """(UNetConfig, params) from a UNet2DModel directory.

    params is a nested dict of numpy arrays in the checkpoint's dtype, shaped
    like `nnx.to_pure_dict(nnx.state(UNet(cfg), nnx.Param))`. Every tensor in
    the files must be used: a leftover one means a feature meshwork would
    silently drop, so it raises ValueError.

    >>> cfg, params = load_diffusers_unet("tests/fixtures/diffusers/unet_class")
    >>> params["down_blocks"][1]["attentions"][0]["wq"].shape   # (C, heads, head_dim)
    (32, 4, 8)
    """
    path = _unet_dir(pathlib.Path(path))
    cfg = config_from_diffusers(json.loads((path / "config.json").read_text()))
    with contextlib.ExitStack() as stack:
        t = _Tensors(_weight_files(path), stack)
        params = _params(t, cfg)
        if left := t.unused():
            raise ValueError(
                f"{len(left)} checkpoint tensors have no place in meshwork's UNet, e.g. {left[:3]}; "
                "the config may not describe these weights"
            )
    return cfg, params


def build_unet(
    cfg: UNetConfig,
    params: dict[str, Any],
    *,
    dtype: jnp.dtype = jnp.float32,
    param_dtype: jnp.dtype = jnp.float32,
    remat: str = "none",
    attention: str = "xla",
) -> nnx.Module:
    """The UNet of `cfg` holding `params` (cast to param_dtype); no random weights are drawn."""
    from meshwork.models.unet import UNet

    model = nnx.eval_shape(
        lambda: UNet(cfg, dtype=dtype, param_dtype=param_dtype, remat=remat, attention=attention, rngs=nnx.Rngs(0))
    )
    apply_params(model, params)
    return model


def unet_from_diffusers(path: str | pathlib.Path, **kw: Any) -> tuple[UNetConfig, nnx.Module]:
    """(UNetConfig, UNet) from a diffusers directory; `kw` go to `build_unet`.

    >>> cfg, model = unet_from_diffusers("tests/fixtures/diffusers/unet_class")
    >>> model(jnp.zeros((1, 16, 16, 2)), jnp.array([10]), jnp.array([3])).shape
    (1, 16, 16, 2)
    """
    cfg, params = load_diffusers_unet(path)
    return cfg, build_unet(cfg, params, **kw)
