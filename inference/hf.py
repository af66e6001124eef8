"""Hugging Face checkpoints (config.json + *.safetensors) as meshwork models.

Reads Llama (`model_type` "llama"), Mixtral ("mixtral") and Qwen2-MoE
("qwen2_moe") checkpoints in the hub's layout, memory-mapped with safetensors
(numpy; no torch), into meshwork models:

    cfg, model = load_hf_model("path/to/checkpoint_dir")        # Transformer or MoETransformer
    logits_BLV = model(tokens_BL)

    sh = hf_param_shardings(load_hf_config(path), mesh, rules_for("tp"))
    cfg, model = load_hf_model(path, shardings=sh)               # each weight born sharded

`load_hf_model` reads one layer at a time and moves it onto its devices before
reading the next, so host memory holds about one layer, never the model.
`load_hf_checkpoint` instead returns the whole parameter tree as numpy
(`build_hf_model(cfg, params)` makes the model from it), with the structure of
`nnx.to_pure_dict(nnx.state(model, nnx.Param))`; `apply_params` writes such a
tree into an existing model with shape checks. Both follow one table,
`hf_layout`, which `inference/hf_export.py` also uses to write checkpoints.

Conventions matched (checked to 1e-4 on float32 logits by tests/test_hf_parity.py):

- RoPE: the "rotate half" layout (dimension i pairs with i + K/2), with HF's
  inv_freq = 1 / theta ** (arange(0, K, 2) / K) and no scaling, so q/k
  projection rows load without permutation.
- RMSNorm: weight * (x * rsqrt(mean(x**2) + eps)), eps inside the rsqrt,
  statistics in float32; the weight is a plain scale (not 1 + w).
- Attention: causal, scores scaled by 1/sqrt(head_dim), grouped-query heads
  (query head h reads key/value head h // (H / G)); q/k/v biases added before
  RoPE (Qwen2), no output bias.
- MLP: SwiGLU, down(silu(x W_gate) * (x W_up)).
- Mixtral router: softmax over all experts, the top-k of those probabilities,
  renormalized to sum to one; no shared expert.
- Qwen2-MoE router: softmax over all experts, top-k, renormalized only if
  `norm_topk_prob`; plus a shared SwiGLU expert whose output is multiplied by
  sigmoid(x . w_shared_gate). Layers in `mlp_only_layers` (or off the
  `decoder_sparse_step` grid) use a dense SwiGLU of `intermediate_size`; meshwork
  can express that only when they are the leading layers (`first_dense_layers`).

Training-only settings (dropout, Mixtral's router jitter, output_router_logits)
are ignored; anything that changes the forward pass and that meshwork does not
implement (rope scaling, sliding windows, other activations, extra biases)
raises a ValueError that names the key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import math
import pathlib
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # registers bfloat16 with numpy, so bf16 checkpoints read as numpy
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors import SafetensorError, safe_open

from meshwork.config import ModelConfig, MoEConfig
from meshwork.sharding.rules import Rules, tree_shardings

SUPPORTED = ("llama", "mixtral", "qwen2_moe")
# Tensors some checkpoints carry that hold no weights meshwork needs.
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$")
# numpy dtype -> config.json's torch_dtype / dtype name.
HF_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(ml_dtypes.bfloat16): "bfloat16",
                  np.dtype(np.float16): "float16"}

# ---------------------------------------------------------------- config


def config_from_hf(hf_config: dict[str, Any]) -> ModelConfig:
    """The meshwork ModelConfig for a Hugging Face config.json dict.

    Reads both the transformers 5 form (`rope_parameters`) and the older one
    (`rope_theta`, `rope_scaling`). Raises ValueError for a model type or a
    setting meshwork cannot reproduce.

    >>> cfg = config_from_hf({"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
    ...     "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
    ...     "rope_theta": 10000.0, "rms_norm_eps": 1e-6})
    >>> cfg.n_kv_heads, cfg.resolved_head_dim, cfg.norm_eps
    (32, 128, 1e-06)
    """
    c = dict(hf_config)
    kind = c.get("model_type")
    if kind not in SUPPORTED:
        raise ValueError(f"model_type={kind!r} is not supported; meshwork reads {', '.join(SUPPORTED)} checkpoints")
    defaults = {"llama": (1e-6, 10000.0), "mixtral": (1e-5, 1e6), "qwen2_moe": (1e-6, 10000.0)}[kind]

    def need(key: str) -> Any:
        if c.get(key) is None:
            raise ValueError(f"{kind} config has no {key!r}; a complete config.json is needed")
        return c[key]

    def refuse(key: str, ok: bool, why: str) -> None:
        if not ok:
            raise ValueError(f"{kind} config {key}={c.get(key)!r}: {why}")

    refuse("hidden_act", c.get("hidden_act", "silu") == "silu", "meshwork's MLP is SwiGLU (silu) only")
    D, H = need("hidden_size"), need("num_attention_heads")
    G = c.get("num_key_value_heads") or H
    refuse("num_key_value_heads", H % G == 0, f"must divide num_attention_heads={H}")
    head_dim = c.get("head_dim") or D // H
    refuse("head_dim", head_dim % 2 == 0, "RoPE needs an even head_dim")
    theta = _rope_theta(c, kind, defaults[1])
    if kind == "llama":
        refuse("attention_bias", not c.get("attention_bias", False),
               "Llama's attention_bias also biases o_proj, which meshwork's attention does not have")
        refuse("mlp_bias", not c.get("mlp_bias", False), "meshwork's MLP has no biases")
    if kind == "mixtral":
        refuse("sliding_window", c.get("sliding_window") is None,
               "meshwork attends causally over the whole sequence; set it to null only if no sequence "
               "you run is longer than the window")
    if kind == "qwen2_moe":
        refuse("use_sliding_window", not c.get("use_sliding_window", False),
               "meshwork attends causally over the whole sequence (no sliding window)")
        refuse("layer_types", all(t == "full_attention" for t in c.get("layer_types") or []),
               "meshwork has full attention in every layer")

    common = dict(vocab_size=need("vocab_size"), d_model=D, n_layers=need("num_hidden_layers"), n_heads=H,
                  n_kv_heads=G, head_dim=head_dim, d_ff=need("intermediate_size"), rope_theta=theta,
                  norm_eps=c.get("rms_norm_eps") or defaults[0],
                  qkv_bias=kind == "qwen2_moe" and c.get("qkv_bias", True),
                  tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                  init_std=c.get("initializer_range", 0.02))
    if kind == "llama":
        return ModelConfig(kind="transformer", **common)
    if kind == "mixtral":
        E, k = need("num_local_experts"), need("num_experts_per_tok")
        refuse("num_experts_per_tok", 0 < k <= E, f"must be between 1 and num_local_experts={E}")
        moe = MoEConfig(n_experts=E, top_k=k, d_expert=need("intermediate_size"), router="softmax",
                        norm_topk_prob=True, aux_loss_coef=c.get("router_aux_loss_coef", 0.001), z_loss_coef=0.0)
        return ModelConfig(kind="moe", moe=moe, **common)

    # qwen2_moe
    dense = _qwen2_moe_dense_layers(c, common["n_layers"])
    if len(dense) == common["n_layers"]:  # no MoE layer at all: a dense model with q/k/v biases
        return ModelConfig(kind="transformer", **common)
    refuse("mlp_only_layers", dense == list(range(len(dense))),
           f"the dense layers {dense} must be the leading ones for meshwork (moe.first_dense_layers)")
    E, k = need("num_experts"), need("num_experts_per_tok")
    refuse("num_experts_per_tok", 0 < k <= E, f"must be between 1 and num_experts={E}")
    d_shared = c.get("shared_expert_intermediate_size", 0)
    shared = dict(n_shared_experts=1, d_shared=d_shared, shared_expert_gate=True) if d_shared else {}
    moe = MoEConfig(n_experts=E, top_k=k, d_expert=need("moe_intermediate_size"), router="softmax",
                    norm_topk_prob=bool(c.get("norm_topk_prob", False)),
                    aux_loss_coef=c.get("router_aux_loss_coef", 0.001), z_loss_coef=0.0,
                    first_dense_layers=len(dense), **shared)
    return ModelConfig(kind="moe", moe=moe, **common)


def _rope_theta(c: dict[str, Any], kind: str, default: float) -> float:
    """rope_theta, refusing any scaled or partial rotary embedding."""
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    for key, p in (("rope_parameters", params), ("rope_scaling", scaling)):
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"{kind} config {key}={p!r}: rope_type {rope_type!r} is not implemented; "
                             "meshwork's RoPE is unscaled (rope_type 'default')")
    partial = params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"{kind} config partial_rotary_factor={partial}: meshwork rotates the whole head_dim")
    return float(params.get("rope_theta", c.get("rope_theta", default)))


def _qwen2_moe_dense_layers(c: dict[str, Any], n_layers: int) -> list[int]:
    """The layer indices Qwen2-MoE builds with a dense MLP instead of experts."""
    only, step, E = set(c.get("mlp_only_layers") or []), c.get("decoder_sparse_step", 1), c.get("num_experts", 0)
    return [i for i in range(n_layers) if i in only or not (E > 0 and (i + 1) % step == 0)]


# ---------------------------------------------------------------- where each weight lives


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One meshwork parameter of one layer and the checkpoint tensor(s) holding it.

    `name` may contain "{e}": then the file has one tensor per expert (`experts`
    of them), stacked on meshwork's leading expert axis. `read` and `write` are
    each other's inverse, so the loader and `inference.hf_export` share this one
    description of the layout.

    >>> t = HFTensor("q_proj.weight", shape=(64, 4, 24), hf_shape=(96, 64), linear=True)
    >>> t.write(np.zeros(t.shape, np.float32))["q_proj.weight"].shape
    (96, 64)
    """

    name: str
    shape: tuple[int, ...]
    """meshwork's shape (with the leading expert axis, if any; without the layers axis)."""
    hf_shape: tuple[int, ...]
    """The shape in the file (of one expert's tensor)."""
    linear: bool = False
    """An nn.Linear weight: (out, in) in the file, (in, ..., out) in meshwork."""
    experts: int = 0

    def names(self) -> list[str]:
        return [self.name.format(e=e) for e in range(self.experts)] if self.experts else [self.name]

    def read(self, t: TensorReader) -> np.ndarray:
        """meshwork's array, from the tensor(s) in the file (a view of what `t` read, where possible)."""
        parts = [t.get(n, self.hf_shape) for n in self.names()]
        parts = [(x.T if self.linear else x).reshape(self.shape[1:] if self.experts else self.shape) for x in parts]
        return np.stack(parts) if self.experts else parts[0]

    def write(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """The file's tensor(s), contiguous, holding meshwork's array `x`."""
        def one(x: np.ndarray) -> np.ndarray:
            return np.ascontiguousarray(x.reshape(self.hf_shape[::-1]).T if self.linear else x.reshape(self.hf_shape))
        parts = [one(x[e]) for e in range(self.experts)] if self.experts else [one(x)]
        return dict(zip(self.names(), parts, strict=True))


def _linear(name: str, d_out: int, d_in: int, shape: tuple[int, ...] | None = None, experts: int = 0) -> HFTensor:
    return HFTensor(name, (experts,) * bool(experts) + (shape or (d_in, d_out)), (d_out, d_in), True, experts)


def _vector(name: str, shape: tuple[int, ...]) -> HFTensor:
    return HFTensor(name, shape, (math.prod(shape),))


def _swiglu(prefix: str, D: int, F: int, names=("gate_proj", "up_proj", "down_proj"), experts: int = 0) -> dict:
    gate, up, down = names
    return {"w_gate": _linear(f"{prefix}{gate}.weight", F, D, experts=experts),
            "w_up": _linear(f"{prefix}{up}.weight", F, D, experts=experts),
            "w_down": _linear(f"{prefix}{down}.weight", D, F, experts=experts)}


def _layer(cfg: ModelConfig, model_type: str, i: int, *, moe: bool) -> dict[str, Any]:
    p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
    D, H, G, K = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
    # HF's projection outputs are head-major (head h owns rows h*K .. h*K+K-1).
    attn = {"wq": _linear(a + "q_proj.weight", H * K, D, (D, H, K)),
            "wk": _linear(a + "k_proj.weight", G * K, D, (D, G, K)),
            "wv": _linear(a + "v_proj.weight", G * K, D, (D, G, K)),
            "wo": _linear(a + "o_proj.weight", D, H * K, (H, K, D))}
    if cfg.qkv_bias:
        attn |= {"bq": _vector(a + "q_proj.bias", (H, K)), "bk": _vector(a + "k_proj.bias", (G, K)),
                 "bv": _vector(a + "v_proj.bias", (G, K))}
    layer = {"attn_norm": {"scale": _vector(p + "input_layernorm.weight", (D,))}, "attn": attn,
             "mlp_norm": {"scale": _vector(p + "post_attention_layernorm.weight", (D,))}}
    if not moe:
        return layer | {"mlp": _swiglu(p + "mlp.", D, cfg.d_ff)}
    m = cfg.moe
    if model_type == "mixtral":
        q, names = p + "block_sparse_moe.", ("w1", "w3", "w2")  # w1: gate, w3: up, w2: down
    else:
        q, names = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
    experts = {"router": _linear(q + "gate.weight", m.n_experts, D)}
    experts |= _swiglu(q + "experts.{e}.", D, m.d_expert, names, experts=m.n_experts)
    if m.n_shared_experts:
        experts["shared"] = _swiglu(q + "shared_expert.", D, m.d_shared or m.n_shared_experts * m.d_expert)
    if m.shared_expert_gate:
        experts["shared_gate"] = _linear(q + "shared_expert_gate.weight", 1, D)  # (D, 1)
    return layer | {"moe": experts}


def hf_layout(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """Where each parameter of the model `cfg` describes lives in a `model_type` checkpoint.

    A tree shaped like the model's parameters (`nnx.to_pure_dict(nnx.state(model,
    nnx.Param))`) with `HFTensor` leaves, except that a stacked group of layers
    ("blocks", "dense_blocks", "moe_blocks") is a list of per-layer trees. The
    loaders here and `inference.hf_export.export_hf` all follow this one table.

    >>> cfg = load_hf_config("tests/fixtures/hf/llama")
    >>> hf_layout(cfg, "llama")["blocks"][1]["attn"]["wq"].name
    'model.layers.1.self_attn.q_proj.weight'
    """
    D, V = cfg.d_model, cfg.vocab_size
    layout: dict[str, Any] = {"embed": {"table": HFTensor("model.embed_tokens.weight", (V, D), (V, D))},
                              "head": {"final_norm": {"scale": _vector("model.norm.weight", (D,))}}}
    if not cfg.tie_embeddings:
        layout["head"]["lm_head"] = _linear("lm_head.weight", V, D)
    if cfg.kind == "transformer":
        layout["blocks"] = [_layer(cfg, model_type, i, moe=False) for i in range(cfg.n_layers)]
        return layout
    k = cfg.moe.first_dense_layers
    if k:
        layout["dense_blocks"] = [_layer(cfg, model_type, i, moe=False) for i in range(k)]
    layout["moe_blocks"] = [_layer(cfg, model_type, i, moe=True) for i in range(k, cfg.n_layers)]
    return layout


def layout_shapes(layout: dict[str, Any]) -> dict[str, Any]:
    """The parameter shapes (ShapeDtypeStructs, float32) a layout implies, layers stacked."""
    def shapes(part: Any) -> Any:
        if isinstance(part, list):
            return jax.tree.map(lambda s: jax.ShapeDtypeStruct((len(part), *s.shape), jnp.float32), part[0])
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), part)
    return {key: shapes(part) for key, part in layout.items()}


def _map(fn, tree: Any) -> Any:
    """jax.tree.map over nested dicts, but in insertion order (so errors name the first tensor)."""
    return {k: _map(fn, v) for k, v in tree.items()} if isinstance(tree, dict) else fn(tree)


def _leaves(tree: Any) -> list[HFTensor]:
    out: list[HFTensor] = []
    _map(out.append, {str(i): part for i, part in enumerate(tree)} if isinstance(tree, list) else tree)
    return out


# ---------------------------------------------------------------- reading


class TensorReader:
    """Named tensors across a checkpoint's safetensors files, opened memory-mapped;
    each read once, with its shape checked (also used by the diffusers import)."""

    def __init__(self, files: Iterable[pathlib.Path], stack: contextlib.ExitStack):
        self.where: dict[str, Any] = {}
        for f in files:
            try:
                handle = stack.enter_context(safe_open(f, framework="numpy"))
            except (SafetensorError, OSError) as e:  # a truncated or corrupt file, or one that is missing
                raise ValueError(f"{f}: not a readable safetensors file ({e}); download or convert it "
                                 "again") from None
            self.where.update(dict.fromkeys(handle.keys(), handle))
        self.used: set[str] = set()

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        """Raises ValueError unless the files hold `name` with `shape` (reads only the header)."""
        if name not in self.where:
            raise ValueError(f"checkpoint has no tensor {name!r}, which the config implies; "
                             "is config.json the one that belongs to these weights?")
        have = tuple(self.where[name].get_slice(name).get_shape())
        if have != shape:
            raise ValueError(f"tensor {name!r} has shape {have}, but config.json implies {shape}")

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        self.check(name, shape)
        self.used.add(name)
        # No copy needed: with framework="numpy" safetensors (0.4 to 0.8 at least) reads the
        # bytes into a buffer the array owns, not a view of the mapping (tests/test_hf_loading.py).
        return self.where[name].get_tensor(name)

    def unused(self, ignored: re.Pattern | None = None) -> list[str]:
        """Tensors never read (a mapping that dropped weights would otherwise go unnoticed)."""
        return sorted(k for k in self.where if k not in self.used and not (ignored and ignored.fullmatch(k)))


def _checkpoint_files(path: pathlib.Path) -> tuple[dict[str, Any], list[pathlib.Path]]:
    if path.is_file():
        path = path.parent
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: no config.json; pass a Hugging Face checkpoint directory")
    hf_config = _read_json(path / "config.json")
    if not isinstance(hf_config, dict):
        raise ValueError(f"{path / 'config.json'}: expected a JSON object of model settings")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted({path / f for f in _read_json(index)["weight_map"].values()})
        except (KeyError, TypeError, AttributeError):
            raise ValueError(f"{index}: expected {{\"weight_map\": {{tensor: file}}}}") from None
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files; convert .bin checkpoints to safetensors first")
    return hf_config, files


def _read_json(path: pathlib.Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:  # its message alone does not say which file
        raise ValueError(f"{path}: not valid JSON ({e}); fix or download it again") from None


def load_hf_config(path: str | pathlib.Path) -> ModelConfig:
    """The ModelConfig of a checkpoint directory, from its config.json alone (e.g. to build
    the shardings for `load_hf_model` before reading any weight)."""
    return config_from_hf(_checkpoint_files(pathlib.Path(path))[0])


def _read_params(files: list[pathlib.Path], cfg: ModelConfig, model_type: str, placer: Any) -> dict[str, Any]:
    """Reads the checkpoint group by group, in stacked groups layer by layer, through `placer`:
    `place(key, tree of HFTensors, read)` and `stack(key, list of per-layer trees, read)`, where
    `read(spec)` returns one parameter of one layer as numpy, and decide where each piece goes."""
    layout = hf_layout(cfg, model_type)
    with contextlib.ExitStack() as stack:
        t = TensorReader(files, stack)
        # Check names and shapes against the files' headers first: a wrong config fails
        # before gigabytes are read.
        specs = [s for part in layout.values() for s in _leaves(part)]
        for spec in specs:
            for name in spec.names():
                t.check(name, spec.hf_shape)
        claimed = {n for s in specs for n in s.names()}
        if cfg.tie_embeddings:
            claimed.add("lm_head.weight")  # some exports keep the tied copy
        if left := sorted(set(t.unused(_IGNORED)) - claimed):
            raise ValueError(f"{len(left)} checkpoint tensors have no place in meshwork's {model_type} model, "
                             f"e.g. {left[:3]}; the config may not describe these weights")
        read = functools.partial(HFTensor.read, t=t)
        return {key: placer.stack(key, part, read) if isinstance(part, list) else placer.place(key, part, read)
                for key, part in layout.items()}


class _Host:
    """Keeps what is read as numpy; each stacked parameter is one array, preallocated and
    filled layer by layer (so the model is in memory once, plus one tensor)."""

    def place(self, key: str, part: dict[str, Any], read: Callable[[HFTensor], np.ndarray]) -> dict[str, Any]:
        return _map(read, part)

    def stack(self, key: str, layers: list[dict[str, Any]], read: Callable[[HFTensor], np.ndarray]) -> dict[str, Any]:
        treedef = jax.tree.structure(layers[0])
        out: list[np.ndarray | None] = [None] * treedef.num_leaves
        for i, layer in enumerate(layers):
            for j, spec in enumerate(jax.tree.leaves(layer)):
                x = read(spec)
                if out[j] is None:
                    out[j] = np.empty((len(layers), *x.shape), x.dtype)
                out[j][i] = x
        return jax.tree.unflatten(treedef, out)


def _layer_sharding(s: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """The sharding of one layer of a stacked parameter: its spec without the layers entry."""
    return NamedSharding(s.mesh, PartitionSpec(*tuple(s.spec)[1:])) if isinstance(s, NamedSharding) else s


def _settle(tree: Any) -> Any:
    """Waits for `tree`'s transfers, then frees their numpy sources before anything else is read.

    XLA drops its reference to a transferred host array from a transfer thread, which cannot
    take the GIL; jax applies such pending releases in a gc callback, so a (cheap, youngest
    generation) collection frees them now rather than several layers later.
    """
    jax.block_until_ready(tree)
    gc.collect(0)
    return tree


def _write_layer(stacked: Any, layer: Any, i: jax.Array) -> Any:
    return jax.tree.map(lambda buf, x: buf.at[i].set(x.astype(buf.dtype)), stacked, layer)


class _Devices:
    """Moves each tensor onto its devices as soon as it is read, cast there to the model's
    dtypes: host memory holds about one tensor at a time (at most one layer), never the model.

    A stacked parameter is allocated on its devices in `shardings`' layout; each
    tensor of layer i is `device_put` with that layout less the layers entry, and
    the layer is written into slice i by a jitted update that donates the stack
    (updated in place: device memory peaks at the model plus one layer).
    """

    def __init__(self, target: dict[str, Any], shardings: dict[str, Any] | None):
        self.target, self.shardings = target, shardings

    def _put(self, part: dict[str, Any], read: Callable[[HFTensor], np.ndarray], shardings: Any) -> Any:
        if shardings is None:
            return jax.tree.map(lambda spec: jax.device_put(read(spec)), part)
        return jax.tree.map(lambda spec, sh: jax.device_put(read(spec), sh), part, shardings)

    def place(self, key: str, part: dict[str, Any], read: Callable[[HFTensor], np.ndarray]) -> dict[str, Any]:
        shardings = self.shardings[key] if self.shardings is not None else None
        placed = _settle(self._put(part, read, shardings))
        # A fresh device copy in the model's dtypes: on CPU, device_put may alias an aligned
        # numpy buffer, which would keep safetensors' host copy alive as the parameter.
        target = self.target[key]
        cast = jax.jit(lambda tree: jax.tree.map(lambda x, ref: x.astype(ref.dtype), tree, target),
                       **({"out_shardings": shardings} if shardings is not None else {}))
        out = cast(placed)
        del placed
        return _settle(out)

    def stack(self, key: str, layers: list[dict[str, Any]], read: Callable[[HFTensor], np.ndarray]) -> dict[str, Any]:
        target, full = self.target[key], self.shardings[key] if self.shardings is not None else None
        kw = {"out_shardings": full} if full is not None else {}
        out = jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), target), **kw)()
        write = jax.jit(_write_layer, donate_argnums=0, **kw)
        layer_shardings = jax.tree.map(_layer_sharding, full) if full is not None else None
        for i, layer in enumerate(layers):
            out = _settle(write(out, self._put(layer, read, layer_shardings), i))
        return out


# ---------------------------------------------------------------- loading


def load_hf_checkpoint(path: str | pathlib.Path) -> tuple[ModelConfig, dict[str, Any]]:
    """(ModelConfig, params) from a checkpoint directory (config.json and *.safetensors), in host memory.

    params is a nested dict of numpy arrays in the checkpoint's dtype, shaped
    like `nnx.to_pure_dict(nnx.state(model, nnx.Param))` of the model built
    from the ModelConfig. Every tensor in the files must be used (apart from
    cached rotary tables): a leftover tensor means a feature meshwork would
    silently drop, so it raises ValueError. Holds the whole model (plus one
    layer) in host memory; `load_hf_model` does not.

    >>> cfg, params = load_hf_checkpoint("tests/fixtures/hf/llama")
    >>> params["blocks"]["attn"]["wq"].shape   # (layers, D, H, K)
    (3, 64, 4, 24)
    """
    hf_config, files = _checkpoint_files(pathlib.Path(path))
    cfg = config_from_hf(hf_config)
    return cfg, _read_params(files, cfg, hf_config["model_type"], _Host())


def load_hf_model(path: str | pathlib.Path, *, shardings: Any = None, dtype: jnp.dtype = jnp.float32,
                  param_dtype: jnp.dtype | None = None, remat: str = "none") -> tuple[ModelConfig, nnx.Module]:
    """(ModelConfig, model) from a checkpoint directory, read straight onto the devices.

    The safetensors files are memory-mapped and read one layer at a time, each
    tensor put on its devices (in its layer's sharding) as soon as it is read
    and each layer written into its slot of the stacked parameters before the
    next is read: host memory peaks at about the largest tensor (at most one
    layer), never the whole model (tests/test_hf_loading.py measures about a
    tenth of a 45 MB checkpoint).
    `shardings`: None (everything on the default device), or NamedShardings
    shaped like `nnx.to_pure_dict(nnx.state(model, nnx.Param))` (a pure dict
    or an nnx.State; `hf_param_shardings` makes them from the rules table).
    `dtype` is the compute dtype, `param_dtype` (default: `dtype`) the
    parameters'; a bf16 file is cast on the devices, not on the host.

    >>> from meshwork.sharding.mesh import make_mesh
    >>> from meshwork.sharding.rules import rules_for
    >>> path = "tests/fixtures/hf/llama"
    >>> mesh = make_mesh({"data": 4, "tensor": 2})
    >>> sh = hf_param_shardings(load_hf_config(path), mesh, rules_for("tp"))
    >>> cfg, model = load_hf_model(path, shardings=sh)
    >>> model.blocks.attn.wq[...].sharding.spec
    P(None, None, 'tensor', None)
    """
    hf_config, files = _checkpoint_files(pathlib.Path(path))
    cfg = config_from_hf(hf_config)
    make = functools.partial(_make_model, cfg, dtype=dtype, param_dtype=param_dtype or dtype, remat=remat, seed=0)
    graphdef, abstract, _ = nnx.split(nnx.eval_shape(make), nnx.Param, ...)
    target = nnx.to_pure_dict(abstract)
    if shardings is not None:
        shardings = as_pure_dict(shardings)
        if jax.tree.structure(shardings) != jax.tree.structure(target):
            raise ValueError("shardings do not match the model's parameters; build them with "
                             "hf_param_shardings(load_hf_config(path), mesh, rules)")
    check_tree(target, layout_shapes(hf_layout(cfg, hf_config["model_type"])))
    params = _read_params(files, cfg, hf_config["model_type"], _Devices(target, shardings))
    nnx.replace_by_pure_dict(abstract, params)
    # Buffers (e.g. MoE selection biases) get their initial values, replicated; under jit the
    # parameters' random init is dead code and compiles away.
    replicated = {}
    if shardings is not None:
        mesh = next(s.mesh for s in jax.tree.leaves(shardings) if isinstance(s, NamedSharding))
        replicated = {"out_shardings": NamedSharding(mesh, PartitionSpec())}
    buffers = jax.jit(lambda: nnx.split(make(), nnx.Param, ...)[2], **replicated)()
    return cfg, nnx.merge(graphdef, abstract, buffers)


def hf_param_shardings(cfg: ModelConfig, mesh: Mesh, rules: Rules) -> dict[str, Any]:
    """NamedShardings for the parameters of the model `cfg` describes, laid out by the
    logical names and `rules` (as training lays them out), as a pure dict for `load_hf_model`.

    >>> from meshwork.sharding.mesh import make_mesh
    >>> from meshwork.sharding.rules import rules_for
    >>> sh = hf_param_shardings(load_hf_config("tests/fixtures/hf/llama"), make_mesh({"tensor": -1}),
    ...                         rules_for("tp"))
    >>> sh["blocks"]["mlp"]["w_up"].spec    # (layers, D, F): F split over tensor
    P(None, None, 'tensor')
    """
    from meshwork.partitioning import logical_specs

    make = functools.partial(_make_model, cfg, dtype=jnp.float32, param_dtype=jnp.float32, remat="none", seed=0)
    abstract = nnx.state(nnx.eval_shape(make), nnx.Param)
    return as_pure_dict(tree_shardings(logical_specs(abstract), mesh, rules))


def as_pure_dict(tree: Any) -> Any:
    """Nested Mappings (e.g. an nnx.State of shardings) as plain nested dicts."""
    return {k: as_pure_dict(v) for k, v in tree.items()} if isinstance(tree, Mapping) else tree


# ---------------------------------------------------------------- into a model


def _make_model(cfg: ModelConfig, *, dtype: jnp.dtype, param_dtype: jnp.dtype, remat: str, seed: int) -> nnx.Module:
    kw = dict(dtype=dtype, param_dtype=param_dtype, remat=remat, rngs=nnx.Rngs(seed))
    if cfg.kind == "moe":
        from meshwork.models.moe import MoETransformer

        return MoETransformer(cfg, **kw)
    from meshwork.models.transformer import Transformer

    return Transformer(cfg, **kw)


def apply_params(model: nnx.Module, params: dict[str, Any]) -> None:
    """Writes a pure-dict parameter tree into `model` in place, cast to each parameter's dtype.

    The tree must have exactly the model's parameters with the same shapes;
    otherwise ValueError lists the differences.
    """
    state = nnx.state(model, nnx.Param)
    check_tree(nnx.to_pure_dict(state), params)
    cast = jax.tree.map(lambda ref, x: jnp.asarray(x, dtype=ref.dtype), nnx.to_pure_dict(state), params)
    nnx.replace_by_pure_dict(state, cast)
    nnx.update(model, state)


def build_hf_model(cfg: ModelConfig, params: dict[str, Any], *, dtype: jnp.dtype = jnp.float32,
                   param_dtype: jnp.dtype = jnp.float32, remat: str = "none") -> nnx.Module:
    """The meshwork model for `cfg` holding `params` (both from `load_hf_checkpoint`).

    The model is built abstractly, so no random weights are drawn for the
    parameters; buffers that are not parameters (e.g. MoE selection biases)
    get their initial values.
    """
    make = lambda: _make_model(cfg, dtype=dtype, param_dtype=param_dtype, remat=remat, seed=0)  # noqa: E731
    graphdef, abstract, _ = nnx.split(nnx.eval_shape(make), nnx.Param, ...)
    # Under jit the parameters' random init is dead code and compiles away.
    buffers = jax.jit(lambda: nnx.split(make(), nnx.Param, ...)[2])()
    check_tree(nnx.to_pure_dict(abstract), params)
    cast = jax.tree.map(lambda ref, x: jnp.asarray(x, dtype=ref.dtype), nnx.to_pure_dict(abstract), params)
    nnx.replace_by_pure_dict(abstract, cast)
    return nnx.merge(graphdef, abstract, buffers)


def model_from_hf(path: str | pathlib.Path, **kw: Any) -> tuple[ModelConfig, nnx.Module]:
    """(ModelConfig, model) from a Hugging Face checkpoint directory: `load_hf_model(path, **kw)`
    (`shardings`, `dtype`, `param_dtype`, `remat`).

    >>> cfg, model = model_from_hf("tests/fixtures/hf/llama")
    >>> model(jnp.zeros((1, 4), jnp.int32)).shape
    (1, 4, 128)
    """
    return load_hf_model(path, **kw)


def check_tree(expected: dict[str, Any], got: dict[str, Any]) -> None:
    """Raises ValueError listing how `got`'s leaf shapes differ from `expected`'s (missing,
    unexpected and mis-shaped leaves), e.g. a parameter tree against a model's."""
    want = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(expected)}
    have = {jax.tree_util.keystr(k): np.shape(v) for k, v in jax.tree_util.tree_leaves_with_path(got)}
    problems = [f"missing {k}" for k in want.keys() - have.keys()]
    problems += [f"unexpected {k}" for k in have.keys() - want.keys()]
    problems += [f"{k}: {have[k]} vs model {want[k]}" for k in want.keys() & have.keys() if have[k] != want[k]]
    if problems:
        raise ValueError(f"parameters do not fit the model ({len(problems)} differences): {sorted(problems)[:5]}")
