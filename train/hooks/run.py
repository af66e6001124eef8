"""The services one invocation of `train` shares between its loop and its hooks."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable
from typing import Any

from meshwork.config import Config
from meshwork.partitioning import abstract_with_shardings
from meshwork.run.checkpoint import Checkpointer
from meshwork.run.fast_tier import FastTier
from meshwork.run.goodput_clock import GoodputClock
from meshwork.run.metrics import MetricsWriter
from meshwork.train.logger import StepLogger


@dataclasses.dataclass
class Run:
    cfg: Config
    run_dir: pathlib.Path
    say: Callable[[str], None]
    is_main: bool
    clock: GoodputClock
    ckpt: Checkpointer
    fast: FastTier | None
    data_iter: Any
    first_position: dict  # the iterator's state before the first batch
    skipped: set[int]  # steps whose batch a rollback threw out, for good
    summary: dict[str, Any]  # what `train` returns
    writer: MetricsWriter | None = None
    logger: StepLogger | None = None

    def progress(self) -> dict[str, Any]:
        """What a checkpoint of the current step keeps beside the state."""
        return {
            "iterator": self.data_iter.get_state(),
            "skipped_steps": sorted(self.skipped),
            "goodput": self.clock.snapshot(),
        }

    def restore(self, trainer, step: int | None, snapshot=None) -> tuple[Any, dict]:
        """(state, progress) at checkpoint `step`, the data iterator moved there; a fresh state when None.
        With `snapshot` (the fast tier's, of `step`) the state comes from it instead of the persistent tier."""
        if step is None:
            self.data_iter.set_state(self.first_position)
            return trainer.init_state(), {}
        target = abstract_with_shardings(trainer.abstract, trainer.shardings)
        if snapshot is not None and snapshot.step == step:
            state, progress = self.fast.restore(snapshot, target), snapshot.progress
        else:
            state, progress = self.ckpt.restore(step, target)
        self.data_iter.set_state(progress["iterator"])
        return state, progress
