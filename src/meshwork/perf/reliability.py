"""Failures at scale: cluster MTTF, the optimal checkpoint interval, and goodput.

A job on N devices stops when any one fails. With independent, exponentially
distributed failures the cluster's failure rate is the sum of the devices'
rates, so its mean time to failure is the device MTTF divided by N: 10,000 GPUs
that each fail once in 100 days fail, as a cluster, every 14.4 minutes.

Checkpointing every `tau` seconds of work, at a cost of C seconds per
checkpoint, trades checkpoint overhead (C / tau) against work lost at a failure
(half an interval on average) plus the restart time R. The optimum is near
Young's sqrt(2 C M); Daly refined it for C not small against M.

    >>> m = cluster_mttf(100 * 86400, 10_000) / 60      # minutes
    >>> round(m, 1)
    14.4
    >>> round(young_interval(1.0, m), 2)                 # C = 1 minute
    5.37

Units: any, as long as all times share one (seconds in the examples below).
"""

from __future__ import annotations

import math
from typing import Literal

from meshwork.config import ConfigError


def _positive(**values: float) -> None:
    for name, v in values.items():
        if not v > 0:
            raise ConfigError(f"{name} must be positive, got {v!r}")


def cluster_mttf(device_mttf: float, n_devices: int) -> float:
    """MTTF of a job that stops when any of `n_devices` fails: device_mttf / n_devices.

    Independent exponential failures with rate 1/device_mttf each; the minimum
    of N such times is exponential with rate N/device_mttf.
    Example: `cluster_mttf(100 * 86400, 10_000)` is 864 s = 14.4 minutes.
    """
    _positive(device_mttf=device_mttf, n_devices=n_devices)
    return device_mttf / n_devices


def young_interval(checkpoint_cost: float, mttf: float) -> float:
    """Young's first-order optimal compute time between checkpoints: sqrt(2 C M).

    J. W. Young, "A first order approximation to the optimum checkpoint
    interval", Communications of the ACM 17(9), 1974. Valid when C << M.
    Example: `young_interval(60, 864)` is 322 s (C = 1 min, M = 14.4 min -> 5.37 min).
    """
    _positive(checkpoint_cost=checkpoint_cost, mttf=mttf)
    return math.sqrt(2.0 * checkpoint_cost * mttf)


def daly_interval(checkpoint_cost: float, mttf: float) -> float:
    """Daly's higher-order optimal compute time between checkpoints.

        tau = sqrt(2 C M) * [1 + (1/3) sqrt(C / 2M) + (1/9) (C / 2M)] - C   for C < 2M
        tau = M                                                           for C >= 2M

    J. T. Daly, "A higher order estimate of the optimum checkpoint interval for
    restart dumps", Future Generation Computer Systems 22(3), 2006
    (doi:10.1016/j.future.2004.11.016). Its figures 3-5 give, for C = 5 min,
    117 min at M = 24 h, 57 min at M = 6 h and 9.1 min at M = 15 min.
    It approximates the optimum of `goodput(..., model="daly")` and is below
    Young's value once C is a noticeable fraction of M.
    Example: `daly_interval(60, 864)` is 283 s (4.72 min).
    """
    _positive(checkpoint_cost=checkpoint_cost, mttf=mttf)
    c, m = checkpoint_cost, mttf
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


def goodput(
    interval: float,
    checkpoint_cost: float,
    mttf: float,
    restart_cost: float = 0.0,
    *,
    model: Literal["daly", "first_order"] = "daly",
) -> float:
    """Expected fraction of wall time spent on work that is kept, checkpointing every `interval` of work.

    model="daly" (default), the full cost function of Daly 2006: with exponential failures at
    rate 1/M that may also strike during checkpoints and restarts, the expected
    wall time to finish T_s of work is M e^{R/M} (e^{(tau + C)/M} - 1) T_s / tau, so

        goodput = tau e^{-R/M} / (M (e^{(tau + C)/M} - 1)).

    model="first_order": each segment of tau + C wall seconds keeps tau; each
    failure (one per M wall seconds) costs R plus half a segment on average:

        goodput = tau / (tau + C) * (1 - (R + (tau + C) / 2) / M),   floored at 0.

    Its maximum is at tau = sqrt(2 C (M - R)) - C, Young's interval less C.
    Both agree when tau + C + R << M; the Daly model is maximized at
    `daly_interval(C, M)` to within a fraction of a percent, whatever R.
    Example: `goodput(283, 60, 864, 120)` is 0.58: a 10,000-GPU job (M = 14.4
    min) that checkpoints in 1 minute every 4.7 and restarts in 2 keeps 58%.
    """
    _positive(interval=interval, mttf=mttf)
    if checkpoint_cost < 0 or restart_cost < 0:
        raise ConfigError(
            f"checkpoint_cost and restart_cost must be >= 0, got {checkpoint_cost!r} and {restart_cost!r}"
        )
    tau, c, m, r = interval, checkpoint_cost, mttf, restart_cost
    if model == "daly":
        return tau * math.exp(-r / m) / (m * math.expm1((tau + c) / m))
    if model == "first_order":
        return max(0.0, tau / (tau + c) * (1.0 - (r + (tau + c) / 2.0) / m))
    raise ConfigError(f"unknown goodput model {model!r}; choose 'daly' or 'first_order'")


def expected_failures(duration: float, device_mttf: float, n_devices: int) -> float:
    """Expected failures in `duration` of wall time on `n_devices`: duration / cluster MTTF.

    Example: a 30-day run on 10,000 GPUs with a 100-day device MTTF sees 3,000.
    """
    return duration / cluster_mttf(device_mttf, n_devices)
