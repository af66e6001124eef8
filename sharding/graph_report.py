"""Graph insight: what XLA's compiler did to a traced program, read from its
jaxpr and its optimized HLO.

    >>> compiled = jax.jit(f).lower(x).compile()                    # doctest: +SKIP
    >>> report = graph_report(compiled, jax.make_jaxpr(f)(x))       # doctest: +SKIP
    >>> report["jaxpr"]["ops"], report["hlo"]["kernels"]             # doctest: +SKIP
    (862, 215)
    >>> print(format_graph_report(report))                           # doctest: +SKIP

Four readings of one compiled program:

- Ops vs kernels. The jaxpr's primitive equations (counted through the
  bodies of `jit`, `scan`, `cond`, `custom_vjp`, `remat`, ...; a container
  equation itself is not an op) against the kernels the optimized HLO
  launches: fusions, custom calls, collectives and the compute ops left
  unfused, in ENTRY and the computations it runs as control flow (while
  bodies and conditions, conditional branches, called computations). Static
  counts take every body once; "per step" multiplies a scan/while body by its
  trip count (`known_trip_count` in the HLO, `length` in the jaxpr), as
  `sharding/hlo.py` does for collectives.
- Fusions. Each fusion's own traffic, its operands plus its result ("reads +
  writes"), against the traffic its instructions would cause if each ran as
  its own kernel (the sum over the fused computation of every instruction's
  operand and result bytes; parameters, constants, tuples and bitcasts move
  nothing). The difference is the memory traffic fusion saved.
- Operator classes. Every executed operation (inside fusions and unfused) by
  class: elementwise, matmul (dot, convolution), reduction, data movement,
  collective, other. FLOPs follow XLA's HloCostAnalysis: a dot 2*M*N*K, an
  elementwise op one per output element (transcendentals included), a reduce
  one per input element; data movement none. "unfused bytes" are the
  operations' bytes as if each ran alone; "kernel bytes" give each kernel's
  real traffic to the class of its heaviest operation, so the two arithmetic
  intensities (FLOPs per byte) show what fusion bought.
- Collectives in the schedule: `sharding/overlap.py`'s reader of the
  scheduled HLO (start/done positions, compute between them).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter, defaultdict
from typing import Any

from meshwork.sharding.hlo import COLLECTIVES, _Instr, _multipliers, _nbytes, _parse_module
from meshwork.sharding.overlap import COMPUTE_OPS, async_collective_schedule

__all__ = ["OP_CLASSES", "Kernel", "classify", "format_graph_report", "graph_report", "hlo_kernels",
           "jaxpr_op_counts"]

OP_CLASSES = ("elementwise", "matmul", "reduction", "data movement", "collective", "other")

_MATMUL = {"dot", "convolution", "ragged-dot"}
_REDUCTION = {"reduce", "reduce-window", "select-and-scatter"}
_DATA = {"copy", "transpose", "broadcast", "reshape", "concatenate", "slice", "dynamic-slice",
         "dynamic-update-slice", "gather", "scatter", "pad", "reverse", "iota", "sort", "copy-start",
         "copy-done", "get-dimension-size", "set-dimension-size"}
_TRANSCENDENTAL = {"exponential", "exponential-minus-one", "log", "log-plus-one", "sqrt", "rsqrt", "cbrt",
                   "tanh", "logistic", "sine", "cosine", "tan", "erf", "power", "atan2"}
# Instructions that launch nothing: values renamed, grouped or passed in, and control flow (its body counts).
_NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
              "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id", "async-update",
              "async-done", "domain"}
# Inside a fusion: instructions that move no bytes of their own.
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}
_CONTROL = re.compile(r"\b(?:body|condition)=%?([^\s,{}]+)")
_CALLS = re.compile(r"\bcalls=%?([^\s,{}]+)")
_BRANCHES = re.compile(r"(?:branch_computations=\{([^}]*)\}|(?:true|false)_computation=%?([^\s,{}]+))")
_DIMS = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")


def classify(op: str) -> str:
    """The operator class of an HLO opcode (see OP_CLASSES).

    >>> classify("dot"), classify("multiply"), classify("reduce"), classify("transpose"), classify("all-gather")
    ('matmul', 'elementwise', 'reduction', 'data movement', 'collective')
    """
    base = op[:-len("-start")] if op.endswith("-start") else op
    if base in COLLECTIVES or base == "async":
        return "collective"
    if op in _MATMUL:
        return "matmul"
    if op in _REDUCTION:
        return "reduction"
    if op in _DATA:
        return "data movement"
    if op in ("custom-call", "fusion", "rng-get-and-update-state", "infeed", "outfeed", "send", "recv"):
        return "other"
    return "elementwise"


# ---------------------------------------------------------------------------
# jaxpr side.

def _sub_jaxprs(eqn) -> list:
    """The jaxprs an equation runs (scan/while bodies, cond branches, jit, custom_vjp, remat)."""
    out = []
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "eqns"):                       # core.Jaxpr
                out.append(v)
            elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):  # core.ClosedJaxpr
                out.append(v.jaxpr)
    return out


def jaxpr_op_counts(jaxpr) -> dict[str, Any]:
    """Primitive operations of a (closed) jaxpr: `ops` counts every body once,
    `per_step` runs a scan body `length` times and one branch of a cond (the
    largest); `by_primitive` holds the static counts.

    >>> import jax, jax.numpy as jnp
    >>> def f(x):
    ...     return jax.lax.scan(lambda c, _: (jnp.sin(c) * 2.0, None), x, None, length=4)[0].sum()
    >>> c = jaxpr_op_counts(jax.make_jaxpr(f)(1.0))
    >>> c["ops"], c["per_step"]  # sin, mul in the body (once or 4 times); convert, reduce_sum outside
    (4, 10)
    """
    by_primitive: Counter = Counter()

    def walk(jx, static: bool) -> int:
        per_step = 0
        for eqn in jx.eqns:
            subs = _sub_jaxprs(eqn)
            if not subs:
                per_step += 1
                if static:
                    by_primitive[eqn.primitive.name] += 1
                continue
            counts = [walk(s, static) for s in subs]
            if eqn.primitive.name == "cond":
                per_step += max(counts)
            else:
                per_step += int(eqn.params.get("length", 1)) * sum(counts)
        return per_step

    jx = getattr(jaxpr, "jaxpr", jaxpr)
    per_step = walk(jx, True)
    return {"ops": sum(by_primitive.values()), "per_step": per_step, "by_primitive": dict(by_primitive.most_common())}


# ---------------------------------------------------------------------------
# HLO side.

@dataclasses.dataclass
class Kernel:
    """One kernel of the optimized HLO (a fusion or an unfused instruction).

    `bytes`: its operands plus its result; `unfused_bytes`: what its
    instructions would move each alone (== bytes for an unfused op);
    `multiplier`: runs per execution of the program (loop trip counts);
    `ops`: {source function: primitive: count} of what it merged;
    `op_class`: the class of its heaviest operation.
    """
    name: str
    op: str
    kind: str
    computation: str
    multiplier: int
    op_class: str
    flops: float
    bytes: int
    unfused_bytes: int
    n_ops: int
    ops: dict[str, int]
    # [(class, flops, unfused bytes)] of each operation it runs, for the class table.
    parts: list[tuple[str, float, int]] = dataclasses.field(repr=False, default_factory=list)

    @property
    def saved_bytes(self) -> int:
        return self.unfused_bytes - self.bytes


class _Frames:
    """stack_frame_id -> the innermost Python function, from the module's tables."""

    def __init__(self, hlo_text: str):
        functions, locations, frames, section = {}, {}, {}, None
        for line in hlo_text.splitlines():
            if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
                section = line
                continue
            if line.startswith(("ENTRY", "%", "HloModule")) or not line.strip():
                section = None if line.strip() else section
                continue
            if section == "FunctionNames" and (m := re.match(r'^(\d+) "(.*)"$', line)):
                functions[m.group(1)] = m.group(2)
            elif section == "FileLocations" and (m := re.match(r"^(\d+) \{file_name_id=\d+ function_name_id=(\d+)", line)):
                locations[m.group(1)] = m.group(2)
            elif section == "StackFrames" and (m := re.match(r"^(\d+) \{file_location_id=(\d+)", line)):
                frames[m.group(1)] = m.group(2)
        self.name = {f: functions.get(locations.get(loc, ""), "") for f, loc in frames.items()}

    def label(self, instr: _Instr) -> str:
        """"Function: primitive" of an instruction, e.g. "RMSNorm.__call__: rsqrt"."""
        op_name = _OP_NAME.search(instr.attrs)
        prim = op_name.group(1).rsplit("/", 1)[-1] if op_name else instr.op
        frame = _FRAME.search(instr.attrs)
        fn = self.name.get(frame.group(1), "") if frame else ""
        fn = fn.split(".<locals>.")[-1] if fn else "?"
        return f"{fn}: {prim}"


def _op_flops(comps: dict, comp: str, instr: _Instr) -> float:
    """FLOPs of one instruction, by XLA's HloCostAnalysis conventions (see the module docstring)."""
    out_elems = sum(math.prod(d) for _, d in instr.shapes)
    cls = classify(instr.op)
    if instr.op == "dot":
        lhs = comps[comp].get(instr.operands[0]) if instr.operands else None
        m = _DIMS.search(instr.attrs)
        k = math.prod(lhs.shapes[0][1][int(i)] for i in m.group(1).split(",") if i) if lhs and m else 1
        return 2.0 * out_elems * k
    if instr.op == "convolution":
        rhs = comps[comp].get(instr.operands[1]) if len(instr.operands) > 1 else None
        labels = re.search(r"dim_labels=\w+_(\w+)->", instr.attrs)
        if rhs and labels and "o" in labels.group(1):
            dims = rhs.shapes[0][1]
            return 2.0 * out_elems * math.prod(dims) / max(dims[labels.group(1).index("o")], 1)
        return 2.0 * out_elems
    if cls == "reduction" or instr.op == "all-reduce":
        if instr.op == "all-reduce":
            return 0.0
        ins = [comps[comp][o] for o in instr.operands if o in comps[comp]]
        n_in = len(ins) // 2 or 1  # variadic reduce: inputs then init values
        return float(sum(math.prod(s[1]) for i in ins[:n_in] for s in i.shapes))
    if cls == "elementwise":
        return float(out_elems)
    return 0.0


def _bytes_of(comps: dict, comp: str, instr: _Instr) -> int:
    """Operand plus result bytes of an instruction, read from its operands' shapes."""
    instrs = comps[comp]
    reads = sum(_nbytes(s) for o in instr.operands if o in instrs for s in instrs[o].shapes)
    return reads + sum(map(_nbytes, instr.shapes))


def _sequential(comps: dict, entry: str) -> set[str]:
    """ENTRY and the computations it runs as control flow (not fusion bodies or reducers)."""
    seen, todo = set(), [entry]
    while todo:
        comp = todo.pop()
        if comp in seen or comp not in comps:
            continue
        seen.add(comp)
        for instr in comps[comp].values():
            names = _CONTROL.findall(instr.attrs) if instr.op == "while" else []
            if instr.op == "conditional":
                for group, single in _BRANCHES.findall(instr.attrs):
                    names += [n.strip().lstrip("%") for n in group.split(",") if n.strip()] + ([single] if single else [])
            if instr.op == "call":
                names += _CALLS.findall(instr.attrs)
            todo += names
    return seen


def hlo_kernels(hlo_text: str) -> list[Kernel]:
    """Every kernel of an optimized HLO module, in schedule order (see the module docstring).

    >>> hlo = '''HloModule m
    ... %fc (a: f32[8], b: f32[8]) -> f32[8] {
    ...   %a = f32[8]{0} parameter(0)
    ...   %b = f32[8]{0} parameter(1)
    ...   %m = f32[8]{0} multiply(%a, %b)
    ...   ROOT %e = f32[8]{0} exponential(%m)
    ... }
    ... ENTRY %main (x: f32[8], y: f32[8]) -> f32[8] {
    ...   %x = f32[8]{0} parameter(0)
    ...   %y = f32[8]{0} parameter(1)
    ...   ROOT %f = f32[8]{0} fusion(%x, %y), kind=kLoop, calls=%fc
    ... }'''
    >>> [(k.name, k.bytes, k.unfused_bytes, k.flops) for k in hlo_kernels(hlo)]   # 3x32 vs (3+2)x32
    [('f', 96, 160, 16.0)]
    """
    comps, entry = _parse_module(hlo_text)
    mult = _multipliers(comps, entry)
    frames = _Frames(hlo_text)
    kernels = []
    for comp in [c for c in comps if c in _sequential(comps, entry)]:
        for instr in comps[comp].values():
            if instr.op in _NO_KERNEL or instr.op.endswith("-done"):
                continue
            own_bytes = _bytes_of(comps, comp, instr)
            callee = next(iter(_CALLS.findall(instr.attrs)), None) if instr.op == "fusion" else None
            if callee in comps:
                parts, labels = [], Counter()
                for inner in comps[callee].values():
                    if inner.op in _FREE:
                        continue
                    parts.append((classify(inner.op), _op_flops(comps, callee, inner), _bytes_of(comps, callee, inner)))
                    labels[frames.label(inner)] += 1
                kind = re.search(r"kind=(\w+)", instr.attrs)
                kind = kind.group(1) if kind else "fusion"
            else:
                parts = [(classify(instr.op), _op_flops(comps, comp, instr), own_bytes)]
                labels, kind = Counter([frames.label(instr)]), instr.op
            by_class = defaultdict(float)
            for cls, fl, b in parts:
                by_class[cls] += fl
            # The heaviest class: matmul over reduction over elementwise, unless one of them has all FLOPs.
            present = {p[0] for p in parts}
            op_class = next((c for c in ("collective", "matmul", "reduction", "elementwise", "data movement")
                             if c in present), "other")
            kernels.append(Kernel(
                name=instr.name, op=instr.op, kind=kind, computation=comp, multiplier=mult.get(comp, 1),
                op_class=op_class, flops=sum(p[1] for p in parts), bytes=own_bytes,
                unfused_bytes=sum(p[2] for p in parts) if callee in comps else own_bytes,
                n_ops=len(parts), ops=dict(labels.most_common()), parts=parts))
    return kernels


# ---------------------------------------------------------------------------
# The report.

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
        "fusions": [{"name": k.name, "bytes": k.bytes, "unfused_bytes": k.unfused_bytes, "multiplier": k.multiplier}
                    for k in fusions],
        "classes": _class_table(kernels, per_step=True),
    }
    report["hlo"]["saved_bytes"] = report["hlo"]["unfused_bytes"] - report["hlo"]["kernel_bytes"]
    cost = compiled.cost_analysis() if hasattr(compiled, "cost_analysis") else None
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    if cost:
        report["cost_analysis"] = {"flops": float(cost.get("flops", 0.0)),
                                   "transcendentals": float(cost.get("transcendentals", 0.0))}
    if jaxpr is not None:
        report["jaxpr"] = jaxpr_op_counts(jaxpr)
    schedule = async_collective_schedule(text)
    report["collectives"] = [
        {"computation": c.computation, "kind": c.kind, "name": c.name, "start": c.start, "done": c.done,
         "async": c.is_async, "overlapped_compute": c.overlapped_compute, "gradient": c.gradient,
         "backward_compute_after": c.backward_compute_after, "in_loop": c.in_loop,
         "before_backward_end": c.before_backward_end, **_position(text, c.computation, c.start)}
        for c in schedule]
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
        out.append({"name": k.name, "kind": k.kind, "computation": k.computation, "multiplier": k.multiplier,
                    "n_ops": k.n_ops, "bytes": k.bytes, "unfused_bytes": k.unfused_bytes,
                    "saved_bytes": k.saved_bytes, "flops": k.flops, "ops": k.ops, "similar": len(members) - 1,
                    "group_saved_bytes": sum(m.saved_bytes * m.multiplier for m in members)})
    return sorted(out, key=lambda f: f["group_saved_bytes"], reverse=True)[:top]


def _position(text: str, comp: str, k: int) -> dict[str, int]:
    """How many compute ops of its computation run before and after position k."""
    comps, _ = _parse_module(text)
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
    lines.append(f"HLO kernels:         {h['kernels']} (per step: {h['kernels_per_step']}); "
                 f"{h['fusions']} fusions holding {h['fused_ops']} ops; "
                 + ", ".join(f"{k} {v}" for k, v in h["by_kind"].items()))
    if "jaxpr" in report and h["kernels"]:
        j = report["jaxpr"]
        lines.append(f"ratio jaxpr ops / HLO kernels: {j['ops'] / h['kernels']:.2f} static, "
                     f"{j['per_step'] / max(h['kernels_per_step'], 1):.2f} per step")
    lines += ["", "== fusion: bytes read + written per step ==",
              f"as kernels: {_kib(h['kernel_bytes'])}; each op alone: {_kib(h['unfused_bytes'])}; "
              f"saved {_kib(h['saved_bytes'])} "
              f"({h['saved_bytes'] / max(h['unfused_bytes'], 1):.0%})",
              "largest fusions (bytes saved per step; one per set of source functions):"]
    for f in report["largest_fusions"]:
        loop = f" x{f['multiplier']}" if f["multiplier"] > 1 else ""
        loop += f"; {f['similar']} similar" if f["similar"] else ""
        merged = ", ".join(f"{k}" + (f" x{v}" if v > 1 else "") for k, v in list(f["ops"].items())[:6])
        more = f", ... ({len(f['ops']) - 6} more)" if len(f["ops"]) > 6 else ""
        lines.append(f"  {f['name']} [{f['kind']}{loop}] {f['n_ops']} ops: reads+writes {_kib(f['bytes'])} "
                     f"vs {_kib(f['unfused_bytes'])} alone")
        lines.append(f"      merged: {merged}{more}")
    lines += ["", "== operator classes (per step) ==",
              f"  {'class':<14} {'ops':>6} {'kernels':>7} {'FLOPs':>11} {'unfused bytes':>14} {'FLOP/B':>7} "
              f"{'kernel bytes':>13} {'FLOP/B':>7}"]
    total = {"ops": 0, "kernels": 0, "flops": 0.0, "unfused_bytes": 0, "kernel_bytes": 0}
    for cls, r in report["classes"].items():
        if not r["ops"] and not r["kernels"]:
            continue
        for key in total:
            total[key] += r[key]
        lines.append(f"  {cls:<14} {r['ops']:>6} {r['kernels']:>7} {r['flops']:>11.3e} {_kib(r['unfused_bytes']):>14} "
                     f"{r['intensity_unfused']:>7.2f} {_kib(r['kernel_bytes']):>13} {r['intensity_kernel']:>7.2f}")
    lines.append(f"  {'total':<14} {total['ops']:>6} {total['kernels']:>7} {total['flops']:>11.3e} "
                 f"{_kib(total['unfused_bytes']):>14} {total['flops'] / max(total['unfused_bytes'], 1):>7.2f} "
                 f"{_kib(total['kernel_bytes']):>13} {total['flops'] / max(total['kernel_bytes'], 1):>7.2f}")
    if "cost_analysis" in report:
        c = report["cost_analysis"]
        lines.append(f"  FLOPs with a loop body once: {h['flops_once_per_body']:.4e}; cost_analysis flops + "
                     f"transcendentals: {c['flops'] + c['transcendentals']:.4e}")
    lines += ["", "== collectives in the schedule =="]
    if not report["collectives"]:
        lines.append("  none")
    for c in report["collectives"]:
        where = f"start {c['start']} done {c['done']}" if c["async"] else f"at {c['start']} (sync)"
        loop = f", in a {c['in_loop']}-trip loop body" if c["in_loop"] > 1 else ""
        grad = ", gradient" + (" issued before the backward pass ends" if c["before_backward_end"] else "") \
            if c["gradient"] else ""
        lines.append(f"  {c['kind']:<18} {c['computation']}: {where}; {c['compute_before']} compute ops before, "
                     f"{c['compute_after']} after, {c['overlapped_compute']} overlapped{grad}{loop}")
    return "\n".join(lines)
