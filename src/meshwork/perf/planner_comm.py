"""Planner, part 2: the collectives of one train step, and what they cost.

`step_collectives` lists what a meshwork train step sends, per device, in the
convention of `sharding/report.py` (so the two can be compared line by
line): kinds are all-reduce, all-gather, reduce-scatter, all-to-all and
collective-permute (send/recv); `payload_bytes` is the per-device buffer S
(the output of an all-gather, the input otherwise) and `sent_bytes` what one
device sends under ring algorithms, per step:

    all-reduce 2(g-1)/g S    all-gather, reduce-scatter, all-to-all (g-1)/g S
    collective-permute S

Where each comes from (g: the devices of the mesh axes involved):

- gradients (`grad sync`): a weight's gradient is summed over the axes that
  feed it different tokens (`planner_weights.token_axes`). Over the axes that
  split it (fsdp) or its gradient or moments (zero1, zero2) it is
  reduce-scattered, over the rest all-reduced (on the 1/s shard: hybrid);
  zero1/zero2 then all-gather the updated parameters. meshwork's gradient
  accumulation reduces every microbatch's gradients (measured: the
  collectives sit inside the accumulation loop); its pipeline executor sums
  over the data axes once, after the schedule, but over axes that split the
  weight (fsdp) inside the loop over schedule time steps;
  `grad_sync="per_step"` models frameworks that reduce once.
- weights (`fsdp gather`): weights split over token axes are all-gathered
  before use, twice per scanned layer (forward, and again in the backward:
  inside a scan the saved residual is the sharded weight), once for the
  embedding and LM head.
- multi-head latent attention under tensor parallelism: the head-split
  products are wq/wq_b and wkv_b, whose inputs are the query and kv latents:
  their backward reductions are latent-sized (one all-reduce per layer of
  kv_lora_rank + q_lora_rank per token) instead of h-sized q, k, v ones.
  Each MTP module's block adds one layer's tp, ep and cp collectives.
- tensor parallelism (Megatron, Shoeybi et al. 2019): per layer one
  all-reduce of the (b, s, h) activation after attention and after the MLP in
  the forward pass, and one per column-parallel input in the backward: 2 with
  Megatron's fused QKV and fc1 matmuls (`fused_projections`), 3 + 2 with
  meshwork's separate q, k, v and gate, up projections (as XLA compiles them).
  Sequence parallelism (Korthikanti et al. 2022) turns them into 2
  all-gathers + 2 reduce-scatters forward, and backward one reduce-scatter
  per input gradient plus 4 all-gathers (saved sharded inputs, output
  gradients). The vocab-parallel embedding and logits add two all-reduces.
- context parallelism (`train.context_parallel`, planner_context.py): per layer
  the ring's K/V blocks (with their positions) go round, c-1 hops forward and
  c-1 + c (float32 dK/dV) backward, hidden under the layer's attention compute
  as far as it lasts; all_gather all-gathers K/V forward and reduce-scatters
  dK/dV backward; ulysses all-to-alls q, k, v and the output each way; usp both.
- expert parallelism: per MoE layer an all-to-all to dispatch and one to
  combine, forward and backward; meshwork's dropless dispatch pads each
  destination's buffer to the no-drop worst case (N x T k rows).
- optimizer: Muon's Newton-Schulz (`optimizer.muon.newton_schulz`), the all-to-alls and
  all-gathers of gather or the Gram all-reduces of sharded, as planner_optimizer.py counts them;
  AdamW sends nothing beyond the gradients' reduction (the clipping norm's few scalars aside).
- pipeline: meshwork's executor permutes an activation forward and a
  cotangent backward at each time step of its schedule table (2(M + P - 1)
  for GPipe and 1F1B; `planner_pipeline`). Interleaving also moves the
  stage's blocks into chunk order and their gradients back: one all-to-all
  over `stage` each way.

Times follow the textbook algorithm costs (Thakur et al. 2005; Patarasuk &
Yuan 2009; NCCL's trees), with the group's placement on nodes decided by the
mesh order (`tensor` innermost, so on neighbouring devices):

    ring          all-reduce 2(n-1)/n S/B + 2(n-1) a;  AG, RS, A2A (n-1)/n S/B + (n-1) a
    tree          all-reduce 2 S/B + 2 log2(n) a;      AG, RS S/B + log2(n) a
    hierarchical  inside each node over n_i (intra B, a), across n_o nodes on S/n_i
                  (inter B, a), e.g. all-reduce 2(n_i-1)/n_i S/B_i + 2(n_o-1)/n_o S/(n_i B_o) + ...

A ring that leaves the node runs at the inter-node bandwidth.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from meshwork.config import Config
from meshwork.perf.flops import attention_dims, mtp_block_is_moe
from meshwork.perf.hardware import Accelerator
from meshwork.perf.planner_context import AttentionShard, cp_collectives
from meshwork.perf.planner_layout import Layout
from meshwork.perf.planner_memory import ITEMSIZE, StateBytes, token_shape
from meshwork.perf.planner_optimizer import merged, newton_schulz_cost
from meshwork.perf.planner_pipeline import pipeline_schedule
from meshwork.perf.planner_weights import model_weights, shard_size, token_axes
from meshwork.sharding.mesh import MESH_AXES

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
ALGORITHMS = ("ring", "tree", "hierarchical")


@dataclasses.dataclass(frozen=True)
class Collective:
    """`count` executions per step of one collective over mesh `axes` (`group`
    devices), each with per-device buffer `payload_bytes` (hlo.py's S)."""

    kind: str
    axes: tuple[str, ...]
    group: int
    payload_bytes: float
    count: float
    what: str
    overlappable: bool = True
    """Can run while other work computes (gradients, weight gathers); activations
    of tp/sp/ep/cp and pipeline sends are on the critical path."""
    under_attention: bool = False
    """Overlaps the attention compute of its layer (ring attention's hops): exposed
    only where the hops take longer than that compute (`plan`)."""
    optimizer: bool = False
    """Sent by the optimizer update, after the backward pass (Muon's Newton-Schulz): the planner
    counts its time with the update's, outside the pipeline bubble and the overlap."""

    @property
    def sent_bytes(self) -> float:
        """Bytes one device sends per step under ring algorithms (sharding/hlo.py's convention)."""
        return self.count * ring_sent(self.kind, self.group, self.payload_bytes)


def ring_sent(kind: str, g: int, payload: float) -> float:
    """Bytes one device sends in one ring collective over g devices of buffer `payload`."""
    if kind == "collective-permute":
        return payload
    if g <= 1:
        return 0.0
    return (2.0 if kind == "all-reduce" else 1.0) * (g - 1) / g * payload


@dataclasses.dataclass(frozen=True)
class CommOptions:
    fused_projections: bool = False
    """Megatron's fused QKV and fc1 matmuls: one backward all-reduce per block
    (2 per layer) instead of one per projection (q, k, v, gate, up: 5)."""
    grad_sync: str = "per_microbatch"
    """"per_microbatch": gradients reduced inside meshwork's accumulation loop;
    "per_step": once per step after local accumulation (DeepSpeed, Megatron)."""


def step_collectives(
    cfg: Config, layout: Layout, options: CommOptions = CommOptions(), accounting: StateBytes | None = None
) -> list[Collective]:
    """Every collective of one train step of `cfg` under `layout`, per device.

    >>> from meshwork.perf.planner_layout import make_layout
    >>> cs = step_collectives(Config(), make_layout(data=8))
    >>> sorted({c.kind for c in cs})
    ['all-reduce']
    """
    acc = accounting or StateBytes.meshwork(cfg)
    out: dict[tuple, list] = {}

    def add(kind, axes, payload, count, what, overlappable=True, under_attention=False):
        axes = tuple(a for a in MESH_AXES if a in axes)
        group = math.prod(layout.sizes[a] for a in axes)
        if group <= 1 and kind != "collective-permute" or count == 0 or payload == 0:
            return
        key = (kind, axes, what, overlappable, under_attention, count)
        out.setdefault(key, [0.0])[0] += payload

    _weight_collectives(cfg, layout, options, acc, add)
    _activation_collectives(cfg, layout, options, add)
    listed = [
        Collective(kind, axes, math.prod(layout.sizes[a] for a in axes), payload[0], count, what, ovl, attn)
        for (kind, axes, what, ovl, attn, count), payload in out.items()
    ]
    if cfg.optimizer.name == "muon":  # the configured variant's Newton-Schulz (planner_optimizer.py)
        listed += merged(c for c in newton_schulz_cost(cfg, layout).collectives if c.group > 1)
    return listed


def _weight_collectives(cfg, layout, options, acc, add) -> None:
    M = layout.microbatches
    reps = M if options.grad_sync == "per_microbatch" else 1
    sizes = layout.sizes
    for w in model_weights(cfg.model):
        P = layout.weight_axes(w, "params")
        G = layout.weight_axes(w, "grads")
        O = layout.weight_axes(w, "opt_state")
        R = token_axes(w, layout)
        gather = [a for a in R if a in P]
        shard = shard_size(w, layout, "params")
        used = shard * math.prod(sizes[a] for a in gather)  # elements of the weight as a device uses it
        # One collective per layer for scanned weights (XLA reduces a layer's gradients together).
        layers = w.shape[0] // math.prod(sizes[a] for a in layout.split("layers")) if w.scanned else 1
        stack = w.path.split(".")[0] if w.scanned else "rest"
        per = 1 / layers
        if gather:
            add(
                "all-gather",
                gather,
                used * acc.param * per,
                layers * (2 if w.scanned else 1) * M,
                f"fsdp gather ({stack})",
            )
        scatter = [a for a in R if a in P or a in G or a in O]
        rest = [a for a in R if a not in scatter]
        grad = used * acc.grad * per
        sync = lambda kind, axes, grad: add(kind, axes, grad, layers * reps, f"grad sync ({stack})")  # noqa: E731
        if layout.pipeline != "none" and options.grad_sync == "per_microbatch":
            # Measured: the pipeline executor sums the gradients over its data axes (batch axes
            # that split no weight: the train step's data_axes) once, after the schedule, one
            # collective per gradient; over axes that split the weight (fsdp) the compiler
            # reduces inside the loop over the table's time steps (2(M+P-1) for GPipe and
            # 1F1B), the stages' layers twice per step, the head once.
            in_loop = pipeline_schedule(layout).steps * (2 if w.scanned else 1)

            def sync(kind, axes, grad, in_loop=in_loop, layers=layers, stack=stack):
                if any(a in P for a in axes):
                    add(kind, axes, grad, layers * in_loop, f"grad sync ({stack})")
                else:
                    add(kind, axes, grad * layers, 1, f"grad sync ({stack}, once)")

        if scatter:
            sync("reduce-scatter", scatter, grad)
            grad /= math.prod(sizes[a] for a in scatter)
        if rest:
            sync("all-reduce", rest, grad)
        if w.scanned and layout.pipeline == "interleaved" and layout.virtual_stages > 1 and "stage" in P:
            # The blocks are stored in model order (stage s: layers s L/P ...); interleaving
            # needs chunks s, s+P, ... on stage s: an all-to-all of the weights in, of their
            # gradients out (measured on lm_tiny: 1.50 MiB per step on stage 2, as here).
            add("all-to-all", ("stage",), shard * acc.param, 1, "interleaved chunk layout")
            add("all-to-all", ("stage",), shard * acc.grad, 1, "interleaved chunk layout")
        regather = [a for a in R if (a in G or a in O) and a not in P]
        if regather:  # ZeRO-1/2: every device rebuilds the parameters from the updated shards
            add("all-gather", regather, shard * acc.param, 1, "zero param gather")


def _activation_collectives(cfg, layout, options, add) -> None:
    m, p = cfg.model, ITEMSIZE[cfg.train.compute_dtype]
    ts = token_shape(cfg, layout)
    M, P = layout.microbatches, layout.sizes["stage"]
    act = ts.tokens * m.d_model * p  # one (b, s, h) activation, full hidden
    # The MTP modules' blocks run after the last stage's layers (one device's share: all of them).
    depth = m.mtp.depth
    layers = m.n_layers // P + depth
    n_moe = m.moe.n_moe_layers(m.n_layers) if m.kind == "moe" else 0
    moe_layers = (n_moe // P if P > 1 else n_moe) + (depth if depth and mtp_block_is_moe(m) else 0)

    tp = layout.split("act_heads")
    if tp:
        sp = set(layout.split("act_norm_seq")) & set(tp)
        n_in = 2 if options.fused_projections else 5  # backward input-gradient reductions per layer
        latent = 0.0
        if m.mla is not None and not options.fused_projections:
            # MLA's head-split products are wq (input x) or wq_b (input: the query latent) and
            # wkv_b (input: the kv latent); the down-projections are not split. Their input
            # gradients are all-reduced at the latent's width (the latent is never sequence-split).
            n_in = 2 + (0 if m.mla.q_lora_rank else 1)  # gate, up (+ wq)
            latent = ts.tokens * (m.mla.kv_lora_rank + (m.mla.q_lora_rank or 0)) * p
        if sp:
            add("all-gather", tp, act, 2 * layers * M, "tp/sp layers forward", False)
            add("reduce-scatter", tp, act, 2 * layers * M, "tp/sp layers forward", False)
            add("all-gather", tp, act, 4 * layers * M, "tp/sp layers backward", False)
            add("reduce-scatter", tp, act, n_in * layers * M, "tp/sp layers backward", False)
        else:
            add("all-reduce", tp, act, 2 * layers * M, "tp layers forward", False)
            add("all-reduce", tp, act, n_in * layers * M, "tp layers backward", False)
        if latent:
            add("all-reduce", tp, latent, layers * M, "tp mla latent backward", False)
    vocab = layout.split("act_vocab")
    if vocab:  # vocab-parallel embedding (forward) and logits (input gradient, backward)
        add("all-reduce", vocab, act, 2 * M, "vocab-parallel embedding and logits", False)
        add("all-reduce", vocab, ts.tokens * 4, 3 * M, "vocab-parallel cross-entropy", False)

    cp = layout.split("act_seq")
    if cp:
        shard = attention_shard(cfg, layout)
        # Under a remat policy the layer's backward runs its attention's forward again, collectives
        # included (planner_context.forward_runs_under).
        for c in cp_collectives(layout.context_parallel, shard, cp, layout.sizes, remat=layout.remat):
            add(
                c.kind,
                c.axes,
                c.payload_bytes,
                c.count * (layers if c.per_layer else 1) * M,
                c.what,
                False,
                c.overlap == "attention",
            )

    ep = layout.split("expert")
    if ep and n_moe:
        N, e = layout.ways("expert"), m.moe
        if e.capacity_factor:
            C = math.ceil(e.capacity_factor * ts.s * e.top_k / e.n_experts)
            buf = e.n_experts * C * ts.b * m.d_model * p
        else:
            buf = N * ts.tokens * e.top_k * m.d_model * p
        add("all-to-all", ep, buf, 4 * moe_layers * M, "expert dispatch/combine", False)

    if (sched := pipeline_schedule(layout)) is not None:
        steps = sched.steps  # 2(M + P - 1) for GPipe and 1F1B
        add("collective-permute", ("stage",), act / ts.t_norm, 2 * steps, "pipeline sends", False)


def attention_shard(cfg: Config, layout: Layout) -> AttentionShard:
    """One device's attention inputs per microbatch under `layout` (before context parallelism)."""
    m, ts = cfg.model, token_shape(cfg, layout)
    if m.mla is None:
        heads, kv_heads, width = m.n_heads // ts.t_heads, m.n_kv_heads // ts.t_kv, m.resolved_head_dim
    else:  # training's expanded form: keys and values per head, padded to one width
        heads = kv_heads = m.n_heads // ts.t_heads
        width = max(attention_dims(m))
    return AttentionShard(
        b=ts.b,
        s=ts.s,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=width,
        itemsize=ITEMSIZE[cfg.train.compute_dtype],
        segments=cfg.data.source in ("text", "chat"),
        # The trainer lays tokens out in zigzag order (with positions) except under Ulysses.
        positions=layout.context_parallel != "ulysses",
    )


def summarize(collectives: list[Collective]) -> dict[str, dict[str, float]]:
    """{kind: {"count", "bytes", "payload_bytes"}} per step, as `sharding.report.collective_summary`."""
    out = {k: {"count": 0.0, "bytes": 0.0, "payload_bytes": 0.0} for k in KINDS}
    for c in collectives:
        out[c.kind]["count"] += c.count
        out[c.kind]["bytes"] += c.sent_bytes
        out[c.kind]["payload_bytes"] += c.payload_bytes * c.count
    return out


# ---------------------------------------------------------------------------
# Time


@functools.lru_cache(maxsize=4096)
def placement(axes: tuple[str, ...], mesh: tuple[tuple[str, int], ...], devices_per_node: int) -> tuple[int, int]:
    """(devices per node, nodes) of a group over mesh `axes`, devices numbered
    row-major over the mesh (the last axis, `tensor`, fastest).

    >>> mesh = (("stage", 1), ("data", 8), ("fsdp", 1), ("expert", 1), ("sequence", 1), ("tensor", 8))
    >>> placement(("tensor",), mesh, 8), placement(("data",), mesh, 8)
    ((8, 1), (1, 8))
    """
    sizes = dict(mesh)
    strides, s = {}, 1
    for a in reversed(MESH_AXES):
        strides[a] = s
        s *= sizes[a]
    members = [0]
    for a in axes:
        members = [m + i * strides[a] for m in members for i in range(sizes[a])]
    nodes = len({m // devices_per_node for m in members})
    return len(members) // nodes, nodes


def algorithm_time(kind: str, S: float, n_intra: int, n_nodes: int, hw: Accelerator, algorithm: str) -> float:
    """Seconds for one collective of per-device buffer S over n_intra x n_nodes devices."""
    n = n_intra * n_nodes
    if n <= 1 and kind != "collective-permute":
        return 0.0
    across = n_nodes > 1
    bw = hw.inter_node_bandwidth if across else hw.intra_node_bandwidth
    lat = hw.inter_node_latency if across else hw.intra_node_latency
    if kind == "collective-permute":
        return S / bw + lat
    if algorithm == "hierarchical" and across and n_intra > 1:
        ni, no = n_intra, n_nodes
        bi, bo, li, lo = hw.intra_node_bandwidth, hw.inter_node_bandwidth, hw.intra_node_latency, hw.inter_node_latency
        if kind == "all-reduce":
            return 2 * (ni - 1) / ni * S / bi + 2 * (no - 1) / no * S / ni / bo + 2 * (ni - 1) * li + 2 * (no - 1) * lo
        if kind == "all-to-all":
            return (ni - 1) / ni * S / bi + (no - 1) / no * S / bo + (ni - 1) * li + (no - 1) * lo
        return (ni - 1) / ni * S / bi + (no - 1) / no * S / ni / bo + (ni - 1) * li + (no - 1) * lo
    if algorithm == "tree" and kind != "all-to-all":
        hops = math.ceil(math.log2(n))
        return (2 * S / bw + 2 * hops * lat) if kind == "all-reduce" else (S / bw + hops * lat)
    factor = 2 if kind == "all-reduce" else 1
    return factor * ((n - 1) / n * S / bw + (n - 1) * lat)


def collective_time(
    c: Collective, layout: Layout, hw: Accelerator, devices_per_node: int, algorithm: str = "auto"
) -> tuple[float, str]:
    """(seconds per step, algorithm used) for `c`; "auto" takes the fastest of
    ring, tree and hierarchical, as NCCL picks per message size."""
    n_intra, n_nodes = placement(c.axes, layout.mesh, devices_per_node)
    if algorithm != "auto":
        return algorithm_time(c.kind, c.payload_bytes, n_intra, n_nodes, hw, algorithm) * c.count, algorithm
    options = ["ring"]
    if c.kind in ("all-reduce", "all-gather", "reduce-scatter"):
        options.append("tree")
    if n_nodes > 1 and n_intra > 1 and c.kind != "collective-permute":
        options.append("hierarchical")
    best_t, best_a = min(
        (algorithm_time(c.kind, c.payload_bytes, n_intra, n_nodes, hw, a), i, a) for i, a in enumerate(options)
    )[::2]
    return best_t * c.count, best_a
