"""A small parser of optimized HLO text: computations of instructions, the
call graph between them, and how many times each one runs per execution.

`sharding/hlo.py` (collectives), `sharding/hlo_kernels.py` (kernels, fusions)
and `sharding/overlap.py` (the schedule) read compiled programs through it.

    >>> comps, entry = parse_module('''HloModule m
    ... ENTRY %main (p: f32[8]) -> f32[8] {
    ...   %p = f32[8]{0} parameter(0)
    ...   ROOT %n = f32[8]{0} negate(%p)
    ... }''')
    >>> entry, [(i.op, i.operands) for i in comps[entry].values()]
    ('main', [('parameter', []), ('negate', ['p'])])
    >>> shape_bytes(comps[entry]["n"].shapes[0])
    32
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Callable

__all__ = [
    "Instr",
    "branches",
    "callees",
    "host_memory_bytes",
    "multipliers",
    "param_index",
    "parse_module",
    "shape_bytes",
]

_ITEMSIZE = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "s4": 0.5,
    "u4": 0.5,
}
_SHAPE = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPERAND = re.compile(r"%([^\s,(){}]+)")
_CALLEE = re.compile(r"\b(?:body|condition|calls|to_apply|true_computation|false_computation)=%?([^\s,{}]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


@dataclasses.dataclass
class Instr:
    """One instruction, `%name = type op(operands), attrs`."""

    name: str
    type: str  # result type, e.g. "f32[8,64]{1,0}" or "(f32[8], s32[])"
    op: str
    operands: list[str]
    args: str  # the raw operand text, e.g. "0" for `parameter(0)`
    attrs: str  # everything after the operand list

    @property
    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(element type, dims) of each array in the result type."""
        return _shapes(self.type)


def param_index(instr: Instr) -> int:
    """i of `parameter(i)`."""
    return int(instr.args) if instr.args.strip().isdigit() else -1


def _shapes(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
    """Array shapes in an HLO type, in order (a tuple type gives several)."""
    return [
        (dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _SHAPE.findall(type_str) if dt in _ITEMSIZE
    ]


def shape_bytes(shape: tuple[str, tuple[int, ...]]) -> int:
    """Bytes of one (element type, dims) array shape."""
    return int(math.prod(shape[1]) * _ITEMSIZE[shape[0]])


_HOST_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]\{[^}]*S\(5\)[^}]*\}")  # memory space 5: pinned host


def host_memory_bytes(hlo_text: str) -> tuple[int, int]:
    """(argument, output) bytes per device that the compiled module's entry layout keeps in host
    memory (its `S(5)` arrays), read from the module's first line.

    >>> host_memory_bytes("HloModule m, entry_computation_layout={(f32[4]{0:S(5)}, f32[2]{0})->f32[4]{0:S(5)}}")
    (16, 16)
    """
    header = hlo_text.split("\n", 1)[0]
    start = header.index("entry_computation_layout={") + len("entry_computation_layout={")
    depth, end = 0, start
    for end, ch in enumerate(header[start:], start):  # noqa: B007 (read after the loop) to the closing brace
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth < 0:
            break
    args, outs = header[start:end].split(")->", 1)

    def total(text: str) -> int:
        return sum(
            shape_bytes((dt, tuple(int(d) for d in dims.split(",") if d))) for dt, dims in _HOST_ARRAY.findall(text)
        )

    return total(args), total(outs)


def _closing(text: str, start: int) -> int:
    """Index just past the parenthesis that closes the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    name, rest = m.groups()
    if rest.startswith("("):  # tuple type; may hold `/*index=5*/` comments
        end = _closing(rest, 0)
    else:
        end = rest.find(" ")
    type_str, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    close = _closing(rest, op.end() - 1)
    args = rest[op.end() : close - 1]
    return Instr(name, type_str, op.group(1), _OPERAND.findall(args), args, rest[close:])


def parse_module(hlo_text: str) -> tuple[dict[str, dict[str, Instr]], str]:
    """{computation: {instruction name: instruction}} (in order), and the ENTRY's name."""
    comps: dict[str, dict[str, Instr]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and not line.startswith("HloModule"):
                current = comps.setdefault(m.group(2), {})
                entry = m.group(2) if m.group(1) else entry
            continue
        if line.startswith("}"):
            current = None
            continue
        instr = _parse_instr(line)
        if instr:
            current[instr.name] = instr
    return comps, entry


def callees(instr: Instr) -> list[str]:
    """The computations an instruction calls (loop body and condition, fusion,
    reducer, conditional branches), by name."""
    names = _CALLEE.findall(instr.attrs)
    for group in _BRANCHES.findall(instr.attrs):
        names += [n.strip().lstrip("%") for n in group.split(",") if n.strip()]
    return names


def branches(instr: Instr) -> list[str]:
    """A conditional's alternative computations (index or predicate form), in order."""
    if instr.op != "conditional":
        return []
    names = [n.strip().lstrip("%") for group in _BRANCHES.findall(instr.attrs) for n in group.split(",") if n.strip()]
    pred = re.findall(r"\b(true|false)_computation=%?([^\s,{}]+)", instr.attrs)
    return names + [name for _, name in sorted(pred, key=lambda kv: kv[0] != "true")]


def multipliers(
    comps: dict[str, dict[str, Instr]], entry: str, branch_cost: Callable[[str], float] | None = None
) -> dict[str, int]:
    """How many times each computation runs per execution of ENTRY.

    A while body runs trip-count times per run of its caller; every other
    callee once per call. Summed over call sites (HLO's call graph is a DAG).
    A conditional runs one of its branches: without `branch_cost` every branch
    is counted as if it ran (each gets the caller's count); with it, only the
    branch of highest cost does (an upper bound on what one execution runs).
    """
    mult: dict[str, int] = defaultdict(int)

    def walk(comp: str, m: int, depth: int = 0) -> None:
        mult[comp] += m
        if depth > 64:
            return
        for instr in comps.get(comp, {}).values():
            if instr.op in ("async-update", "async-done"):
                continue  # the same wrapped computation as its async-start
            trip = _TRIP.search(instr.attrs) if instr.op == "while" else None
            alternatives = [b for b in branches(instr) if b in comps] if branch_cost is not None else []
            chosen = max(alternatives, key=branch_cost) if alternatives else None
            for callee in callees(instr):
                if callee in comps and (chosen is None or callee not in alternatives or callee == chosen):
                    walk(callee, m * (int(trip.group(1)) if trip else 1), depth + 1)

    if entry:
        walk(entry, 1)
    return dict(mult)
