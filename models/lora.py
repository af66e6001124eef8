"""Parameter-efficient fine-tuning, model side: LoRA, QLoRA, and the entry point by config.

LoRA (Hu et al., 2021): a chosen projection W0 stays frozen and learns a
low-rank delta, y = x W0 + (alpha / r) (x A) B, with A (inputs..., r) random and
B (r, outputs...) zero, so the model is unchanged at step 0. The delta is
computed as (x A) B: B A is never materialized in training. QLoRA (Dettmers et
al., 2023) is the same over a 4-bit base: every projection of the model is
quantized to models/quantize.py's int4 format (group scales, dequantized on
the fly inside the layer scan) and the LoRA factors stay in the model's dtypes.

    model = build_model(cfg)                    # then write the base run's weights into it
    apply_finetune(model, cfg.finetune, nnx.Rngs(cfg.run.seed))         # in place
    graphdef, train_params, rest = nnx.split(model, trainable(cfg.finetune), ...)
    ...                                         # optimize train_params only
    merged = merge_lora(model)                  # W0 += (alpha/r) B A: the base model again
    unmerge_lora(model, merged)                 # W0 -= (alpha/r) B A, wrappers back

A wrapped projection is a `LoRA` module in the weight's place (e.g.
`model.blocks.attn.wq`), holding the frozen `base` nnx.Param and the factors
`lora_a`, `lora_b` (`LoRAParam`); `models.layers.params.matmul` hands the
product to it. In the stacked blocks every variable keeps the leading `layers`
axis and its logical names ("layers", ..., "lora_rank", ...).

Dropout on the LoRA branch (`finetune.dropout`) draws from the training key the
trainer passes as `Transformer.apply(..., noise_key=...)`: `apply_layers` splits
it into one key per layer and sets it as `dropout_key` on that layer's `LoRA`
modules, which fold it with the projection's index, so masks differ across
layers and projections. Without a key (evaluation, inference) the branch is
deterministic.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshwork.config_sections import FinetuneConfig
from meshwork.models.adapters import (
    AdapterParam,
    PrefixParam,
    add_adapters,
    add_prefixes,
    param_dtype_of,
    require_dense,
)
from meshwork.models.layers import params
from meshwork.models.layers.params import param
from meshwork.models.transformer import Transformer, stack_layers

__all__ = [
    "LoRA",
    "LoRAParam",
    "AdapterParam",
    "PrefixParam",
    "MergedLoRA",
    "TARGETS",
    "MLA_TARGETS",
    "apply_finetune",
    "trainable",
    "add_lora",
    "merge_lora",
    "unmerge_lora",
    "lora_delta",
]

# finetune.targets name -> (submodule of a block, weight attribute, the einsum it is read with).
TARGETS: dict[str, tuple[str, str, str]] = {
    "q": ("attn", "wq", "BLD,DHK->BLHK"),
    "k": ("attn", "wk", "BLD,DGK->BLGK"),
    "v": ("attn", "wv", "BLD,DGK->BLGK"),
    "o": ("attn", "wo", "BLHK,HKD->BLD"),
    "gate": ("mlp", "w_gate", "BLD,DF->BLF"),
    "up": ("mlp", "w_up", "BLD,DF->BLF"),
    "down": ("mlp", "w_down", "BLF,FD->BLD"),
}
# Multi-head latent attention's own projections (models/layers/mla.py: low-rank query, latent,
# up-projection); its `q` (without q-LoRA) and `o` are the targets above.
MLA_TARGETS: dict[str, tuple[str, str, str]] = {
    "q_a": ("attn", "wq_a", "BLD,DQ->BLQ"),
    "q_b": ("attn", "wq_b", "BLQ,QHK->BLHK"),
    "kv_a": ("attn", "wkv_a", "BLD,DC->BLC"),
    "kv_b": ("attn", "wkv_b", "BLR,RHK->BLHK"),
}
RANK = "r"  # the rank's letter in the einsums below (docs/architecture.md#shape-letters); no weight spec uses it


class LoRAParam(nnx.Param):
    """A LoRA factor (A or B): the trainable variables of finetune.method=lora and qlora."""


def _letters(spec: str) -> tuple[str, str, str, str, str]:
    """'BLD,DHK->BLHK' -> (x 'BLD', weight 'DHK', out 'BLHK', contracted 'D', weight's outputs 'HK')."""
    inputs, out = spec.replace(" ", "").split("->")
    x, w = inputs.split(",")
    assert RANK not in spec, spec
    return x, w, out, "".join(c for c in w if c not in out), "".join(c for c in w if c in out)


def lora_delta(a: jax.Array, b: jax.Array, spec: str, scale: float) -> jax.Array:
    """scale * B A laid out like the weight read by `spec` (leading stacked axes kept):
    what merging adds to W0. Float32, full precision.

    >>> lora_delta(jnp.ones((3, 64, 2)), jnp.ones((3, 2, 4, 16)), "BLD,DHK->BLHK", 0.5).shape
    (3, 64, 4, 16)
    """
    _, w, _, contracted, outputs = _letters(spec)
    return scale * jnp.einsum(
        f"...{contracted}{RANK},...{RANK}{outputs}->...{w}",
        a.astype(jnp.float32),
        b.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )


class LoRA(nnx.Module):
    """A frozen weight plus a trainable low-rank delta: x W0 + (alpha / r) (x A) B.

    `base`: the frozen nnx.Param (its value a float array or a quantized weight of
    models/quantize.py). `lora_a` (inputs..., r), `lora_b` (r, outputs...): `LoRAParam`s.
    Build with `LoRA.wrap`; `models.layers.params.matmul` calls `matmul`.

    `dropout_key`: the layer's training key for dropout on the branch, None (evaluation) unless
    set; models/transformer.py `apply_layers` sets it on each layer's fresh copy of the block.
    """

    def __init__(
        self,
        base: nnx.Param,
        lora_a: LoRAParam,
        lora_b: LoRAParam,
        *,
        spec: str,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        site: int = 0,
    ):
        self.base, self.lora_a, self.lora_b = base, lora_a, lora_b
        self.spec, self.rank, self.alpha, self.dropout, self.site = spec, rank, alpha, dropout, site
        # Data, not a static attribute, so a traced key may be set on it; None adds nothing to the
        # module's state (checkpoints and optimizer state are unchanged).
        self.dropout_key = nnx.data(None)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def wrap(
        cls,
        base: nnx.Param,
        spec: str,
        *,
        rank: int,
        alpha: float,
        rngs: nnx.Rngs,
        layers: int = 0,
        dropout: float = 0.0,
        site: int = 0,
        param_dtype: jnp.dtype | None = None,
    ) -> LoRA:
        """Wraps `base` (read as `einsum(spec, x, base)`), with `layers` > 0 when it is stacked
        on a leading `layers` axis: the factors are then stacked too, each layer with its own A.

        A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (peft's default, Kaiming-uniform with a=sqrt(5));
        B = 0. The factors are stored in `param_dtype` (default: W0's dtype, float32 if quantized).

        >>> w = nnx.Param(jnp.ones((64, 128)), out_sharding=("embed", "mlp"), eager_sharding=False)
        >>> lora = LoRA.wrap(w, "BLD,DF->BLF", rank=4, alpha=8.0, rngs=nnx.Rngs(0))
        >>> lora.lora_a.shape, lora.lora_b.shape, lora.lora_b.get_metadata()["out_sharding"]
        ((64, 4), (4, 128), ('lora_rank', 'mlp'))
        """
        _, w, _, contracted, outputs = _letters(spec)
        value = base.get_value()
        shape = tuple(value.shape)  # a quantized weight reports the shape of the float one
        names = base.get_metadata().get("out_sharding") or (None,) * len(shape)
        if layers:
            shape, names = shape[1:], tuple(names)[1:]  # the vmap below puts `layers` back in front
        if len(shape) != len(w):
            raise ValueError(f"a weight of shape {shape} cannot be read as {spec!r}")
        dims, dim_names = dict(zip(w, shape)), dict(zip(w, names))
        fan_in = math.prod(dims[c] for c in contracted)
        dtype = param_dtype or (value.dtype if isinstance(value, jax.Array | np.ndarray) else jnp.float32)

        def uniform(key, shape, dtype):
            bound = 1 / math.sqrt(fan_in)
            return jax.random.uniform(key, shape, dtype, -bound, bound)

        def zeros(key, shape, dtype):
            return jnp.zeros(shape, dtype)

        def factors(r: nnx.Rngs) -> tuple[LoRAParam, LoRAParam]:
            a = param(
                uniform,
                r.params(),
                [dims[c] for c in contracted] + [rank],
                dtype,
                [dim_names[c] for c in contracted] + ["lora_rank"],
                LoRAParam,
            )
            b = param(
                zeros,
                r.params(),
                [rank] + [dims[c] for c in outputs],
                dtype,
                ["lora_rank"] + [dim_names[c] for c in outputs],
                LoRAParam,
            )
            return a, b

        a, b = stack_layers(factors, layers, rngs) if layers else factors(rngs)
        return cls(base, a, b, spec=spec, rank=rank, alpha=alpha, dropout=dropout, site=site)

    def matmul(self, spec: str, x: jax.Array, dtype: jnp.dtype) -> jax.Array:
        """x W0 (frozen; dequantized on the fly when quantized) + scale * (x A) B, in `dtype`."""
        x_letters, _, out, contracted, outputs = _letters(spec)
        kept = "".join(c for c in x_letters if c not in contracted)
        y = params.matmul(spec, x, self.base, dtype)
        xa = jnp.einsum(
            f"{x_letters},{contracted}{RANK}->{kept}{RANK}", self._dropout(x), self.lora_a[...].astype(dtype)
        )
        # Scaling the rank-r product is the cheapest place; with B = 0 the sum is exactly y.
        return y + jnp.einsum(
            f"{kept}{RANK},{RANK}{outputs}->{out}", xa * jnp.asarray(self.scale, dtype), self.lora_b[...].astype(dtype)
        )

    def _dropout(self, x: jax.Array) -> jax.Array:
        if self.dropout == 0 or self.dropout_key is None:
            return x
        keep = jax.random.bernoulli(jax.random.fold_in(self.dropout_key, self.site), 1 - self.dropout, x.shape)
        return jnp.where(keep, x / (1 - self.dropout), 0).astype(x.dtype)


def add_lora(
    model: Transformer, targets: Sequence[str], *, rank: int, alpha: float, rngs: nnx.Rngs, dropout: float = 0.0
) -> None:
    """In place: wraps the `targets` projections (names of `TARGETS`) of every block in `LoRA`.

    >>> from meshwork.config_sections import ModelConfig
    >>> m = Transformer(ModelConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64), rngs=nnx.Rngs(0))
    >>> add_lora(m, ["q", "v"], rank=4, alpha=8.0, rngs=nnx.Rngs(1))
    >>> m.blocks.attn.wq.lora_a.shape, m.blocks.attn.wq.lora_b.shape    # (layers, D, r), (layers, r, H, K)
    ((2, 32, 4), (2, 4, 2, 16))
    """
    require_dense(model, "finetune.method=lora")
    known = {**TARGETS, **MLA_TARGETS}  # in this order: a target's site index (its dropout stream) is fixed
    unknown = [t for t in targets if t not in known]
    if unknown or not targets:
        raise ValueError(f"finetune.targets={list(targets)}: choose among {', '.join(known)}")
    for site, t in enumerate(known):
        if t not in targets:
            continue
        sub, name, spec = known[t]
        module = getattr(model.blocks, sub)
        weight = getattr(module, name, None)
        if weight is None:
            have = [k for k, (s, n, _) in known.items() if getattr(getattr(model.blocks, s), n, None) is not None]
            raise ValueError(f"finetune.targets: this model has no {t!r} projection; choose among {', '.join(have)}")
        if isinstance(weight, LoRA):
            raise ValueError(f"blocks/{sub}/{name} already has LoRA; build the base model again")
        setattr(
            module,
            name,
            LoRA.wrap(
                weight,
                spec,
                rank=rank,
                alpha=alpha,
                rngs=rngs,
                layers=model.cfg.n_layers,
                dropout=dropout,
                site=site,
                param_dtype=param_dtype_of(model),
            ),
        )


def apply_finetune(model: nnx.Module, ft: FinetuneConfig, rngs: nnx.Rngs) -> None:
    """Prepares `model` (in place) for `ft.method`, from the weights it holds now.

    none, full: nothing to do. lora: LoRA on `ft.targets`. qlora: every projection
    quantized to int4 (groups of `ft.group_size` inputs; the current weights, so load
    the base run's weights first), then LoRA on `ft.targets`. adapter: bottleneck
    adapters of width `ft.rank`. prefix: `ft.prefix_len` prefixes per layer
    (reparameterized when `ft.prefix_hidden` > 0). `trainable(ft)` selects what to train.

    >>> from meshwork.config_sections import ModelConfig
    >>> m = Transformer(ModelConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64), rngs=nnx.Rngs(0))
    >>> apply_finetune(m, FinetuneConfig(method="lora", base="runs/x", rank=4), nnx.Rngs(1))
    >>> sum(x.size for x in jax.tree.leaves(nnx.state(m, trainable(FinetuneConfig(method="lora")))))
    896
    """
    method = ft.method
    if method in ("none", "full"):
        return
    if ft.dropout > 0 and method not in ("lora", "qlora"):
        raise ValueError(
            f"finetune.dropout={ft.dropout} applies to the LoRA branch; "
            f"finetune.method={method} has none, so set finetune.dropout=0"
        )
    require_dense(model, f"finetune.method={method}")
    if method in ("lora", "qlora"):
        if any(isinstance(node, LoRA) for _, node in nnx.iter_graph(model)):
            raise ValueError("the model already has LoRA; build the base model again (or merge_lora first)")
        if method == "qlora":
            _quantize_base(model, ft.group_size)
        add_lora(model, ft.targets, rank=ft.rank, alpha=ft.alpha, rngs=rngs, dropout=ft.dropout)
    elif method == "adapter":
        add_adapters(model, ft.rank, rngs=rngs)
    elif method == "prefix":
        add_prefixes(model, ft.prefix_len, ft.prefix_hidden, rngs=rngs)
    else:
        raise ValueError(f"finetune.method={method!r}; choose none, full, lora, qlora, adapter or prefix")


def _quantize_base(model: Transformer, group_size: int) -> None:
    # inference/ sits above models/ in the layering; only QLoRA reaches up, for the one
    # int4 format the project has, so the import waits until it is needed.
    from meshwork.models.quantize import quantize_model

    try:
        quantize_model(model, "int4", group_size)
    except ValueError as e:
        raise ValueError(f"finetune.method=qlora (finetune.group_size={group_size}): {e}") from e


def trainable(ft: FinetuneConfig) -> type[nnx.Variable]:
    """The nnx filter of the variables `ft.method` trains: nnx.Param (none, full: every
    weight), LoRAParam (lora, qlora), AdapterParam (adapter) or PrefixParam (prefix).

    >>> trainable(FinetuneConfig(method="qlora")).__name__
    'LoRAParam'
    """
    kinds = {
        "none": nnx.Param,
        "full": nnx.Param,
        "lora": LoRAParam,
        "qlora": LoRAParam,
        "adapter": AdapterParam,
        "prefix": PrefixParam,
    }
    return kinds[ft.method]


@dataclasses.dataclass
class MergedLoRA:
    """What `unmerge_lora` needs to undo `merge_lora` at one site."""

    path: tuple[str, ...]  # e.g. ("blocks", "attn", "wq")
    lora: LoRA  # the wrapper, with its factors as they were merged
    quantized_base: Any = None  # QLoRA: the original 4-bit W0, restored exactly


def _lora_sites(model: nnx.Module) -> list[tuple[tuple[str, ...], nnx.Module, LoRA]]:
    sites = [(tuple(map(str, path)), node) for path, node in nnx.iter_graph(model) if isinstance(node, LoRA)]
    return [(path, _resolve(model, path[:-1]), lora) for path, lora in sites]


def _resolve(model: nnx.Module, path: Sequence[str]) -> nnx.Module:
    return functools.reduce(getattr, path, model)


@functools.partial(jax.jit, static_argnames=("spec", "scale", "sign"))
def _add_delta(w, a, b, *, spec: str, scale: float, sign: int):
    return (w.astype(jnp.float32) + sign * lora_delta(a, b, spec, scale)).astype(w.dtype)


def merge_lora(model: nnx.Module) -> list[MergedLoRA]:
    """In place: W0 += (alpha / r) B A at every LoRA site, and the wrapper replaced by
    W0's own nnx.Param, so the model is structurally the base model again (same
    program, same FLOPs). Returns what `unmerge_lora` needs.

    A QLoRA base is dequantized first: the merged weight is float (param dtype of the
    factors); `unmerge_lora` puts the original 4-bit weight back.

    >>> from meshwork.config_sections import ModelConfig
    >>> m = Transformer(ModelConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64), rngs=nnx.Rngs(0))
    >>> add_lora(m, ["q"], rank=4, alpha=8.0, rngs=nnx.Rngs(1))
    >>> merged = merge_lora(m)
    >>> type(m.blocks.attn.wq).__name__, [s.path for s in merged]
    ('Param', [('blocks', 'attn', 'wq')])
    >>> unmerge_lora(m, merged); type(m.blocks.attn.wq).__name__
    'LoRA'
    """
    merged = []
    for path, parent, lora in _lora_sites(model):
        base, w, quantized = lora.base, lora.base.get_value(), None
        if not isinstance(w, jax.Array | np.ndarray):
            quantized, w = w, w.dequantize(lora.lora_a[...].dtype)
        base.set_value(_add_delta(w, lora.lora_a[...], lora.lora_b[...], spec=lora.spec, scale=lora.scale, sign=1))
        setattr(parent, path[-1], base)
        merged.append(MergedLoRA(path, lora, quantized))
    return merged


def unmerge_lora(model: nnx.Module, merged: Sequence[MergedLoRA]) -> None:
    """In place, the inverse of `merge_lora`: W0 -= (alpha / r) B A (float bases; a QLoRA
    base gets its 4-bit weight back exactly) and the `LoRA` wrappers restored around
    the model's current weights. See `merge_lora` for an example."""
    for site in merged:
        parent = _resolve(model, site.path[:-1])
        base = getattr(parent, site.path[-1])
        if not isinstance(base, nnx.Variable):
            raise ValueError(
                f"{'/'.join(site.path)} is a {type(base).__name__}, not a merged weight; "
                f"unmerge only what merge_lora returned for this model"
            )
        lora = site.lora
        if site.quantized_base is not None:
            base.set_value(site.quantized_base)
        else:
            base.set_value(
                _add_delta(
                    base.get_value(), lora.lora_a[...], lora.lora_b[...], spec=lora.spec, scale=lora.scale, sign=-1
                )
            )
        lora.base = base
        setattr(parent, site.path[-1], lora)
