"""Primitive operations of a jaxpr, counted through the bodies of `jit`,
`scan`, `cond`, `custom_vjp`, `remat`, ... (a container equation itself is
not an op): the jaxpr side of `sharding/graph_report.py`'s ops vs kernels.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

__all__ = ["jaxpr_op_counts"]


def _sub_jaxprs(eqn) -> list:
    """The jaxprs an equation runs (scan/while bodies, cond branches, jit, custom_vjp, remat)."""
    out = []
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "eqns"):  # core.Jaxpr
                out.append(v)
            elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):  # core.ClosedJaxpr
                out.append(v.jaxpr)
    return out


def jaxpr_op_counts(jaxpr) -> dict[str, Any]:
    """Primitive operations of a (closed) jaxpr: `ops` counts every body once,
    `per_step` runs a scan body `length` times and one branch of a cond (the
    largest); `by_primitive` holds the static counts.

    >>> import jax, jax.numpy as jnp
    >>> def f(x):
    ...     return jax.lax.scan(lambda c, _: (jnp.sin(c) * 2.0, None), x, None, length=4)[0].sum()
    >>> c = jaxpr_op_counts(jax.make_jaxpr(f)(1.0))
    >>> c["ops"], c["per_step"]  # sin, mul in the body (once or 4 times); convert, reduce_sum outside
    (4, 10)
    """
    by_primitive: Counter = Counter()

    def walk(jx, static: bool) -> int:
        per_step = 0
        for eqn in jx.eqns:
            subs = _sub_jaxprs(eqn)
            if not subs:
                per_step += 1
                if static:
                    by_primitive[eqn.primitive.name] += 1
                continue
            counts = [walk(s, static) for s in subs]
            if eqn.primitive.name == "cond":
                per_step += max(counts)
            else:
                per_step += int(eqn.params.get("length", 1)) * sum(counts)
        return per_step

    jx = getattr(jaxpr, "jaxpr", jaxpr)
    per_step = walk(jx, True)
    return {"ops": sum(by_primitive.values()), "per_step": per_step, "by_primitive": dict(by_primitive.most_common())}
