"""What a compiled program does per device: memory, FLOPs, collectives, state.

Everything is read from XLA's compiled executable, not predicted:
`memory_analysis()` for buffer sizes, `cost_analysis()` for FLOPs, the
optimized HLO text for the collectives GSPMD inserted (`sharding/hlo.py`
explains how they are counted, per step and in bytes), and the arrays' shard
shapes for the per-device train state.

    >>> compiled = jax.jit(f).lower(x).compile()              # doctest: +SKIP
    >>> compiled_report(compiled)["collectives"]["all-reduce"]  # doctest: +SKIP
    {'count': 1, 'bytes': 16384, 'payload_bytes': 16384}

`cost_analysis()` counts a while body once, so `flops` undercounts a scanned
model by about the number of layers; the collective figures do not.
"""

from __future__ import annotations

import math
from typing import Any

import jax

from meshwork.sharding.hlo import COLLECTIVES, Collective, collective_counts, collective_summary, list_collectives

__all__ = [
    "COLLECTIVES",
    "Collective",
    "collective_counts",
    "collective_summary",
    "compiled_report",
    "format_report",
    "list_collectives",
    "state_bytes",
]


# ---------------------------------------------------------------------------
# Per-device state from the real shard shapes.


def _tree_bytes(tree: Any, shardings: Any) -> int:
    """Per-device bytes of `tree` (leaves with .shape and .dtype) laid out by
    `shardings`, a tree prefix of it (one sharding per leaf or per subtree)."""
    per_subtree = jax.tree.map(
        lambda sharding, sub: sum(
            math.prod(sharding.shard_shape(tuple(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(sub)
        ),
        shardings,
        tree,
        is_leaf=lambda s: isinstance(s, jax.sharding.Sharding),
    )
    return int(sum(jax.tree.leaves(per_subtree)))


def state_bytes(
    abstract_state: dict[str, Any], shardings: dict[str, Any], grad_shardings: Any = None
) -> dict[str, int]:
    """Bytes one device holds of the train state, from each leaf's shard shape.

    `abstract_state` is {"params", "opt_state", ...} of arrays or
    ShapeDtypeStructs; `shardings` the same keys, each a tree prefix of
    shardings (a train state's `.parts()`, as `Trainer.report_dict` passes). Gradients have the parameters' shapes
    and dtypes, laid out by `grad_shardings` when given (ZeRO-2) and like the
    parameters otherwise.

    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
    >>> w = jax.ShapeDtypeStruct((jax.device_count() * 4, 8), "float32")
    >>> state_bytes({"params": {"w": w}, "opt_state": {}},
    ...             {"params": {"w": NamedSharding(mesh, P("fsdp"))}, "opt_state": {}})
    {'params': 128, 'grads': 128, 'opt_state': 0, 'total': 256}
    """
    params = _tree_bytes(abstract_state["params"], shardings["params"])
    grads = params if grad_shardings is None else _tree_bytes(abstract_state["params"], grad_shardings)
    opt = _tree_bytes(abstract_state["opt_state"], shardings["opt_state"])
    out = {"params": params, "grads": grads, "opt_state": opt, "total": params + grads + opt}
    # Untrained weights carried in the state (a fine-tuned model's frozen base), when there are any.
    frozen = _tree_bytes(abstract_state["buffers"], shardings["buffers"]) if "buffers" in abstract_state else 0
    if frozen:
        out["frozen"] = frozen
        out["total"] += frozen
    return out


# ---------------------------------------------------------------------------
# The report.


def compiled_report(compiled: Any, state: dict[str, int] | None = None) -> dict[str, Any]:
    """Per-device memory (bytes), FLOPs and collectives of a compiled jit, as a
    JSON-serializable dict; `state` (from `state_bytes`) is included when given.

    `flops` comes from `cost_analysis()`, which counts a while (scan) body
    once; `collectives` is `collective_summary` (per run, loops multiplied).

    >>> report = compiled_report(trainer.step_fn, state_bytes(abstract, shardings))  # doctest: +SKIP
    >>> report["collectives"]["all-gather"]["count"], report["state"]["params"]      # doctest: +SKIP
    (40, 53408)
    """
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    report: dict[str, Any] = {
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
        "flops": float((cost or {}).get("flops", 0.0)),
        "collectives": collective_summary(compiled.as_text()),
    }
    if state is not None:
        report["state"] = {k: int(v) for k, v in state.items()}
    return report


def _mib(b: float) -> str:
    m = b / 2**20
    return f"{m:,.2f} MiB" if m >= 1 or m == 0 else f"{m:.3g} MiB"  # tiny models: keep 3 digits


def format_report(report: dict[str, Any], cfg: Any = None, mesh: Any = None) -> str:
    """The report as text, one fact a line, all figures per device.

    >>> print(format_report(compiled_report(compiled)))   # doctest: +SKIP
    per-device arguments: 1.63 MiB (donated/aliased: 1.63 MiB)
    ...
    """
    lines = []
    if mesh is not None:
        lines.append("mesh: " + " x ".join(f"{k}={v}" for k, v in mesh.shape.items()))
    if cfg is not None:
        lines.append(f"rules: {cfg.rules.preset}")
    state = report.get("state")
    if state:
        lines += [
            f"per-device params:    {_mib(state['params'])}",
            f"per-device grads:     {_mib(state['grads'])}",
            f"per-device opt state: {_mib(state['opt_state'])}",
        ]
        if "frozen" in state:
            lines.append(f"per-device frozen:    {_mib(state['frozen'])}")
    lines += [
        f"per-device arguments: {_mib(report['argument_bytes'])} (donated/aliased: {_mib(report['alias_bytes'])})",
        f"per-device outputs:   {_mib(report['output_bytes'])}",
        f"per-device temp:      {_mib(report['temp_bytes'])}",
        f"FLOPs per device (scan body once): {report['flops']:.3e}",
        "collectives per step (bytes sent per device, ring algorithms):",
    ]
    width = max(map(len, COLLECTIVES))
    for kind, c in report["collectives"].items():
        c = c if isinstance(c, dict) else {"count": c, "bytes": 0}
        lines.append(f"  {kind:<{width}}  {c['count']:>4} x  {_mib(c['bytes'])}")
    return "\n".join(lines)
