"""Compute-communication overlap: the XLA options that schedule collectives
asynchronously, and a reader of the compiled schedule that shows whether they do.

    >>> opts = compiler_options(cfg.comm, "gpu")                         # doctest: +SKIP
    >>> compiled = jax.jit(step).lower(state, batch).compile(compiler_options=opts)  # doctest: +SKIP
    >>> gradients_issued_before_backward_end(compiled.as_text())        # doctest: +SKIP
    True

The options (names checked against jaxlib 0.10.2 and 0.12.0: each one below
compiles; a name XLA does not know raises "No such compile option"):

- `xla_gpu_enable_latency_hiding_scheduler` (default false). XLA's
  latency-hiding scheduler (LHS) orders the program so that each async
  collective's `-start` is issued as early as its operands allow and its
  `-done` as late as its users allow, with compute in between, using a cost
  model of both. Without it, collectives are still async on GPU but tend to
  sit next to their producers and consumers, overlapping little.
- Async collectives. On GPU every collective is async by default (a
  `*-start`/`*-done` pair, run on a separate CUDA stream); the old switches
  `xla_gpu_enable_async_all_reduce` / `_all_gather` / `_reduce_scatter` are
  gone (this jaxlib rejects them). The one switch left is the inverse,
  `xla_gpu_disable_async_collectives`, a comma list of `ALLREDUCE`,
  `ALLGATHER`, `REDUCESCATTER`, `COLLECTIVEPERMUTE`, `ALLTOALL`, ... (or
  `ALLCOLLECTIVES`): the "overlap off" arm of a comparison.
  `xla_gpu_enable_highest_priority_async_stream` (default true) gives the
  collectives' stream priority over compute kernels.
- `xla_gpu_enable_pipelined_all_reduce` / `_all_gather` / `_reduce_scatter`
  (defaults false / false / true): the collective pipeliner moves a scanned
  layer's collective into the neighbouring loop iteration, so layer i's
  gradient reduce-scatter overlaps layer i-1's backward and layer i+1's
  weights are all-gathered during layer i (FSDP prefetch). Newer jaxlibs
  replace these booleans by enums, `xla_gpu_pipeline_all_reduce` / ... =
  `COLLECTIVE_PIPELINING_MODE_ON` (jaxlib 0.12 rejects the booleans);
  `compiler_options` passes the enums where this jaxlib knows them.
- Combine thresholds, the JAX analogue of DDP's gradient buckets:
  `xla_gpu_all_reduce_combine_threshold_bytes`,
  `xla_gpu_all_gather_combine_threshold_bytes`,
  `xla_gpu_reduce_scatter_combine_threshold_bytes` (and
  `xla_gpu_collective_combine_threshold_count`). XLA's combiner passes merge
  independent small collectives into one tuple-shaped collective up to this
  many bytes. DDP's `bucket_cap_mb` makes the same trade: few large messages
  (bandwidth-efficient, less per-call latency) against many small ones (the
  first can start as soon as the last layers' gradients exist, so more of the
  communication hides behind the rest of the backward pass). A bucket as large
  as the model means one all-reduce after the backward pass: no overlap.
- TPU: libtpu's options are not in the open-source `DebugOptions`, so this
  jaxlib rejects `xla_tpu_*` names when compiling for CPU (and they are only
  passed for TPU here). `xla_tpu_enable_latency_hiding_scheduler` is the
  TPU scheduler switch (on by default in recent libtpu); the data-parallel
  gradient overlap flags (`xla_tpu_enable_data_parallel_all_reduce_opt`,
  `xla_tpu_data_parallel_opt_different_sized_ops`) and the async collective
  fusion flags are libtpu-version dependent: pass them through
  `comm.xla_options` after checking them on the TPU. None of the TPU names is
  verified here (no TPU).

What the CPU backend does (jaxlib 0.10.2, 8 fake devices; tests/test_overlap.py):

- No async collectives. XLA:CPU's first pass is `AsyncCollectiveReplacer`
  (`async-collective-replacer`, async pairs -> synchronous ops; see an
  `--xla_dump_hlo_pass_re=.*` dump) and it has no `AsyncCollectiveCreator`;
  no compiled CPU program here contains a `*-start`/`*-done` collective,
  whatever the options. The `xla_gpu_*` options above are accepted when compiling for
  CPU (they are fields of the shared `DebugOptions`) and ignored.
- The CPU scheduler: `xla_cpu_scheduler_type` =
  `CPU_SCHEDULER_TYPE_DEFAULT` | `_MEMORY_OPTIMIZED` |
  `_CONCURRENCY_OPTIMIZED` (the DEFAULT schedule is the concurrency-optimized
  one in this jaxlib: identical HLO). The CPU runtime's thunk executor runs
  thunks whose buffers do not conflict at the same time, so a synchronous
  collective can still run beside independent compute; the HLO text shows
  the order, not that concurrency.
- Combine thresholds are not honoured. XLA:CPU runs its own
  `cpu-all-reduce-combiner` with a fixed threshold (unbounded bytes, 256
  operands): 300 independent all-reduces compile to 2 (256 + 44) whatever
  the byte or count thresholds say. All-gathers are not combined. The
  combiner is the only bucket knob on CPU: `xla_disable_hlo_passes=
  "cpu-all-reduce-combiner"` (through `comm.xla_options`) leaves one
  all-reduce per gradient, and the schedule then interleaves them with the
  backward pass (a data-parallel 6-layer MLP: 12 all-reduces, 10 of them
  issued before the backward pass ends, instead of 1 combined all-reduce
  after its last op).
- Scanned layers: in lm_tiny's data-parallel step each layer's gradients are
  all-reduced inside the backward loop's body, once per layer, so they are
  issued before the backward pass ends even on CPU; the embedding and norm
  gradients follow in one combined all-reduce after the loop. (XLA:CPU
  leaves reduce-scatters as all-reduce + dynamic-slice; `sharding/hlo.py`
  counts them as the reduce-scatters GPU and TPU run. The schedule here
  lists ops as written.)

How to read a schedule. An optimized module printed with
`is_scheduled=true` lists each computation's instructions in execution order
(ENTRY, and a `while` body per scanned loop). `async_collective_schedule`
walks that order: an async pair is a `<kind>-start` / `<kind>-done` (or an
`async-start` / `async-done` wrapping a computation that holds the
collective, as GPU prints reduce-scatter and all-to-all), and the compute
ops (fusions, dots, convolutions, custom-calls, loops and calls) between its
start and done are the compute it can hide behind. A synchronous collective
has start == done and overlaps nothing in the schedule. The backward pass is
what JAX names `transpose(jvp(...))` in each op's `metadata={op_name=...}`
(without such metadata every compute op counts as backward). A gradient
collective (an all-reduce or reduce-scatter of the backward pass) "is issued
before the backward pass ends" when backward compute that does not read its
result is scheduled after its start in the same computation, or when it sits
in the body of a backward loop that runs more than once (layer i's
collective precedes layer i-1's compute). Issued early is what a schedule
can show; whether the transfer then runs beside that compute is the
runtime's business (async pairs on GPU/TPU; nothing overlaps a synchronous
collective on GPU).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import jax

from meshwork.sharding.hlo import COLLECTIVES
from meshwork.sharding.hlo_parse import callees, parse_module

__all__ = [
    "COMPUTE_OPS",
    "ScheduledCollective",
    "async_collective_schedule",
    "compiler_options",
    "format_schedule",
    "gradients_issued_before_backward_end",
]

# HLO ops that do the work a collective can hide behind (a loop or call: all of its body).
COMPUTE_OPS = frozenset({"fusion", "dot", "convolution", "custom-call", "while", "conditional", "call"})
_REDUCTIONS = ("all-reduce", "reduce-scatter")
# JAX names the backward pass in op_name metadata: jit(step)/transpose(jvp())/dot_general.
_BACKWARD = "transpose(jvp"
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_BODY = re.compile(r"\bbody=%?([^\s,{}]+)")

_GPU_OVERLAP = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_enable_highest_priority_async_stream": True,
}
_PIPELINED = ("all_reduce", "all_gather", "reduce_scatter")
_GPU_THRESHOLDS = (
    "xla_gpu_all_reduce_combine_threshold_bytes",
    "xla_gpu_all_gather_combine_threshold_bytes",
    "xla_gpu_reduce_scatter_combine_threshold_bytes",
)
_PLATFORMS = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


def compiler_options(comm_cfg: Any, platform: str) -> dict[str, bool | int | str]:
    """XLA options for `jit(f).lower(...).compile(compiler_options=...)` from a
    `comm:` config section (`overlap`, `combine_threshold_bytes`, `xla_options`).

    Only options of `platform`'s own backend are set ("cpu", "gpu"/"cuda"/
    "rocm", "tpu": e.g. `jax.devices()[0].platform`); `comm_cfg.xla_options`
    is merged last and wins. With `overlap` off and no threshold the result is
    `{}` plus the overrides: XLA's defaults. The CPU backend has no async
    collectives and ignores combine thresholds (see the module docstring), so
    for CPU `overlap` only pins the concurrency-optimized scheduler.

    >>> from types import SimpleNamespace
    >>> comm = SimpleNamespace(overlap=True, combine_threshold_bytes=2**25, xla_options={})
    >>> compiler_options(comm, "cuda")["xla_gpu_all_reduce_combine_threshold_bytes"]
    33554432
    >>> compiler_options(comm, "cpu")
    {'xla_cpu_scheduler_type': 'CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED'}
    """
    kind = _PLATFORMS.get(platform.lower())
    if kind is None:
        raise ValueError(f"compiler_options: unknown platform {platform!r}; use one of {sorted(_PLATFORMS)}")
    opts: dict[str, bool | int | str] = {}
    if kind == "gpu":
        if comm_cfg.overlap:
            opts.update(_GPU_OVERLAP, **_gpu_pipeliner_options())
        if comm_cfg.combine_threshold_bytes is not None:
            opts.update(dict.fromkeys(_GPU_THRESHOLDS, int(comm_cfg.combine_threshold_bytes)))
    elif kind == "tpu":
        if comm_cfg.overlap:
            opts["xla_tpu_enable_latency_hiding_scheduler"] = True
    elif comm_cfg.overlap:  # cpu
        opts["xla_cpu_scheduler_type"] = "CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED"
    opts.update(comm_cfg.xla_options or {})
    return opts


@functools.cache
def _gpu_pipeliner_options() -> dict[str, bool | str]:
    """The collective pipeliner's "on" switches, named as this jaxlib's DebugOptions name them.

    Only a compile tells which names a jaxlib accepts, so one tiny program is compiled
    (once per process) with the enum names; a jaxlib without them gets the booleans.
    """
    enums = {f"xla_gpu_pipeline_{kind}": "COLLECTIVE_PIPELINING_MODE_ON" for kind in _PIPELINED}
    try:
        jax.jit(lambda x: x + 1).lower(0.0).compile(compiler_options=enums)
    except jax.errors.JaxRuntimeError:
        return {f"xla_gpu_enable_pipelined_{kind}": True for kind in _PIPELINED}
    return enums


# ---------------------------------------------------------------------------
# Reading the schedule.


@dataclasses.dataclass(frozen=True)
class ScheduledCollective:
    """One collective in a scheduled computation.

    `start`/`done`: positions in the computation's instruction sequence (equal
    for a synchronous collective); `overlapped_compute`: compute ops scheduled
    strictly between them; `backward_compute_after`: backward compute ops
    scheduled after `start` in the same computation that do not read its
    result (work it could hide behind); `in_loop`: trip count of
    the while loop whose body holds it (1 outside loops or when unknown);
    `gradient`: an all-reduce / reduce-scatter of the backward pass.
    """

    computation: str
    kind: str
    name: str
    done_name: str | None
    is_async: bool
    start: int
    done: int
    overlapped_compute: int
    backward_compute_after: int
    gradient: bool
    in_loop: int
    body_has_backward: bool

    @property
    def before_backward_end(self) -> bool:
        """Issued while backward compute is still to run (see the module docstring)."""
        return self.backward_compute_after > 0 or (self.in_loop > 1 and self.body_has_backward)


def _op_name(instr) -> str:
    m = _OP_NAME.search(instr.attrs)
    return m.group(1) if m else ""


def _collective_kind(op: str, comps: dict, callees: list[str]) -> tuple[str | None, bool]:
    """(collective kind, is an async start) of an op; (None, False) for anything else."""
    if op in COLLECTIVES:
        return op, False
    if op.endswith("-start") and op[: -len("-start")] in COLLECTIVES:
        return op[: -len("-start")], True
    if op == "async-start":  # a wrapped collective: async-start(...), calls=%wrapped_reduce_scatter
        for callee in callees:
            for inner in comps.get(callee, {}).values():
                if inner.op in COLLECTIVES:
                    return inner.op, True
    return None, False


def async_collective_schedule(hlo_text: str) -> list[ScheduledCollective]:
    """Every collective of a scheduled (optimized) HLO module, in schedule order,
    with the compute it overlaps and where it sits relative to the backward pass.

    >>> hlo = '''HloModule m, is_scheduled=true
    ... ENTRY %main (p: f32[8]) -> f32[8] {
    ...   %p = f32[8]{0} parameter(0)
    ...   %ars = f32[8]{0} all-reduce-start(%p), to_apply=%add, metadata={op_name="transpose(jvp())/dot"}
    ...   %f = f32[8]{0} fusion(%p), kind=kLoop, calls=%fc, metadata={op_name="transpose(jvp())/mul"}
    ...   ROOT %ard = f32[8]{0} all-reduce-done(%ars)
    ... }'''
    >>> [(c.kind, c.start, c.done, c.overlapped_compute, c.before_backward_end)
    ...  for c in async_collective_schedule(hlo)]
    [('all-reduce', 1, 3, 1, True)]
    """
    comps, _ = parse_module(hlo_text)
    # Computations that are not sequences of their own: what async ops wrap.
    wrapped = {c for instrs in comps.values() for i in instrs.values() if i.op.startswith("async-") for c in callees(i)}
    trips: dict[str, int] = {}
    for instrs in comps.values():
        for i in instrs.values():
            if i.op == "while" and (b := _BODY.search(i.attrs)):
                t = _TRIP.search(i.attrs)
                trips[b.group(1)] = int(t.group(1)) if t else 1
    any_backward = any(_BACKWARD in name for name in _OP_NAME.findall(hlo_text))
    found = []
    for cname, instrs in comps.items():
        if cname in wrapped:
            continue
        seq = list(instrs.values())
        compute = [k for k, i in enumerate(seq) if i.op in COMPUTE_OPS]
        # Without op_name metadata every compute op counts as backward.
        backward = [k for k in compute if not any_backward or _BACKWARD in _op_name(seq[k])]
        dones = _done_positions(seq)
        for k, instr in enumerate(seq):
            kind, is_async = _collective_kind(instr.op, comps, callees(instr))
            if kind is None:
                continue
            done = dones.get(instr.name, k) if is_async else k
            # Backward work still to run that does not wait for this collective's result.
            users = _dependents(seq, k)
            found.append(
                ScheduledCollective(
                    computation=cname,
                    kind=kind,
                    name=instr.name,
                    done_name=seq[done].name if is_async and done != k else None,
                    is_async=is_async,
                    start=k,
                    done=done,
                    overlapped_compute=sum(k < c < done for c in compute),
                    backward_compute_after=sum(c > k and seq[c].name not in users for c in backward),
                    gradient=kind in _REDUCTIONS and (not any_backward or _BACKWARD in _op_name(instr)),
                    in_loop=trips.get(cname, 1),
                    body_has_backward=bool(backward),
                )
            )
    return found


def _dependents(seq: list, k: int) -> set[str]:
    """Names of the instructions after position k that read seq[k]'s result,
    directly or through others (a scheduled sequence is in dependency order)."""
    deps = {seq[k].name}
    for i in seq[k + 1 :]:
        if any(o in deps for o in i.operands):
            deps.add(i.name)
    return deps


def _done_positions(seq: list) -> dict[str, int]:
    """{start name: position of its done}, following `async-update` chains."""
    pos = {i.name: k for k, i in enumerate(seq)}
    origin: dict[str, str] = {}
    out = {}
    for k, i in enumerate(seq):
        if i.op == "async-update" or i.op.endswith("-done"):
            if not i.operands:
                continue
            src = i.operands[0]
            root = origin.get(src, src)
            if i.op == "async-update":
                origin[i.name] = root
            elif root in pos:
                out[root] = k
    return out


def gradients_issued_before_backward_end(hlo_text: str) -> bool:
    """True if some gradient collective (an all-reduce or reduce-scatter of the
    backward pass) is issued while backward compute is still to run: before the
    last backward compute op of its computation, or inside a backward loop body
    that runs more than once. False for one combined all-reduce after the
    backward pass, as XLA:CPU's all-reduce combiner leaves a data-parallel step.

    >>> gradients_issued_before_backward_end(compiled.as_text())  # doctest: +SKIP
    False
    """
    return any(c.gradient and c.before_backward_end for c in async_collective_schedule(hlo_text))


def format_schedule(entries: list[ScheduledCollective]) -> str:
    """One line per collective: where it starts and ends, what it overlaps.

    >>> print(format_schedule(async_collective_schedule(compiled.as_text())))  # doctest: +SKIP
    main.0_spmd  all-reduce      async  start 41 done 57  overlaps 9 compute ops  gradient, 6 backward ops after
    """
    lines = []
    for c in entries:
        mode = "async" if c.is_async else "sync "
        where = f"start {c.start} done {c.done}" if c.is_async else f"at {c.start}"
        loop = f", in a {c.in_loop}-trip loop body" if c.in_loop > 1 else ""
        grad = "gradient, " if c.gradient else ""
        lines.append(
            f"{c.computation}  {c.kind:<18} {mode}  {where}  overlaps {c.overlapped_compute} compute ops  "
            f"{grad}{c.backward_compute_after} backward ops after{loop}"
        )
    return "\n".join(lines)
