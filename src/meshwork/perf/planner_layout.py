"""Planner: the layout, what a meshwork config says about parallelism.

A `Layout` holds the six mesh axis sizes, the rules preset (`sharding/rules.py`),
microbatches, the pipeline schedule and the remat policy. The planner never
re-states what a preset does: it asks the same rules table the trainer uses
which mesh axes split each logical dimension, so `fsdp` splits `embed` over
`fsdp`, `tp` splits heads, MLP and vocabulary over `tensor`, `zero1`/`zero2`
split the moments (and gradients) over `data` x `fsdp`, exactly as in training.

    >>> layout = make_layout(fsdp=8)
    >>> layout.preset, layout.sizes["fsdp"]
    ('fsdp', 8)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING

from meshwork.config import Config, ConfigError
from meshwork.perf.planner_remat import POLICIES
from meshwork.sharding.mesh import MESH_AXES
from meshwork.sharding.rules import axes_of, rules_for

if TYPE_CHECKING:
    from meshwork.perf.planner_weights import Weight

# The policies the layout search tries (any of planner_remat.POLICIES can be planned).
REMATS = ("none", "dots_saveable", "full")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Mesh sizes, rules preset and the schedule knobs: what a config's `mesh`,
    `rules` and `train.{microbatches,pipeline,remat}` say.

    `mesh` holds all six axes in `MESH_AXES` order, no -1. Build one with
    `make_layout` (from parallelism degrees) or `layout_from_config`.
    """

    mesh: tuple[tuple[str, int], ...]
    preset: str = "dp"
    microbatches: int = 1
    pipeline: str = "none"
    remat: str = "none"
    overrides: tuple[tuple[str, object], ...] = ()
    virtual_stages: int = 1
    """Model chunks per stage (train.virtual_stages) under the interleaved schedule."""
    context_parallel: str = "ring"
    """How attention runs over a split sequence (train.context_parallel: ring, all_gather, ulysses, usp)."""

    @functools.cached_property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh)

    @property
    def devices(self) -> int:
        return math.prod(self.sizes.values())

    def rules(self, role: str = "params"):
        """The rules table for `role`, with `+pp` added under a pipeline as the Trainer does."""
        return _rules(self._preset, self.overrides, role)

    @functools.cached_property
    def _preset(self) -> str:
        return self.preset + ("+pp" if self.pipeline != "none" else "")

    @functools.cached_property
    def _memo(self) -> dict:
        return {}

    def axes(self, name: str | None, role: str = "params") -> tuple[str, ...]:
        """Mesh axes logical dimension `name` maps to under `role` (any size)."""
        return _table(self._preset, self.overrides, role).get(name, ()) if name else ()

    def split(self, name: str, role: str = "params") -> tuple[str, ...]:
        """Mesh axes of size > 1 that split logical dimension `name`."""
        key = ("split", name, role)
        if key not in self._memo:
            self._memo[key] = tuple(a for a in self.axes(name, role) if self.sizes[a] > 1)
        return self._memo[key]

    def ways(self, name: str, role: str = "params") -> int:
        """Into how many pieces logical dimension `name` is cut."""
        return math.prod(self.sizes[a] for a in self.split(name, role))

    def weight_split(self, weight: Weight, role: str = "params") -> tuple[tuple[str, ...], ...]:
        """Per dimension of `weight`, the mesh axes splitting it under `role` (as
        `sharding.rules.logical_to_spec`: a mesh axis splits at most one
        dimension of an array, the first that names it)."""
        return _weight_split(self._preset, self.overrides, role, weight.names)

    def weight_axes(self, weight: Weight, role: str = "params") -> tuple[str, ...]:
        """Mesh axes of size > 1 that split some dimension of `weight` under `role`."""
        return tuple(a for axes in self.weight_split(weight, role) for a in axes if self.sizes[a] > 1)

    def describe(self) -> str:
        """e.g. `data=8 x fsdp=8, fsdp, remat=full, mb=4`."""
        mesh = " x ".join(f"{a}={n}" for a, n in self.mesh if n > 1) or "1 device"
        extra = [f"remat={self.remat}"] if self.remat != "none" else []
        if self.microbatches > 1:
            extra.append(f"mb={self.microbatches}")
        if self.pipeline != "none":
            extra.append(self.pipeline + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if self.split("act_seq"):
            extra.append(f"cp={self.context_parallel}")
        return ", ".join([mesh, self.preset, *extra])


@functools.cache
def _rules(preset: str, overrides: tuple, role: str):
    return rules_for(preset, dict(overrides), role)


@functools.cache
def _weight_split(preset: str, overrides: tuple, role: str, names: tuple) -> tuple[tuple[str, ...], ...]:
    table = _table(preset, overrides, role)
    used: set[str] = set()
    dims = []
    for name in names:
        axes = tuple(a for a in (table.get(name, ()) if name else ()) if a not in used)
        used.update(axes)
        dims.append(axes)
    return tuple(dims)


@functools.cache
def _table(preset: str, overrides: tuple, role: str) -> dict[str, tuple[str, ...]]:
    return {name: axes_of(name, _rules(preset, overrides, role)) for name, _ in _rules(preset, overrides, role)}


# usp in a search: act_seq (and the residual stream's) over sequence (the ring) and tensor (Ulysses).
USP_OVERRIDES = (("act_norm_seq", ("sequence", "tensor")), ("act_seq", ("sequence", "tensor")))


def make_layout(
    *,
    data: int = 1,
    fsdp: int = 1,
    expert: int = 1,
    sequence: int = 1,
    tensor: int = 1,
    stage: int = 1,
    zero: int = 0,
    sequence_parallel: bool = False,
    microbatches: int = 1,
    remat: str = "none",
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    context_parallel: str = "ring",
) -> Layout:
    """A Layout from parallelism degrees, with the preset meshwork needs for them.

    `zero` (0, 1, 2) is the ZeRO stage over the data-parallel axes when
    `fsdp` is 1; `fsdp` > 1 is ZeRO-3 over `fsdp` (hybrid with `data`).
    `tensor` > 1 adds `tp` (`sp` with `sequence_parallel`), `sequence` > 1
    `cp` (attention by `context_parallel`), `expert` > 1 `ep`; `stage` > 1 runs
    the pipeline `schedule` (with `virtual_stages` chunks per stage under
    "interleaved"). `context_parallel="usp"` spends `tensor` on the sequence
    instead (the ring over `sequence`, Ulysses over `tensor`: act_seq over both).

    >>> make_layout(data=2, fsdp=2, tensor=2).preset
    'fsdp+tp'
    >>> make_layout(data=8, zero=2).preset
    'zero2'
    >>> make_layout(sequence=4, tensor=2, context_parallel="usp").split("act_seq")
    ('sequence', 'tensor')
    """
    if zero not in (0, 1, 2, 3):
        raise ConfigError(f"zero={zero}: the ZeRO stages are 0, 1, 2 and 3 (= fsdp)")
    if remat not in POLICIES:
        raise ConfigError(f"remat={remat!r}; choose one of {', '.join(POLICIES)}")
    usp = context_parallel == "usp"
    if usp and (sequence < 2 or tensor < 2):
        raise ConfigError(f"context_parallel=usp needs sequence and tensor > 1 (got {sequence}, {tensor})")
    parts = ["fsdp" if fsdp > 1 or zero == 3 else ("dp", "zero1", "zero2")[zero]]
    if tensor > 1 and not usp:
        parts.append("sp" if sequence_parallel else "tp")
    if sequence > 1:
        parts.append("cp")
    if expert > 1:
        parts.append("ep")
    sizes = dict(stage=stage, data=data, fsdp=fsdp, expert=expert, sequence=sequence, tensor=tensor)
    return Layout(
        tuple((a, sizes[a]) for a in MESH_AXES),
        "+".join(parts),
        microbatches,
        schedule if stage > 1 else "none",
        remat,
        USP_OVERRIDES if usp else (),
        virtual_stages=virtual_stages if stage > 1 else 1,
        context_parallel=context_parallel,
    )


def layout_from_config(cfg: Config, n_devices: int) -> Layout:
    """The Layout a config asks for on `n_devices` (its one -1 mesh axis filled in)."""
    from meshwork.sharding.mesh import MeshSizeError, resolve_mesh_shape

    try:
        shape = resolve_mesh_shape(cfg.mesh.sizes(), n_devices)
    except MeshSizeError as e:
        raise ConfigError(f"{e} (devices: {n_devices})") from None
    overrides = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in cfg.rules.overrides.items()))
    layout = Layout(
        tuple(zip(MESH_AXES, shape)),
        cfg.rules.preset,
        cfg.train.microbatches,
        cfg.train.pipeline,
        cfg.train.remat,
        overrides,
        cfg.train.virtual_stages,
        cfg.train.context_parallel,
    )
    try:
        layout.rules()
    except KeyError as e:
        raise ConfigError(str(e.args[0])) from None
    return layout
