"""Planner: a layout's pipeline schedule, read from the tables the executor runs.

The planner does not restate a schedule's bubble or stash as a formula: it
builds the same `sharding.pipeline_schedules.schedule_table` the train step hands to
the executor and reads `idle_fraction` (the bubble) and `stash_size` (stage
inputs a stage keeps for its backward) from it. For GPipe and 1F1B the idle
fraction is (P-1)/(M+P-1) and the bubble time (P-1)/M of the busy time; an
interleaved or zero-bubble table gives its own numbers. A table cell is one
time step whatever it holds, so a schedule whose cells differ in length (a
backward that recomputes its forward, a split backward) is modelled as if
they were equal.

    >>> from meshwork.perf.planner_layout import make_layout
    >>> s = pipeline_schedule(make_layout(stage=4, data=2, microbatches=8, schedule="1f1b"))
    >>> s.idle == 3 / 11, s.stash, s.steps
    (True, 4, 22)
"""

from __future__ import annotations

import dataclasses
import functools

from meshwork.config import ConfigError
from meshwork.perf.planner_layout import Layout
from meshwork.sharding import pipeline_schedules as pipeline


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """What the planner reads from one schedule table."""

    kind: str
    stages: int
    microbatches: int
    virtual_stages: int
    idle: float
    """Share of (time step, stage) cells with nothing to do: `idle_fraction(table)`."""
    stash: int
    """Stage inputs one stage keeps for its backward: `stash_size(table)`."""
    cotangents: int
    """Output cotangents one stage keeps for its backward or deferred weight gradient
    (`cotangent_stash_size(table)`: 1 under 1F1B, P-1 under zb-h1)."""
    steps: int
    """Time steps of the table: the executor's loop length (one send each way per step)."""

    @property
    def bubble_ratio(self) -> float:
        """Idle time over busy time, idle / (1 - idle): (P-1)/M for GPipe and 1F1B."""
        return self.idle / (1 - self.idle)


def schedule_table(kind: str, stages: int, microbatches: int, virtual_stages: int = 1) -> pipeline.Schedule:
    """`sharding.pipeline_schedules.schedule_table`, with an unknown kind a config error naming the key."""
    if kind not in pipeline.SCHEDULES:
        raise ConfigError(
            f"train.pipeline={kind!r}: sharding/pipeline_schedules.py has no such schedule; "
            f"choose one of {', '.join(pipeline.SCHEDULES)}"
        )
    return pipeline.schedule_table(kind, stages, microbatches, virtual_stages=virtual_stages)


@functools.lru_cache(maxsize=256)
def _read(kind: str, stages: int, microbatches: int, virtual_stages: int) -> PipelineSchedule:
    table = schedule_table(kind, stages, microbatches, virtual_stages)
    return PipelineSchedule(
        kind,
        stages,
        microbatches,
        virtual_stages,
        pipeline.idle_fraction(table),
        pipeline.stash_size(table),
        pipeline.cotangent_stash_size(table),
        table.n_steps,
    )


def pipeline_schedule(layout: Layout) -> PipelineSchedule | None:
    """The schedule `layout` runs (None without a pipeline), built once per (kind, P, M, v)."""
    if layout.pipeline == "none" or layout.sizes["stage"] == 1:
        return None
    return _read(layout.pipeline, layout.sizes["stage"], layout.microbatches, layout.virtual_stages)


def compact_table(table: pipeline.Schedule, max_steps: int = 40) -> str:
    """`str(table)` with every row cut to its first and last steps when the table is longer
    than `max_steps` (the middle of a long schedule repeats its steady state).

    >>> print(compact_table(pipeline.schedule_table("gpipe", 2, 8), max_steps=8))
    stage 0: F0 F1 F2 F3 ... B4 B5 B6 B7
    stage 1:  . F0 F1 F2 ... B5 B6 B7  .
    """
    lines = str(table).splitlines()
    if table.n_steps <= max_steps:
        return "\n".join(lines)
    head, tail = max_steps // 2, max_steps - max_steps // 2
    rows = [line.split(": ", 1) for line in lines]
    cells = [cells.split() for _, cells in rows]
    width = max(len(c) for row in cells for c in row)
    cut = lambda row: [c.rjust(width) for c in row[:head]] + ["..."] + [c.rjust(width) for c in row[-tail:]]  # noqa: E731
    return "\n".join(f"{name}: {' '.join(cut(row))}" for (name, _), row in zip(rows, cells))


def schedule_text(layout: Layout, max_steps: int = 40) -> str:
    """What `python -m train --dry-run` prints about a pipeline: the table the executor runs
    (compacted), its idle fraction and stash, and the bubble the planner charges for it."""
    s = pipeline_schedule(layout)
    if s is None:
        return ""
    table = schedule_table(s.kind, s.stages, s.microbatches, s.virtual_stages)
    chunks = f" x {s.virtual_stages} virtual stages" if s.virtual_stages > 1 else ""
    return (
        f"pipeline schedule: {s.kind}, {s.stages} stages{chunks} x {s.microbatches} microbatches, "
        f"{s.steps} time steps\n{compact_table(table, max_steps)}\n"
        f"pipeline idle fraction: {s.idle:.4f} of stage time steps (bubble = {s.bubble_ratio:.4f} x busy time); "
        f"stash: {s.stash} stage inputs and {s.cotangents} cotangents per stage"
    )
