"""Eager vs graph: one training step of lm_tiny run op by op and as one compiled
program, and attention written as separate ops vs the fused implementations.

    python benchmarks/eager_vs_graph.py [--tiny] [--steps 5] [key=value ...]
    python benchmarks/eager_vs_graph.py --attention [--tiny]

Eager: the step's jaxpr is interpreted one primitive at a time, each equation
dispatched on its own (`primitive.bind` on concrete arrays, so every op is its
own small compiled kernel, as in PyTorch eager), through the bodies of `jit`,
`custom_vjp`, `remat` and `cond`; a scan runs its body once per iteration in
Python. Graph: `build_trainer(cfg, ...).compile().step_fn`, the whole step compiled by XLA;
its kernels are counted by `sharding/hlo_kernels.py` (per step: loop bodies
times their trip counts). Both run on one device in one process, so the
ratios compare like with like; the absolute times are this machine's.

`--attention`: softmax(Q K^T * scale + mask) with dropout, written as separate
jnp ops, against `model.attention=xla` and `pallas` (interpret mode on CPU),
forward + backward on one device: HLO kernels and temp bytes of each.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from meshwork.config import load_config  # noqa: E402
from meshwork.sharding.hlo_kernels import hlo_kernels  # noqa: E402
from meshwork.sharding.jaxpr_ops import jaxpr_op_counts  # noqa: E402

TINY = [
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=128",
    "data.seq_len=32",
    "train.global_batch=8",
]
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


# ---------------------------------------------------------------------------
# Op-by-op execution of a jaxpr.


class EagerInterpreter:
    """Runs a jaxpr one primitive at a time; `dispatches` counts the ops sent to the device."""

    def __init__(self):
        self.dispatches = 0

    def run(self, jaxpr, consts, *args) -> list:
        env: dict[Any, Any] = {}

        def read(v):
            return v.val if hasattr(v, "val") and not hasattr(v, "count") else env[v]

        for var, val in zip(jaxpr.constvars, consts):
            env[var] = val
        for var, val in zip(jaxpr.invars, args):
            env[var] = val
        for eqn in jaxpr.eqns:
            outs = self.eqn(eqn, [read(v) for v in eqn.invars])
            for var, val in zip(eqn.outvars, outs):
                if type(var).__name__ != "DropVar":
                    env[var] = val
        return [read(v) for v in jaxpr.outvars]

    def closed(self, closed, *args) -> list:
        inner = getattr(closed, "jaxpr", closed)
        return self.run(inner, getattr(closed, "consts", ()), *args)

    def eqn(self, eqn, invals: list) -> list:
        name, params = eqn.primitive.name, eqn.params
        if name == "scan":
            return self.scan(params, invals)
        if name == "cond":
            branch = params["branches"][int(invals[0])]
            return self.closed(branch, *invals[1:])
        if name == "while":
            return self.while_loop(params, invals)
        sub = next(
            (
                params[p]
                for p in _CALL_PARAMS
                if p in params and hasattr(getattr(params[p], "jaxpr", params[p]), "eqns")
            ),
            None,
        )
        if sub is not None and name != "pallas_call":
            return self.closed(sub, *invals)
        self.dispatches += 1
        out = eqn.primitive.bind(*invals, **params)
        return list(out) if eqn.primitive.multiple_results else [out]

    def scan(self, p, invals) -> list:
        n_c, n_k = p["num_consts"], p["num_carry"]
        consts, carry, xs = invals[:n_c], invals[n_c : n_c + n_k], invals[n_c + n_k :]
        ys_steps = []
        order = range(p["length"] - 1, -1, -1) if p["reverse"] else range(p["length"])
        for i in order:
            self.dispatches += len(xs)  # slicing each x is a dispatch of its own
            out = self.closed(p["jaxpr"], *consts, *carry, *[x[i] for x in xs])
            carry, ys = out[:n_k], out[n_k:]
            ys_steps.append(ys)
        if p["reverse"]:
            ys_steps.reverse()
        n_ys = len(p["jaxpr"].out_avals) - n_k
        self.dispatches += n_ys
        ys = [jnp.stack([s[j] for s in ys_steps]) for j in range(n_ys)]
        return [*carry, *ys]

    def while_loop(self, p, invals) -> list:
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, carry = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
        while bool(self.closed(p["cond_jaxpr"], *cconsts, *carry)[0]):
            carry = self.closed(p["body_jaxpr"], *bconsts, *carry)
        return carry


# ---------------------------------------------------------------------------
# The step, eager and compiled.


def _trainer(overrides: list[str]):
    from meshwork.train.trainer import build_trainer, check_runtime

    tmp = tempfile.mkdtemp(prefix="eager_vs_graph_")
    cfg = load_config(
        ROOT / "configs/lm_tiny.yaml",
        [f"run.dir={tmp}", "mesh.data=1", "log.progress=false", "log.tensorboard=false", *overrides],
    )
    devices = jax.devices()[:1]
    return build_trainer(cfg, check_runtime(cfg, devices), devices).compile()


def _block(tree):
    jax.block_until_ready(tree)
    return tree


def eager_vs_graph(overrides: list[str], steps: int = 3) -> dict[str, float]:
    """Seconds per step and launches of lm_tiny's train step, op by op and compiled."""
    trainer = _trainer(overrides)
    batch = trainer.to_device(next(trainer.task.train_iterator()))
    with trainer.context():
        state = trainer.init_state()
        step = trainer.make_step(trainer.grad_shardings)
        closed = jax.make_jaxpr(step)(state, batch)
        flat = jax.tree.leaves((state, batch))
        interp = EagerInterpreter()
        _block(interp.closed(closed, *flat))  # first run: every op compiles once, as eager frameworks cache
        interp.dispatches = 0
        t = time.perf_counter()
        for _ in range(steps):
            _block(interp.closed(closed, *flat))
        eager_s = (time.perf_counter() - t) / steps
        dispatches = interp.dispatches // steps
        state, _ = _block(trainer.step_fn(state, batch))  # warm-up; the state is donated, so it is carried on
        t = time.perf_counter()
        for _ in range(steps):
            state, _ = _block(trainer.step_fn(state, batch))
        graph_s = (time.perf_counter() - t) / steps
    kernels = hlo_kernels(trainer.step_fn.as_text())
    counts = jaxpr_op_counts(closed)
    return {
        "eager_s": eager_s,
        "graph_s": graph_s,
        "eager_dispatches": dispatches,
        "jaxpr_ops": counts["ops"],
        "jaxpr_ops_per_step": counts["per_step"],
        "graph_kernels": len(kernels),
        "graph_kernels_per_step": sum(k.multiplier for k in kernels),
    }


# ---------------------------------------------------------------------------
# Attention: separate ops vs the fused implementations.


def naive_attention(q_BLHK, k_BSGK, v_BSGK, key, *, dropout: float = 0.1):
    """softmax(Q K^T * scale + causal mask), dropout, times V: every step its own op."""
    H, G = q_BLHK.shape[2], k_BSGK.shape[2]
    k_BSHK = jnp.repeat(k_BSGK, H // G, axis=2)
    v_BSHK = jnp.repeat(v_BSGK, H // G, axis=2)
    scores_BHLS = jnp.einsum("blhk,bshk->bhls", q_BLHK, k_BSHK)
    scores_BHLS = scores_BHLS * (q_BLHK.shape[-1] ** -0.5)
    L, S = scores_BHLS.shape[-2:]
    mask_LS = jnp.arange(L)[:, None] >= jnp.arange(S)[None, :]
    scores_BHLS = jnp.where(mask_LS, scores_BHLS, -1e30)
    scores_BHLS = scores_BHLS - scores_BHLS.max(axis=-1, keepdims=True)
    p_BHLS = jnp.exp(scores_BHLS)
    p_BHLS = p_BHLS / p_BHLS.sum(axis=-1, keepdims=True)
    if dropout:
        keep = jax.random.bernoulli(key, 1.0 - dropout, p_BHLS.shape)
        p_BHLS = jnp.where(keep, p_BHLS / (1.0 - dropout), 0.0)
    return jnp.einsum("bhls,bshk->blhk", p_BHLS, v_BSHK)


def attention_variants(B: int = 2, L: int = 128, H: int = 4, G: int = 2, K: int = 32) -> list[dict[str, Any]]:
    """HLO kernels and temp bytes of attention forward + backward, per implementation (one device)."""
    from meshwork.models.layers.attention import attend

    q = jax.ShapeDtypeStruct((B, L, H, K), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, L, G, K), jnp.float32)
    key = jax.random.key(0)
    variants = {
        "naive (separate ops, dropout 0.1)": lambda q, k, v: naive_attention(q, k, v, key, dropout=0.1),
        "naive (separate ops, no dropout)": lambda q, k, v: naive_attention(q, k, v, key, dropout=0.0),
        "model.attention=xla": lambda q, k, v: attend(q, k, v, causal=True, impl="xla"),
        "model.attention=pallas": lambda q, k, v: attend(q, k, v, causal=True, impl="pallas"),
        "model.attention=cudnn": lambda q, k, v: attend(q, k, v, causal=True, impl="cudnn"),
    }
    rows = []
    for name, fn in variants.items():

        def loss(q, k, v, fn=fn):
            return (fn(q, k, v) ** 2).sum()

        try:
            compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
        except Exception as e:  # cuDNN lowers only for a GPU
            rows.append({"variant": name, "unavailable": f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"})
            continue
        kernels = hlo_kernels(compiled.as_text())
        rows.append(
            {
                "variant": name,
                "kernels": len(kernels),
                "kernels_per_step": sum(k.multiplier for k in kernels),
                "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
            }
        )
    return rows


def format_attention(rows: list[dict[str, Any]], shape: str) -> str:
    lines = [
        f"attention forward + backward, one device, {shape}:",
        f"  {'variant':<36} {'HLO kernels':>11} {'per run':>8} {'temp KiB':>10}",
    ]
    for r in rows:
        if "unavailable" in r:
            lines.append(f"  {r['variant']:<36} unavailable on {jax.default_backend()}: {r['unavailable']}")
        else:
            lines.append(
                f"  {r['variant']:<36} {r['kernels']:>11} {r['kernels_per_step']:>8} {r['temp_bytes'] / 1024:>10.1f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="the test suite's tiny shapes (d=64, 2 layers, seq 32)")
    p.add_argument("--steps", type=int, default=3, help="timed steps of each mode, after one warm-up")
    p.add_argument("--attention", action="store_true", help="also compare the attention implementations")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = p.parse_args(argv)
    overrides = [*(TINY if args.tiny else []), *args.overrides]
    r = eager_vs_graph(overrides, args.steps)
    print(
        f"lm_tiny train step on {jax.devices()[0].platform} ({'tiny shape' if args.tiny else 'lm_tiny shape'}), "
        f"{args.steps} timed steps each, {time.strftime('%Y-%m-%d')}, jax {jax.__version__}"
    )
    print(
        f"eager (op by op): {r['eager_s'] * 1e3:9.2f} ms/step, {r['eager_dispatches']:6d} dispatches "
        f"(jaxpr: {r['jaxpr_ops']} ops, {r['jaxpr_ops_per_step']} per step)"
    )
    print(
        f"graph (compiled): {r['graph_s'] * 1e3:9.2f} ms/step, {r['graph_kernels_per_step']:6d} kernels "
        f"({r['graph_kernels']} in the HLO text)"
    )
    print(
        f"ratio eager/graph: time {r['eager_s'] / r['graph_s']:.1f}x, launches "
        f"{r['eager_dispatches'] / r['graph_kernels_per_step']:.1f}x"
    )
    out: dict[str, Any] = dict(r)
    if args.attention:
        B, L, H, G, K = (2, 64, 4, 2, 16) if args.tiny else (2, 128, 4, 2, 32)
        rows = attention_variants(B, L, H, G, K)
        print(format_attention(rows, f"B={B} L={L} H={H} G={G} K={K}"))
        out["attention"] = rows
    return out


if __name__ == "__main__":
    main()
