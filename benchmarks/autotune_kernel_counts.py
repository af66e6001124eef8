"""What the flash-attention kernels of a traced program do: work counted per loop level, launch parameters.

`kernels_of` counts from each pallas_call's kernel jaxpr and takes how often
each level runs from the kernels' own block ranges (what is counted, and why
the jaxpr rather than the lowered text: autotune_attention.py's docstring);
`triton_launches` reads the (num_warps, num_stages) the lowered Triton calls got.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys

import jax
import numpy as np

from meshwork.kernels import flash_attention as fa
from meshwork.kernels import flash_attention_kernels as fk

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from autotune_search import Candidate  # noqa: E402

TRANSCENDENTAL = {"exp", "exp2", "log", "log1p", "tanh", "logistic", "rsqrt", "sqrt"}
LOADS, STORES = {"get", "load"}, {"swap", "store", "addupdate"}
LOOPS = {"while", "scan"}


@dataclasses.dataclass
class Level:
    """Work of one execution of a loop level's body (level 0: the program outside any loop)."""

    dots: list = dataclasses.field(default_factory=list)  # (flops, M) per dot_general
    elems: float = 0.0  # vector element-ops, transcendentals included
    transcendental: float = 0.0
    load_bytes: float = 0.0
    store_bytes: float = 0.0
    ops: int = 0  # jaxpr equations: the interpreter pays per op
    carried_words: float = 0.0  # 4-byte words carried by loops that start at this level
    max_tile_words: float = 0.0

    @property
    def flops(self) -> float:
        return sum(f for f, _ in self.dots)


@dataclasses.dataclass
class Kernel:
    kind: str  # "fwd" | "dq" | "dkdv" | "?"
    levels: dict  # depth -> Level
    executions: list  # depth -> how many times that level's body runs, over the whole grid
    block_bytes: float  # bytes of all ref blocks one program sees (inputs and outputs)
    num_warps: int | None
    num_stages: int | None
    blocks: tuple  # (block_q, block_kv) this kernel runs with


def _size(aval) -> int:
    return int(np.prod(aval.shape)) if hasattr(aval, "shape") else 1


def _words(aval) -> float:
    dtype = getattr(aval, "dtype", None)
    return _size(aval) * (np.dtype(dtype).itemsize if dtype is not None else 4) / 4


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for x in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(x, "eqns"):
                yield x
            elif hasattr(getattr(x, "jaxpr", None), "eqns"):
                yield x.jaxpr


def _count(jaxpr, levels: dict, depth: int) -> None:
    level = levels.setdefault(depth, Level())
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        outs = [v.aval for v in eqn.outvars]
        if name in LOOPS:
            level.carried_words += sum(_words(a) for a in outs)
            for sub in _subjaxprs(eqn):
                _count(sub, levels, depth + 1)
            continue
        subs = list(_subjaxprs(eqn))
        if subs:  # jit, pjit, closed_call, custom_jvp: count the body where it runs
            for sub in subs:
                _count(sub, levels, depth)
            continue
        level.ops += 1
        level.max_tile_words = max([level.max_tile_words] + [_words(a) for a in outs])
        if name == "dot_general":
            lhs = eqn.invars[0].aval
            (contract, _), (batch, _) = eqn.params["dimension_numbers"]
            k = int(np.prod([lhs.shape[d] for d in contract]))
            m = int(np.prod([lhs.shape[d] for d in range(lhs.ndim) if d not in contract and d not in batch]))
            level.dots.append((2.0 * _size(outs[0]) * k, m))
        elif name in LOADS:
            level.load_bytes += sum(_words(a) * 4 for a in outs)
        elif name in STORES:
            level.store_bytes += sum(_words(eqn.invars[i].aval) * 4 for i in range(1, min(2, len(eqn.invars))))
        else:
            n = sum(_size(a) for a in outs)
            level.elems += n
            if name in TRANSCENDENTAL:
                level.transcendental += n


def _pallas_calls(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        else:
            for sub in _subjaxprs(eqn):
                yield from _pallas_calls(sub)


def _kind(eqn, index: int) -> str:
    text = " ".join(str(eqn.params.get(k, "")) for k in ("name", "name_and_src_info", "metadata", "debug"))
    for kind in ("dkdv", "dq", "fwd"):
        if f"flash_attention_{kind}" in text:
            return kind
    return ("fwd", "dq", "dkdv")[index] if index < 3 else "?"  # the order flash_forward/flash_backward call them in


def _launch_params(compiler_params) -> tuple[int | None, int | None]:
    """num_warps / num_stages from a pallas_call's compiler params, whatever container this JAX uses."""
    if isinstance(compiler_params, dict):
        for value in compiler_params.values():
            found = _launch_params(value)
            if found != (None, None):
                return found
        return compiler_params.get("num_warps"), compiler_params.get("num_stages")
    return getattr(compiler_params, "num_warps", None), getattr(compiler_params, "num_stages", None)


def _executions(kind: str, cfg, B: int, H: int, G: int) -> list[float]:
    """How often each loop level runs over the grid, from the kernel's own block-range functions."""
    b = cfg.blocks
    try:  # a few small integer ops: keep them off the accelerator
        host = jax.devices("cpu")[0]
    except RuntimeError:
        host = None
    with jax.default_device(host):
        if kind in ("fwd", "dq"):
            bq, bk = (b.q, b.kv) if kind == "fwd" else (b.bwd_q, b.bwd_kv)
            starts = np.arange(cfg.padded_q_len // bq, dtype=np.int32) * bq
            lo, hi = fk.kv_block_range(cfg, starts, bq, bk)
            trips = np.maximum(np.broadcast_to(np.asarray(hi), starts.shape) - np.asarray(lo), 0)
            return [B * H * len(starts), B * H * float(trips.sum())]
        bq, bk = b.bwd_q, b.bwd_kv
        starts = np.arange(cfg.padded_kv_len // bk, dtype=np.int32) * bk
        lo, hi = fk.q_block_range(cfg, starts, bq, bk)
        trips = np.maximum(np.broadcast_to(np.asarray(hi), starts.shape) - np.asarray(lo), 0)
        programs = B * G * len(starts)
        return [programs, programs * cfg.rep, B * G * cfg.rep * float(trips.sum())]


def kernels_of(traced, shape: dict, cand: Candidate, backend: str) -> list[Kernel]:
    """The flash-attention kernels in a traced program, with their counted work."""
    B, L, S, H, G, K = (shape[k] for k in "BLSHGK")
    cfg = fa.plan(
        (B, L, H, K),
        (B, S, G, K),
        causal=shape["causal"],
        scale=None,
        window=None,
        segmented=False,
        block_q=cand.block_q,
        block_kv=cand.block_kv,
        backend=backend,
        interpret=None,
    )
    out = []
    for i, eqn in enumerate(_pallas_calls(traced.jaxpr.jaxpr)):
        kind = _kind(eqn, i)
        levels: dict = {}
        body = eqn.params["jaxpr"]
        _count(body, levels, 0)
        execs = _executions(kind, cfg, B, H, G) if kind != "?" else [float(np.prod(eqn.params["grid_mapping"].grid))]
        warps, stages = _launch_params(eqn.params.get("compiler_params"))
        warps, stages = warps or cand.num_warps, stages or cand.num_stages  # a JAX that hides them: trust the ask
        blocks = (cfg.blocks.q, cfg.blocks.kv) if kind == "fwd" else (cfg.blocks.bwd_q, cfg.blocks.bwd_kv)
        out.append(Kernel(kind, levels, execs, sum(_words(v.aval) * 4 for v in body.invars), warps, stages, blocks))
    return out


def level_runs(kernel: Kernel, depth: int) -> float:
    """How often level `depth` of `kernel` runs over the whole grid."""
    # A level deeper than the block-range model knows (the kernel grew a loop) runs as often as the deepest known.
    return kernel.executions[min(depth, len(kernel.executions) - 1)]


def triton_launches(lowered_text: str) -> list[tuple[int, int]]:
    """(num_warps, num_stages) of every Triton custom call in a lowered module's text."""
    out = []
    for line in lowered_text.splitlines():
        if "xla.gpu.triton" in line:
            w, s = re.search(r"num_warps = (\d+)", line), re.search(r"num_stages = (\d+)", line)
            out.append((int(w.group(1)) if w else None, int(s.group(1)) if s else None))
    return out
