"""The autotuner's search: the candidate launch configurations, and how fast an order over them finds the best.

A search that tries candidates in some order (the static cost's, or a random
one) needs `trials_to_reach` timed trials to meet the best; `random_trials`
is the mean of that over shuffled orders, the baseline a static order must beat.

    >>> [c.label() for c in candidates({"block_q": (32, 64)})]
    ['defaults', 'bq=32', 'bq=64']
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One launch configuration; None leaves the choice to the kernel (all None: its defaults)."""

    block_q: int | None = None
    block_kv: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def config(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def label(self) -> str:
        short = {"block_q": "bq", "block_kv": "bk", "num_warps": "warps", "num_stages": "stages"}
        return " ".join(f"{short[k]}={v}" for k, v in self.config().items()) or "defaults"


# The real grid per backend; --quick replaces it. GPU: Triton tiles are powers
# of two >= 16; warps 4/8 and 1-3 pipeline stages cover what FlashAttention-2
# style kernels use on Ampere/Hopper. TPU: the key block is a lane dim (x128).
GRIDS = {
    "gpu": dict(block_q=(32, 64, 128, 256), block_kv=(32, 64, 128), num_warps=(4, 8), num_stages=(1, 2, 3)),
    "tpu": dict(block_q=(128, 256, 512, 1024), block_kv=(128, 256, 512, 1024)),
    "cpu": dict(block_q=(32, 64, 128, 256), block_kv=(32, 64, 128, 256)),
}
QUICK_GRIDS = {
    "gpu": dict(block_q=(64, 128), block_kv=(32, 64), num_warps=(4, 8), num_stages=(2, 3)),
    "tpu": dict(block_q=(128, 256), block_kv=(128, 256)),
    "cpu": dict(block_q=(32, 64, 128), block_kv=(32, 64, 128)),
}


def candidates(grid: dict) -> list[Candidate]:
    """The kernel's defaults first, then the grid's product."""
    names = list(grid)
    return [Candidate()] + [Candidate(**dict(zip(names, values))) for values in itertools.product(*grid.values())]


# --------------------------------------------------------------------------
# Search statistics
# --------------------------------------------------------------------------


def trials_to_reach(order, times, tol: float = 0.0) -> int:
    """Timed trials, in `order`, until one within (1 + tol) x the best time (1-based)."""
    target = min(times) * (1 + tol)
    return next(i for i, c in enumerate(order, 1) if times[c] <= target)


def random_trials(times, tol: float, n_orders: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    return float(np.mean([trials_to_reach(rng.permutation(len(times)), times, tol) for _ in range(n_orders)]))


def spearman(a, b) -> float:
    """Rank correlation of two finite sequences (ties broken by position: fine for a report)."""
    if len(a) < 3:
        return float("nan")
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])
