"""The fast checkpoint tier (checkpoint.fast_every): a host copy of the state, in RAM or on local disk.
The last step is left to the persistent tier."""

from __future__ import annotations

from meshwork.train.hooks import StepEnd
from meshwork.train.hooks.run import Run


class FastCheckpoint:
    def __init__(self, run: Run, last: int):
        self.run, self.last = run, last

    def after_step(self, end: StepEnd) -> None:
        run = self.run
        if run.fast is not None and run.fast.due(end.step) and end.step != self.last:
            with run.clock.phase("checkpoint"):
                run.fast.save(end.step, end.state, run.progress(), run.cfg.to_dict())
