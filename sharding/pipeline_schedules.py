"""Pipeline schedules: what every stage does at every time step, as a table.

The model is cut into P stages and the batch into M microbatches. A *schedule
table* says, for every time step and every stage, which operation that stage
runs on which microbatch (and, for interleaved schedules, which of its model
chunks); `sharding/pipeline.py` executes any table `check_schedule` accepts,
and the planner reads the same tables (`src/meshwork/perf/planner_pipeline.py`).

Time is counted in table steps: one step runs one operation of one stage (or
of one model chunk, for interleaved), and every operation takes one step.

- `gpipe`: all M forwards, then all M backwards (BWD, input and weight
  gradients together); every stage keeps M stage inputs. Idle (P-1)/(M+P-1).
- `1f1b` (PipeDream-Flush): stage s runs P-1-s warm-up forwards, then
  alternates one forward and one backward, then drains the backwards; a stage
  keeps at most P stage inputs, whatever M. Idle (P-1)/(M+P-1) (the same with
  a backward twice as long as a forward: idle time (P-1)(F+B) of M(F+B)).
- `interleaved` (Megatron-LM's virtual pipeline, `virtual_stages=v`): the
  layers are cut into v*P model chunks and device s holds chunks s, s+P,
  s+2P, ...; chunk c*P+s-1's output goes to chunk c*P+s, and device P-1's
  chunk c to device 0's chunk c+1 (the ppermutes become a ring). Forwards go
  in groups of P microbatches per chunk (Megatron's order), with P-1-s +
  (v-1)P warm-up forwards on device s. One step is one chunk's forward or
  backward: idle (P-1)/(v*M+P-1). M must be a multiple of P. The stash holds
  chunk inputs (each of a stage input's size): more of them than 1F1B's
  (10 against 4 for P=4, M=8, v=2), the price of the smaller bubble when
  stages recompute from their inputs.
- `zb-h1` (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): each backward
  is split into BWD_INPUT (B, the input cotangent the previous stage waits
  for) and BWD_WEIGHT (W, the weight gradient). Stage s runs 1F1B's order of
  F and B and defers each W by s backwards, so W's fill 1F1B's drain bubble.
  With F, B and W one step each, the table is 3M + P-1 steps long: idle
  (P-1)/(3M+P-1), the paper's (P-1)(F+B-W) bubble, a third of 1F1B's
  (P-1)(F+B+W). A deferred W keeps its stage input and its output cotangent;
  the stash of stage inputs is 1F1B's (min(P, M) per stage), and at most
  P-1 cotangents wait for their W (the last stage recomputes its loss).

    >>> table = schedule_table("1f1b", n_stages=4, n_microbatches=8)
    >>> table.op.shape, idle_fraction(table) == 3 / 11, stash_size(table)
    ((22, 4), True, 4)
    >>> idle_fraction(schedule_table("zb-h1", 4, 8)) == 3 / 27
    True
    >>> idle_fraction(schedule_table("interleaved", 4, 8, virtual_stages=2)) == 3 / 19
    True
"""

from __future__ import annotations

import dataclasses

import numpy as np

IDLE, FWD, BWD, BWD_INPUT, BWD_WEIGHT = 0, 1, 2, 3, 4
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
_LETTER = {FWD: "F", BWD: "B", BWD_INPUT: "B", BWD_WEIGHT: "W"}


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """A static pipeline schedule: what every stage does at every time step.

    `op[t, s]` is IDLE, FWD, BWD (fused backward), BWD_INPUT or BWD_WEIGHT;
    `mb[t, s]` the microbatch it works on and `chunk[t, s]` the model chunk
    (0 unless `virtual_stages` > 1), both -1 when idle. All are numpy int32
    arrays of shape (T, P). Model chunk c on stage s is virtual stage c*P + s.
    """

    kind: str
    n_stages: int
    n_microbatches: int
    op: np.ndarray
    mb: np.ndarray
    chunk: np.ndarray | None = None
    virtual_stages: int = 1

    def __post_init__(self):
        if self.chunk is None:
            object.__setattr__(self, "chunk", np.where(np.asarray(self.op) != IDLE, 0, -1).astype(np.int32))

    @property
    def n_steps(self) -> int:
        return self.op.shape[0]

    def __str__(self) -> str:
        """One row per stage: F/B/W and the microbatch, `.c` the chunk when v > 1, `.` idle."""

        def cell(o, m, c):
            if o == IDLE:
                return "."
            return _LETTER[int(o)] + str(m) + (f".{c}" if self.virtual_stages > 1 else "")

        cells = [[cell(*x) for x in zip(self.op[:, s], self.mb[:, s], self.chunk[:, s])] for s in range(self.n_stages)]
        width = max([3] + [len(x) + 1 for row in cells for x in row])
        return "\n".join(f"stage {s}: " + " ".join(x.rjust(width) for x in row) for s, row in enumerate(cells))


def _stage_order(
    kind: str, stage: int, n_stages: int, n_microbatches: int, virtual_stages: int = 1
) -> list[tuple[int, int, int]]:
    """The order in which one stage runs its operations, as (op, microbatch, chunk)."""
    P, M, v = n_stages, n_microbatches, virtual_stages
    if kind == "gpipe":
        return [(FWD, m, 0) for m in range(M)] + [(BWD, m, 0) for m in range(M)]
    if kind == "interleaved":
        # Megatron's order: P microbatches through chunk 0, the same P through
        # chunk 1, ..., then the next P; backwards walk the chunks in reverse.
        n = v * M
        fwd = [(FWD, (i // (P * v)) * P + i % P, (i // P) % v) for i in range(n)]
        bwd = [(BWD, (i // (P * v)) * P + i % P, v - 1 - (i // P) % v) for i in range(n)]
        warm = min(P - 1 - stage + (v - 1) * P, n)
    else:
        # 1F1B: enough warm-up forwards that the first backward reaches this
        # stage just as its last warm-up forward is done; after that each
        # backward frees the stash slot the next forward takes, so at most P
        # inputs are live.
        b_op = BWD_INPUT if kind == "zb-h1" else BWD
        fwd = [(FWD, m, 0) for m in range(M)]
        bwd = [(b_op, m, 0) for m in range(M)]
        warm = min(n_stages - 1 - stage, M)
    order = fwd[:warm]
    for i in range(len(fwd) - warm):
        order += [fwd[warm + i], bwd[i]]
    order += bwd[len(fwd) - warm :]
    if kind != "zb-h1":
        return order
    # ZB-H1: stage s runs the W of microbatch i right after the B of
    # microbatch i+s; the W's left over fill the drain at the end.
    out, n_w = [], 0
    for op, m, c in order:
        out.append((op, m, c))
        if op == BWD_INPUT and m >= stage:
            out.append((BWD_WEIGHT, m - stage, 0))
            n_w += 1
    return out + [(BWD_WEIGHT, m, 0) for m in range(n_w, M)]


def schedule_table(kind: str, n_stages: int, n_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Builds the table of `kind` (one of SCHEDULES) for P stages and M microbatches.

    Every stage runs its operations in the schedule's order, each as early as
    its inputs allow: the forward of m on virtual stage k needs virtual stage
    k-1's forward of m from an earlier step; the backward (or B) needs this
    stage's forward of m and stage k+1's backward (or B) of m (the loss, on
    the last stage); a W needs this stage's B of m.

    >>> print(schedule_table("gpipe", 2, 2))
    stage 0:  F0  F1   .   .  B0  B1
    stage 1:   .  F0  F1  B0  B1   .
    >>> print(schedule_table("zb-h1", 2, 2))
    stage 0:  F0  F1   .  B0  W0  B1  W1
    stage 1:   .  F0  B0  F1  B1  W0  W1
    """
    if kind not in SCHEDULES:
        raise ValueError(f"pipeline schedule {kind!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    if n_stages < 1 or n_microbatches < 1 or virtual_stages < 1:
        raise ValueError(
            f"pipeline needs n_stages, n_microbatches and virtual_stages >= 1, got {n_stages}, "
            f"{n_microbatches} and {virtual_stages}"
        )
    if virtual_stages > 1 and kind != "interleaved":
        raise ValueError(f"virtual_stages={virtual_stages} needs the 'interleaved' schedule, not {kind!r}")
    if kind == "interleaved" and n_microbatches % n_stages:
        raise ValueError(
            f"interleaved pipeline needs n_microbatches a multiple of n_stages={n_stages} "
            f"(Megatron's rule), got {n_microbatches}"
        )
    P, M, v = n_stages, n_microbatches, virtual_stages
    op, mb, chunk = _run_in_order([_stage_order(kind, s, P, M, v) for s in range(P)], v)
    return Schedule(kind, P, M, op, mb, chunk, v)


def _run_in_order(orders: list[list[tuple[int, int, int]]], v: int) -> tuple[np.ndarray, ...]:
    """(op, mb, chunk) tables: each stage runs its `orders` entry in order, each operation as early as it can."""
    P = len(orders)
    V = P * v
    done: dict[tuple[str, int, int], int] = {}  # ("F" | "B" | "W", virtual stage, microbatch) -> step
    nxt = [0] * P
    ops, mbs, chunks = [], [], []
    t = 0
    while any(nxt[s] < len(orders[s]) for s in range(P)):
        if t > 3 * max(map(len, orders)) + 4 * V:
            raise RuntimeError(f"pipeline schedule deadlocked for P={P}, v={v}")
        row = [(IDLE, -1, -1)] * P
        for s in range(P):
            if nxt[s] == len(orders[s]):
                continue
            op, m, c = orders[s][nxt[s]]
            k = c * P + s
            if op == FWD:
                ready = k == 0 or done.get(("F", k - 1, m), t) < t
            elif op == BWD_WEIGHT:
                ready = done.get(("B", k, m), t) < t
            else:
                ready = done.get(("F", k, m), t) < t and (k == V - 1 or done.get(("B", k + 1, m), t) < t)
            if ready:
                row[s] = (op, m, c)
        for s, (op, m, c) in enumerate(row):  # record after the row: a result is usable from the next step on
            if op != IDLE:
                done[(_LETTER[op], c * P + s, m)] = t
                nxt[s] += 1
        ops.append([r[0] for r in row])
        mbs.append([r[1] for r in row])
        chunks.append([r[2] for r in row])
        t += 1
    return tuple(np.asarray(x, np.int32) for x in (ops, mbs, chunks))


def idle_fraction(table: Schedule) -> float:
    """The share of (time step, stage) cells in which a stage does nothing.

    Every operation (a forward, a backward, a B or a W, of one chunk) counts
    one step, so compare kinds with that in mind: 1F1B's idle share is the
    same whether its fused backward takes one step or two (B+W).

    >>> idle_fraction(schedule_table("gpipe", n_stages=4, n_microbatches=4)) == 3 / 7
    True
    """
    return float(np.mean(table.op == IDLE))


def _is_split(table: Schedule) -> bool:
    return bool(np.isin(table.op, (BWD_INPUT, BWD_WEIGHT)).any())


def _op_times(table: Schedule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Steps of every forward, backward (fused or B) and W, as (v*P, M) arrays
    indexed by virtual stage (-1 if missing)."""
    P, v = table.n_stages, table.virtual_stages
    t_fwd = np.full((P * v, table.n_microbatches), -1)
    t_bwd, t_w = np.full_like(t_fwd, -1), np.full_like(t_fwd, -1)
    for t, s in zip(*np.nonzero(table.op != IDLE)):
        op = table.op[t, s]
        out = t_fwd if op == FWD else t_w if op == BWD_WEIGHT else t_bwd
        out[table.chunk[t, s] * P + s, table.mb[t, s]] = t
    return t_fwd, t_bwd, t_w


def check_schedule(table: Schedule) -> None:
    """Raises ValueError unless `table` is a schedule the executor can run.

    Every virtual stage runs exactly one forward and one backward of each
    microbatch (or one B and one W: a table splits all backwards or none); a
    forward comes after the previous virtual stage's forward of that
    microbatch, a backward (B) after this stage's forward and the next
    stage's backward (B), a W after this stage's B.

    >>> check_schedule(schedule_table("1f1b", 4, 8))
    """
    P, M, v = table.n_stages, table.n_microbatches, table.virtual_stages
    shapes = {table.op.shape, table.mb.shape, table.chunk.shape}
    if len(shapes) != 1 or table.op.ndim != 2 or table.op.shape[1] != P:
        raise ValueError(
            f"schedule: op {table.op.shape}, mb {table.mb.shape} and chunk {table.chunk.shape} must all be (steps, {P})"
        )
    if not np.isin(table.op, (IDLE, FWD, BWD, BWD_INPUT, BWD_WEIGHT)).all():
        raise ValueError("schedule: op holds values other than IDLE, FWD, BWD, BWD_INPUT, BWD_WEIGHT")
    split = _is_split(table)
    if split and (table.op == BWD).any():
        raise ValueError("schedule: mixes fused backwards (BWD) with split ones (BWD_INPUT, BWD_WEIGHT)")
    busy = table.op != IDLE
    if ((table.mb[busy] < 0) | (table.mb[busy] >= M)).any():
        raise ValueError(f"schedule: a busy cell names a microbatch outside [0, {M})")
    if ((table.chunk[busy] < 0) | (table.chunk[busy] >= v)).any():
        raise ValueError(f"schedule: a busy cell names a chunk outside [0, {v})")
    codes = (
        ((FWD, "forward"), (BWD_INPUT, "input backward"), (BWD_WEIGHT, "weight backward"))
        if split
        else ((FWD, "forward"), (BWD, "backward"))
    )
    for code, name in codes:
        for s in range(P):
            for c in range(v):
                cells = (table.op[:, s] == code) & (table.chunk[:, s] == c)
                count = np.bincount(table.mb[:, s][cells], minlength=M)
                if (count != 1).any():
                    m = int(np.argmax(count != 1))
                    where = f" (chunk {c})" if v > 1 else ""
                    raise ValueError(
                        f"schedule: stage {s}{where} runs the {name} of microbatch {m} {count[m]} times, not once"
                    )
    t_fwd, t_bwd, t_w = _op_times(table)
    name = (lambda k: f"stage {k}") if v == 1 else (lambda k: f"virtual stage {k}")  # noqa: E731
    for k in range(P * v):
        for m in range(M):
            if k > 0 and t_fwd[k, m] <= t_fwd[k - 1, m]:
                raise ValueError(f"schedule: forward of microbatch {m} on {name(k)} runs before {name(k - 1)}'s")
            if t_bwd[k, m] <= t_fwd[k, m]:
                raise ValueError(f"schedule: backward of microbatch {m} on {name(k)} runs before its forward")
            if k < P * v - 1 and t_bwd[k, m] <= t_bwd[k + 1, m]:
                raise ValueError(f"schedule: backward of microbatch {m} on {name(k)} runs before {name(k + 1)}'s")
            if split and t_w[k, m] <= t_bwd[k, m]:
                raise ValueError(
                    f"schedule: weight backward of microbatch {m} on {name(k)} runs before its input backward"
                )


def _allocate(write: np.ndarray, read: np.ndarray, n_stages: int) -> tuple[np.ndarray, int]:
    """Buffer slots for entries (k, m) of device k % n_stages, live from step
    write[k, m] to step read[k, m]: (slot per entry, slots per device).

    An entry written in step t (at its end, or in a forward step before the
    forward reads it) may take the slot of one last read in step t. Greedy by
    write step, which uses the fewest slots (interval graph colouring).
    """
    slot = np.full(write.shape, -1)
    n = 1
    for s in range(n_stages):
        free_at: list[int] = []  # per slot: the step from which it may be written again
        for _, _, k, m in sorted(
            (write[k, m], read[k, m], k, m) for k in range(s, write.shape[0], n_stages) for m in range(write.shape[1])
        ):
            i = next((i for i, f in enumerate(free_at) if f <= write[k, m]), len(free_at))
            if i == len(free_at):
                free_at.append(0)
            free_at[i] = read[k, m]
            slot[k, m] = i
        n = max(n, len(free_at))
    return slot, n


@dataclasses.dataclass(frozen=True)
class BufferPlan:
    """Per (step, stage) buffer slots derived from a table; -1 = nothing."""

    n_stash: int  # slots for stage inputs
    n_grad: int  # slots for cotangents received from the next stage
    slot: np.ndarray  # stash slot of this step's microbatch
    gslot: np.ndarray  # cotangent slot read by this step's backward (or W)
    recv_x: np.ndarray  # stash slot the activation arriving after this step goes to
    recv_g: np.ndarray  # cotangent slot the cotangent arriving after this step goes to


def buffer_plan(table: Schedule) -> BufferPlan:
    P, v = table.n_stages, table.virtual_stages
    V = P * v
    t_fwd, t_bwd, t_w = _op_times(table)
    t_last = t_w if _is_split(table) else t_bwd  # a stage input and its cotangent are last read here
    # A stage input lands when the previous virtual stage's forward sends it
    # (virtual stage 0 reads it from x_M in its own forward).
    xslot, n_stash = _allocate(np.concatenate([t_fwd[:1], t_fwd[:-1]]), t_last, P)
    if V > 1:
        gslot_km, n_grad = _allocate(t_bwd[1:], t_last[:-1], P)
    else:
        gslot_km, n_grad = np.zeros((0, table.n_microbatches), int), 1
    slot, gslot = np.full_like(table.op, -1), np.full_like(table.op, -1)
    recv_x, recv_g = np.full_like(table.op, -1), np.full_like(table.op, -1)
    for t, s in zip(*np.nonzero(table.op != IDLE)):
        op, m = table.op[t, s], table.mb[t, s]
        k = table.chunk[t, s] * P + s
        slot[t, s] = xslot[k, m]
        if op != FWD and k < V - 1:
            gslot[t, s] = gslot_km[k, m]
        if op == FWD and k < V - 1:
            recv_x[t, (s + 1) % P] = xslot[k + 1, m]
        if op in (BWD, BWD_INPUT) and k > 0:
            recv_g[t, (s - 1) % P] = gslot_km[k - 1, m]
    return BufferPlan(n_stash, n_grad, slot, gslot, recv_x, recv_g)


def stash_size(table: Schedule) -> int:
    """How many stage (chunk) inputs each stage keeps for its backward under `table`.

    >>> stash_size(schedule_table("gpipe", 4, 8)), stash_size(schedule_table("1f1b", 4, 8))
    (8, 4)
    >>> stash_size(schedule_table("zb-h1", 4, 8)), stash_size(schedule_table("interleaved", 4, 8, 2))
    (4, 10)
    """
    return buffer_plan(table).n_stash


def cotangent_stash_size(table: Schedule) -> int:
    """How many output cotangents each stage keeps for its backward (or its deferred W).

    >>> cotangent_stash_size(schedule_table("1f1b", 4, 8)), cotangent_stash_size(schedule_table("zb-h1", 4, 8))
    (1, 3)
    """
    return buffer_plan(table).n_grad
