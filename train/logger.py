"""Per-step metrics: read one step late, written every `log.every` steps, shown as a bar or as lines."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from meshwork.config import Config
from meshwork.perf.hardware import peak_flops_per_device
from meshwork.run.metrics import MetricsWriter
from meshwork.train.terminal import interactive, say

LINES_PER_RUN = 10  # without a bar: about this many progress lines over a run (and one per evaluation)
LINE_AT_LEAST_EVERY_S = 60.0  # ... and one at least this often


def to_host(x: jax.Array) -> np.ndarray:
    """A replicated value as numpy, also when other processes hold copies of it."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_shards[0].data)


def _peak_flops(dtype: str, announce: bool, device=None) -> float | None:
    """The device's peak FLOP/s for MFU, or None (mfu logged as null) for a device kind that
    src/meshwork/perf/hardware.py has no row for: training does not depend on it."""
    try:
        return peak_flops_per_device(dtype, device)[0]
    except KeyError as e:
        if announce:
            say(f"mfu: not logged ({e.args[0]})")
        return None


class StepLogger:
    """Reads each step's metrics one step late (the next step is already queued,
    so the host never stalls the device) and writes every `log.every`-th
    step, every step with extra values (evaluation, a skipped batch) and the
    last one, with throughput and MFU. Host-side values of a step (its data
    position) join its row when the row is written.

    On a terminal (and with log.progress) a tqdm bar moves once per step;
    elsewhere (a pipe, a log file, a notebook) a line is printed every
    ~1/LINES_PER_RUN of the run, at each evaluation and at the last step."""

    def __init__(
        self,
        cfg: Config,
        writer: MetricsWriter,
        flops_per_step: float,
        items_per_step: int,
        unit: str,
        *,
        start: int,
        last: int,
        enabled: bool,
        n_devices: int,
        live: Callable[[], dict] = dict,
    ):
        self.cfg, self.writer, self.last, self.live, self.n_devices = cfg, writer, last, live, n_devices
        self.unit, self.items_per_step, self.flops_per_step = unit, items_per_step, flops_per_step
        self.peak = _peak_flops(cfg.train.compute_dtype, enabled)
        bar = enabled and cfg.log.progress and interactive()
        self.pbar = tqdm(total=cfg.train.steps, initial=start, disable=not bar, desc=cfg.run.name, dynamic_ncols=True)
        self.lines = enabled and not bar
        self.line_every = cfg.log.every * max(1, round((last - start) / LINES_PER_RUN / cfg.log.every))
        self.start, self.t_start = start, time.perf_counter()
        self.t_line = self.t_start
        self.pending: tuple[int, Any, dict] | None = None
        self.extra: dict[int, dict[str, Any]] = {}
        self.restart_timer()

    def restart_timer(self) -> None:
        self.t_last, self.steps_since = time.perf_counter(), 0

    def add(self, step: int, **values: Any) -> None:
        """Values that force `step`'s row to be written (an evaluation, a skipped batch)."""
        self.extra.setdefault(step, {}).update(values)

    def step_dispatched(self, step: int, metrics: Any, **host: Any) -> tuple[int, dict] | None:
        """Queues `step`; finishes the previous one and returns (its step, its metrics on the host)."""
        done = self.flush()
        self.pending = (step, metrics, host)
        return done

    def flush(self) -> tuple[int, dict] | None:
        """Finishes the pending step now (before a checkpoint: its row must exist if the checkpoint does)."""
        if self.pending is None:
            return None
        step, metrics, host = self.pending
        self.pending = None
        return step, self._finish(step, metrics, host)

    def discard(self) -> None:
        """Drops the pending step unlogged (a rollback throws it away)."""
        self.pending = None

    def close(self) -> None:
        self.flush()
        self.pbar.close()

    def _finish(self, step: int, metrics: Any, host: dict) -> dict:
        m = {k: to_host(v).tolist() for k, v in metrics.items()}  # scalars, or per-expert lists
        self.steps_since += 1
        if "loss" in m:  # no refresh of its own: the update below draws the bar once for this step
            self.pbar.set_postfix(loss=f"{m['loss']:.3f}", refresh=False)
        self.pbar.update(1)
        if step % self.cfg.log.every and step not in self.extra and step != self.last and not m.get("nonfinite"):
            return m
        now = time.perf_counter()
        step_time = (now - self.t_last) / self.steps_since
        self.t_last, self.steps_since = now, 0
        tflops = self.flops_per_step / step_time / self.n_devices / 1e12
        extra = self.extra.pop(step, {})
        self.writer.write(
            step,
            {
                **m,
                "step_time_s": step_time,
                f"{self.unit}_per_s": self.items_per_step / step_time,
                "tflops_per_device": tflops,
                "mfu": tflops * 1e12 / self.peak if self.peak else None,
                **self.live(),
                **host,
                **extra,
            },
        )
        if self.lines and (
            step % self.line_every == 0
            or step == self.last
            or "val_loss" in extra
            or now - self.t_line >= LINE_AT_LEAST_EVERY_S
        ):
            self.t_line = now
            say(self.progress_line(step, m, step_time, extra, now))
        elif "val_loss" in extra and not self.pbar.disable:
            say(f"step {step}: validation loss {extra['val_loss']:.4f}")
        return m

    def progress_line(self, step: int, m: dict, step_time: float, extra: dict, now: float) -> str:
        """`step 20/600: loss 3.054, 21.3 ms/step, 12,021 tokens/s, eta 0:03:12` (+ the validation loss)."""
        parts = [f"loss {m['loss']:.4f}"] if "loss" in m else []
        if "val_loss" in extra:
            parts.append(f"validation loss {extra['val_loss']:.4f}")
        for key, label in (("reward", "reward"), ("val_reward", "held-out reward")):
            if key in extra:
                parts.append(f"{label} {extra[key]:.3f}")
        parts += [f"{step_time * 1e3:.1f} ms/step", f"{self.items_per_step / step_time:,.0f} {self.unit}/s"]
        if step < self.last:
            eta = (now - self.t_start) / max(step - self.start, 1) * (self.last - step)
            parts.append(f"eta {tqdm.format_interval(eta)}")
        return f"step {step}/{self.cfg.train.steps}: " + ", ".join(parts)
