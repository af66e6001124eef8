"""How the layers being traced run on the mesh: one `ParallelContext`, chosen once per trace.

A layer's math is written for one device. The context says how that math runs on the mesh that
is current (`jax.set_mesh`): which mesh axes split each logical dimension (the rules table), whether
tensor-parallel projections run as collective matmuls, and how attention runs when its sequence is
split or its kernel is opaque to the partitioner. The trainer and the generator each build one
context and make it current while tracing (`use_parallel`); layers ask `current_parallel()` and call
its implementations, so a model file holds math and this file holds the parallel code paths.

The context is a frozen, hashable value, and jit's cache does not key on it: trace a jitted
function under one context only (the trainer's step and the generator's forward are closures made
per trainer and per generator, so each is traced under its own).

    >>> from meshwork.sharding.mesh import make_mesh
    >>> from meshwork.sharding.rules import rules_for
    >>> mesh = make_mesh({"data": -1})
    >>> f = jax.jit(lambda x: with_logical_constraint(x * 2, ("act_batch", "act_embed")))
    >>> with jax.set_mesh(mesh), use_parallel(ParallelContext(rules_for("dp"))):
    ...     y = f(jax.numpy.ones((jax.device_count(), 4)))
    >>> y.addressable_shards[0].data.shape   # one row per device
    (1, 4)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Sequence

import jax
from jax.sharding import PartitionSpec

from meshwork.sharding.context_parallel import ALGORITHMS, context_parallel_attention
from meshwork.sharding.rules import Rules, compiler_axes, logical_to_spec, split_axes

# (q_BLHK, k_BSGK, v_BSGK, segment_ids_BL or None, sinks_H or None) -> o_BLHK: attention on whatever
# part of the batch and heads it is given, with those heads' sinks (the layer closes over causality,
# scale, window, soft-capping and positions). A formula that masks by position (XLA's; it sets
# `masks_by_position = True`) also takes `positions=(q_positions_BL, kv_positions_BS)` and
# `kv_segment_ids_BS=`, for queries and keys that are not the same whole rows (context parallelism:
# sharding/context_parallel.py); the kernels mask by index and take tokens in order 0..L-1.
LocalAttention = Callable[..., jax.Array]


@dataclasses.dataclass(frozen=True)
class ParallelContext:
    """rules: the logical-name -> mesh-axes table activations are constrained by (None: no
    constraints, e.g. one device). collective_matmul: SwiGLU runs as ppermute rings overlapped
    with partial matmuls wherever the rules are Megatron-SP's (config `comm.collective_matmul`).
    context_parallel: how attention runs when the rules split the sequence (config
    `train.context_parallel`: ring, all_gather, ulysses or usp; sharding/context_parallel.py)."""

    rules: Rules | None = None
    collective_matmul: bool = False
    context_parallel: str = "ring"

    def __post_init__(self):
        if self.rules is not None:  # a tuple, so the context hashes
            object.__setattr__(self, "rules", tuple(tuple(r) for r in self.rules))
        if self.context_parallel not in ALGORITHMS:
            raise ValueError(f"context_parallel={self.context_parallel!r}; choose one of {', '.join(ALGORITHMS)}")

    def split(self, name: str) -> tuple[str, ...]:
        """The mesh axes of size > 1 (of the current mesh) that split logical dimension `name`."""
        return split_axes(name, self.rules, _mesh_shape()) if self.rules is not None else ()

    # ------------------------------------------------------------ attention

    def attention(
        self,
        local: LocalAttention,
        q_BLHK: jax.Array,
        k_BSGK: jax.Array,
        v_BSGK: jax.Array,
        positions_BL: jax.Array | None,
        *,
        causal: bool,
        scale: float | None,
        segment_ids_BL: jax.Array | None = None,
        window: int | None = None,
        opaque: bool = False,
        softcap: float | None = None,
        sinks_H: jax.Array | None = None,
    ) -> jax.Array:
        """`local` run on the mesh: the one interface through which a layer's attention is parallelized.

        - the sequence split over mesh axes (context parallelism, the `cp` preset): the context's
          `context_parallel` algorithm (sharding/context_parallel.py: ring, all_gather, ulysses,
          usp), inside a pipeline stage all-gathered keys and values (or ulysses); each masks by
          `positions_BL`, so any token layout (e.g. the load-balancing zigzag) is correct, and
          takes segment ids, a window, soft-capping and sinks;
        - `opaque` (a Pallas kernel, which the partitioner cannot split): `local` per device inside
          `shard_map`, each device holding whole sequences of its batch rows and heads;
        - otherwise `local` itself, which XLA partitions like any other op.
        """
        seq_axes = self.split("act_seq")
        if seq_axes:
            return context_parallel_attention(
                self.context_parallel,
                local,
                q_BLHK,
                k_BSGK,
                v_BSGK,
                positions_BL,
                seq_axes=seq_axes,
                batch_axes=self.split("act_batch"),
                head_axes=self._head_axes(),
                causal=causal,
                scale=scale,
                segment_ids_BL=segment_ids_BL,
                window=window,
                softcap=softcap,
                sinks_H=sinks_H,
                opaque=opaque,
            )
        if opaque:
            return self._per_device(local, q_BLHK, k_BSGK, v_BSGK, segment_ids_BL, sinks_H)
        return local(q_BLHK, k_BSGK, v_BSGK, segment_ids_BL, sinks_H)

    def _head_axes(self) -> tuple[str, ...]:
        """The mesh axes splitting the query heads, which must split the kv heads alike."""
        heads, kv_heads = self.split("act_heads"), self.split("act_kv_heads")
        if heads != kv_heads:
            raise ValueError(
                f"context parallelism splits query and kv heads alike; the rules split act_heads over {heads} "
                f"and act_kv_heads over {kv_heads}: map both to the same mesh axes"
            )
        return heads

    def _per_device(self, local: LocalAttention, q_BLHK, k_BSGK, v_BSGK, segment_ids_BL, sinks_H=None):
        """`local` on each device's shard of the batch and heads, inside `shard_map` with the specs the
        rules give the activations (segment ids split by batch like them, sinks by heads)."""
        mesh_shape = _mesh_shape()
        if self.rules is None or not mesh_shape or all(n == 1 for n in mesh_shape.values()):
            return local(q_BLHK, k_BSGK, v_BSGK, segment_ids_BL, sinks_H)
        batch, heads = compiler_axes(self.split("act_batch")), compiler_axes(self.split("act_heads"))
        spec = PartitionSpec(batch or None, None, heads or None, None)
        optional = [
            (x, s)
            for x, s in ((segment_ids_BL, PartitionSpec(batch or None, None)), (sinks_H, PartitionSpec(heads or None)))
            if x is not None
        ]

        def run(q, k, v, *rest):
            it = iter(rest)
            seg = next(it) if segment_ids_BL is not None else None
            return local(q, k, v, seg, next(it) if sinks_H is not None else None)

        # check_vma=False: pallas_call outputs cannot declare the mesh axes they vary over.
        return jax.shard_map(
            run,
            mesh=jax.sharding.get_abstract_mesh(),
            in_specs=(spec,) * 3 + tuple(s for _, s in optional),
            out_specs=spec,
            check_vma=False,
        )(q_BLHK, k_BSGK, v_BSGK, *(x for x, _ in optional))

    # ------------------------------------------------------------ MLP

    def collective_matmul_axes(self) -> tuple[str, tuple[str, ...]] | None:
        """(the axis, the batch axes) for a collective-matmul SwiGLU (sharding/collective_matmul.py
        `tp_mlp`): when collective matmul is on and one mesh axis splits both the MLP's hidden
        dimension and the residual stream's sequence (and nothing else of the layer), as the `sp`
        preset does; None otherwise, and inside a shard_map (pipeline stages)."""
        mesh = jax.sharding.get_abstract_mesh()
        if not self.collective_matmul or self.rules is None or mesh.empty or mesh.manual_axes:
            return None
        axes = self.split("mlp")
        if (
            len(axes) != 1
            or any(self.split(n) != axes for n in ("act_mlp", "act_norm_seq"))
            or self.split("act_seq")
            or self.split("act_embed")
        ):
            return None
        return axes[0], self.split("act_batch")


_CURRENT: contextvars.ContextVar[ParallelContext] = contextvars.ContextVar(
    "meshwork_parallel",
    default=ParallelContext(),  # noqa: B039 (a frozen value)
)


@contextlib.contextmanager
def use_parallel(parallel: ParallelContext) -> Iterator[ParallelContext]:
    """Makes `parallel` the context layers read while tracing; use with `jax.set_mesh(mesh)` around
    the first call (the trace) of a jitted function."""
    token = _CURRENT.set(parallel)
    try:
        yield parallel
    finally:
        _CURRENT.reset(token)


def current_parallel() -> ParallelContext:
    """The context being traced under (outside any: no rules, no collective matmul)."""
    return _CURRENT.get()


def use_rules(rules: Rules) -> contextlib.AbstractContextManager[ParallelContext]:
    """`use_parallel` with only a rules table (the context's other choices at their defaults)."""
    return use_parallel(ParallelContext(rules))


def current_rules() -> Rules | None:
    return current_parallel().rules


def with_logical_constraint(x: jax.Array, names: Sequence[str | None], rules: Rules | None = None) -> jax.Array:
    """Constrains activation `x` to the sharding its logical `names` map to (under `rules`, or the
    current context's).

    A no-op outside a mesh (`jax.set_mesh`) or without rules, so model code can call it
    unconditionally and still run on one device.
    """
    rules = rules if rules is not None else current_rules()
    mesh = jax.sharding.get_abstract_mesh()
    # Inside shard_map the axes are manual: each device already holds exactly its part.
    if rules is None or mesh.empty or mesh.are_all_axes_manual:
        return x
    spec = logical_to_spec(names, rules)
    if mesh.manual_axes:
        # Partly manual (a pipeline stage with its data shards manual too): the constraint can
        # only name the axes the compiler still owns; the manual ones already split x.
        spec = _without(spec, set(mesh.manual_axes))
    return jax.lax.with_sharding_constraint(x, spec)


def _without(spec: PartitionSpec, axes: set[str]) -> PartitionSpec:
    """`spec` with the mesh `axes` removed from every entry."""
    out = []
    for entry in spec:
        kept = tuple(a for a in ((entry,) if isinstance(entry, str) else tuple(entry or ())) if a not in axes)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*out)


def _mesh_shape() -> dict[str, int]:
    mesh = jax.sharding.get_abstract_mesh()
    return {} if mesh.empty else dict(mesh.shape)
