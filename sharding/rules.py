"""THE logical-axis table: logical names -> mesh axes, and its presets.

Models name every weight and activation dimension with a logical name
(`embed`, `heads`, `act_batch`, ...) and never mention mesh axes. A rules table
maps each logical name to a mesh axis (or a tuple of them, or None for
replicated). Parallelism strategies are presets of this table plus mesh sizes,
combined with `+` (e.g. `fsdp+tp` on a 2 data x 2 fsdp x 2 tensor mesh):

- `dp`: parameters replicated; the batch is split over `data` (and `fsdp`,
  which is data-parallel for activations); XLA all-reduces the gradients.
- `zero1`: as `dp`, but Adam's moments are split over the data-parallel axes
  (ZeRO stage 1); `zero2`: gradients too, so XLA reduce-scatters them.
- `fsdp` (ZeRO-3): every weight is split over `fsdp` along its `embed`
  dimension, so parameters, gradients and moments all live in 1/fsdp pieces;
  XLA all-gathers weights before use and reduce-scatters gradients. With
  `data` > 1 as well this is hybrid sharding (HSDP).
- `tp`: Megatron tensor parallelism over `tensor`: attention heads and the MLP
  hidden dimension split (column-parallel in, row-parallel out: one all-reduce
  per block in the forward pass), vocab-parallel embedding and logits.
- `sp`: `tp` plus Megatron sequence parallelism: the residual stream and norms
  (`act_norm_seq`) are split over the sequence on `tensor` between the
  tensor-parallel regions, turning each all-reduce into all-gather +
  reduce-scatter.
- `cp`: context parallelism: the sequence split over `sequence` everywhere;
  attention becomes ring attention (see `sharding/ring_attention.py`).
- `ep`: expert parallelism: MoE experts split over `expert`, tokens sent to
  their experts' devices by all-to-all (models/layers/moe_dispatch.py); the batch is
  split over `expert` too.
- `pp`: pipeline parallelism: the stacked layers split over `stage`, so each
  stage holds its own layers (and their moments); the step then runs a
  schedule of `sharding/pipeline_schedules.py` (gpipe, 1f1b, interleaved, zb-h1).
  `train.pipeline` adds it.

Each preset gives one table per role: `params` (also used for activations),
`grads` and `opt_state`; they differ only for the ZeRO-1/2 presets.

    >>> rules = rules_for("fsdp")
    >>> logical_to_spec(("embed", "mlp"), rules) == PartitionSpec("fsdp", None)
    True
    >>> logical_to_spec(("act_batch", "act_seq", "act_embed"), rules) == PartitionSpec(("data", "fsdp"), None, None)
    True
    >>> logical_to_spec(("embed", "mlp"), rules_for("zero1", role="opt_state")) == PartitionSpec(("data", "fsdp"), None)
    True
    >>> logical_to_spec(("embed", "heads"), rules_for("fsdp+tp")) == PartitionSpec("fsdp", "tensor")
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]
ROLES = ("params", "grads", "opt_state")

# Every logical name used by models/ appears here; a name missing from the
# table is an error rather than a silent "replicated".
_BASE: dict[str, MeshAxes] = {
    # weights
    "vocab": None,
    "embed": None,
    "heads": None,
    "kv_heads": None,
    "head_dim": None,
    "mlp": None,
    "layers": None,
    "expert": None,  # the stacked-experts dimension of MoE weights
    "router": None,  # the experts dimension of the router's weight and bias
    "lora_rank": None,
    "q_lora": None,  # MLA's low-rank query dimension (models/layers/mla.py)
    "kv_lora": None,  # MLA's key/value latent (one per token, shared by the heads: never split)  # fine-tuning's low-rank dimension: LoRA rank, adapter bottleneck (models/lora.py)
    "linear_heads": None,  # value heads of a linear-attention layer (models/layers/gated_deltanet.py)
    "linear_k_heads": None,  # its query/key heads, each serving a contiguous run of value heads
    # UNet weights: the output-channel dimension of a conv or dense layer is `embed`
    # (what fsdp splits); these name the other dimensions.
    "conv_kh": None,  # convolution kernel height
    "conv_kw": None,  # convolution kernel width
    "channels_in": None,  # input channels/features of a UNet conv or dense layer (and norms over them)
    "image_channels": None,  # the image's own channels (in/out of the first/last conv)
    "classes": None,  # rows of the class-embedding table
    # activations
    "act_batch": ("data", "fsdp"),
    "act_seq": None,  # sequence inside attention and the MLP
    "act_norm_seq": None,  # sequence of the residual stream and norms (Megatron-SP splits only this)
    "act_embed": None,
    "act_heads": None,
    "act_kv_heads": None,
    "act_head_dim": None,
    "act_mlp": None,
    "act_vocab": None,
    "act_expert": None,  # the experts dimension of dispatched tokens
    "act_height": None,  # image rows (NHWC activations)
    "act_width": None,  # image columns
    "act_channels": None,  # image channels
}

_DATA_PARALLEL = ("data", "fsdp")
_TENSOR_PARALLEL = {
    name: "tensor"
    for name in (
        *("heads", "kv_heads", "linear_heads", "linear_k_heads", "mlp", "vocab"),
        *("act_heads", "act_kv_heads", "act_mlp", "act_vocab"),
    )
}

# preset -> role ("all" or one of ROLES) -> changes to the base table.
PRESETS: dict[str, dict[str, dict[str, MeshAxes]]] = {
    "dp": {},
    "zero1": {"opt_state": {"embed": _DATA_PARALLEL}},
    "zero2": {"opt_state": {"embed": _DATA_PARALLEL}, "grads": {"embed": _DATA_PARALLEL}},
    "fsdp": {"all": {"embed": "fsdp"}},
    "tp": {"all": _TENSOR_PARALLEL},
    "sp": {"all": {**_TENSOR_PARALLEL, "act_norm_seq": "tensor"}},
    "cp": {"all": {"act_seq": "sequence", "act_norm_seq": "sequence"}},
    "pp": {"all": {"layers": "stage"}},
    # Expert parallelism: each device of the `expert` axis owns E/n experts and,
    # outside the MoE layers, acts as one more data-parallel shard.
    "ep": {"all": {"expert": "expert", "act_expert": "expert", "act_batch": ("data", "fsdp", "expert")}},
}


def rules_for(
    preset: str, overrides: Mapping[str, MeshAxes | Sequence[str]] | None = None, role: str = "params"
) -> Rules:
    """The rules of `preset` (names joined by `+`, applied left to right) for `role`,
    with `overrides` applied last, as a tuple of (logical name, mesh axes) pairs.

    >>> dict(rules_for("dp", {"mlp": "tensor"}))["mlp"]
    'tensor'
    >>> dict(rules_for("zero2", role="grads"))["embed"]
    ('data', 'fsdp')
    >>> dict(rules_for("zero1+ep", role="opt_state"))["embed"]
    ('data', 'fsdp', 'expert')
    """
    if role not in ROLES:
        raise ValueError(f"role {role!r}; choose one of {ROLES}")
    table = dict(_BASE)
    for name in preset.split("+"):
        if name not in PRESETS:
            raise KeyError(
                f"rules.preset: unknown preset {name!r} in {preset!r}; choose from {', '.join(PRESETS)}, joined by +"
            )
        table.update(PRESETS[name].get("all", {}))
        table.update(PRESETS[name].get(role, {}))
    if "ep" in preset.split("+") and role != "params":
        # Expert parallelism's devices are data-parallel replicas for every non-expert weight (act_batch
        # spans them), so ZeRO's split of that weight's gradients or optimizer state over the data axes
        # takes the expert axis too (DeepSeek-V3's ZeRO-1 over DP x EP). An expert weight's `expert`
        # dimension comes first and keeps the axis (logical_to_spec uses an axis once per array).
        embed = (table["embed"],) if isinstance(table["embed"], str) else tuple(table["embed"] or ())
        if "data" in embed and "expert" not in embed:
            table["embed"] = (*embed, "expert")
    for name, axes in (overrides or {}).items():
        if name not in table:
            raise KeyError(f"rules.overrides: unknown logical axis {name!r}; known: {', '.join(table)}")
        table[name] = tuple(axes) if isinstance(axes, list | tuple) else axes
    return tuple(table.items())


def axes_of(name: str, rules: Rules) -> tuple[str, ...]:
    """The mesh axes a logical name maps to, as a tuple (empty when replicated)."""
    axes = dict(rules)[name]
    return (axes,) if isinstance(axes, str) else tuple(axes or ())


def split_axes(name: str, rules: Rules, mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes of size > 1 that split logical dimension `name`.

    >>> split_axes("act_seq", rules_for("cp"), {"data": 2, "sequence": 4})
    ('sequence',)
    >>> split_axes("act_seq", rules_for("cp"), {"data": 8, "sequence": 1})
    ()
    """
    return tuple(a for a in axes_of(name, rules) if mesh_shape.get(a, 1) > 1)


def manual_axes() -> frozenset[str]:
    """The mesh axes that are manual where this is traced: inside a `jax.shard_map` that is
    manual over some axes only (a pipeline stage with its data shards manual too), a nested
    shard_map or sharding constraint may name only the other axes, and a mean over a
    dimension those manual axes split must also be taken across them (`lax.pmean`)."""
    mesh = jax.sharding.get_abstract_mesh()
    return frozenset() if mesh.empty else frozenset(mesh.manual_axes)


def compiler_axes(axes: Sequence[str]) -> tuple[str, ...]:
    """`axes` without the ones already manual here (`manual_axes`): the axes a nested
    shard_map may still take over."""
    manual = manual_axes()
    return tuple(a for a in axes if a not in manual)


def logical_to_spec(names: Sequence[str | None], rules: Rules) -> PartitionSpec:
    """Maps a tuple of logical names to a PartitionSpec.

    A mesh axis is used at most once per array: a later dimension that maps
    to an axis already taken stays unsharded (as Linen's rules do).

    >>> logical_to_spec(("embed", "embed"), rules_for("fsdp")) == PartitionSpec("fsdp", None)
    True
    """
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name in names:
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no rule; add it to sharding/rules.py")
        axes = table[name]
        axes_t = (axes,) if isinstance(axes, str) else tuple(axes or ())
        axes_t = tuple(a for a in axes_t if a not in used)
        used.update(axes_t)
        out.append(None if not axes_t else axes_t[0] if len(axes_t) == 1 else axes_t)
    return PartitionSpec(*out)


def logical_to_sharding(names: Sequence[str | None], mesh: Mesh, rules: Rules) -> NamedSharding:
    """NamedSharding on `mesh` for an array whose dimensions have logical `names`.

    >>> from meshwork.sharding.mesh import make_mesh
    >>> mesh = make_mesh({"fsdp": -1})
    >>> logical_to_sharding(("embed", "mlp"), mesh, rules_for("fsdp")).spec == PartitionSpec("fsdp", None)
    True
    """
    return NamedSharding(mesh, logical_to_spec(names, rules))


def tree_shardings(logical_specs: Any, mesh: Mesh, rules: Rules) -> Any:
    """Maps a pytree whose leaves are PartitionSpecs of logical names to NamedShardings.

    Leaves that are None (no annotation, e.g. a scalar step count) become
    replicated shardings.
    """
    return jax.tree.map(
        lambda s: logical_to_sharding(tuple(s) if s is not None else (), mesh, rules),
        logical_specs,
        is_leaf=lambda s: s is None or isinstance(s, PartitionSpec),
    )
