"""What a compiled program will do per device: memory, FLOPs, collectives.

Read from XLA's compiled executable, not predicted: `memory_analysis()` for
buffer sizes, `cost_analysis()` for FLOPs (a scanned body is counted once),
and the optimized HLO text for the collectives GSPMD inserted.

    >>> compiled = jax.jit(f).lower(x).compile()          # doctest: +SKIP
    >>> collective_counts(compiled.as_text())["all-reduce"] # doctest: +SKIP
    1
"""

from __future__ import annotations

import re
from typing import Any

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# An HLO instruction `%name = type op(...)`; async pairs count once, by their -start.
_OP = re.compile(r"=\s*[^=]*?\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")


def collective_counts(hlo_text: str) -> dict[str, int]:
    """Number of each collective in optimized HLO text (async start/done counted once)."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if m:
            counts[m.group(1)] += 1
    return counts


def compiled_report(compiled: Any) -> dict[str, Any]:
    """Per-device memory (bytes), FLOPs and collective counts of a compiled jit."""
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {
        "argument_bytes": mem.argument_size_in_bytes,
        "output_bytes": mem.output_size_in_bytes,
        "temp_bytes": mem.temp_size_in_bytes,
        "alias_bytes": mem.alias_size_in_bytes,
        "flops": float((cost or {}).get("flops", 0.0)),
        "collectives": collective_counts(compiled.as_text()),
    }


def format_report(report: dict[str, Any], cfg: Any = None, mesh: Any = None) -> str:
    mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    lines = []
    if mesh is not None:
        lines.append("mesh: " + " x ".join(f"{k}={v}" for k, v in mesh.shape.items()))
    if cfg is not None:
        lines.append(f"rules: {cfg.rules.preset}")
    lines += [
        f"per-device arguments: {mib(report['argument_bytes'])} (donated/aliased: {mib(report['alias_bytes'])})",
        f"per-device outputs:   {mib(report['output_bytes'])}",
        f"per-device temp:      {mib(report['temp_bytes'])}",
        f"FLOPs per device (scan body once): {report['flops']:.3e}",
        "collectives: " + ", ".join(f"{k} {v}" for k, v in report["collectives"].items()),
    ]
    return "\n".join(lines)
