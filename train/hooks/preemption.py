"""SIGTERM/SIGINT (train/preemption.py): the loop ends after the step in which the signal was seen,
once that step is checkpointed; this says so."""

from __future__ import annotations

from meshwork.train.hooks import StepEnd
from meshwork.train.hooks.run import Run


class Preemption:
    def __init__(self, run: Run):
        self.run = run

    def after_step(self, end: StepEnd) -> None:
        if end.preempted:
            self.run.summary["preempted"] = True
            self.run.say(f"preempted: checkpoint of step {end.step} saved; run the same command to resume")
