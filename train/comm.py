"""Data-parallel communication, made explicit: compressed gradient all-reduce,
stale (one-step-delayed) gradients, and local SGD / DiLoCo.

Under GSPMD the gradient all-reduce of data parallelism is implicit: XLA
inserts it where the replicated parameters meet the batch-sharded gradient.
To change *what* crosses the wire, each replica's gradient has to exist as a
value first, so these options compute it inside `jax.shard_map` over the
mesh axis `data` (each device: its rows of the batch, the full replicated
parameters) and reduce it by hand:

- `comm.compression=int8`: each replica quantizes its gradient in blocks of
  256 (one float32 scale per block), sends block j to replica j
  (all-to-all), which sums what it receives in float32, re-quantizes its
  1/n of the sum and sends it to everyone (all-gather): a quarter of a
  float32 ring all-reduce's bytes, plus the scales.
- `comm.compression=bf16`: the same exchange in bfloat16 (half the bytes).
- `comm.compression=powersgd` (Vogels et al., 2019): each gradient matrix M
  (n x m) is sent as two all-reduced factors, P = M Q (n x r) and, after
  orthogonalizing P, Q = M^T P (m x r); the mean gradient is approximated
  by P Q^T, r(n + m) numbers instead of n m. Q carries over between steps
  (warm start), so the power iteration improves over time. Vectors (norm
  scales) and matrices too small to gain are all-reduced exactly.
- Error feedback (`comm.error_feedback`, on by default): what compression
  lost this step (the replica's gradient minus what it contributed) is
  added to its next gradient, so errors are delayed, not dropped; without
  it, low-rank compression loses whatever lies outside the subspace for good.
- `comm.stale_gradients`: each step all-reduces the *previous* step's local
  gradients and applies them, while computing its own. Nothing in the step
  waits on that all-reduce, so the scheduler may overlap it with the whole
  forward and backward pass; the price is that every update uses a gradient
  one step old (staleness 1; Ho et al.'s stale-synchronous parallelism with
  a bound of one).
- `comm.local_steps=H > 1` (local SGD; with the outer Nesterov momentum of
  DiLoCo, Douillard et al., 2023): each replica trains its own copy with the
  inner AdamW for H steps without communicating; then the replicas' mean
  change ("outer gradient") is applied to the shared parameters by SGD with
  Nesterov momentum, and every replica restarts from the result. One
  parameter all-reduce per H steps instead of one gradient all-reduce per
  step.

The per-replica buffers (error feedback, previous gradients, local copies
and their optimizer states) carry a leading axis of size `mesh.data`,
sharded over `data`: each device holds its own, as DDP would. They are
part of the checkpointed state, so a run with these options resumes on the
same number of data-parallel replicas.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshwork.config import Config, ConfigError

AXIS = "data"
INT8_BLOCK = 256
PER_REPLICA = ("error", "prev_grads", "local_params", "inner_opt")  # comm-state entries with a replica axis


def uses_comm(cfg: Config) -> bool:
    c = cfg.comm
    return c.compression != "none" or c.stale_gradients or c.local_steps > 1


def check_comm(cfg: Config, mesh_shape: dict[str, int]) -> None:
    """ConfigError unless the options apply: pure data parallelism (dp or zero1), one option at a time."""
    if not uses_comm(cfg):
        return
    c = cfg.comm
    chosen = [
        name
        for name, on in (
            ("comm.compression", c.compression != "none"),
            ("comm.stale_gradients", c.stale_gradients),
            ("comm.local_steps", c.local_steps > 1),
        )
        if on
    ]
    if len(chosen) > 1:
        raise ConfigError(f"{chosen[1]}: cannot be combined with {chosen[0]}; choose one")
    allowed = ("dp",) if c.local_steps > 1 else ("dp", "zero1")
    if cfg.rules.preset not in allowed:
        raise ConfigError(
            f"{chosen[0]}: works on the data axis under rules.preset {' or '.join(allowed)}, "
            f"not {cfg.rules.preset}; set rules.preset=dp"
        )
    others = {a: n for a, n in mesh_shape.items() if a != AXIS and n > 1}
    if others or cfg.train.pipeline != "none":
        raise ConfigError(
            f"{chosen[0]}: needs a mesh of the data axis alone, not {others or 'a pipeline'}; "
            "set the other mesh axes to 1"
        )


# ---------------------------------------------------------------- reducers (inside shard_map)


def _mean_exact(grads, state, cfg):
    return jax.tree.map(lambda g: jax.lax.pmean(g, AXIS), grads), state


def _encode_int8(x_NCc: jax.Array) -> tuple[jax.Array, jax.Array]:
    scale_NC = jnp.max(jnp.abs(x_NCc), axis=-1) / 127.0
    q = jnp.round(x_NCc / jnp.where(scale_NC == 0, 1.0, scale_NC)[..., None]).astype(jnp.int8)
    return q, scale_NC


def _decode_int8(q: jax.Array, scale: jax.Array) -> jax.Array:
    return q.astype(jnp.float32) * scale[..., None]


def _encode_bf16(x_NCc: jax.Array) -> tuple[jax.Array, None]:
    # Sent as raw 16-bit words: XLA's CPU backend widens bf16 collectives to f32, integers it leaves alone.
    return jax.lax.bitcast_convert_type(x_NCc.astype(jnp.bfloat16), jnp.uint16), None


def _decode_bf16(q: jax.Array, scale: None) -> jax.Array:
    return jax.lax.bitcast_convert_type(q, jnp.bfloat16).astype(jnp.float32)


CODECS = {"int8": (_encode_int8, _decode_int8), "bf16": (_encode_bf16, _decode_bf16)}


def _mean_blockwise(grads, state, cfg):
    """Mean over replicas with every byte on the wire encoded (int8 with a scale per block, or bf16).

    A ring all-reduce is a reduce-scatter then an all-gather; done by hand as
    an all-to-all of encoded blocks, a float32 sum, and an all-gather of the
    encoded share, nothing is ever added up in the narrow type (and XLA's CPU
    backend, which widens a bf16 all-reduce to f32, sends what it says).
    """
    (encode, decode), n = CODECS[cfg.comm.compression], _n()
    flat, unravel = ravel_pytree(grads)
    size = flat.size
    chunk = -(-size // (n * INT8_BLOCK)) * INT8_BLOCK
    x_NCc = jnp.pad(flat.astype(jnp.float32), (0, n * chunk - size)).reshape(n, chunk // INT8_BLOCK, INT8_BLOCK)
    q, scale = encode(x_NCc)
    sent = decode(q, scale).reshape(-1)[:size]
    # Block row j goes to replica j, which sums the n contributions to its share in float32 ...
    to_all = lambda x: jax.lax.all_to_all(x, AXIS, 0, 0, tiled=True)  # noqa: E731
    share = jnp.sum(decode(*jax.tree.map(to_all, (q, scale))), axis=0) / n
    # ... and sends its 1/n of the mean back to everyone, encoded again.
    q2, scale2 = encode(share[None])
    mean = decode(*jax.tree.map(lambda x: jax.lax.all_gather(x[0], AXIS), (q2, scale2))).reshape(-1)[:size]
    # Both encodings' errors are fed back: this replica's own, and n times the error of the share
    # it re-encoded (its next contribution to that share's mean carries it).
    share_error = (share - decode(q2, scale2)[0]).reshape(-1) * n
    owned = jax.lax.dynamic_update_slice(
        jnp.zeros(n * chunk, jnp.float32), share_error, (jax.lax.axis_index(AXIS) * chunk,)
    )
    error = flat - sent + owned[:size]
    return unravel(mean.astype(flat.dtype)), {"error": unravel(error.astype(flat.dtype))}


def matrix_view(shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """(batch, rows, cols) PowerSGD compresses a gradient of `shape` as, or None to send it exactly.

    A stacked (scanned) weight's leading axis is its layers: one matrix per
    layer. The other axes split where rows and columns are most even.
    """
    if len(shape) < 2:
        return None
    batch, dims = (shape[0], shape[1:]) if len(shape) >= 3 else (1, shape)
    rows, cols = max(((math.prod(dims[:k]), math.prod(dims[k:])) for k in range(1, len(dims))), key=min)
    return batch, rows, cols


def compressed(shape: tuple[int, ...], rank: int) -> bool:
    """Whether rank-`rank` factors of a gradient of `shape` take under half its size."""
    view = matrix_view(shape)
    return view is not None and rank * (view[1] + view[2]) < view[1] * view[2] // 2


def _mean_powersgd(grads, state, cfg):
    leaves, treedef = jax.tree.flatten(grads)
    means, new_q = [], {}
    for i, g in enumerate(leaves):
        q = state["q"].get(str(i))
        if q is None:  # a vector, or a matrix too small to gain: exact
            means.append(jax.lax.pmean(g, AXIS))
            continue
        batch, rows, cols = matrix_view(g.shape)
        # m: (batch, rows, cols) matrices; p: (batch, rows, r) and q: (batch, cols, r) their factors.
        m = g.reshape(batch, rows, cols).astype(jnp.float32)
        p = jax.lax.pmean(m @ q, AXIS)
        p = jnp.linalg.qr(p)[0]  # the same on every replica: it was all-reduced
        q = jax.lax.pmean(jnp.swapaxes(m, 1, 2) @ p, AXIS)
        means.append((p @ jnp.swapaxes(q, 1, 2)).reshape(g.shape).astype(g.dtype))
        new_q[str(i)] = q
    mean = treedef.unflatten(means)
    # This replica's error: its gradient minus what the shared approximation kept of it.
    error = jax.tree.map(lambda g, m: g - m, grads, mean)
    return mean, {"error": error, "q": new_q}


REDUCERS = {"none": _mean_exact, "bf16": _mean_blockwise, "int8": _mean_blockwise, "powersgd": _mean_powersgd}


def _n() -> int:
    return jax.lax.axis_size(AXIS)


# ---------------------------------------------------------------- state


def init_comm_state(cfg: Config, params: Any, n_replicas: int, inner_tx: optax.GradientTransformation | None):
    """The comm entries of the train state (see the module docstring); {} when no option is on."""
    c = cfg.comm
    per_replica = lambda tree: jax.tree.map(  # noqa: E731
        lambda p: jnp.zeros((n_replicas, *p.shape), jnp.float32 if c.compression != "none" else p.dtype), tree
    )
    if c.local_steps > 1:
        local = jax.tree.map(lambda p: jnp.broadcast_to(p, (n_replicas, *p.shape)), params)
        return {"local_params": local, "inner_opt": jax.vmap(inner_tx.init)(local)}
    if c.stale_gradients:
        return {"prev_grads": per_replica(params)}
    state = {"error": per_replica(params)} if c.error_feedback else {}
    if c.compression == "powersgd":
        key = jax.random.key(0)  # the same start on every replica: Q is shared
        state["q"] = {
            str(i): jax.random.normal(key, (matrix_view(p.shape)[0], matrix_view(p.shape)[2], c.rank))
            for i, p in enumerate(jax.tree.leaves(params))
            if compressed(p.shape, c.rank)
        }
    return state


def comm_shardings(comm_abstract: dict, mesh) -> dict:
    """Per-replica buffers split over `data` along their leading axis; the rest replicated."""
    return {k: NamedSharding(mesh, P(AXIS) if k in PER_REPLICA else P()) for k in comm_abstract}


# ---------------------------------------------------------------- gradients with explicit reduction


def make_comm_gradients(accumulate: Callable, cfg: Config, mesh) -> Callable:
    """grads_fn(params, buffers, batch, noise_key, comm) -> (metrics, mean grads, new comm), for
    compression and stale gradients; `accumulate` computes one replica's (metrics, grads)."""
    c = cfg.comm
    reduce = REDUCERS[c.compression]

    def local(params, buffers, batch, noise_key, comm):
        comm = {k: jax.tree.map(lambda x: x[0], v) if k in PER_REPLICA else v for k, v in comm.items()}
        metrics, grads = accumulate(params, buffers, batch, noise_key)
        metrics = jax.tree.map(lambda m: jax.lax.pmean(m, AXIS), metrics)
        if c.stale_gradients:  # all-reduce last step's gradients: nothing below waits on it
            mean, _ = _mean_exact(comm["prev_grads"], None, cfg)
            new = {"prev_grads": grads}
        else:
            if c.error_feedback:
                grads = jax.tree.map(lambda g, e: g + e.astype(g.dtype), grads, comm["error"])
            mean, new = reduce(grads, comm, cfg)
            if not c.error_feedback:
                new.pop("error", None)
        new = {k: (jax.tree.map(lambda x: x[None], v) if k in PER_REPLICA else v) for k, v in new.items()}
        return metrics, mean, new

    def grads_fn(params, buffers, batch, noise_key, comm):
        specs = {k: P(AXIS) if k in PER_REPLICA else P() for k in comm}
        return jax.shard_map(
            local, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(), specs), out_specs=(P(), P(), specs), check_vma=False
        )(params, buffers, batch, noise_key, comm)

    return grads_fn


def outer_optimizer(cfg: Config) -> optax.GradientTransformation:
    """DiLoCo's outer step: SGD with Nesterov momentum on the replicas' mean parameter change."""
    return optax.sgd(cfg.comm.outer_lr, momentum=cfg.comm.outer_momentum, nesterov=True)


def make_diloco_step(
    graphdef,
    accumulate: Callable,
    inner_tx: optax.GradientTransformation,
    outer_tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    cfg: Config,
    mesh,
    seed: int = 0,
) -> Callable:
    """step(state, batch) -> (state, metrics) for local SGD / DiLoCo (comm.local_steps = H).

    Every step: each replica updates its own copy with the inner optimizer on
    its rows of the batch, inside shard_map, with no communication but the
    scalar metrics. Every H-th step, also: the outer gradient (shared
    parameters minus the replicas' mean) goes through the outer optimizer
    (one all-reduce of the parameters) and every replica restarts from the
    new shared parameters.
    """
    H = cfg.comm.local_steps

    def local(local_params, inner_opt, buffers, batch, noise_key):
        mine = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731
        params, opt = mine(local_params), mine(inner_opt)
        metrics, grads = accumulate(params, buffers, batch, noise_key)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
        finite = jax.lax.pmin(finite.astype(jnp.int32), AXIS) > 0  # all replicas skip together
        updates, new_opt = inner_tx.update(grads, opt, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b)[None], new, old)  # noqa: E731
        metrics = {
            **jax.tree.map(lambda m: jax.lax.pmean(m, AXIS), metrics),
            "grad_norm": jax.lax.pmean(grad_norm, AXIS),
            "nonfinite": ~finite,
        }
        return keep(new_params, params), keep(new_opt, opt), metrics

    def sync(args):
        params, opt_state, local_params = args
        outer_grad = jax.tree.map(lambda p, lp: p - lp.mean(axis=0).astype(p.dtype), params, local_params)
        updates, opt_state = outer_tx.update(outer_grad, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, jax.tree.map(lambda p, lp: jnp.broadcast_to(p, lp.shape), params, local_params)

    def train_step(state, batch):
        noise_key = jax.random.fold_in(jax.random.key(seed), state.step)
        local_params, inner_opt, metrics = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(AXIS), P(AXIS), P(), P(AXIS), P()),
            out_specs=(P(AXIS), P(AXIS), P()),
            check_vma=False,
        )(state.comm["local_params"], state.comm["inner_opt"], state.buffers, batch, noise_key)
        step = state.step + 1
        params, opt_state, local_params = jax.lax.cond(
            step % H == 0, sync, lambda args: args, (state.params, state.opt_state, local_params)
        )
        metrics = {**metrics, "lr": schedule(state.step)}
        comm = {"local_params": local_params, "inner_opt": inner_opt}
        return state.replace(step=step, params=params, opt_state=opt_state, comm=comm), metrics

    return train_step
