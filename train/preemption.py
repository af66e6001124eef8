"""Preemption: SIGTERM or SIGINT asks for a checkpoint at the next step boundary.

Schedulers (SLURM, Kubernetes, cloud spot VMs) send SIGTERM some seconds
before they kill a job. The first signal only sets a flag; the loop sees it
after the step in flight, saves that step, waits for the write to commit and
returns, and the command line exits with PREEMPTED_EXIT_STATUS so a wrapper
can tell "requeue me" from success or failure. A second signal means "now":
the process exits at once, and the last committed checkpoint still holds.

Every signal counts, however close behind the first it comes. Python runs a
signal's handler only between bytecodes of the main thread, and runs it once
for any number of deliveries that arrived meanwhile: while the main thread
waits in a compiled step or a checkpoint write, two SIGTERMs a few ms apart
would call the handler once, and the run would save and exit 75. So the
counting is done below Python's handlers: CPython's C-level handler writes one
byte per delivered signal to the wakeup fd (`signal.set_wakeup_fd`), and a
thread of the guard reads them; at the second it ends the process with
128 + signal, whatever the main thread is doing. (Two deliveries can still be
one if the second comes before the kernel has handed the first to any thread;
the kernel, not this process, merges those.)

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


class SignalCounter:
    """Counts SIGTERM/SIGINT deliveries from the wakeup fd's bytes, in a thread; the second ends the process.

    One instance per guard, installed from the main thread; `close` puts the previous wakeup fd back.
    """

    def __init__(self, already: int | None = None):
        self.count = 0
        self._lock = threading.Lock()
        if already is not None:  # a Ctrl-C held since the imports (train/interrupts.py) is the first
            self.add(already)
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # the C handler must never block on it
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="preemption-signals", daemon=True)
        self._thread.start()

    def add(self, signum: int) -> int:
        """One more delivery of `signum`; at the second of any of SIGNALS the process exits 128 + signum."""
        with self._lock:
            self.count += 1
            if self.count >= 2:
                os._exit(128 + signum)
            return self.count

    def _watch(self) -> None:
        while data := os.read(self._read, 64):
            for byte in data:
                if byte == 0:  # close(): no more signals to count
                    return
                if byte in SIGNALS:
                    self.add(byte)

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        os.write(self._write, b"\0")
        self._thread.join(timeout=5)
        os.close(self._read)
        os.close(self._write)


class PreemptionGuard:
    """Context manager: installs the handlers (main thread only) and restores the old ones on exit."""

    def __init__(self):
        self.signal: int | None = None
        self._calls = 0  # should_stop calls in this invocation: JAX's preemption sync counter
        self._previous: dict[int, object] = {}
        self._counter: SignalCounter | None = None

    def __enter__(self) -> PreemptionGuard:
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self._counter = SignalCounter(interrupts.held)
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
        if self._counter is not None:
            self._counter.close()

    def _handle(self, signum: int, frame) -> None:
        """Python's handler: runs in the main thread, once for one or more deliveries (the counter
        counts them and ends the process at the second); the first asks the loop to save and stop."""
        if self.signal is not None:  # a second call is a second delivery, were the wakeup fd taken over
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
