"""What happens between training steps, one hook per concern, each in its own file.

The loop (train/loop.py) runs a step, then asks each hook in turn:

    action = hook.after_step(end)     # end: StepEnd(step, state, trainer, ending, preempted)

A hook returns None to let the loop go on, `RollBack(step, state)` to resume from an earlier
step (the remaining hooks are skipped and the loop continues from there), or
`Moved(trainer, state, step)` when the run now trains on other devices. Hooks share the run's
services through `Run` (run.py): the metrics writer and step logger, the checkpoint tiers, the
data iterator and the goodput clock. In the order the loop calls them:

- nonfinite.py   NonFiniteGuard: a step whose loss or gradient is not finite (train.on_nan); the
                 loop asks it about each step's metrics as they are read back, before the hooks.

- evaluation.py  Evaluation: validation losses every log.eval_every steps and at the end.
- samples.py     Samples: a grid of diffusion samples every log.sample_every steps.
                 (Then the loop asks whether a signal asks it to stop: `ending` and `preempted`.)
- goodput.py     GoodputRow: the invocation's time account, on its last row.
- persistent.py  PersistentCheckpoint: the persistent tier, on its schedule and at the end.
- fast_tier.py   FastCheckpoint: the fast (RAM or local disk) tier.
- elastic.py     ElasticChange: lost or returning devices (train.elastic).
- preemption.py  Preemption: says where a preempted run stopped.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True)
class StepEnd:
    """The loop's view after a step: `ending` when it is the invocation's last (train.steps,
    train.stop_after, or a preemption signal, then also `preempted`)."""

    step: int
    state: Any
    trainer: Any
    ending: bool = False
    preempted: bool = False


@dataclasses.dataclass(frozen=True)
class RollBack:
    """Train on from `step` with `state` (a checkpoint's); the loop skips the remaining hooks."""

    step: int
    state: Any


@dataclasses.dataclass(frozen=True)
class Moved:
    """The run now trains with `trainer` (another mesh) from `step` with `state`."""

    trainer: Any
    state: Any
    step: int


class Hook(Protocol):
    def after_step(self, end: StepEnd) -> RollBack | Moved | None: ...
