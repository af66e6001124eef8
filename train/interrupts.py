"""Ctrl-C between a command's first line and the trainer's preemption guard.

Python raises KeyboardInterrupt wherever the main thread happens to be. During the seconds of
imports before training starts, that is sometimes inside a garbage-collection callback (jax
registers one), where Python prints "Exception ignored" and carries on: the interrupt is lost and
the run trains to the end. So the command line holds interrupts from its first line (stdlib only,
before jax is imported) and whoever comes next acts on the one held: the preemption guard as if it
had just arrived, or `release()` on paths without a guard.
"""

from __future__ import annotations

import os
import signal
import threading

held: int | None = None  # the signal number of a Ctrl-C received while holding


def hold(signum: int, frame) -> None:
    global held
    if held is not None:  # the second Ctrl-C: now
        os._exit(128 + signum)
    held = signum


def hold_until_the_guard() -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, hold)


def release() -> None:
    """Ctrl-C raises KeyboardInterrupt again, and one held meanwhile raises now."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is hold:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if held is not None:
        raise KeyboardInterrupt
