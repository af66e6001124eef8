"""Validation losses (grpo: held-out rewards): at step 0, every log.eval_every steps and at train.steps."""

from __future__ import annotations

from meshwork.train.hooks import StepEnd
from meshwork.train.hooks.run import Run


class Evaluation:
    """`base_val_set`: a fine-tuning run on new data also tracks the loss on its base run's data
    (what may be forgotten), as val_loss_base_data."""

    def __init__(self, run: Run, val_set: list, base_val_set: list | None = None):
        self.run, self.val_set, self.base_val_set = run, val_set, base_val_set

    def evaluate(self, trainer, state, step: int) -> dict[str, float]:
        with self.run.clock.phase("eval"):
            if (score_policy := getattr(self.run.data_iter, "evaluate", None)) is not None:
                row = score_policy(trainer, state)  # grpo: the held-out prompts' reward, not a loss
            else:
                row = {f"val_{k}": v for k, v in trainer.evaluate(state, self.val_set).items()}  # val_loss, ...
            if self.base_val_set is not None:
                row["val_loss_base_data"] = trainer.evaluate(state, self.base_val_set)["loss"]
        for k, v in row.items():
            self.run.summary.setdefault(k, {})[step] = v
        return row

    def after_step(self, end: StepEnd) -> None:
        if end.step % self.run.cfg.log.eval_every == 0 or end.step == self.run.cfg.train.steps:
            self.run.logger.add(end.step, **self.evaluate(end.trainer, end.state, end.step))
