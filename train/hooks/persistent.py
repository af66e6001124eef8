"""The persistent checkpoint tier: saved on checkpoint.every's schedule (or Young/Daly's, `auto`)
and always at the invocation's last step, after that step's metrics and finiteness are settled."""

from __future__ import annotations

from meshwork.run.checkpoint import CheckpointSchedule
from meshwork.train.hooks import RollBack, StepEnd
from meshwork.train.hooks.nonfinite import NonFiniteGuard
from meshwork.train.hooks.run import Run


class PersistentCheckpoint:
    def __init__(self, run: Run, schedule: CheckpointSchedule, nonfinite: NonFiniteGuard):
        self.run, self.schedule, self.nonfinite = run, schedule, nonfinite

    def after_step(self, end: StepEnd) -> RollBack | None:
        run, step = self.run, end.step
        if not (self.schedule.due(step) or end.ending):
            return None
        # The step's own row and finiteness are settled before its checkpoint exists.
        if (back := self.nonfinite.check(run.logger.flush(), end.trainer)) is not None:
            return back
        if end.ending:  # the run's last write: the summary waits for it
            run.say(f"saving the checkpoint of step {step}...")
        with run.clock.phase("checkpoint"):
            run.ckpt.save(step, end.state, run.progress(), run.cfg.to_dict(), force=True)
        run.clock.checkpointed()
        if row := self.schedule.measured(step, run.ckpt.stalls, run.clock.totals["productive"]):
            run.say(self.schedule.describe(row))
            run.writer.write(step, row)
        return None
