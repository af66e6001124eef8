"""Preemption: SIGTERM or SIGINT asks for a checkpoint at the next step boundary.

Schedulers (SLURM, Kubernetes, cloud spot VMs) send SIGTERM some seconds
before they kill a job. The first signal only sets a flag; the loop sees it
after the step in flight, saves that step, waits for the write to commit and
returns, and the command line exits with PREEMPTED_EXIT_STATUS so a wrapper
can tell "requeue me" from success or failure. A second signal means "now":
the process exits at once, and the last committed checkpoint still holds.

With several processes, every one must stop at the same step or the others
hang in the step's collectives; there the decision is JAX's own: its
distributed runtime catches SIGTERM on any host and agrees on a step
(`reached_preemption_sync_point`), so no handler is installed here. JAX sets
that step to one past the largest count any process last passed it, so the
guard passes its own count of calls (1, 2, ... in this invocation; the same on
every process, which step in lockstep) rather than the training step: a
SIGTERM during the compile or the restore of a resumed run (no call yet, so
count 0) then stops after the invocation's first step, where the step number
(start + 1, never 1) would never meet the sync point and the notice would be
lost. JAX's handler replaces SIGTERM's default action there, so a second
SIGTERM does not end the process at once (SIGKILL does).
"""

from __future__ import annotations

import os
import signal
import threading

import jax

from meshwork.train import interrupts

PREEMPTED_EXIT_STATUS = 75  # EX_TEMPFAIL: "try again later"
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionGuard:
    """Context manager: installs the handlers (main thread only) and restores the old ones on exit."""

    def __init__(self):
        self.signal: int | None = None
        self._calls = 0  # should_stop calls in this invocation: JAX's preemption sync counter
        self._previous: dict[int, object] = {}

    def __enter__(self) -> PreemptionGuard:
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            if interrupts.held is not None:  # a Ctrl-C during the imports: acted on now
                self._handle(interrupts.held, None)
        else:
            interrupts.release()
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            # What was there before the guard; the holder of early interrupts has done its work.
            signal.signal(sig, signal.default_int_handler if handler is interrupts.hold else handler)

    def _handle(self, signum: int, frame) -> None:
        if self.signal is not None:  # the second signal: no more waiting
            os._exit(128 + signum)
        self.signal = signum
        from meshwork.train.terminal import say  # clears a progress bar first, so the line stands alone

        say(
            f"{signal.Signals(signum).name}: saving a checkpoint after the current step (send it again to exit at once)"
        )

    def should_stop(self, step: int) -> bool:
        """Whether to checkpoint `step` and stop; call once per step boundary, on every process."""
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            self._calls += 1
            return multihost_utils.reached_preemption_sync_point(self._calls)
        return self.signal is not None
