"""Where a run's wall time went, across restarts: the measured side of goodput.

Goodput is productive step time over the wall time since the run first
started. The rest is broken down into compiling, restoring, checkpoint
stalls, evaluation, lost work (steps computed and then thrown away by a
crash or a rollback, plus the time the run was down before a restart) and
whatever is left (data loading, logging, Python).

The clock's totals travel inside each checkpoint, so a resumed process
continues the account; the time between the checkpoint it resumes from and
its own start is exactly the work the crash cost, and counts as lost.
(`meshwork.perf.reliability.goodput` is the planner's prediction of the same ratio.)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

PHASES = ("productive", "compile", "restore", "checkpoint", "eval", "lost")


class GoodputClock:
    def __init__(self, now: float | None = None):
        self.started = time.time() if now is None else now
        self.origin = self.started  # the run's first start; earlier when resuming
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.since_checkpoint = 0.0  # productive time not yet covered by a checkpoint

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self.totals[name] += dt
            if name == "productive":
                self.since_checkpoint += dt

    def snapshot(self) -> dict[str, Any]:
        """What a checkpoint stores: the account as of now."""
        return {"origin": self.origin, "elapsed": time.time() - self.origin, "totals": dict(self.totals)}

    def checkpointed(self) -> None:
        self.since_checkpoint = 0.0

    def resume(self, saved: dict[str, Any] | None) -> None:
        """Continues the account of the checkpoint this process restored.

        Everything between that checkpoint's snapshot and this process's
        start (the steps redone, the downtime) is lost time.
        """
        if not saved:
            return
        gap = max(0.0, self.started - (saved["origin"] + saved["elapsed"]))
        self.origin = saved["origin"]
        for name in PHASES:
            self.totals[name] += saved["totals"].get(name, 0.0)
        self.totals["lost"] += gap
        self.since_checkpoint = 0.0

    def rollback(self) -> None:
        """The steps since the last checkpoint were thrown away: their time was lost, not productive."""
        self.totals["productive"] -= self.since_checkpoint
        self.totals["lost"] += self.since_checkpoint
        self.since_checkpoint = 0.0

    def goodput(self) -> float:
        elapsed = time.time() - self.origin
        return self.totals["productive"] / elapsed if elapsed > 0 else 0.0

    def breakdown(self) -> dict[str, float]:
        """Seconds per phase, `other_s` (the rest of the wall time), `wall_s` and `goodput`."""
        wall = time.time() - self.origin
        out = {f"{name}_s": round(v, 3) for name, v in self.totals.items()}
        out["other_s"] = round(max(0.0, wall - sum(self.totals.values())), 3)
        out["wall_s"] = round(wall, 3)
        out["goodput"] = self.totals["productive"] / wall if wall > 0 else 0.0
        return out
