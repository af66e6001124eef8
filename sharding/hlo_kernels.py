"""The kernels an optimized HLO module launches, and what each computes and moves.

A kernel is a fusion, a custom call, a collective or a compute op left
unfused, in ENTRY or a computation it runs as control flow (while bodies and
conditions, conditional branches, called computations); its `multiplier` is
how many times it runs per execution (loop trip counts, `known_trip_count`).

- Fusion traffic. Each fusion's own traffic, its operands plus its result
  ("reads + writes"), against the traffic its instructions would cause if
  each ran as its own kernel (the sum over the fused computation of every
  instruction's operand and result bytes; parameters, constants, tuples and
  bitcasts move nothing). The difference is the memory traffic fusion saved.
- Operator classes. Every operation (inside fusions and unfused) has a class:
  elementwise, matmul (dot, convolution), reduction, data movement,
  collective, other. FLOPs follow XLA's HloCostAnalysis: a dot 2*M*N*K, an
  elementwise op one per output element (transcendentals included), a reduce
  one per input element; data movement none. A kernel's class is that of its
  heaviest operation.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter, defaultdict

from meshwork.sharding.hlo import COLLECTIVES
from meshwork.sharding.hlo_parse import Instr, multipliers, parse_module, shape_bytes

__all__ = ["OP_CLASSES", "Kernel", "classify", "hlo_kernels"]

OP_CLASSES = ("elementwise", "matmul", "reduction", "data movement", "collective", "other")

_MATMUL = {"dot", "convolution", "ragged-dot"}
_REDUCTION = {"reduce", "reduce-window", "select-and-scatter"}
_DATA = {
    "copy",
    "transpose",
    "broadcast",
    "reshape",
    "concatenate",
    "slice",
    "dynamic-slice",
    "dynamic-update-slice",
    "gather",
    "scatter",
    "pad",
    "reverse",
    "iota",
    "sort",
    "copy-start",
    "copy-done",
    "get-dimension-size",
    "set-dimension-size",
}
# Instructions that launch nothing: values renamed, grouped or passed in, and control flow (its body counts).
_NO_KERNEL = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "while",
    "conditional",
    "call",
    "after-all",
    "add-dependency",
    "opt-barrier",
    "partition-id",
    "replica-id",
    "async-update",
    "async-done",
    "domain",
}
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
    base = op[: -len("-start")] if op.endswith("-start") else op
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
            elif section == "FileLocations" and (
                m := re.match(r"^(\d+) \{file_name_id=\d+ function_name_id=(\d+)", line)
            ):
                locations[m.group(1)] = m.group(2)
            elif section == "StackFrames" and (m := re.match(r"^(\d+) \{file_location_id=(\d+)", line)):
                frames[m.group(1)] = m.group(2)
        self.name = {f: functions.get(locations.get(loc, ""), "") for f, loc in frames.items()}

    def label(self, instr: Instr) -> str:
        """ "Function: primitive" of an instruction, e.g. "RMSNorm.__call__: rsqrt"."""
        op_name = _OP_NAME.search(instr.attrs)
        prim = op_name.group(1).rsplit("/", 1)[-1] if op_name else instr.op
        frame = _FRAME.search(instr.attrs)
        fn = self.name.get(frame.group(1), "") if frame else ""
        fn = fn.split(".<locals>.")[-1] if fn else "?"
        return f"{fn}: {prim}"


def _op_flops(comps: dict, comp: str, instr: Instr) -> float:
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


def _bytes_of(comps: dict, comp: str, instr: Instr) -> int:
    """Operand plus result bytes of an instruction, read from its operands' shapes."""
    instrs = comps[comp]
    reads = sum(shape_bytes(s) for o in instr.operands if o in instrs for s in instrs[o].shapes)
    return reads + sum(map(shape_bytes, instr.shapes))


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
                    names += [n.strip().lstrip("%") for n in group.split(",") if n.strip()] + (
                        [single] if single else []
                    )
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
    comps, entry = parse_module(hlo_text)
    mult = multipliers(comps, entry)
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
            for cls, fl, _b in parts:
                by_class[cls] += fl
            # The heaviest class: matmul over reduction over elementwise, unless one of them has all FLOPs.
            present = {p[0] for p in parts}
            op_class = next(
                (c for c in ("collective", "matmul", "reduction", "elementwise", "data movement") if c in present),
                "other",
            )
            kernels.append(
                Kernel(
                    name=instr.name,
                    op=instr.op,
                    kind=kind,
                    computation=comp,
                    multiplier=mult.get(comp, 1),
                    op_class=op_class,
                    flops=sum(p[1] for p in parts),
                    bytes=own_bytes,
                    unfused_bytes=sum(p[2] for p in parts) if callee in comps else own_bytes,
                    n_ops=len(parts),
                    ops=dict(labels.most_common()),
                    parts=parts,
                )
            )
    return kernels
