"""Diffusion runs: a grid of samples every log.sample_every steps, under run.dir/samples/."""

from __future__ import annotations

from meshwork.train.hooks import StepEnd
from meshwork.train.hooks.run import Run


class Samples:
    def __init__(self, run: Run):
        self.run = run

    def after_step(self, end: StepEnd) -> None:
        every = self.run.cfg.log.sample_every
        if end.trainer.task.name == "diffusion" and every and end.step % every == 0 and self.run.is_main:
            end.trainer.write_samples(end.state, self.run.run_dir / "samples" / f"step_{end.step:06d}.png")
