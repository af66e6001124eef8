"""Hugging Face checkpoints (config.json + *.safetensors) as meshwork models.

Reads Llama (`model_type` "llama"), Mixtral ("mixtral") and Qwen2-MoE
("qwen2_moe") checkpoints in the hub's layout, memory-mapped with safetensors
(numpy; no torch), into meshwork's parameter tree:

    cfg, params = load_hf_checkpoint("path/to/checkpoint_dir")  # ModelConfig, nested dict of numpy
    model = build_hf_model(cfg, params)                          # Transformer or MoETransformer
    logits_BLV = model(tokens_BL)

`params` has the structure of `nnx.to_pure_dict(nnx.state(model, nnx.Param))`
for the model `train.state.build_model` makes from `cfg` (layers stacked on a
leading axis), so it can also be placed with shardings and written into an
existing model with `nnx.replace_by_pure_dict`; `apply_params` does that with
shape checks.

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
import json
import pathlib
import re
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  registers bfloat16 with numpy, so bf16 checkpoints read as numpy
import numpy as np
from flax import nnx
from safetensors import safe_open

from meshwork.config import ModelConfig, MoEConfig

SUPPORTED = ("llama", "mixtral", "qwen2_moe")
# Tensors some checkpoints carry that hold no weights meshwork needs.
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$")

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


# ---------------------------------------------------------------- weights


class TensorReader:
    """Named tensors across a checkpoint's safetensors files, opened memory-mapped;
    each read once, with its shape checked (also used by the diffusers import)."""

    def __init__(self, files: Iterable[pathlib.Path], stack: contextlib.ExitStack):
        self.where: dict[str, Any] = {}
        for f in files:
            handle = stack.enter_context(safe_open(f, framework="numpy"))
            self.where.update(dict.fromkeys(handle.keys(), handle))
        self.used: set[str] = set()

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.where:
            raise ValueError(f"checkpoint has no tensor {name!r}, which the config implies; "
                             "is config.json the one that belongs to these weights?")
        # A copy: the views safetensors returns point into the mapping, which closes.
        x = np.array(self.where[name].get_tensor(name))
        if x.shape != shape:
            raise ValueError(f"tensor {name!r} has shape {x.shape}, but config.json implies {shape}")
        self.used.add(name)
        return x

    def unused(self, ignored: re.Pattern | None = None) -> list[str]:
        """Tensors never read (a mapping that dropped weights would otherwise go unnoticed)."""
        return sorted(k for k in self.where if k not in self.used and not (ignored and ignored.fullmatch(k)))


class _Tensors(TensorReader):
    """The Hugging Face transformers layout."""

    def linear(self, name: str, d_out: int, d_in: int) -> np.ndarray:
        """An nn.Linear weight, stored (out, in), as meshwork's (in, out)."""
        return self.get(name, (d_out, d_in)).T

    def unused(self) -> list[str]:
        return super().unused(_IGNORED)


def _checkpoint_files(path: pathlib.Path) -> tuple[dict[str, Any], list[pathlib.Path]]:
    if path.is_file():
        path = path.parent
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: no config.json; pass a Hugging Face checkpoint directory")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files; convert .bin checkpoints to safetensors first")
    return json.loads((path / "config.json").read_text()), files


def load_hf_checkpoint(path: str | pathlib.Path) -> tuple[ModelConfig, dict[str, Any]]:
    """(ModelConfig, params) from a checkpoint directory (config.json and *.safetensors).

    params is a nested dict of numpy arrays in the checkpoint's dtype, shaped
    like `nnx.to_pure_dict(nnx.state(model, nnx.Param))` of the model built
    from the ModelConfig. Every tensor in the files must be used (apart from
    cached rotary tables): a leftover tensor means a feature meshwork would
    silently drop, so it raises ValueError.

    >>> cfg, params = load_hf_checkpoint("tests/fixtures/hf/llama")
    >>> params["blocks"]["attn"]["wq"].shape   # (layers, D, H, K)
    (3, 64, 4, 24)
    """
    hf_config, files = _checkpoint_files(pathlib.Path(path))
    cfg = config_from_hf(hf_config)
    kind = hf_config["model_type"]
    with contextlib.ExitStack() as stack:
        t = _Tensors(files, stack)
        D, V = cfg.d_model, cfg.vocab_size
        params: dict[str, Any] = {"embed": {"table": t.get("model.embed_tokens.weight", (V, D))},
                                  "head": {"final_norm": {"scale": t.get("model.norm.weight", (D,))}}}
        if cfg.tie_embeddings:
            t.used.add("lm_head.weight")  # some exports keep the tied copy
        else:
            params["head"]["lm_head"] = t.linear("lm_head.weight", V, D)
        if cfg.kind == "transformer":
            params["blocks"] = _stack(_dense_layer(t, cfg, i) for i in range(cfg.n_layers))
        else:
            k = cfg.moe.first_dense_layers
            if k:
                params["dense_blocks"] = _stack(_dense_layer(t, cfg, i) for i in range(k))
            moe_layer = _mixtral_layer if kind == "mixtral" else _qwen2_moe_layer
            params["moe_blocks"] = _stack(moe_layer(t, cfg, i) for i in range(k, cfg.n_layers))
        if left := t.unused():
            raise ValueError(f"{len(left)} checkpoint tensors have no place in meshwork's {kind} model, "
                             f"e.g. {left[:3]}; the config may not describe these weights")
    return cfg, params


def _stack(layers: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Per-layer trees -> one tree with a leading layers axis (as nnx.vmap makes them)."""
    return jax.tree.map(lambda *xs: np.stack(xs), *layers)


def _attention(t: _Tensors, cfg: ModelConfig, i: int) -> dict[str, np.ndarray]:
    p = f"model.layers.{i}.self_attn."
    D, H, G, K = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
    # HF's projection outputs are head-major (head h owns rows h*K .. h*K+K-1).
    attn = {"wq": t.linear(p + "q_proj.weight", H * K, D).reshape(D, H, K),
            "wk": t.linear(p + "k_proj.weight", G * K, D).reshape(D, G, K),
            "wv": t.linear(p + "v_proj.weight", G * K, D).reshape(D, G, K),
            "wo": t.linear(p + "o_proj.weight", D, H * K).reshape(H, K, D)}
    if cfg.qkv_bias:
        attn |= {"bq": t.get(p + "q_proj.bias", (H * K,)).reshape(H, K),
                 "bk": t.get(p + "k_proj.bias", (G * K,)).reshape(G, K),
                 "bv": t.get(p + "v_proj.bias", (G * K,)).reshape(G, K)}
    return attn


def _swiglu(t: _Tensors, prefix: str, D: int, F: int, names=("gate_proj", "up_proj", "down_proj")) -> dict:
    gate, up, down = names
    return {"w_gate": t.linear(f"{prefix}{gate}.weight", F, D), "w_up": t.linear(f"{prefix}{up}.weight", F, D),
            "w_down": t.linear(f"{prefix}{down}.weight", D, F)}


def _norms_and_attention(t: _Tensors, cfg: ModelConfig, i: int) -> dict[str, Any]:
    p, D = f"model.layers.{i}.", cfg.d_model
    return {"attn_norm": {"scale": t.get(p + "input_layernorm.weight", (D,))},
            "attn": _attention(t, cfg, i),
            "mlp_norm": {"scale": t.get(p + "post_attention_layernorm.weight", (D,))}}


def _dense_layer(t: _Tensors, cfg: ModelConfig, i: int) -> dict[str, Any]:
    return _norms_and_attention(t, cfg, i) | {"mlp": _swiglu(t, f"model.layers.{i}.mlp.", cfg.d_model, cfg.d_ff)}


def _experts(t: _Tensors, prefix: str, cfg: ModelConfig, names: tuple[str, str, str]) -> dict[str, np.ndarray]:
    """Per-expert SwiGLUs stacked on a leading expert axis: (E, D, F), (E, D, F), (E, F, D)."""
    per_expert = [_swiglu(t, f"{prefix}experts.{e}.", cfg.d_model, cfg.moe.d_expert, names)
                  for e in range(cfg.moe.n_experts)]
    return jax.tree.map(lambda *xs: np.stack(xs), *per_expert)


def _mixtral_layer(t: _Tensors, cfg: ModelConfig, i: int) -> dict[str, Any]:
    p = f"model.layers.{i}.block_sparse_moe."
    moe = {"router": t.linear(p + "gate.weight", cfg.moe.n_experts, cfg.d_model)}
    moe |= _experts(t, p, cfg, ("w1", "w3", "w2"))  # w1: gate, w3: up, w2: down
    return _norms_and_attention(t, cfg, i) | {"moe": moe}


def _qwen2_moe_layer(t: _Tensors, cfg: ModelConfig, i: int) -> dict[str, Any]:
    p, D = f"model.layers.{i}.mlp.", cfg.d_model
    moe = {"router": t.linear(p + "gate.weight", cfg.moe.n_experts, D)}
    moe |= _experts(t, p, cfg, ("gate_proj", "up_proj", "down_proj"))
    if cfg.moe.n_shared_experts:
        moe["shared"] = _swiglu(t, p + "shared_expert.", D, cfg.moe.d_shared)
        moe["shared_gate"] = t.linear(p + "shared_expert_gate.weight", 1, D)  # (D, 1)
    return _norms_and_attention(t, cfg, i) | {"moe": moe}


# ---------------------------------------------------------------- into a model


def _make_model(cfg: ModelConfig, *, dtype: jnp.dtype, param_dtype: jnp.dtype, remat: str, seed: int) -> nnx.Module:
    kw = dict(dtype=dtype, param_dtype=param_dtype, remat=remat, rngs=nnx.Rngs(seed))
    if cfg.kind == "moe":
        from models.moe import MoETransformer

        return MoETransformer(cfg, **kw)
    from models.transformer import Transformer

    return Transformer(cfg, **kw)


def apply_params(model: nnx.Module, params: dict[str, Any]) -> None:
    """Writes a pure-dict parameter tree into `model` in place, cast to each parameter's dtype.

    The tree must have exactly the model's parameters with the same shapes;
    otherwise ValueError lists the differences.
    """
    state = nnx.state(model, nnx.Param)
    _check_tree(nnx.to_pure_dict(state), params)
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
    _check_tree(nnx.to_pure_dict(abstract), params)
    cast = jax.tree.map(lambda ref, x: jnp.asarray(x, dtype=ref.dtype), nnx.to_pure_dict(abstract), params)
    nnx.replace_by_pure_dict(abstract, cast)
    return nnx.merge(graphdef, abstract, buffers)


def model_from_hf(path: str | pathlib.Path, **kw: Any) -> tuple[ModelConfig, nnx.Module]:
    """(ModelConfig, model) from a Hugging Face checkpoint directory; `kw` go to `build_hf_model`.

    >>> cfg, model = model_from_hf("tests/fixtures/hf/llama")
    >>> model(jnp.zeros((1, 4), jnp.int32)).shape
    (1, 4, 128)
    """
    cfg, params = load_hf_checkpoint(path)
    return cfg, build_hf_model(cfg, params, **kw)


def _check_tree(expected: dict[str, Any], got: dict[str, Any]) -> None:
    want = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(expected)}
    have = {jax.tree_util.keystr(k): np.shape(v) for k, v in jax.tree_util.tree_leaves_with_path(got)}
    problems = [f"missing {k}" for k in want.keys() - have.keys()]
    problems += [f"unexpected {k}" for k in have.keys() - want.keys()]
    problems += [f"{k}: {have[k]} vs model {want[k]}" for k in want.keys() & have.keys() if have[k] != want[k]]
    if problems:
        raise ValueError(f"parameters do not fit the model ({len(problems)} differences): {sorted(problems)[:5]}")
