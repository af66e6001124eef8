"""train.on_nan: what a step whose loss or gradient norm is not finite does to the run.

skip: counted (summary["nonfinite_steps"]); the step itself already left the state unchanged.
stop: the checkpoint in flight commits, then NonFiniteLoss names the step.
rollback: state and data go back to the newest checkpoint, and the bad step's batch is skipped
from then on (kept in the checkpoints' progress, so a resumed run skips it too).
"""

from __future__ import annotations

from meshwork.train.hooks import RollBack
from meshwork.train.hooks.run import Run
from meshwork.train.stops import NonFiniteLoss


class NonFiniteGuard:
    """Not a hook of the list: the loop asks it about every step's metrics as they are read back,
    and the persistent tier about the step it is about to save."""

    def __init__(self, run: Run):
        self.run = run

    def check(self, done: tuple[int, dict] | None, trainer) -> RollBack | None:
        """`done`: (step, metrics) of a step just read back, or None."""
        if done is None or not done[1].get("nonfinite"):
            return None
        run, on_nan = self.run, self.run.cfg.train.on_nan
        run.summary["nonfinite_steps"].append(done[0])
        if on_nan == "stop":
            run.ckpt.close()  # the write in flight commits: it is where a rerun resumes
            raise NonFiniteLoss(
                f"train.on_nan=stop: step {done[0]} has loss {done[1]['loss']} and gradient norm "
                f"{done[1]['grad_norm']}; its update was not applied and the run stopped (last checkpoint: "
                f"step {run.ckpt.latest_step()}); lower optimizer.lr, or set train.on_nan=skip or rollback"
            )
        return self.roll_back(done[0], trainer) if on_nan == "rollback" else None

    def roll_back(self, bad: int, trainer) -> RollBack:
        run = self.run
        run.logger.discard()
        run.ckpt.wait()
        good = run.ckpt.latest_step()
        run.say(f"warning: step {bad} is not finite; rolling back to step {good or 0} and skipping its batch")
        with run.clock.phase("restore"):
            state, _ = run.restore(trainer, good)
        run.skipped.add(bad)
        run.clock.rollback()
        run.writer.truncate(good or 0)
        run.logger.restart_timer()
        return RollBack(good or 0, state)
