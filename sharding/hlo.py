"""Collectives read from optimized HLO text: what a compiled program sends, per step.

    >>> compiled = jax.jit(f).lower(x).compile()           # doctest: +SKIP
    >>> collective_summary(compiled.as_text())["all-reduce"] # doctest: +SKIP
    {'count': 1, 'bytes': 16384, 'payload_bytes': 16384}

How the collectives are counted:

- Per train step. Scanned layers compile to a `while` loop; a collective in
  its body runs once per iteration, so counts and bytes are multiplied by the
  product of the enclosing loops' `known_trip_count` (a loop without one
  counts once). Called computations (`calls=`, `to_apply=`) run with their
  caller's multiplier. A conditional runs one branch per execution: it counts
  as its branch with the most collective bytes, an upper bound where the
  branches differ (a pipeline schedule's switch between forward and backward
  steps counts every time step as its heaviest operation).
- Bytes are what one device sends under ring algorithms, for a per-device
  buffer of S bytes in a group of g devices: all-reduce 2(g-1)/g * S,
  all-gather (g-1)/g * S_out, reduce-scatter (g-1)/g * S_in, all-to-all
  (g-1)/g * S, collective-permute S. `payload_bytes` keeps S itself (S_out
  for all-gather, S_in otherwise).
- Reduce-scatters that are all-reduces on CPU. XLA's CPU pipeline has no pass
  that creates reduce-scatters: GSPMD's reduce-scatter stays an `all-reduce`
  whose every result is consumed only by a `dynamic-slice` (often fused into
  a `fusion`) at an offset computed from `partition-id`, keeping 1/s of the
  elements. On GPU and TPU XLA rewrites that pair into one reduce-scatter, so
  it is reported as one here, with `matched_as="all-reduce + dynamic-slice"`.
  When s is smaller than the group size g (hybrid sharding: reduce over
  data x fsdp = 8 devices, keep 1/fsdp = 1/4), it is reported as what the
  GPU/TPU program does: a reduce-scatter over s devices plus an all-reduce
  over g/s devices of the 1/s shard. The parts of a combined (tuple-shaped)
  all-reduce are classified one by one, so one HLO instruction may show up
  as one reduce-scatter and one all-reduce.
- Native `reduce-scatter` ops and async `*-start` ops (counted once, by their
  start) are read as they are.
- By scope. Each collective keeps the `op_name` of its HLO metadata, the
  `jax.named_scope` path of the code that made it, so `scope="optimizer"` keeps
  what the train step's optimizer update sends (`in_scope`; an op XLA combined
  from several counts as inside only when all of its parts were).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

from meshwork.sharding.hlo_parse import (
    _TRIP,
    Instr,
    branches,
    callees,
    multipliers,
    param_index,
    parse_module,
    shape_bytes,
)

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# An HLO instruction `%name = type op(...)`; async pairs count once, by their -start.
_OP = re.compile(r"=\s*[^=]*?\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_MATCHED_RS = "all-reduce + dynamic-slice"
_OP_NAME = re.compile(r'op_name="([^"]*)"')

# Ops that move or relabel a value without changing which elements it holds.
_PASS_THROUGH = {"bitcast", "reshape", "copy", "transpose"}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective as a GPU/TPU program would run it.

    `payload_bytes`: per-device buffer S (all-gather: its output); `sent_bytes`:
    what one device sends per execution under a ring algorithm; `multiplier`:
    executions per run of the program (loop trip counts); `matched_as`: the HLO
    op it was read from ("all-reduce + dynamic-slice" for a reduce-scatter
    that XLA:CPU left as an all-reduce followed by a slice).
    """

    kind: str
    group_size: int
    payload_bytes: int
    multiplier: int
    computation: str
    name: str
    matched_as: str
    op_name: str = ""
    """The op's `metadata={op_name=...}`: jit name and named scopes, e.g. `jit(step)/optimizer/psum`."""

    @property
    def sent_bytes(self) -> float:
        return _ring_bytes(self.kind, self.group_size, self.payload_bytes)


def _ring_bytes(kind: str, g: int, payload: int) -> float:
    if kind == "collective-permute":
        return float(payload)
    if g <= 1:
        return 0.0
    return (2.0 if kind == "all-reduce" else 1.0) * (g - 1) / g * payload


def _split_top(text: str, sep: str) -> list[str]:
    """`text` split at each `sep` outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def _paths(op_name: str) -> list[list[str]]:
    """The scope paths an op_name stands for: one, or one per part of an op XLA combined from
    several, which it names `common/prefix/(rest_1:rest_2:...)`."""
    parts = _split_top(op_name, "/")
    for i, part in enumerate(parts):
        if part.startswith("(") and part.endswith(")") and len(_split_top(part[1:-1], ":")) > 1:
            rest = "/".join(parts[i + 1 :])
            return [
                parts[:i] + path
                for alt in _split_top(part[1:-1], ":")
                for path in _paths(alt + ("/" + rest if rest else ""))
            ]
    return [parts]


def in_scope(op_name: str, scope: str) -> bool:
    """Whether an op named `op_name` ran inside `jax.named_scope` path `scope` (one name, or nested
    ones joined by "/"); an op combined from several must have every part inside.

    >>> in_scope("jit(step)/cond/branch_1_fun/optimizer/shard_map/psum", "optimizer/shard_map")
    True
    >>> in_scope("jit(step)/(optimizer/reduce_sum:jvp(loss)/reduce_sum)", "optimizer")
    False
    """
    want = scope.split("/")
    n = len(want)
    paths = _paths(op_name)
    return bool(op_name) and all(any(p[i : i + n] == want for i in range(len(p) - n + 1)) for p in paths)


def _group_size(attrs: str, n_devices: int) -> int:
    """Devices per replica group, from any of the three printed formats."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", attrs)
    if m:  # mesh['axis_0'=4,'axis_1'=2], device_ids=(...) {'axis_0'}: product of the braced axes
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        size = 1
        for axis, sub in re.findall(r"'([^']+)'(:\(\d+\)\d+)?", m.group(2)):
            size *= int(sub.rsplit(")", 1)[1]) if sub else sizes.get(axis, 1)
        return size
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", attrs)
    if m:  # [4,2]<=[8]: 4 groups of 2
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=\{\{([^}]*)\}", attrs)
    if m:  # {{0,1},{2,3}}: the first group's size
        return len(m.group(1).split(","))
    return n_devices  # replica_groups={} or absent: everyone


class _Module:
    def __init__(self, hlo_text: str):
        self.comps, self.entry = parse_module(hlo_text)
        m = re.search(r"num_partitions=(\d+)", hlo_text)
        self.n_devices = int(m.group(1)) if m else 1
        self._cost: dict[str, float] = {}
        self.mult = multipliers(self.comps, self.entry, branch_cost=self.collective_payload)
        self.users: dict[str, dict[str, list[Instr]]] = {}
        self.callers: dict[str, list[tuple[str, Instr]]] = defaultdict(list)
        for cname, instrs in self.comps.items():
            users: dict[str, list[Instr]] = defaultdict(list)
            for instr in instrs.values():
                for o in instr.operands:
                    users[o].append(instr)
                for callee in callees(instr):
                    self.callers[callee].append((cname, instr))
            self.users[cname] = users
        self._partition_memo: dict[tuple[str, str], bool] = {}
        self._visiting: set[tuple[str, str]] = set()

    def collective_payload(self, comp: str, depth: int = 0) -> float:
        """Bytes of collective results one run of `comp` produces, through what it calls (loops
        times their trip counts, a conditional as its heaviest branch): how the branches of a
        conditional are told apart."""
        if comp in self._cost:
            return self._cost[comp]
        total = 0.0
        for instr in self.comps.get(comp, {}).values():
            kind = instr.op[: -len("-start")] if instr.op.endswith("-start") else instr.op
            if kind in COLLECTIVES:
                total += sum(map(shape_bytes, instr.shapes))
            if depth > 64 or instr.op in ("async-update", "async-done"):
                continue
            alternatives = [b for b in branches(instr) if b in self.comps]
            if alternatives:
                total += max(self.collective_payload(b, depth + 1) for b in alternatives)
                continue
            trip = _TRIP.search(instr.attrs) if instr.op == "while" else None
            total += sum(self.collective_payload(c, depth + 1) for c in callees(instr) if c in self.comps) * (
                int(trip.group(1)) if trip else 1
            )
        self._cost[comp] = total
        return total

    def operand_shapes(self, comp: str, instr: Instr) -> list[tuple[str, tuple[int, ...]]]:
        """The operands' shapes (a `-start` op's result also holds its output)."""
        instrs = self.comps[comp]
        if all(o in instrs for o in instr.operands):
            return [s for o in instr.operands for s in instrs[o].shapes]
        return instr.shapes

    # -- is a value derived from partition-id? (GSPMD's slices are; a scan's are not)
    def from_partition(self, comp: str, name: str, depth: int = 0) -> bool:
        key = (comp, name)
        if key in self._partition_memo:
            return self._partition_memo[key]
        if depth > 200 or key in self._visiting:
            return False  # HLO has no cycles; this only bounds the recursion
        self._visiting.add(key)
        self._partition_memo[key] = found = self._from_partition(comp, name, depth)
        self._visiting.discard(key)
        return found

    def _from_partition(self, comp: str, name: str, depth: int) -> bool:
        instr = self.comps[comp].get(name)
        if instr is None:
            return False
        if instr.op in ("partition-id", "replica-id"):
            return True
        if instr.op == "parameter":  # a fusion's or call's parameter i: the caller's operand i
            i = param_index(instr)
            return any(
                i < len(call.operands) and self.from_partition(caller, call.operands[i], depth + 1)
                for caller, call in self.callers.get(comp, ())
                if call.op != "while"
            )
        if instr.op == "get-tuple-element" and instr.operands:
            src = self.comps[comp].get(instr.operands[0])
            if src is not None and src.op == "parameter":
                # Element k of a loop's carry: trace the loop's initial value.
                k = int(re.search(r"index=(\d+)", instr.attrs).group(1))
                for caller, call in self.callers.get(comp, ()):
                    if call.op == "while" and call.operands:
                        init = self.comps[caller].get(call.operands[0])
                        if init is not None and init.op == "tuple" and k < len(init.operands):
                            if self.from_partition(caller, init.operands[k], depth + 1):
                                return True
                        elif self.from_partition(caller, call.operands[0], depth + 1):
                            return True
                return False
        return any(self.from_partition(comp, o, depth + 1) for o in instr.operands)

    # -- the elements a value keeps after partition slicing
    def _slice_fraction(self, comp: str, name: str, elems: int, depth: int = 0) -> int | None:
        """s if every use of `name` is a partition-id dynamic-slice keeping 1/s of
        its `elems` elements (looking through bitcasts and into fusions), else None."""
        users = self.users[comp].get(name, [])
        if not users or depth > 8:
            return None
        fractions = set()
        for u in users:
            if u.op in _PASS_THROUGH:
                s = self._slice_fraction(comp, u.name, elems, depth + 1)
            elif u.op == "dynamic-slice" and u.operands and u.operands[0] == name:
                kept = sum(math.prod(d) for _, d in u.shapes)
                s = elems // kept if kept and elems % kept == 0 and kept < elems else None
                if s and not any(self.from_partition(comp, o) for o in u.operands[1:]):
                    s = None  # a loop's or the user's own slice, not GSPMD's
            elif u.op == "fusion":
                callee = next(iter(callees(u)), None)
                param = self._param_named(callee, u.operands.index(name)) if callee in self.comps else None
                s = self._slice_fraction(callee, param, elems, depth + 1) if param else None
            else:
                s = None
            if s is None:
                return None
            fractions.add(s)
        return fractions.pop() if len(fractions) == 1 else None

    def _param_named(self, comp: str, index: int) -> str | None:
        for instr in self.comps[comp].values():
            if instr.op == "parameter" and param_index(instr) == index:
                return instr.name
        return None

    def _results(self, comp: str, instr: Instr) -> list[str | None]:
        """The value names holding each element of an op's result (tuple: its
        get-tuple-elements; None for an element nobody reads)."""
        shapes = instr.shapes
        if not instr.type.startswith("("):
            return [instr.name]
        names: list[str | None] = [None] * len(shapes)
        for u in self.users[comp].get(instr.name, []):
            m = re.search(r"index=(\d+)", u.attrs)
            if u.op != "get-tuple-element" or not m:
                return [None] * len(shapes)  # the tuple escapes whole: no per-element reading
            names[int(m.group(1))] = u.name
        return names

    def collectives(self) -> list[Collective]:
        found = []
        for comp, instrs in self.comps.items():
            mult = self.mult.get(comp, 0)
            if mult == 0:
                continue  # not reachable from ENTRY (e.g. a reducer's clone)
            for instr in instrs.values():
                kind = instr.op[: -len("-start")] if instr.op.endswith("-start") else instr.op
                if kind not in COLLECTIVES:
                    continue
                g = _group_size(instr.attrs, self.n_devices)
                shapes = self.operand_shapes(comp, instr)

                op_name = _OP_NAME.search(instr.attrs)

                def make(k, group, nbytes, how=instr.op, comp=comp, mult=mult, name=instr.name, op=op_name):
                    return Collective(k, group, int(nbytes), mult, comp, name, how, op.group(1) if op else "")

                if kind == "all-gather":  # payload: the gathered output, g inputs' worth
                    out = instr.shapes if instr.op == kind else [sh for sh in shapes for _ in range(g)]
                    found.append(make(kind, g, sum(map(shape_bytes, out))))
                elif kind == "all-reduce" and not instr.op.endswith("-start"):
                    found += self._split_all_reduce(comp, instr, g, shapes, make)
                else:
                    found.append(make(kind, g, sum(map(shape_bytes, shapes))))
        return found

    def _split_all_reduce(self, comp, instr, g, shapes, make) -> list[Collective]:
        """Each element of a (combined) all-reduce, classified as plain
        all-reduce or as reduce-scatter by its consumers; one entry per class."""
        by_s: dict[int, int] = defaultdict(int)
        for shape, value in zip(shapes, self._results(comp, instr)):
            s = self._slice_fraction(comp, value, math.prod(shape[1])) if value else None
            # A slice finer than the group (s > g) or not dividing it is no reduce-scatter over it.
            by_s[s if s and s > 1 and g % s == 0 else 1] += shape_bytes(shape)
        out = []
        for s, nbytes in sorted(by_s.items()):
            if s == 1:
                out.append(make("all-reduce", g, nbytes))
                continue
            out.append(make("reduce-scatter", s, nbytes, _MATCHED_RS))
            if g > s:  # hybrid: the 1/s shards still need summing over the other g/s devices
                out.append(make("all-reduce", g // s, nbytes // s, _MATCHED_RS))
        return out


def list_collectives(hlo_text: str, scope: str | None = None) -> list[Collective]:
    """Every collective in optimized HLO, as GPU/TPU would run it (see the
    module docstring for how all-reduce + dynamic-slice becomes reduce-scatter);
    with `scope`, only those made inside that `jax.named_scope` (`in_scope`).

    >>> cs = list_collectives(jax.jit(f).lower(x).compile().as_text())  # doctest: +SKIP
    >>> [(c.kind, c.group_size, c.multiplier) for c in cs]             # doctest: +SKIP
    [('all-reduce', 2, 1)]
    """
    found = _Module(hlo_text).collectives()
    return found if scope is None else [c for c in found if in_scope(c.op_name, scope)]


def collective_summary(hlo_text: str, scope: str | None = None) -> dict[str, dict[str, int]]:
    """{kind: {"count", "bytes", "payload_bytes"}} per run of the program, for
    all five kinds: counts and bytes sent per device, loop trip counts included
    (with `scope`: of the collectives made inside that named scope).

    >>> hlo = '''HloModule m, num_partitions=4
    ... ENTRY %main (p: f32[8]) -> f32[8] {
    ...   %p = f32[8]{0} parameter(0)
    ...   ROOT %ar = f32[8]{0} all-reduce(%p), replica_groups=[2,2]<=[4], to_apply=%add
    ... }'''
    >>> collective_summary(hlo)["all-reduce"]   # 2 (g-1)/g * 32 bytes, g = 2
    {'count': 1, 'bytes': 32, 'payload_bytes': 32}
    """
    out = {k: {"count": 0, "bytes": 0, "payload_bytes": 0} for k in COLLECTIVES}
    for c in list_collectives(hlo_text, scope):
        out[c.kind]["count"] += c.multiplier
        out[c.kind]["bytes"] += round(c.sent_bytes * c.multiplier)
        out[c.kind]["payload_bytes"] += c.payload_bytes * c.multiplier
    return out


def collective_counts(hlo_text: str) -> dict[str, int]:
    """Number of each collective op in optimized HLO text, as written (async
    start/done counted once; no loop multipliers, no reduce-scatter matching).

    >>> collective_counts(compiled.as_text())["all-reduce"]  # doctest: +SKIP
    1
    """
    counts = dict.fromkeys(COLLECTIVES, 0)
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if m:
            counts[m.group(1)] += 1
    return counts
