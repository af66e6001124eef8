"""Hugging Face checkpoints (config.json + *.safetensors) as meshwork models.

Reads Llama (`model_type` "llama"), Mistral ("mistral"), Qwen2 ("qwen2"), Qwen3 ("qwen3"),
Mixtral ("mixtral"), Qwen2-MoE ("qwen2_moe"), Qwen3-MoE ("qwen3_moe"), DeepSeek-V3 ("deepseek_v3"),
Gemma 2 / 3 ("gemma2", "gemma3_text") and gpt-oss ("gpt_oss") checkpoints in the hub's layout,
memory-mapped with safetensors (numpy; no torch), into meshwork models:

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
`hf_layout` (models/hf/layout.py), which `inference/hf_export.py` also uses
to write checkpoints; models/hf/files.py reads the directory's files and
models/hf/config.py maps config.json.

Conventions matched (checked to 1e-4 on float32 logits by tests/test_hf_parity.py):

- RoPE: the "rotate half" layout (dimension i pairs with i + K/2), with HF's
  inv_freq = 1 / theta ** (arange(0, K, 2) / K), scaled as `rope_scaling` says
  (llama3, linear, dynamic, yarn: models/layers/rope.py), so q/k projection rows
  load without permutation.
- RMSNorm: weight * (x * rsqrt(mean(x**2) + eps)), eps inside the rsqrt,
  statistics in float32; the weight is a plain scale (not 1 + w).
- Attention: causal, scores scaled by 1/sqrt(head_dim), grouped-query heads
  (query head h reads key/value head h // (H / G)); q/k/v biases added before
  RoPE (Qwen2), no output bias; Qwen3's per-head RMSNorm on q and k (after the biases,
  before RoPE).
- MLP: SwiGLU, down(silu(x W_gate) * (x W_up)).
- Mixtral router: softmax over all experts, the top-k of those probabilities,
  renormalized to sum to one; no shared expert.
- Qwen2-MoE router: softmax over all experts, top-k, renormalized only if
  `norm_topk_prob`; plus a shared SwiGLU expert whose output is multiplied by
  sigmoid(x . w_shared_gate). Layers in `mlp_only_layers` (or off the
  `decoder_sparse_step` grid) use a dense SwiGLU of `intermediate_size`: meshwork's
  `moe.first_dense_layers` when they lead, else `moe.dense_layers`.
- gpt-oss (models/hf/gpt_oss.py): q/k/v/o biases, per-head attention sinks, alternating
  sliding and full layers, a biased router softmaxed over its top-k logits, biased experts with
  the clamped SwiGLU, stored stacked with gate and up interleaved in one `gate_up_proj` (each read
  as columns of it: `HFTensor.columns`, which the export writes back interleaved).

Which config.json settings are ignored and which are refused: models/hf/config.py.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import pathlib
import re
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshwork.config_sections import ModelConfig
from meshwork.models.hf.config import config_from_hf, rope_interleaved
from meshwork.models.hf.files import TensorReader, checkpoint_files
from meshwork.models.hf.layout import (
    HFTensor,
    as_pure_dict,
    check_tree,
    hf_layout,
    layout_leaves,
    layout_shapes,
    map_in_order,
    mtp_shared_copies,
    split_buffers,
)
from meshwork.sharding.rules import Rules, tree_shardings

# Tensors some checkpoints carry that hold no weights meshwork needs.
# Tensors no meshwork model reads: RoPE tables some exports keep, and Qwen3-Next's MTP layer
# (`mtp.*`, which transformers does not run either).
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq|mtp\..*")

# ---------------------------------------------------------------- reading


def load_hf_config(path: str | pathlib.Path) -> ModelConfig:
    """The ModelConfig of a checkpoint directory, from its config.json (and, for a tied config,
    the two tensors that say whether the file's head really is the embedding), e.g. to build
    the shardings for `load_hf_model` before reading any weight."""
    return _checkpoint(path)[0]


class _Source(NamedTuple):
    """A checkpoint directory as the loaders read it."""

    cfg: ModelConfig
    model_type: str
    files: list[pathlib.Path]
    interleaved: bool  # DeepSeek's RoPE rows in interleaved pairs (models/hf/layout.py permutes them)


def _checkpoint(path: str | pathlib.Path) -> _Source:
    """The ModelConfig, model_type, safetensors files and layout options of a checkpoint directory."""
    hf_config, files = checkpoint_files(pathlib.Path(path))
    cfg = config_from_hf(hf_config)
    if cfg.tie_embeddings and _file_head_differs(files):
        cfg = cfg.model_copy(update={"tie_embeddings": False})
    if cfg.mtp.depth and not _has_tensor(files, f"model.layers.{cfg.n_layers}.eh_proj.weight"):
        # transformers neither runs nor saves DeepSeek's MTP layers: a fine-tune it wrote has none.
        warnings.warn(
            f"config.json has num_nextn_predict_layers={cfg.mtp.depth} but the files hold no MTP layer "
            f"(model.layers.{cfg.n_layers}.*); loading the model without MTP modules (mtp.depth 0)",
            UserWarning,
            stacklevel=3,
        )
        cfg = cfg.model_copy(update={"mtp": cfg.mtp.model_copy(update={"depth": 0})})
    return _Source(cfg, hf_config["model_type"], files, rope_interleaved(hf_config))


def _has_tensor(files: list[pathlib.Path], name: str) -> bool:
    with contextlib.ExitStack() as stack:
        return name in TensorReader(files, stack).where


def _file_head_differs(files: list[pathlib.Path]) -> bool:
    """A tied config whose files hold an lm_head.weight other than the embedding: transformers
    loads the file's head (and warns), so meshwork builds the model untied and does the same,
    rather than silently dropping the head."""
    with contextlib.ExitStack() as stack:
        t = TensorReader(files, stack)
        if "lm_head.weight" not in t.where or "model.embed_tokens.weight" not in t.where:
            return False
        head = t.where["lm_head.weight"].get_tensor("lm_head.weight")
        table = t.where["model.embed_tokens.weight"].get_tensor("model.embed_tokens.weight")
    if head.shape == table.shape and np.array_equal(head, table):
        return False
    diff = (
        float(np.abs(head.astype(np.float32) - table.astype(np.float32)).max())
        if head.shape == table.shape
        else float("nan")
    )
    warnings.warn(
        f"config.json has tie_word_embeddings=true, but the checkpoint's lm_head.weight differs from "
        f"model.embed_tokens.weight (max |difference| {diff:.3g}); using the file's lm_head, as "
        "transformers does (the model is loaded with untied embeddings)",
        UserWarning,
        stacklevel=3,
    )
    return True


def _read_params(source: _Source, placer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Reads the checkpoint group by group, in stacked groups layer by layer, through `placer`:
    `place(key, tree of HFTensors, read)` and `stack(key, list of per-layer trees, read)`, where
    `read(spec)` returns one parameter of one layer as numpy, and decide where each piece goes.
    Returns (parameters, buffers): the buffers (DeepSeek-V3's selection biases) as numpy."""
    cfg, model_type, files = source.cfg, source.model_type, source.files
    layout = hf_layout(cfg, model_type, source.interleaved)
    with contextlib.ExitStack() as stack:
        t = TensorReader(files, stack)
        # Check names and shapes against the files' headers first: a wrong config fails
        # before gigabytes are read.
        specs = [s for part in layout.values() for s in layout_leaves(part)]
        for spec in specs:
            for name in spec.names():
                t.check(name, spec.hf_shape)
        claimed = {n for s in specs for n in s.names()} | set(mtp_shared_copies(cfg))
        if cfg.tie_embeddings:
            claimed.add("lm_head.weight")  # some exports keep the tied copy
        if left := sorted(set(t.unused(_IGNORED)) - claimed):
            raise ValueError(
                f"{len(left)} checkpoint tensors have no place in meshwork's {model_type} model, "
                f"e.g. {left[:3]}; the config may not describe these weights"
            )
        read = functools.partial(HFTensor.read, t=t)
        params_layout, buffers_layout = split_buffers(layout)
        host = _Host()
        buffers = {
            key: host.stack(key, part, read) if isinstance(part, list) else host.place(key, part, read)
            for key, part in buffers_layout.items()
        }
        params = {
            key: placer.stack(key, part, read) if isinstance(part, list) else placer.place(key, part, read)
            for key, part in params_layout.items()
        }
        return params, buffers


class _Host:
    """Keeps what is read as numpy; each stacked parameter is one array, preallocated and
    filled layer by layer (so the model is in memory once, plus one tensor)."""

    def place(self, key: str, part: dict[str, Any], read: Callable[[HFTensor], np.ndarray]) -> dict[str, Any]:
        return map_in_order(read, part)

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


# Module-level functions with their shapes and dtypes as static arguments, not lambdas closing over
# them: jax traces a function once per shapes and layout, so every tensor and stack of a model with
# the same shapes (and every later load in the process) reuses the first one's program.
def _cast(tree: Any, dtypes: tuple) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([x.astype(d) for x, d in zip(leaves, dtypes, strict=True)])


def _zeros(treedef: Any, specs: tuple) -> Any:
    return treedef.unflatten([jnp.zeros(shape, dtype) for shape, dtype in specs])


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
        cast = jax.jit(_cast, static_argnums=1, **({"out_shardings": shardings} if shardings is not None else {}))
        out = cast(placed, tuple(ref.dtype for ref in jax.tree.leaves(self.target[key])))
        del placed
        return _settle(out)

    def stack(self, key: str, layers: list[dict[str, Any]], read: Callable[[HFTensor], np.ndarray]) -> dict[str, Any]:
        target, full = self.target[key], self.shardings[key] if self.shardings is not None else None
        kw = {"out_shardings": full} if full is not None else {}
        leaves, treedef = jax.tree.flatten(target)
        out = jax.jit(_zeros, static_argnums=(0, 1), **kw)(treedef, tuple((a.shape, a.dtype) for a in leaves))
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
    source = _checkpoint(path)
    params, buffers = _read_params(source, _Host())
    return source.cfg, _merge(params, buffers)


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two nested dicts as one (b's leaves added to a's branches)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and k in out else v
    return out


def load_hf_model(
    path: str | pathlib.Path,
    *,
    shardings: Any = None,
    dtype: jnp.dtype = jnp.float32,
    param_dtype: jnp.dtype | None = None,
    remat: str = "none",
    attention: str | None = None,
) -> tuple[ModelConfig, nnx.Module]:
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
    parameters'; a bf16 file is cast on the devices, not on the host. `attention`: the
    implementation the model runs (`model.attention`: xla, pallas, cudnn, reference; default
    xla); it changes no weight, and with pallas a paged cache is read by the paged kernel.

    >>> from meshwork.sharding.mesh import make_mesh
    >>> from meshwork.sharding.rules import rules_for
    >>> path = "tests/fixtures/hf/llama"
    >>> mesh = make_mesh({"data": 4, "tensor": 2})
    >>> sh = hf_param_shardings(load_hf_config(path), mesh, rules_for("tp"))
    >>> cfg, model = load_hf_model(path, shardings=sh)
    >>> model.blocks.attn.wq[...].sharding.spec
    P(None, None, 'tensor', None)
    """
    source = _checkpoint(path)
    if attention is not None:
        source = source._replace(cfg=source.cfg.model_copy(update={"attention": attention}))
    cfg, model_type = source.cfg, source.model_type
    make = functools.partial(_make_model, cfg, dtype=dtype, param_dtype=param_dtype or dtype, remat=remat, seed=0)
    graphdef, abstract, _ = nnx.split(nnx.eval_shape(make), nnx.Param, ...)
    target = nnx.to_pure_dict(abstract)
    if shardings is not None:
        shardings = as_pure_dict(shardings)
        if jax.tree.structure(shardings) != jax.tree.structure(target):
            raise ValueError(
                "shardings do not match the model's parameters; build them with "
                "hf_param_shardings(load_hf_config(path), mesh, rules)"
            )
    check_tree(target, layout_shapes(split_buffers(hf_layout(cfg, model_type))[0]))
    params, read_buffers = _read_params(source, _Devices(target, shardings))
    nnx.replace_by_pure_dict(abstract, params)
    # Buffers (e.g. MoE selection biases) get their initial values, replicated.
    replicated = None
    if shardings is not None:
        mesh = next(s.mesh for s in jax.tree.leaves(shardings) if isinstance(s, NamedSharding))
        replicated = NamedSharding(mesh, PartitionSpec())
    buffers = _initial_buffers(cfg, dtype=dtype, param_dtype=param_dtype or dtype, remat=remat, out_sharding=replicated)
    _set_buffers(buffers, read_buffers)
    return cfg, nnx.merge(graphdef, abstract, buffers)


def _set_buffers(buffers: nnx.State, read: dict[str, Any]) -> None:
    """Writes the buffers read from a checkpoint into the model's, in their dtype and placement."""
    if not read:
        return
    current = nnx.to_pure_dict(buffers)
    new = jax.tree.map(
        lambda x, ref: jax.device_put(np.asarray(x, ref.dtype), ref.sharding),
        read,
        _subtree(current, read),
    )
    nnx.replace_by_pure_dict(buffers, new)


def _subtree(tree: dict[str, Any], like: dict[str, Any]) -> dict[str, Any]:
    return {k: _subtree(tree[k], v) if isinstance(v, dict) else tree[k] for k, v in like.items()}


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


# ---------------------------------------------------------------- into a model


def _initial_buffers(
    cfg: ModelConfig, *, dtype: jnp.dtype, param_dtype: jnp.dtype, remat: str, out_sharding: NamedSharding | None = None
) -> nnx.State:
    """The model's buffers that are not parameters (e.g. MoE selection biases) at their initial
    values, from one jitted program per model config and layout in the process (under jit the
    parameters' random init is dead code and compiles away)."""
    return _buffer_program(cfg.model_dump_json(), jnp.dtype(dtype), jnp.dtype(param_dtype), remat, out_sharding)()


@functools.lru_cache(maxsize=32)  # a process loading many models keeps the last 32 programs
def _buffer_program(
    cfg_json: str, dtype: jnp.dtype, param_dtype: jnp.dtype, remat: str, out_sharding: NamedSharding | None
) -> Callable[[], nnx.State]:
    # Keyed by the config's JSON (the config holds lists, so it is not hashable itself): a lambda
    # jitted per load was traced and lowered again at every load of the same model.
    cfg = ModelConfig.model_validate_json(cfg_json)
    make = functools.partial(_make_model, cfg, dtype=dtype, param_dtype=param_dtype, remat=remat, seed=0)
    kw = {"out_shardings": out_sharding} if out_sharding is not None else {}
    return jax.jit(lambda: nnx.split(make(), nnx.Param, ...)[2], **kw)


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


def build_hf_model(
    cfg: ModelConfig,
    params: dict[str, Any],
    *,
    dtype: jnp.dtype = jnp.float32,
    param_dtype: jnp.dtype = jnp.float32,
    remat: str = "none",
) -> nnx.Module:
    """The meshwork model for `cfg` holding `params` (both from `load_hf_checkpoint`).

    The model is built abstractly, so no random weights are drawn for the
    parameters; buffers that are not parameters (e.g. MoE selection biases)
    get their initial values.
    """
    make = lambda: _make_model(cfg, dtype=dtype, param_dtype=param_dtype, remat=remat, seed=0)  # noqa: E731
    graphdef, abstract, _ = nnx.split(nnx.eval_shape(make), nnx.Param, ...)
    buffers = _initial_buffers(cfg, dtype=dtype, param_dtype=param_dtype, remat=remat)
    # A checkpoint's buffers (DeepSeek-V3's selection biases) ride in `params`, beside the parameters.
    target = nnx.to_pure_dict(abstract)
    params, read_buffers = _split_like(params, target)
    _set_buffers(buffers, read_buffers)
    check_tree(target, params)
    cast = jax.tree.map(lambda ref, x: jnp.asarray(x, dtype=ref.dtype), nnx.to_pure_dict(abstract), params)
    nnx.replace_by_pure_dict(abstract, cast)
    return nnx.merge(graphdef, abstract, buffers)


def _split_like(tree: dict[str, Any], like: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tree's branches that `like` has, the others), recursively over dicts."""
    kept, rest = {}, {}
    for k, v in tree.items():
        if k not in like:
            rest[k] = v
        elif isinstance(v, dict) and isinstance(like[k], dict):
            kept[k], sub = _split_like(v, like[k])
            if sub:
                rest[k] = sub
        else:
            kept[k] = v
    return kept, rest


def model_from_hf(path: str | pathlib.Path, **kw: Any) -> tuple[ModelConfig, nnx.Module]:
    """(ModelConfig, model) from a Hugging Face checkpoint directory: `load_hf_model(path, **kw)`
    (`shardings`, `dtype`, `param_dtype`, `remat`, `attention`).

    >>> cfg, model = model_from_hf("tests/fixtures/hf/llama")
    >>> model(jnp.zeros((1, 4), jnp.int32)).shape
    (1, 4, 128)
    """
    return load_hf_model(path, **kw)
