"""Graph insight: what XLA's compiler did to a traced program, read from its
jaxpr and its optimized HLO.

    >>> compiled = jax.jit(f).lower(x).compile()                    # doctest: +SKIP
    >>> report = graph_report(compiled, jax.make_jaxpr(f)(x))       # doctest: +SKIP
    >>> report["jaxpr"]["ops"], report["hlo"]["kernels"]             # doctest: +SKIP
    (862, 215)
    >>> print(format_graph_report(report))                           # doctest: +SKIP

Four readings of one compiled program:

- Ops vs kernels. The jaxpr's primitive equations (`sharding/jaxpr_ops.py`)
  against the kernels the optimized HLO launches (`sharding/hlo_kernels.py`).
  Static counts take every body once; "per step" multiplies a scan/while
  body by its trip count (`known_trip_count` in the HLO, `length` in the
  jaxpr), as `sharding/hlo.py` does for collectives.
- Fusions. Each fusion's reads + writes against what its instructions would
  move each alone (`sharding/hlo_kernels.py`): the memory traffic fusion saved.
- Operator classes. Every executed operation (inside fusions and unfused) by
  class, with its FLOPs (`sharding/hlo_kernels.py`). "unfused bytes" are the
  operations' bytes as if each ran alone; "kernel bytes" give each kernel's
  real traffic to the class of its heaviest operation, so the two arithmetic
  intensities (FLOPs per byte) show what fusion bought.
- Collectives in the schedule: `sharding/overlap.py`'s reader of the
  scheduled HLO (start/done positions, compute between them).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from meshwork.sharding.hlo_kernels import OP_CLASSES, Kernel, hlo_kernels
from meshwork.sharding.hlo_parse import parse_module
from meshwork.sharding.jaxpr_ops import jaxpr_op_counts
from meshwork.sharding.overlap import COMPUTE_OPS, async_collective_schedule

__all__ = ["format_graph_report", "graph_report"]


def _class_table(kernels: list[Kernel], per_step: bool) -> dict[str, dict[str, float]]:
    table = {c: {"ops": 0, "flops": 0.0, "unfused_bytes": 0, "kernel_bytes": 0, "kernels": 0} for c in OP_CLASSES}
    for k in kernels:
        m = k.multiplier if per_step else 1
        for cls, fl, b in k.parts:
            row = table[cls]
            row["ops"] += m
            row["flops"] += fl * m
            row["unfused_bytes"] += b * m
        table[k.op_class]["kernel_bytes"] += k.bytes * m
        table[k.op_class]["kernels"] += m
    for row in table.values():
        row["intensity_unfused"] = row["flops"] / row["unfused_bytes"] if row["unfused_bytes"] else 0.0
        row["intensity_kernel"] = row["flops"] / row["kernel_bytes"] if row["kernel_bytes"] else 0.0
    return table


def graph_report(compiled: Any, jaxpr: Any = None, top: int = 8) -> dict[str, Any]:
    """Ops vs kernels, the largest fusions, the operator-class table and the
    collectives' schedule of a compiled program (`jit(f).lower(...).compile()`),
    as a JSON-serializable dict. `jaxpr` (from `jax.make_jaxpr(f)(...)`) adds
    the primitive counts. Figures are per device (the SPMD-partitioned program).

    `flops_once_per_body` applies cost_analysis()'s convention (a while body
    counted once) and is comparable with `compiled.cost_analysis()["flops"] +
    ["transcendentals"]`; the `classes` table is per step (bodies x trips).

    >>> r = graph_report(trainer.step_fn, jaxpr)                       # doctest: +SKIP
    >>> r["jaxpr"]["ops"] / r["hlo"]["kernels"]                         # doctest: +SKIP
    4.1
    """
    text = compiled.as_text() if hasattr(compiled, "as_text") else str(compiled)
    kernels = hlo_kernels(text)
    fusions = [k for k in kernels if k.op == "fusion"]
    report: dict[str, Any] = {
        "hlo": {
            "kernels": len(kernels),
            "kernels_per_step": sum(k.multiplier for k in kernels),
            "by_kind": dict(Counter(k.op if k.op != "fusion" else "fusion" for k in kernels).most_common()),
            "fusions": len(fusions),
            "fused_ops": sum(k.n_ops for k in fusions),
            "kernel_bytes": sum(k.bytes * k.multiplier for k in kernels),
            "unfused_bytes": sum(k.unfused_bytes * k.multiplier for k in kernels),
            "flops_once_per_body": sum(k.flops for k in kernels),
            "flops": sum(k.flops * k.multiplier for k in kernels),
        },
        "largest_fusions": _largest_fusions(fusions, top),
        "fusions": [
            {"name": k.name, "bytes": k.bytes, "unfused_bytes": k.unfused_bytes, "multiplier": k.multiplier}
            for k in fusions
        ],
        "classes": _class_table(kernels, per_step=True),
    }
    report["hlo"]["saved_bytes"] = report["hlo"]["unfused_bytes"] - report["hlo"]["kernel_bytes"]
    cost = compiled.cost_analysis() if hasattr(compiled, "cost_analysis") else None
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    if cost:
        report["cost_analysis"] = {
            "flops": float(cost.get("flops", 0.0)),
            "transcendentals": float(cost.get("transcendentals", 0.0)),
        }
    if jaxpr is not None:
        report["jaxpr"] = jaxpr_op_counts(jaxpr)
    schedule = async_collective_schedule(text)
    report["collectives"] = [
        {
            "computation": c.computation,
            "kind": c.kind,
            "name": c.name,
            "start": c.start,
            "done": c.done,
            "async": c.is_async,
            "overlapped_compute": c.overlapped_compute,
            "gradient": c.gradient,
            "backward_compute_after": c.backward_compute_after,
            "in_loop": c.in_loop,
            "before_backward_end": c.before_backward_end,
            **_position(text, c.computation, c.start),
        }
        for c in schedule
    ]
    return report


def _largest_fusions(fusions: list[Kernel], top: int) -> list[dict[str, Any]]:
    """The fusions that saved the most bytes per step, one per kind of work: fusions
    merging the same source functions (the optimizer update of each parameter,
    each layer's norm) are one entry with `similar` counting the others."""
    groups: dict[tuple, list[Kernel]] = defaultdict(list)
    for k in fusions:
        groups[(k.kind, tuple(sorted({label.split(":")[0] for label in k.ops})))].append(k)
    out = []
    for members in groups.values():
        k = max(members, key=lambda k: (k.saved_bytes * k.multiplier, k.n_ops))
        out.append(
            {
                "name": k.name,
                "kind": k.kind,
                "computation": k.computation,
                "multiplier": k.multiplier,
                "n_ops": k.n_ops,
                "bytes": k.bytes,
                "unfused_bytes": k.unfused_bytes,
                "saved_bytes": k.saved_bytes,
                "flops": k.flops,
                "ops": k.ops,
                "similar": len(members) - 1,
                "group_saved_bytes": sum(m.saved_bytes * m.multiplier for m in members),
            }
        )
    return sorted(out, key=lambda f: f["group_saved_bytes"], reverse=True)[:top]


def _position(text: str, comp: str, k: int) -> dict[str, int]:
    """How many compute ops of its computation run before and after position k."""
    comps, _ = parse_module(text)
    seq = list(comps.get(comp, {}).values())
    compute = [i for i, instr in enumerate(seq) if instr.op in COMPUTE_OPS]
    return {"compute_before": sum(i < k for i in compute), "compute_after": sum(i > k for i in compute)}


def _kib(b: float) -> str:
    return f"{b / 1024:,.1f} KiB"


def format_graph_report(report: dict[str, Any]) -> str:
    """The report as text: four short sections.

    >>> print(format_graph_report(graph_report(trainer.step_fn, jaxpr)))   # doctest: +SKIP
    == ops vs kernels ==
    ...
    """
    h = report["hlo"]
    lines = ["== ops vs kernels (per device) =="]
    if "jaxpr" in report:
        j = report["jaxpr"]
        lines.append(f"jaxpr primitive ops: {j['ops']} (per step, scan bodies x trips: {j['per_step']})")
    lines.append(
        f"HLO kernels:         {h['kernels']} (per step: {h['kernels_per_step']}); "
        f"{h['fusions']} fusions holding {h['fused_ops']} ops; "
        + ", ".join(f"{k} {v}" for k, v in h["by_kind"].items())
    )
    if "jaxpr" in report and h["kernels"]:
        j = report["jaxpr"]
        lines.append(
            f"ratio jaxpr ops / HLO kernels: {j['ops'] / h['kernels']:.2f} static, "
            f"{j['per_step'] / max(h['kernels_per_step'], 1):.2f} per step"
        )
    lines += [
        "",
        "== fusion: bytes read + written per step ==",
        f"as kernels: {_kib(h['kernel_bytes'])}; each op alone: {_kib(h['unfused_bytes'])}; "
        f"saved {_kib(h['saved_bytes'])} "
        f"({h['saved_bytes'] / max(h['unfused_bytes'], 1):.0%})",
        "largest fusions (bytes saved per step; one per set of source functions):",
    ]
    for f in report["largest_fusions"]:
        loop = f" x{f['multiplier']}" if f["multiplier"] > 1 else ""
        loop += f"; {f['similar']} similar" if f["similar"] else ""
        merged = ", ".join(f"{k}" + (f" x{v}" if v > 1 else "") for k, v in list(f["ops"].items())[:6])
        more = f", ... ({len(f['ops']) - 6} more)" if len(f["ops"]) > 6 else ""
        lines.append(
            f"  {f['name']} [{f['kind']}{loop}] {f['n_ops']} ops: reads+writes {_kib(f['bytes'])} "
            f"vs {_kib(f['unfused_bytes'])} alone"
        )
        lines.append(f"      merged: {merged}{more}")
    lines += [
        "",
        "== operator classes (per step) ==",
        f"  {'class':<14} {'ops':>6} {'kernels':>7} {'FLOPs':>11} {'unfused bytes':>14} {'FLOP/B':>7} "
        f"{'kernel bytes':>13} {'FLOP/B':>7}",
    ]
    total = {"ops": 0, "kernels": 0, "flops": 0.0, "unfused_bytes": 0, "kernel_bytes": 0}
    for cls, r in report["classes"].items():
        if not r["ops"] and not r["kernels"]:
            continue
        for key in total:
            total[key] += r[key]
        lines.append(
            f"  {cls:<14} {r['ops']:>6} {r['kernels']:>7} {r['flops']:>11.3e} {_kib(r['unfused_bytes']):>14} "
            f"{r['intensity_unfused']:>7.2f} {_kib(r['kernel_bytes']):>13} {r['intensity_kernel']:>7.2f}"
        )
    lines.append(
        f"  {'total':<14} {total['ops']:>6} {total['kernels']:>7} {total['flops']:>11.3e} "
        f"{_kib(total['unfused_bytes']):>14} {total['flops'] / max(total['unfused_bytes'], 1):>7.2f} "
        f"{_kib(total['kernel_bytes']):>13} {total['flops'] / max(total['kernel_bytes'], 1):>7.2f}"
    )
    if "cost_analysis" in report:
        c = report["cost_analysis"]
        lines.append(
            f"  FLOPs with a loop body once: {h['flops_once_per_body']:.4e}; cost_analysis flops + "
            f"transcendentals: {c['flops'] + c['transcendentals']:.4e}"
        )
    lines += ["", "== collectives in the schedule =="]
    if not report["collectives"]:
        lines.append("  none")
    for c in report["collectives"]:
        where = f"start {c['start']} done {c['done']}" if c["async"] else f"at {c['start']} (sync)"
        loop = f", in a {c['in_loop']}-trip loop body" if c["in_loop"] > 1 else ""
        grad = (
            ", gradient" + (" issued before the backward pass ends" if c["before_backward_end"] else "")
            if c["gradient"]
            else ""
        )
        lines.append(
            f"  {c['kind']:<18} {c['computation']}: {where}; {c['compute_before']} compute ops before, "
            f"{c['compute_after']} after, {c['overlapped_compute']} overlapped{grad}{loop}"
        )
    return "\n".join(lines)
