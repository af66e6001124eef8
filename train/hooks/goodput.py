"""The invocation's time account (productive, compile, restore, checkpoint, ...) joins its last row."""

from __future__ import annotations

from meshwork.train.hooks import StepEnd
from meshwork.train.hooks.run import Run


class GoodputRow:
    def __init__(self, run: Run):
        self.run = run

    def after_step(self, end: StepEnd) -> None:
        if end.ending:
            self.run.logger.add(
                end.step, **{f"time_{k}" if k.endswith("_s") else k: v for k, v in self.run.clock.breakdown().items()}
            )
