"""Planner: what the optimizer holds per device, and what Muon's Newton-Schulz sends and computes.

State. AdamW keeps two moments per weight element; Muon (optimizer.name: muon) keeps one
momentum per element of each matrix stack (`optimizers/matrices.py` says which weights those are)
and AdamW's two moments for the rest. Every moment is laid out like the weight under the
"opt_state" rules, so a device holds `shard_size(w, layout, "opt_state")` elements of each. The
optax states also hold int32 step counters, replicated: adamw's `scale_by_adam` count and its
schedule's (`scale_by_learning_rate`) count; muon's `optax.partition` holds those two for its AdamW
part and one more for the Muon chain's learning-rate schedule.

Newton-Schulz, per device and per step, in sharding/hlo.py's byte convention (all-reduce
2(g-1)/g S, all-gather (g-1)/g S_out, all-to-all (g-1)/g S), itemsize the momentum's (train.param_dtype),
with each weight's `Placement` taken from `optimizers/newton_schulz.py` itself (the mesh axes that
split its batch, rows and columns, and the axes holding copies of its block):

- gather: the matrices whose local blocks have the same (rows, columns) and the same row, column and
  copy axes go together, k of them on each device, padded to k_pad = ceil(k / n) n with
  n = |rows axes| |cols axes| |copies axes|; with S = k_pad r_loc c_loc itemsize, one all-to-all of S
  over each row and each column axis there and one back, and one all-gather of S over the copy axes.
  Each device then iterates k_pad / n whole m x n matrices: per iteration 4 s^2 l + 2 s^3 FLOPs
  (s = min(m, n), l = max(m, n): X Xᵀ, its square, the product with X).
- sharded: a block split both ways is first all-gathered over the side split over fewer devices
  (a tie gathers the columns), S_out = k_loc x that side whole x the other side's block. Then over
  the g devices that still split one side: one all-reduce of the k_loc squared norms (k_loc itemsize
  bytes) and per iteration one of the k_loc Gram matrices over the unsplit side, k_loc side^2
  itemsize bytes; per iteration 2 side^2 other_loc k (the Gram) + 2 side^3 k (its square) + 2 side^2
  other_loc k (the product with X) FLOPs. A block split neither way iterates locally.

FLOPs count the matrix products only (the normalization and the a X + ... sums are elementwise, a
few FLOPs per element). tests/test_planner_optimizer.py holds the bytes to the compiled step's HLO
and the state to the built trainer's, byte for byte.

    >>> from meshwork.config import Config
    >>> from meshwork.perf.planner_layout import make_layout
    >>> cfg = Config.model_validate({"optimizer": {"name": "muon"}})
    >>> cost = newton_schulz_cost(cfg, make_layout(fsdp=8), "gather")
    >>> sorted({c.kind for c in cost.collectives})
    ['all-to-all']
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from meshwork.config import Config, ConfigError
from meshwork.config_sections import OptimizerConfig
from meshwork.optimizers.matrices import matrix_layout
from meshwork.optimizers.newton_schulz import VARIANTS, Placement, axes_size, placement
from meshwork.perf.planner_layout import Layout
from meshwork.perf.planner_memory import ITEMSIZE
from meshwork.perf.planner_weights import Weight, model_weights, shard_size
from meshwork.sharding.mesh import MESH_AXES
from meshwork.sharding.rules import logical_to_spec

if TYPE_CHECKING:
    from meshwork.perf.hardware import Accelerator
    from meshwork.perf.planner_comm import Collective

# int32 scalars in the optax state (checked against jax.eval_shape of train/optim.py's tx.init).
COUNTERS = {"adamw": 2, "muon": 3}


# ---------------------------------------------------------------------------
# State


def is_muon_matrix(opt: OptimizerConfig, weight: Weight) -> bool:
    """Whether `opt` updates `weight` with Muon (one momentum) rather than AdamW (two moments)."""
    return opt.name == "muon" and matrix_layout(weight.names) is not None


def moments(opt: OptimizerConfig, weight: Weight) -> int:
    """Arrays of the weight's shape that the optimizer keeps for it: 1 under Muon, 2 under AdamW."""
    return 1 if is_muon_matrix(opt, weight) else 2


def counter_bytes(opt: OptimizerConfig) -> int:
    """Bytes of the optax state's int32 step counters (replicated on every device)."""
    return 4 * COUNTERS[opt.name]


def state_elements(cfg: Config, layout: Layout) -> dict[str, int]:
    """Elements one device holds of the optimizer's per-weight arrays: "adamw" (weights with two
    moments, each counted once) and "muon" (matrix stacks with one momentum)."""
    out = {"adamw": 0, "muon": 0}
    for w in model_weights(cfg.model):
        out["muon" if is_muon_matrix(cfg.optimizer, w) else "adamw"] += shard_size(w, layout, "opt_state")
    return out


# ---------------------------------------------------------------------------
# Newton-Schulz


@dataclasses.dataclass(frozen=True)
class NewtonSchulzCost:
    """One variant's collectives (per device, per step) and matrix-product FLOPs per device per step."""

    variant: str
    collectives: tuple[Collective, ...]
    flops: float

    @property
    def sent_bytes(self) -> float:
        return sum(c.sent_bytes for c in self.collectives)

    def to_dict(self) -> dict:
        from meshwork.perf.planner_comm import summarize

        return {"bytes": self.sent_bytes, "flops": self.flops, "collectives": summarize(list(self.collectives))}


def muon_placements(cfg: Config, layout: Layout) -> list[tuple[Weight, Placement]]:
    """Each Muon matrix stack with the Placement optimizers/muon.py gives it on this layout (its
    momentum laid out by the "opt_state" rules). Raises ConfigError where Muon cannot split a matrix."""
    if cfg.optimizer.name != "muon":
        return []
    rules = layout.rules("opt_state")
    out = []
    for w in model_weights(cfg.model):
        lay = matrix_layout(w.names)
        if lay is None:
            continue
        try:
            out.append((w, placement(lay, w.shape, logical_to_spec(w.names, rules), layout.sizes)))
        except ValueError as e:
            raise ConfigError(f"optimizer.name=muon: {w.path}: {e}") from None
    return out


def muon_problem(cfg: Config, layout: Layout) -> str | None:
    """Why Muon cannot run `layout` (a sentence), or None."""
    try:
        muon_placements(cfg, layout)
    except ConfigError as e:
        return str(e)
    return None


def _local_flops(k: float, m: int, n: int) -> float:
    """One iteration over k whole m x n matrices (newton_schulz: the Gram over the shorter side)."""
    s, lo = min(m, n), max(m, n)
    return k * (4 * s * s * lo + 2 * s**3)


def newton_schulz_cost(cfg: Config, layout: Layout, variant: str | None = None) -> NewtonSchulzCost:
    """The Newton-Schulz collectives and FLOPs of one step of `cfg` under `layout`, per device, by
    `variant` ("gather" or "sharded"; default: the config's optimizer.muon.newton_schulz)."""
    from meshwork.perf.planner_comm import Collective

    settings = cfg.optimizer.muon_settings
    variant = variant or settings.newton_schulz
    if variant not in VARIANTS:
        raise ConfigError(f"newton_schulz={variant!r}; choose one of {', '.join(VARIANTS)}")
    placed = muon_placements(cfg, layout)
    item, steps = ITEMSIZE[cfg.train.param_dtype], settings.ns_steps
    what = f"newton-schulz ({variant})"
    found: list[Collective] = []

    def add(kind, axes, payload, count):
        axes = tuple(a for a in MESH_AXES if a in axes)
        found.append(Collective(kind, axes, axes_size(axes, layout.sizes), payload, count, what, False, optimizer=True))

    # The whole-matrix path (no mesh, or nothing split and nothing copied): local iterations alone.
    whole = layout.devices == 1 or all(not p.splits and not p.copies for _, p in placed)
    if whole or variant == "sharded":
        flops = sum(_sharded_one(w, p, layout, item, steps, add) for w, p in placed)
    else:
        flops = _gathered(placed, layout, item, steps, add)
    return NewtonSchulzCost(variant, tuple(found), flops)


def merged(collectives) -> list[Collective]:
    """`collectives` joined per kind and mesh axes: the counts summed, the payload their mean (the
    same bytes and the same number of operations, in one line of a plan)."""
    groups: dict[tuple, list] = {}
    for c in collectives:
        groups.setdefault((c.kind, c.axes), []).append(c)
    out = []
    for cs in groups.values():
        count = sum(c.count for c in cs)
        payload = sum(c.payload_bytes * c.count for c in cs) / count
        out.append(dataclasses.replace(cs[0], payload_bytes=payload, count=count))
    return out


def _gathered(placed, layout: Layout, item: int, steps: int, add) -> float:
    """newton_schulz._gathered: same-shape blocks through their owners together."""
    groups: dict[tuple, int] = {}
    for w, p in placed:
        k, r, c = p.block(w.shape, layout.sizes)
        key = (r, c, p.rows, p.cols, p.copies)
        groups[key] = groups.get(key, 0) + k
    flops = 0.0
    for (r, c, rows, cols, copies), k in groups.items():
        n = axes_size(rows + cols + copies, layout.sizes)
        k_pad = -(-k // n) * n
        S = k_pad * r * c * item
        for axis in rows + cols:  # one all-to-all per axis there and one back
            add("all-to-all", (axis,), S, 2)
        if copies:
            add("all-gather", copies, S, 1)
        flops += steps * _local_flops(k_pad // n, r * axes_size(rows, layout.sizes), c * axes_size(cols, layout.sizes))
    return flops


def _sharded_one(w: Weight, p: Placement, layout: Layout, item: int, steps: int, add) -> float:
    """newton_schulz._sharded_one: the Gram products all-reduced over the split side."""
    k, r, c = p.block(w.shape, layout.sizes)
    rows, cols = p.rows, p.cols
    n_rows, n_cols = axes_size(rows, layout.sizes), axes_size(cols, layout.sizes)
    if rows and cols:  # the side split over fewer devices is gathered (a tie: the columns)
        if n_rows < n_cols:
            add("all-gather", rows, k * r * n_rows * c * item, 1)
            r, rows = r * n_rows, ()
        else:
            add("all-gather", cols, k * r * c * n_cols * item, 1)
            c, cols = c * n_cols, ()
    if not (rows or cols):
        return steps * _local_flops(k, r, c)
    split = rows or cols
    side, other = (c, r) if rows else (r, c)  # the Gram is over the unsplit side
    add("all-reduce", split, k * item, 1)
    add("all-reduce", split, k * side * side * item, steps)
    return steps * k * (4 * side * side * other + 2 * side**3)


# ---------------------------------------------------------------------------
# In a plan


def optimizer_plan(
    cfg: Config, layout: Layout, hw: Accelerator, devices_per_node: int, algorithm: str, efficiency: float
) -> dict:
    """What a plan says of the optimizer: its name and, under Muon, each Newton-Schulz variant's
    bytes sent, FLOPs and seconds per step (collectives at planner_comm's cost, products at
    `efficiency` of the peak for train.param_dtype, the momentum's dtype), which one is
    configured and which is cheaper."""
    from meshwork.perf.planner_comm import collective_time

    out: dict = {"name": cfg.optimizer.name}
    if cfg.optimizer.name != "muon":
        return out
    peak = hw.flops("bf16" if cfg.train.param_dtype == "bfloat16" else "fp32") * efficiency
    variants = {}
    for variant in VARIANTS:
        cost = newton_schulz_cost(cfg, layout, variant)
        comm = sum(collective_time(c, layout, hw, devices_per_node, algorithm)[0] for c in merged(cost.collectives))
        variants[variant] = {**cost.to_dict(), "comm_s": comm, "compute_s": cost.flops / peak}
        variants[variant]["time_s"] = comm + cost.flops / peak
    out["newton_schulz"] = {
        "configured": cfg.optimizer.muon_settings.newton_schulz,
        "cheaper": min(VARIANTS, key=lambda v: variants[v]["time_s"]),
        "variants": variants,
    }
    return out


def optimizer_lines(opt: dict, state_bytes: float, fmt_bytes, fmt_secs) -> list[str]:
    """The plan's optimizer lines: its state per device and, under Muon, both variants."""
    lines = [f"optimizer: {opt['name']}, state {fmt_bytes(state_bytes)} per device"]
    ns = opt.get("newton_schulz")
    if ns is None:
        return lines
    lines.append(f"  newton-schulz per step and device (configured: {ns['configured']}, cheaper: {ns['cheaper']}):")
    for variant, v in ns["variants"].items():
        lines.append(
            f"    {variant:<8} sent {fmt_bytes(v['bytes']):>11}  {v['flops']:.3e} FLOPs  "
            f"{fmt_secs(v['time_s'])} ({fmt_secs(v['comm_s'])} communication)"
        )
    return lines
