"""Replaying a trace of failures against a training job's costs: goodput by simulation.

`reliability.goodput` is the closed form for one recovery scheme (restart from
the last checkpoint). This module plays the same story out event by event, so
that schemes without a closed form can be compared on one trace of failures:

- "persistent": restart the process (startup + compile + restore from the
  persistent tier) and redo the work since the last persistent checkpoint;
- "fast": restart the process but restore from a fast tier (host RAM or local
  disk, replicated to a peer) written every `fast_every` steps: a cheaper
  write, a cheaper restore, less work lost;
- "elastic": no process restart: the survivors reshard from the fast tier and
  recompile, roll back `rollback` of the work since the last fast copy, and go
  on with fewer devices (throughput lowered by `degraded_fraction` per
  outstanding failure) until the replacement joins `replacement_time` later,
  which costs a pause of `rejoin_cost`.

Failures arrive as a Poisson process in wall time (they strike during
checkpoints and recoveries too; a recovery that is struck starts over), as in
Daly's model, which the "persistent" scheme reproduces exactly:

    >>> s = Scenario.persistent(step_time=1.0, checkpoint_cost=60, every=283, recovery_cost=120)
    >>> r = simulate(s, failure_trace(864, 3e6, seed=3), horizon=3e6)
    >>> round(r.goodput, 2)                  # reliability.goodput(283, 60, 864, 120) is 0.58
    0.58

Goodput is productive step time over wall time; `Result.breakdown` splits the
rest into checkpoint stalls, recoveries, lost (redone) work, rejoin pauses and
the throughput lost while running degraded. Pure Python and NumPy; times in
seconds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import numpy as np

from meshwork.config import ConfigError
from meshwork.perf.reliability import cluster_mttf, daly_interval

MODES = ("persistent", "fast", "elastic")


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A recovery scheme with its costs, in seconds and steps.

    step_time: wall seconds per step on the full set of devices.
    every / checkpoint_cost: persistent checkpoint every this many steps, blocking this long;
        None: only the final one (a run that stops at `total_steps` always saves it).
    recovery_cost: failure to training again when restoring from the persistent tier.
    fast_every / fast_cost / fast_recovery_cost: the fast tier's interval, write stall and the
        failure-to-training time when restoring from it (a process restart, or for "elastic"
        the in-process reshard + recompile).
    fast_loss_prob: chance that a failure also takes the fast copy (then the persistent tier is used).
    rollback: elastic: the share of the steps since the last fast copy that are redone (0: the lost
        shards live on in replicas, nothing needs a copy).
    degraded_fraction: elastic: throughput lost per outstanding failure (negative: the smaller mesh
        runs faster, as simulated CPU devices sharing the same cores do).
    replacement_time / rejoin_cost: elastic: a failure's devices come back this long after it,
        and taking them in pauses the run this long.
    initial_cost: the first start (startup + compile, nothing to restore); also what a restart
        costs while no checkpoint exists yet.
    """

    mode: Literal["persistent", "fast", "elastic"]
    step_time: float
    checkpoint_cost: float
    every: int | None
    recovery_cost: float
    fast_every: int | None = None
    fast_cost: float = 0.0
    fast_recovery_cost: float = 0.0
    fast_loss_prob: float = 0.0
    rollback: float = 1.0
    degraded_fraction: float = 0.0
    replacement_time: float = math.inf
    rejoin_cost: float = 0.0
    initial_cost: float = 0.0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if not self.step_time > 0:
            raise ConfigError(f"step_time must be positive, got {self.step_time!r}")
        for name in (
            "checkpoint_cost",
            "recovery_cost",
            "fast_cost",
            "fast_recovery_cost",
            "rejoin_cost",
            "initial_cost",
            "replacement_time",
        ):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("every", "fast_every"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, np.integer)) and v >= 1):
                raise ConfigError(f"{name} must be a positive number of steps or None, got {v!r}")
        for name in ("fast_loss_prob", "rollback"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.mode != "persistent" and self.fast_every is None:
            raise ConfigError(f"mode {self.mode!r} needs fast_every (the fast tier's interval in steps)")
        if not -1 < self.degraded_fraction < 1:
            raise ConfigError(f"degraded_fraction must be in (-1, 1), got {self.degraded_fraction!r}")

    @classmethod
    def persistent(
        cls,
        *,
        step_time: float,
        checkpoint_cost: float,
        every: int | None,
        recovery_cost: float,
        initial_cost: float = 0.0,
    ) -> Scenario:
        """Mode (a): restart the process and restore the persistent tier."""
        return cls("persistent", step_time, checkpoint_cost, every, recovery_cost, initial_cost=initial_cost)


@dataclasses.dataclass
class Result:
    wall: float
    steps: float  # steps of progress kept at the end
    failures: int
    breakdown: dict[str, float]  # seconds: productive, checkpoint, recovery, lost, rejoin, degraded

    @property
    def goodput(self) -> float:
        return float(self.breakdown["productive"] / self.wall) if self.wall > 0 else 0.0


def failure_trace(mttf: float, horizon: float, seed: int = 0) -> np.ndarray:
    """Failure times in [0, horizon): a Poisson process of mean inter-arrival `mttf`, from `seed`.

    A longer horizon extends the same trace (the draws come in the same order).

    Example: `failure_trace(cluster_mttf(100 * 86400, 10_000), 86400, seed=1)` is about 100 times.
    """
    if not mttf > 0 or not horizon >= 0:
        raise ConfigError(f"mttf must be positive and horizon >= 0, got {mttf!r} and {horizon!r}")
    rng = np.random.default_rng(seed)
    chunk = int(horizon / mttf * 1.1) + 16
    times = np.cumsum(rng.exponential(mttf, chunk))
    while times[-1] < horizon:
        times = np.concatenate([times, times[-1] + np.cumsum(rng.exponential(mttf, chunk))])
    return times[times < horizon]


def interval_steps(step_time: float, checkpoint_cost: float, mttf: float) -> int:
    """Daly's optimal checkpoint interval (reliability.daly_interval) in whole steps, at least 1.

    Example: `interval_steps(10, 60, 864)` is 28 (283 s of work between checkpoints).
    """
    return max(1, round(daly_interval(checkpoint_cost, mttf) / step_time))


def simulate(
    s: Scenario, failures: np.ndarray, *, total_steps: int | None = None, horizon: float | None = None, seed: int = 0
) -> Result:
    """Plays `s` against the failure times `failures` (seconds, ascending) until `total_steps` are done
    (and the final checkpoint saved) or until wall time `horizon`, whichever is given (one of them).

    After the last failure time the run sees no more failures. `seed` draws the fast-tier losses.
    Example: with no failures, `goodput` is step_time / (step_time + checkpoint_cost / every).
    """
    if (total_steps is None) == (horizon is None):
        raise ConfigError("give exactly one of total_steps and horizon")
    if total_steps is not None and total_steps < 1:
        raise ConfigError(f"total_steps must be a positive number of steps, got {total_steps!r}")
    return _Sim(s, np.asarray(failures, dtype=float), total_steps, horizon, seed).run()


class _Sim:
    def __init__(self, s: Scenario, failures: np.ndarray, total_steps: int | None, horizon: float | None, seed: int):
        self.s, self.fails, self.total, self.horizon = s, failures, total_steps, horizon
        self.rng = np.random.default_rng(seed)
        self.t, self.i = 0.0, 0  # wall clock; index of the next failure
        self.step = 0.0  # progress in steps (fractional inside a step)
        self.persist_at = self.fast_at = None  # steps of the newest copies; None: none yet
        self.down: list[float] = []  # elastic: arrival times of the replacements still missing
        self.failures = 0
        self.acct = dict.fromkeys(("checkpoint", "recovery", "lost", "rejoin", "degraded"), 0.0)
        self.end = math.inf if horizon is None else horizon

    def next_failure(self) -> float:
        return float(self.fails[self.i]) if self.i < len(self.fails) else math.inf

    def pause(self, seconds: float, kind: str) -> bool:
        """Spends `seconds` on `kind`; False if a failure (or the horizon) cut it short."""
        stop = min(self.next_failure(), self.end)
        if self.t + seconds <= stop:
            self.t += seconds
            self.acct[kind] += seconds
            return True
        self.acct[kind] += stop - self.t
        self.t = stop
        return False

    def rate(self) -> float:
        return max(0.0, 1.0 - self.s.degraded_fraction * len(self.down))

    def boundary(self) -> tuple[float, str | None]:
        """The next step at which something is saved and which tier ("persistent", "fast"; None: nothing
        is ever saved again, so work until the horizon)."""
        s, now = self.s, math.floor(self.step + 1e-9)
        due = {every: (now // every + 1) * every for every in (s.every, s.fast_every) if every is not None}
        if self.total is not None:
            due[self.total] = self.total
        if not due:
            return math.inf, None
        b = min(due.values())
        persistent = b == self.total or (s.every is not None and b % s.every == 0)
        return b, "persistent" if persistent else "fast"

    def work_until(self, target: float) -> bool:
        """Runs steps up to `target`; False if a failure or the horizon came first."""
        while self.step < target - 1e-9:
            if self.down and min(self.down) <= self.t:  # replacements that arrived: one pause to take them in
                self.down = [a for a in self.down if a > self.t]
                if not self.pause(self.s.rejoin_cost, "rejoin"):
                    return False
                continue
            r = self.rate()
            stop = min(self.next_failure(), min(self.down, default=math.inf), self.end)
            # With every device counted out, nothing runs until a replacement arrives.
            need = (target - self.step) * self.s.step_time / r if r > 0 else math.inf
            dt = min(need, stop - self.t)
            if dt == math.inf:  # no failure, replacement or horizon will ever come: a stalled run
                raise ConfigError(
                    "the run stalls: degraded_fraction x outstanding failures reached 1 with no "
                    "replacement due; lower degraded_fraction or give a replacement_time"
                )
            self.step = target if dt == need else self.step + dt * r / self.s.step_time
            self.acct["degraded"] += dt * (1 - r)
            self.t += dt
            if dt == need:
                return True
            if self.t >= min(self.next_failure(), self.end):
                return False
        return True

    def fail(self) -> None:
        """A failure at self.t: roll back, then recover (anew each time a failure strikes the recovery)."""
        s = self.s
        while True:
            self.failures += 1
            self.i += 1
            # Elastic with rollback 0 needs no copy: the lost shards live on in the survivors (replicas).
            has_copy = self.fast_at is not None or (s.mode == "elastic" and s.rollback == 0)
            if s.mode != "persistent" and has_copy and self.rng.random() >= s.fast_loss_prob:
                base = self.fast_at or 0.0
                back = base if s.mode == "fast" else self.step - s.rollback * (self.step - base)
                cost = s.fast_recovery_cost
                if s.mode == "elastic":
                    self.down.append(self.t + s.replacement_time)
            else:  # the persistent tier, after a process restart on a full set of devices
                back = self.persist_at if self.persist_at is not None else 0.0
                cost = s.recovery_cost if self.persist_at is not None else s.initial_cost
                self.down = []
                self.fast_at = self.persist_at  # what the restarted job holds
            self.acct["lost"] += (self.step - back) * s.step_time
            self.step = back
            if self.pause(cost, "recovery") or self.t >= self.end:
                return

    def run(self) -> Result:
        s = self.s
        if not self.pause(s.initial_cost, "recovery") and self.t < self.end:
            self.fail()
        while self.t < self.end:
            target, tier = self.boundary()
            if not self.work_until(target) or not self.pause(
                s.checkpoint_cost if tier == "persistent" else s.fast_cost, "checkpoint"
            ):
                if self.t < self.end:
                    self.fail()
                continue
            self.fast_at = target
            if tier == "persistent":
                self.persist_at = target
            if self.total is not None and target >= self.total:
                break
        return Result(
            wall=self.t,
            steps=self.step,
            failures=self.failures,
            breakdown={"productive": self.step * s.step_time, **self.acct},
        )


def scenario(
    mode: str,
    *,
    n_devices: int,
    device_mttf: float,
    step_time: float,
    persistent_cost: float,
    fast_cost: float,
    startup: float,
    compile_: float,
    restore_persistent: float,
    restore_fast: float,
    reshard: float,
    recompile: float,
    rejoin: float,
    replacement_time: float,
    group: int,
    fast_loss_prob: float,
    rollback: float,
    every: int | None = None,
    fast_every: int | None = None,
) -> Scenario:
    """One of MODES at `n_devices`, its intervals from Daly's formula unless given.

    Persistent interval: Daly at the cluster MTTF for "persistent"; for "fast"/"elastic", Daly at the
    MTTF of the failures that need the persistent tier (cluster MTTF / fast_loss_prob), on a multiple
    of the fast interval. Elastic loses `group` devices per failure (throughput group / n_devices).
    """
    mttf = cluster_mttf(device_mttf, n_devices)
    if mode == "persistent":
        return Scenario(
            "persistent",
            step_time,
            persistent_cost,
            every or interval_steps(step_time, persistent_cost, mttf),
            startup + compile_ + restore_persistent,
            initial_cost=0.0,
        )
    fast_every = fast_every or interval_steps(step_time, fast_cost, mttf)
    if every is None and fast_loss_prob > 0:
        k = max(1, round(interval_steps(step_time, persistent_cost, mttf / fast_loss_prob) / fast_every))
        every = k * fast_every
    common = {
        "fast_every": fast_every,
        "fast_cost": fast_cost,
        "fast_loss_prob": fast_loss_prob,
        "recovery_cost": startup + compile_ + restore_persistent,
    }
    if mode == "fast":
        return Scenario(
            "fast", step_time, persistent_cost, every, fast_recovery_cost=startup + compile_ + restore_fast, **common
        )
    if mode == "elastic":
        return Scenario(
            "elastic",
            step_time,
            persistent_cost,
            every,
            fast_recovery_cost=reshard + recompile,
            rollback=rollback,
            degraded_fraction=min(group / n_devices, 0.99),
            replacement_time=replacement_time,
            rejoin_cost=rejoin,
            **common,
        )
    raise ConfigError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
