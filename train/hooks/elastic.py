"""train.elastic: when devices are lost or come back, the run moves to a trainer on the devices it
has (train/elastic.py), from the live state, or from the newest tier when shards were lost."""

from __future__ import annotations

from collections.abc import Callable

from meshwork.train.elastic import Elastic
from meshwork.train.hooks import Moved, StepEnd
from meshwork.train.hooks.run import Run
from meshwork.train.run_dir.resume import restore_newest


class ElasticChange:
    def __init__(self, run: Run, elastic: Elastic, trainer_on: Callable):
        """`trainer_on(cfg, devices, task)`: a trainer compiled on another device set."""
        self.run, self.elastic, self.trainer_on = run, elastic, trainer_on

    def after_step(self, end: StepEnd) -> Moved | None:
        run, step = self.run, end.step
        if (lost := self.elastic.poll(step)) is None:
            return None
        run.logger.flush()  # the last step's metrics, read while its devices are still there
        with run.clock.phase("lost"):
            moved = self.elastic.change(
                lost,
                end.trainer,
                end.state,
                step,
                run.fast,
                lambda target: restore_newest(run.ckpt, run.fast, target),
                self.trainer_on,
            )
        run.logger.n_devices = moved.trainer.mesh.size
        if moved.rolled_back_to is not None:  # shards were lost for good: train the steps since again
            step = moved.rolled_back_to
            run.data_iter.set_state((moved.progress or {}).get("iterator", run.first_position))
            run.writer.truncate(step)
            run.clock.rollback()
        run.summary["elastic"].append({"step": step, **moved.row})
        run.writer.write(step, moved.row)
        run.logger.restart_timer()
        return Moved(moved.trainer, moved.state, step)
