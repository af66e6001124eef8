"""Where a compiled step's time goes: XLA's own per-op trace, grouped by model part and op kind.

`profile_steps` runs a jitted function under `jax.profiler.trace` and reads the trace back with
`jax.profiler.ProfileData` (no TensorBoard needed). Every executed HLO op is an event carrying
its instruction name; the compiled HLO text maps that name to its opcode and to the JAX name
stack it came from (`metadata={op_name=...}`), and the name scopes the model sets
(`embed`, `attention_core`, `lm_head`, `loss`, `optimizer`, `nan_guard`) say which part of the
step emitted it. What is left is the host's share: the step's wall time minus the time some
op was running (the union of the op intervals), i.e. dispatch and gaps between ops.

Op times are summed over the threads that ran them: on a CPU the runtime may run independent
ops at once, so the parts can add up to more than the busy time.
"""

from __future__ import annotations

import dataclasses
import glob
import re
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable

import jax

# (part, name-stack scope that marks it), first match wins: attention inside a layer is
# attention, not "layers"; the optimizer runs inside the NaN guard's branch.
PARTS = (
    ("embedding", "embed"),
    ("attention core", "attention_core"),
    ("LM head + loss", "lm_head"),
    ("LM head + loss", "loss"),
    ("optimizer", "optimizer"),
    ("NaN guard", "nan_guard"),
)
KINDS = ("matmul", "collective", "copy/convert", "elementwise/other")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all", "collective-broadcast")
MOVES = (
    "copy",
    "convert",
    "transpose",
    "bitcast-convert",
    "dynamic-update-slice",
    "dynamic-slice",
    "pad",
    "concatenate",
    "slice",
)
# Ops that only contain other ops (their bodies' ops are events of their own): counted once, inside.
CONTAINERS = ("while", "conditional", "call", "async-start", "async-done", "async-update")

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


@dataclasses.dataclass(frozen=True)
class Instruction:
    opcode: str
    op_name: str  # the JAX name stack, e.g. jit(step)/transpose(jvp(attention_core))/dot_general
    calls: tuple[str, ...]  # computations it calls (a fusion's body)
    operands: tuple[str, ...] = ()  # the instructions it reads


def _balanced(text: str) -> int:
    """The index just past the parenthesized group `text` starts with."""
    depth = 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return i + 1
    return len(text)


def _opcode_and_operands(rhs: str) -> tuple[str, tuple[str, ...]]:
    """The opcode and operand names of `type opcode(operands), attrs`, where type may be a
    parenthesized tuple."""
    rhs = rhs[_balanced(rhs) :] if rhs.startswith("(") else (rhs.split(" ", 1)[1] if " " in rhs else rhs)
    opcode, _, rest = rhs.strip().partition("(")
    group = rest[: _balanced("(" + rest) - 1]
    return opcode.strip(), tuple(re.findall(r"%([\w.\-]+)", group))


def parse_hlo(text: str) -> tuple[dict[str, Instruction], dict[str, set[str]]]:
    """(instruction name -> Instruction, computation name -> the opcodes in it) of HLO text."""
    instructions: dict[str, Instruction] = {}
    computations: dict[str, set[str]] = defaultdict(set)
    current = None
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m and "=" in line.split("(", 1)[0]:
            name, rhs = m.groups()
            opcode, operands = _opcode_and_operands(rhs)
            op_name = re.search(r'op_name="([^"]*)"', rhs)
            calls = re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", rhs)
            instructions[name] = Instruction(opcode, op_name.group(1) if op_name else "", tuple(calls), operands)
            if current is not None:
                computations[current].add(opcode)
            continue
        c = _COMPUTATION.match(line)
        if c:
            current = c.group(1)
    return _named_after_users(instructions), computations


def _named_after_users(instructions: dict[str, Instruction]) -> dict[str, Instruction]:
    """Instructions XLA created without a name stack (a dot it rewrote, say the LM head's weight
    gradient accumulated in the chunked loss's scan) take the one of their nearest user that has
    one: they exist to compute what that user reads. The search stays inside the op's own
    computation (an op only a loop body's ROOT reads keeps no name); among equally near named
    users the first in the text wins."""
    users: dict[str, list[str]] = defaultdict(list)
    for name, instr in instructions.items():
        for operand in instr.operands:
            users[operand].append(name)
    out = dict(instructions)
    for name, instr in instructions.items():
        if instr.op_name:
            continue
        frontier = list(dict.fromkeys(users[name]))
        seen = {name, *frontier}
        while frontier:  # breadth first; each op visited once (diamonds of unnamed ops are common)
            named = next((u for u in frontier if instructions[u].op_name), None)
            if named is not None:
                out[name] = dataclasses.replace(instr, op_name=instructions[named].op_name)
                break
            frontier = list(dict.fromkeys(u for f in frontier for u in users[f] if u not in seen))
            seen.update(frontier)
    return out


def classify(instr: Instruction, computations: dict[str, set[str]]) -> tuple[str, str]:
    """(part, kind) of one instruction: the part from its name stack, the kind from its opcode
    (a fusion is a matmul when its body holds a dot or convolution, a move when it holds only
    copies, converts and reshapes)."""
    stack = instr.op_name.split("/", 1)[-1]  # without the jitted function's own name: jit(loss)/...
    part = next((p for p, scope in PARTS if re.search(rf"\b{scope}\b", stack)), None)
    if part is None:
        part = (
            "layers (projections, MLP, norms)"
            if "while/body" in instr.op_name or "checkpoint" in instr.op_name
            else "other"
        )
    ops = {instr.opcode}
    if instr.opcode == "fusion":
        ops = set().union(*(computations.get(c, set()) for c in instr.calls)) or {"fusion"}
    base = {op.removesuffix("-start").removesuffix("-done") for op in ops}
    if base & {"dot", "convolution"} and not base & set(COLLECTIVES):
        kind = "matmul"
    elif base & set(COLLECTIVES):
        kind = "collective"
    elif base <= set(MOVES) | {
        "bitcast",
        "reshape",
        "broadcast",
        "parameter",
        "constant",
        "tuple",
        "get-tuple-element",
    }:
        kind = "copy/convert"
    else:
        kind = "elementwise/other"
    return part, kind


@dataclasses.dataclass
class StepProfile:
    steps: int
    devices: int
    wall_s: float  # per step, measured around the traced steps
    busy_s: float  # per step and device: the time at least one op was running
    by_part_kind: dict[tuple[str, str], float]  # seconds per step and device, summed over threads
    top_ops: list[tuple[str, float, str, str]]  # (instruction, seconds per step and device, part, kind)

    @property
    def host_gap_s(self) -> float:
        return max(self.wall_s - self.busy_s, 0.0)

    def table(self) -> str:
        """A markdown table: parts by rows, op kinds by columns, milliseconds per step."""
        parts = sorted(
            {p for p, _ in self.by_part_kind},
            key=lambda p: -sum(v for (q, _), v in self.by_part_kind.items() if q == p),
        )
        total = sum(self.by_part_kind.values())
        lines = ["| part | " + " | ".join(KINDS) + " | total ms | share |", "|---" * (len(KINDS) + 3) + "|"]
        for p in parts:
            row = [self.by_part_kind.get((p, k), 0.0) * 1e3 for k in KINDS]
            lines.append(
                f"| {p} | " + " | ".join(f"{v:.1f}" for v in row) + f" | {sum(row):.1f} | "
                f"{sum(row) / 1e3 / total:.0%} |"
            )
        col = [sum(v for (_, k), v in self.by_part_kind.items() if k == kind) * 1e3 for kind in KINDS]
        lines.append("| **all ops** | " + " | ".join(f"{v:.1f}" for v in col) + f" | {total * 1e3:.1f} | 100% |")
        lines.append(
            f"\nstep wall {self.wall_s * 1e3:.1f} ms; ops running {self.busy_s * 1e3:.1f} ms "
            f"(summed op time / busy = {total / max(self.busy_s, 1e-12):.2f}: ops run concurrently); "
            f"host gap {self.host_gap_s * 1e3:.1f} ms"
        )
        return "\n".join(lines)


def _union_length(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def profile_steps(
    fn: Callable,
    args_for_step: Iterable[tuple],
    compiled_text: str,
    *,
    steps: int,
    n_devices: int = 1,
    module: str | None = None,
) -> StepProfile:
    """Trace `steps` calls of `fn(*args)` (args from `args_for_step`, whose results feed nothing:
    a train step threads its state through `args_for_step`'s generator) and group the op time.

    `compiled_text`: the compiled program's HLO (`jitted.lower(...).compile().as_text()`), to
    name each op's part and kind. `module`: only ops of this HLO module (default: the module
    the text declares). Call `fn` once before: a compile inside the trace counts as wall time."""
    instructions, computations = parse_hlo(compiled_text)
    module = module or re.search(r"HloModule\s+([\w.\-]+)", compiled_text).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        it = iter(args_for_step)
        jax.profiler.start_trace(tmp)
        t0 = time.perf_counter()
        for _ in range(steps):
            jax.block_until_ready(fn(*next(it)))
        wall = (time.perf_counter() - t0) / steps
        jax.profiler.stop_trace()
        files = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        if not files:
            raise RuntimeError(f"jax.profiler wrote no trace under {tmp}; is another trace running?")
        data = jax.profiler.ProfileData.from_file(files[0])
        by_part_kind: dict[tuple[str, str], float] = defaultdict(float)
        by_op: dict[str, float] = defaultdict(float)
        intervals: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for plane in data.planes:
            for line in plane.lines:
                for ev in line.events:
                    stats = dict(ev.stats)
                    if stats.get("hlo_module") != module or "hlo_op" not in stats:
                        continue
                    instr = instructions.get(stats["hlo_op"])
                    if instr is None or instr.opcode in CONTAINERS:
                        continue
                    by_part_kind[classify(instr, computations)] += ev.duration_ns
                    by_op[stats["hlo_op"]] += ev.duration_ns
                    intervals[stats.get("device_ordinal", 0)].append(
                        (int(ev.start_ns), int(ev.start_ns + ev.duration_ns))
                    )
    per = 1e-9 / (steps * n_devices)
    busy = sum(_union_length(v) for v in intervals.values()) * per
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:30]
    return StepProfile(
        steps,
        n_devices,
        wall,
        busy,
        {k: v * per for k, v in by_part_kind.items()},
        [(name, t * per, *classify(instructions[name], computations)) for name, t in top],
    )
