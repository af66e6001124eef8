"""The parallelism planner: memory, communication, step time and MFU of a
layout on N accelerators, and a search for the fastest layout that fits.

Pure arithmetic on the config and a hardware data sheet
(`meshwork.perf.hardware`): no devices, nothing compiled. The parts:

- `planner_layout`: the layout (mesh sizes + rules preset, as in a config).
- `planner_weights`: the model's weights and each one's shard on a device.
- `planner_memory`: per-device bytes of parameters, gradients, optimizer
  state, activations.
- `planner_comm`: each collective of a step (count, bytes) and its time under
  ring, tree or hierarchical algorithms.
- here: FLOPs, step time, MFU, `plan`, `search`, and writing a layout back
  as a config `python -m train` runs.

Step time (seconds), with `PlanOptions` saying how efficient and overlapped:

    compute    = (model FLOPs + remat recompute) / devices / (peak x efficiency)
    critical   = compute + exposed activation collectives (tp, sp, ep, pipeline; context
                 parallelism's all-gathers and all-to-alls, and what of the ring's hops the
                 attention compute they overlap, half the attention FLOPs (causal), cannot cover)
    bubble     = critical x idle / (1 - idle)  idle: idle_fraction of the schedule table the
                                               executor runs (GPipe, 1F1B: (P-1)/(M+P-1), so
                                               critical x (P-1)/M; interleaved, zb-h1: less)
    hidden     = min(overlap x gradient/weight collectives, compute)
    step       = critical + bubble + (gradient/weight collectives - hidden) + optimizer
    MFU        = model FLOPs / (step x peak x devices)

Model FLOPs are `meshwork.perf.flops.train_flops_per_token` (6N + the PaLM
attention term; MLA's scores over qk_nope + qk_rope dims and values over
v_head_dim, its zero padding of the values counted as `padding`; each MTP
module's block, projection and extra pass through the head); remat "full" recomputes the layers' forward pass (+1/3 of
their 6N), a partial policy the products it does not keep (planner_remat.py;
"offload_dots" streams the kept ones over the host link), and a meshwork
pipeline recomputes each stage's forward inside its backward (twice under
zb-h1: in the input and in the weight half). The
optimizer update is memory-bound: it reads and writes the state once
(bytes / HBM bandwidth); under Muon it adds the configured Newton-Schulz
variant's collectives and matrix products (`planner_optimizer`), and the plan
shows both variants' bytes, FLOPs and time so the cheaper can be chosen.

    >>> from meshwork.config import Config
    >>> from meshwork.perf.hardware import get_hardware
    >>> p = plan(Config(), make_layout(data=8), get_hardware("h100"))
    >>> p.fits, 0 < p.mfu < 1
    (True, True)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import yaml

from meshwork.config import Config, ConfigError, validate
from meshwork.perf.flops import (
    attention_dims,
    attention_flops_per_token,
    mla_padding_flops_per_token,
    train_flops_per_token,
)
from meshwork.perf.hardware import Accelerator
from meshwork.perf.planner_comm import Collective, CommOptions, collective_time, placement, step_collectives, summarize
from meshwork.perf.planner_layout import REMATS, Layout, layout_from_config, make_layout
from meshwork.perf.planner_memory import (
    StateBytes,
    activation_memory,
    gathered_weight_bytes,
    grad_accumulator_bytes,
    kept_by_layers,
    offload_memory,
    state_memory,
)
from meshwork.perf.planner_optimizer import muon_problem, newton_schulz_cost, optimizer_lines, optimizer_plan
from meshwork.perf.planner_pipeline import pipeline_schedule
from meshwork.perf.planner_remat import kept_during_backward, recompute_fraction
from meshwork.perf.planner_weights import indivisible, model_weights, shard_size
from meshwork.sharding.context_parallel import check_heads
from meshwork.sharding.mesh import MESH_AXES

__all__ = [
    "Plan",
    "PlanOptions",
    "Layout",
    "make_layout",
    "layout_from_config",
    "layout_problem",
    "plan",
    "search",
    "explain",
    "format_plan",
    "describe_nodes",
    "step_flops",
    "compiled_step_flops",
    "config_for",
    "write_config",
]

GB = 1e9
# AdamW + global-norm clipping, per parameter element, as XLA:CPU's cost_analysis counts
# them (measured on lm_tiny: the step's FLOPs minus 1.03 x the model's, over the parameters).
OPTIMIZER_FLOPS_PER_PARAM = 20


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """The assumptions of a plan: change them with the CLI's flags."""

    efficiency: float = 0.6
    """Fraction of peak FLOP/s the matmuls reach (0.4-0.7 is typical of large runs)."""
    overlap: float = 0.5
    """Fraction of gradient and weight collectives that run under compute."""
    algorithm: str = "auto"
    """ring, tree, hierarchical, or auto (the fastest of the three per collective)."""
    memory_fraction: float = 0.9
    """Share of HBM usable for the train state and activations (the rest: runtime, fragmentation)."""
    accounting: str = "meshwork"
    """meshwork (state in train.param_dtype) or mixed (ZeRO's 2 + 2 + 12 bytes per parameter)."""
    comm: CommOptions = CommOptions()

    def state_bytes(self, cfg: Config) -> StateBytes:
        from meshwork.perf.planner_memory import MIXED_PRECISION_ADAM

        if self.accounting not in ("meshwork", "mixed"):
            raise ConfigError(f"accounting={self.accounting!r}; choose meshwork or mixed")
        return StateBytes.meshwork(cfg) if self.accounting == "meshwork" else MIXED_PRECISION_ADAM


@dataclasses.dataclass
class Plan:
    """One layout's predicted memory, collectives, time split and MFU."""

    layout: Layout
    hardware: Accelerator
    devices_per_node: int
    memory: dict[str, float]
    collectives: list[tuple[Collective, float, str]]  # (collective, seconds per step, algorithm)
    times: dict[str, float]
    flops: dict[str, float]
    step_time: float
    mfu: float
    tokens_per_s: float
    fits: bool
    hbm_usable: float
    optimizer: dict[str, Any] = dataclasses.field(default_factory=dict)
    """planner_optimizer.optimizer_plan: the optimizer and, under Muon, both Newton-Schulz variants."""

    def summary(self) -> dict[str, dict[str, float]]:
        """Collectives per kind, in `sharding/report.py`'s format."""
        return summarize([c for c, _, _ in self.collectives])

    def to_dict(self) -> dict[str, Any]:
        return {
            "layout": {
                "mesh": self.layout.sizes,
                "preset": self.layout.preset,
                "microbatches": self.layout.microbatches,
                "pipeline": self.layout.pipeline,
                "virtual_stages": self.layout.virtual_stages,
                "remat": self.layout.remat,
                "context_parallel": self.layout.context_parallel,
            },
            "hardware": self.hardware.name,
            "memory": self.memory,
            "hbm_usable": self.hbm_usable,
            "fits": self.fits,
            "collectives": self.summary(),
            "collective_list": [
                {
                    "kind": c.kind,
                    "axes": list(c.axes),
                    "group": c.group,
                    "count": c.count,
                    "payload_bytes": c.payload_bytes,
                    "bytes": c.sent_bytes,
                    "what": c.what,
                    "time_s": t,
                    "algorithm": a,
                }
                for c, t, a in self.collectives
            ],
            "times": self.times,
            "flops": self.flops,
            "step_time_s": self.step_time,
            "mfu": self.mfu,
            "tokens_per_s": self.tokens_per_s,
            "optimizer": self.optimizer,
        }


# ---------------------------------------------------------------------------
# FLOPs


def _layer_flops_per_token(cfg: Config) -> float:
    """The layers' share of train_flops_per_token: everything but the LM head's 6 V D and the MTP
    modules (which run outside the layer scan: no remat, no pipeline stage recomputes them)."""
    m = cfg.model
    if m.mtp.depth:
        m = m.model_copy(update={"mtp": m.mtp.model_copy(update={"depth": 0})})
    return train_flops_per_token(m, cfg.data.seq_len) - 6 * m.vocab_size * m.d_model


def _layer_forward_flops(cfg: Config) -> dict[str, float]:
    """Forward FLOPs per token of the layers by product (planner_remat's tensors): q/k/v, the
    attention scores and values, the output projection, the MLP's (or shared experts' and
    routers') rest split 2:1 between gate and up and the down projection, and the routed
    experts' three products (capacity dispatch; dropless ones are left to "total" alone: no
    policy keeps a ragged_dot's output). A gated shared expert's down projection counts with
    gate and up: the gate's gradient reads its output."""
    m, h = cfg.model, cfg.model.d_model
    q, kv = m.n_heads * m.resolved_head_dim, m.n_kv_heads * m.resolved_head_dim
    total = _layer_flops_per_token(cfg) / 3
    parts = {
        "qkv": 2 * h * (q + 2 * kv) * m.n_layers,
        "attention": 4 * q * cfg.data.seq_len * m.n_layers,
        "out_proj": 2 * q * h * m.n_layers,
    }
    unnamed = 0.0  # products no policy names: every partial policy runs them again
    if m.mla is not None:
        # MLA's named products: the queries, the latent + RoPE-key projection, wkv_b's keys and
        # values (QKV_PROJ); the q-LoRA down-projection is unnamed.
        a, H, L = m.mla, m.n_heads, m.n_layers
        dq, dv = attention_dims(m)
        q_in = a.q_lora_rank or h
        parts = {
            "qkv": 2
            * L
            * (
                q_in * H * dq
                + h * (a.kv_lora_rank + a.qk_rope_head_dim)
                + a.kv_lora_rank * H * (a.qk_nope_head_dim + dv)
            ),
            "attention": 2 * H * (dq + dv) * cfg.data.seq_len * L,
            "out_proj": 2 * H * dv * h * L,
        }
        unnamed = 2 * L * h * (a.q_lora_rank or 0)
    n_moe = m.moe.n_moe_layers(m.n_layers) if m.kind == "moe" else 0
    e = m.moe
    experts = n_moe * 6 * h * e.top_k * e.d_expert  # the routed experts' three products
    mlp = max(total - sum(parts.values()) - experts - unnamed, 0.0)  # dense MLPs, shared experts, routers
    gated_down = n_moe * 2 * h * (e.d_shared or e.n_shared_experts * e.d_expert) if e.shared_expert_gate else 0.0
    return {
        **parts,
        "mlp_in": 2 / 3 * mlp + gated_down,
        "mlp_out": mlp / 3 - gated_down,
        "experts": experts if e.capacity_factor is not None else 0.0,
        "total": total,
    }


def step_flops(cfg: Config, layout: Layout) -> dict[str, float]:
    """FLOPs of one step, all devices together: `model` (useful work, MFU's
    numerator), `recompute` (remat, pipeline), `padding` (MoE capacity slots,
    MLA's values zero-padded to the key width in the attention kernel),
    and `per_device` (their sum over the devices).

    >>> from meshwork.config import Config
    >>> f = step_flops(Config(), make_layout(data=8, remat="full"))
    >>> f["recompute"] > 0 and f["per_device"] * 8 == f["model"] + f["recompute"] + f["padding"]
    True
    """
    m, tokens = cfg.model, cfg.train.global_batch * cfg.data.seq_len
    model = train_flops_per_token(m, cfg.data.seq_len) * tokens
    # A pipeline backward recomputes its stage's forward; zb-h1's input and weight halves each do.
    forwards = recompute_fraction(layout.remat, _layer_forward_flops(cfg)) + {"none": 0, "zb-h1": 2}.get(
        layout.pipeline, 1
    )
    recompute = forwards * _layer_flops_per_token(cfg) / 3 * tokens
    # MLA's expanded form pads values to the key width: kernel work, not model FLOPs.
    padding = mla_padding_flops_per_token(m, cfg.data.seq_len) * tokens
    if m.kind == "moe" and m.moe.capacity_factor and m.moe.capacity_factor > 1:
        e = m.moe
        padding += (
            (e.capacity_factor - 1) * 6 * e.top_k * 3 * m.d_model * e.d_expert * e.n_moe_layers(m.n_layers) * tokens
        )
    return {
        "model": model,
        "recompute": recompute,
        "padding": padding,
        "per_device": (model + recompute + padding) / layout.devices,
    }


def compiled_step_flops(cfg: Config, layout: Layout) -> float:
    """What XLA's `cost_analysis()` should report per device for the step:
    the scanned layer body counted once (as cost_analysis counts a while
    body; likewise one microbatch of gradient accumulation), plus the
    optimizer's elementwise work on this device's parameters. Elementwise
    work inside the layers (norms, softmax, SwiGLU) is left out: about 3.5%
    more on lm_tiny. Pipelines (nested loops) and MoE (XLA counts the padded
    dispatch buffers) are not comparable this way.

    >>> from meshwork.config import Config
    >>> compiled_step_flops(Config(), make_layout(data=8)) < step_flops(Config(), make_layout(data=8))["per_device"]
    True
    """
    one = cfg.model_copy(update={"model": cfg.model.model_copy(update={"n_layers": 1})})
    f = step_flops(one, layout)["per_device"]
    if layout.pipeline == "none":
        f /= layout.microbatches  # the accumulation loop's body, one microbatch, is counted once too
    local_params = sum(shard_size(w, layout, "opt_state") for w in model_weights(cfg.model))
    muon = newton_schulz_cost(cfg, layout).flops if cfg.optimizer.name == "muon" else 0.0
    return f + OPTIMIZER_FLOPS_PER_PARAM * local_params + muon


# ---------------------------------------------------------------------------
# One plan


def memory(cfg: Config, layout: Layout, accounting: StateBytes | None = None) -> dict[str, float]:
    """Per-device bytes by kind (state, gradient accumulator, activations,
    logits, gathered weights) and their "total"."""
    mem = dict(state_memory(cfg, layout, accounting))
    del mem["total"]
    mem["grad_accumulator"] = grad_accumulator_bytes(cfg, layout)
    mem.update(activation_memory(cfg, layout))
    mem["gathered_weights"] = gathered_weight_bytes(cfg, layout, accounting)
    mem["total"] = sum(mem.values())
    off = cfg.train.offload
    if off.optimizer or off.params or layout.remat == "offload_dots":  # bytes in host memory, not on the device
        host = offload_memory(cfg, layout, accounting)
        mem["host"] = host["host"]
        mem["total"] -= host["host"] - host["activations"]  # offloaded activations were never counted above
    return mem


def plan(
    cfg: Config,
    layout: Layout,
    hw: Accelerator,
    devices_per_node: int | None = None,
    options: PlanOptions = PlanOptions(),
) -> Plan:
    """Memory, collectives, time and MFU of `cfg` trained under `layout` on `hw`.

    `devices_per_node` defaults to the hardware's (capped at the device count).
    """
    dpn = min(devices_per_node or hw.devices_per_node, layout.devices)
    acc = options.state_bytes(cfg)
    mem = memory(cfg, layout, acc)
    usable = hw.hbm_bytes * options.memory_fraction

    dtype = "bf16" if cfg.train.compute_dtype == "bfloat16" else "fp32"
    peak = hw.flops(dtype)
    flops = step_flops(cfg, layout)
    compute = (flops["model"] + flops["padding"]) / layout.devices / (peak * options.efficiency)
    recompute = flops["recompute"] / layout.devices / (peak * options.efficiency)
    if layout.remat not in ("none", "full"):
        # Recomputing norms, softmax and activations is memory-bound: read the saved
        # tensors and write what was not kept once more (offload_dots: what came back).
        kept = kept_during_backward(layout.remat)
        unsaved = (kept_by_layers(cfg, layout, "none") - kept_by_layers(cfg, layout, kept)) / layout.sizes["stage"]
        recompute += 2 * max(unsaved, 0.0) * layout.microbatches / hw.hbm_bandwidth  # per microbatch

    timed = [
        (c, *collective_time(c, layout, hw, dpn, options.algorithm))
        for c in step_collectives(cfg, layout, options.comm, acc)
    ]
    # Ring attention's hops overlap the attention compute of their layer: what that cannot cover is exposed.
    ring = sum(t for c, t, _ in timed if c.under_attention)
    ring_hidden = min(ring, _attention_time(cfg, layout, peak * options.efficiency))
    critical_comm = (
        sum(t for c, t, _ in timed if not c.overlappable and not c.under_attention and not c.optimizer)
        + ring
        - ring_hidden
    )
    background = sum(t for c, t, _ in timed if c.overlappable and not c.under_attention)
    work = compute + recompute + critical_comm
    sched = pipeline_schedule(layout)  # the executor's own table: its idle share is the bubble
    bubble = work * sched.bubble_ratio if sched is not None else 0.0
    hidden = min(options.overlap * background, compute + recompute)
    state = mem["params"] + mem["grads"] + mem["opt_state"]
    opt = optimizer_plan(cfg, layout, hw, dpn, options.algorithm, options.efficiency)
    ns = opt.get("newton_schulz")
    # Muon: the configured variant's collectives and products, after the backward pass.
    optimizer = 2 * state / hw.hbm_bandwidth + (ns["variants"][ns["configured"]]["time_s"] if ns else 0.0)
    step = work + bubble + background - hidden + optimizer
    times = {
        "compute": compute,
        "recompute": recompute,
        "activation_comm": critical_comm,
        "ring_attention_comm": ring,
        "ring_attention_hidden": ring_hidden,
        "bubble": bubble,
        "grad_weight_comm": background,
        "hidden_comm": hidden,
        "exposed_grad_weight_comm": background - hidden,
        "optimizer": optimizer,
        "step": step,
    }
    if "host" in mem:
        # Host offload streams its bytes over PCIe; counted as not overlapped (an upper bound).
        link = hw.host_link_bandwidth or 64 * GB  # PCIe 5.0 x16 where the table has no figure
        times["host_transfer"] = offload_memory(cfg, layout, acc)["transfer"] / link
        step += times["host_transfer"]
        times["step"] = step
    tokens = cfg.train.global_batch * cfg.data.seq_len
    return Plan(
        layout,
        hw,
        dpn,
        mem,
        timed,
        times,
        flops,
        step,
        flops["model"] / (step * peak * layout.devices),
        tokens / step,
        mem["total"] <= usable,
        usable,
        opt,
    )


def _attention_time(cfg: Config, layout: Layout, flops_per_s: float) -> float:
    """Seconds per step one device spends in the attention scores and values, forward and backward:
    what ring attention's hops overlap. Causal attention computes half of PaLM's square."""
    tokens = cfg.train.global_batch * cfg.data.seq_len
    return 0.5 * attention_flops_per_token(cfg.model, cfg.data.seq_len) * tokens / layout.devices / flops_per_s


# ---------------------------------------------------------------------------
# Search


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _factorizations(n: int, k: int):
    """Ordered k-tuples of positive integers whose product is n."""
    if k == 1:
        yield (n,)
        return
    for d in _divisors(n):
        for rest in _factorizations(n // d, k - 1):
            yield (d, *rest)


def layout_problem(cfg: Config, layout: Layout) -> str | None:
    """Why meshwork cannot run `layout` for `cfg` (a sentence), or None."""
    m, s = cfg.model, layout.sizes
    if s["stage"] > 1 and (m.kind != "transformer" or m.n_layers % s["stage"]):
        return "pipelines need a dense transformer whose layers divide into equal stages"
    if layout.pipeline == "interleaved" and (
        m.n_layers % (s["stage"] * layout.virtual_stages) or layout.microbatches % s["stage"]
    ):
        return "interleaving needs layers divisible by stage x virtual stages and microbatches by stage"
    if s["sequence"] > 1 and (problem := _context_parallel_problem(cfg, layout)):
        return problem
    if s["expert"] > 1 and (m.kind != "moe" or m.moe.n_experts % s["expert"]):
        return "expert parallelism needs experts divisible by the expert axis"
    heads = layout.ways("heads")
    # MLA has no kv heads: its latent is never split.
    if m.n_heads % heads or (m.mla is None and m.n_kv_heads % layout.ways("kv_heads")):
        return f"{m.n_heads} heads / {m.n_kv_heads} kv heads do not split {heads} ways"
    batch = layout.ways("act_batch") * layout.microbatches
    if cfg.train.global_batch % batch:
        return f"global batch {cfg.train.global_batch} does not split into {batch} (batch shards x microbatches)"
    bad = indivisible(model_weights(m), layout)
    if bad:
        return f"{bad} does not divide evenly"
    return muon_problem(cfg, layout)


def _context_parallel_problem(cfg: Config, layout: Layout) -> str | None:
    """Why `layout`'s context parallelism cannot run `cfg` (as train/trainer.py check_runtime says), or None."""
    m, cp, seq = cfg.model, layout.context_parallel, layout.split("act_seq")
    if layout.pipeline != "none":
        return "the planner's context parallelism runs without a pipeline"
    if len(seq) != (2 if cp == "usp" else 1):
        return f"context_parallel={cp} with act_seq over {seq}"
    ring = layout.sizes[seq[0]]
    if cfg.data.seq_len % (ring if cp == "ulysses" else 2 * ring):
        return f"context parallelism needs seq_len divisible by {'' if cp == 'ulysses' else '2 x '}sequence"
    if cp == "all_gather" and m.attention != "xla":
        return f"context_parallel=all_gather masks by position, which model.attention={m.attention} does not"
    if cp in ("ulysses", "usp"):
        heads, kv_heads = (m.n_heads, m.n_heads) if m.mla is not None else (m.n_heads, m.n_kv_heads)
        try:
            check_heads(cp, heads, kv_heads, layout.sizes[seq[-1]], layout.ways("act_heads"))
        except ValueError as e:
            return str(e)
    return None


def candidate_layouts(cfg: Config, n_devices: int, devices_per_node: int):
    """Every layout worth planning on `n_devices`: mesh factorizations (tensor
    within a node), ZeRO stage, sequence parallelism, remat, microbatches."""
    m = cfg.model
    for stage, data, fsdp, expert, sequence, tensor in _factorizations(n_devices, len(MESH_AXES)):
        if tensor > devices_per_node or (expert > 1 and m.kind != "moe"):
            continue
        if stage > 1 and m.kind != "transformer":
            continue
        zeros = (3,) if fsdp > 1 else ((0, 1, 2) if data > 1 else (0,))
        # Context parallelism's four algorithms; usp spends `tensor` on the sequence (Ulysses).
        cps = ("ring",) if sequence == 1 else ("ring", "all_gather", "ulysses", "usp")[: 4 if tensor > 1 else 3]
        for zero, sp, remat, cp in itertools.product(zeros, (False, True) if tensor > 1 else (False,), REMATS, cps):
            if cp == "usp" and sp:
                continue  # tensor is no tensor-parallel axis under usp
            base = dict(
                stage=stage,
                data=data,
                fsdp=fsdp,
                expert=expert,
                sequence=sequence,
                tensor=tensor,
                zero=zero,
                sequence_parallel=sp,
                remat=remat,
                context_parallel=cp,
            )
            per_shard = cfg.train.global_batch // max(1, data * fsdp * (expert if expert > 1 else 1))
            mbs = [mb for mb in _divisors(per_shard) if mb <= 64]
            if stage > 1:
                mbs = [mb for mb in mbs if mb >= stage][:4]
            yield base, mbs


def search(
    cfg: Config,
    hw: Accelerator,
    n_devices: int,
    devices_per_node: int | None = None,
    options: PlanOptions = PlanOptions(),
) -> tuple[list[Plan], dict[str, int]]:
    """All layouts that fit in HBM, fastest first, and counts of what was considered.

    Without a pipeline more microbatches never make a step faster here (the
    same FLOPs, as many or more collectives), so each layout keeps only the
    fewest microbatches that fit; under a pipeline each of up to four
    microbatch counts >= stages is planned (more shrink the bubble).
    """
    dpn = min(devices_per_node or hw.devices_per_node, n_devices)
    accounting, usable = options.state_bytes(cfg), hw.hbm_bytes * options.memory_fraction
    fitting: list[Plan] = []
    stats = {"considered": 0, "invalid": 0, "too_big": 0}
    for base, mbs in candidate_layouts(cfg, n_devices, dpn):
        for mb in mbs:
            layout = make_layout(**base, microbatches=mb)
            stats["considered"] += 1
            if layout_problem(cfg, layout):
                stats["invalid"] += 1
                continue
            if memory(cfg, layout, accounting)["total"] > usable:
                stats["too_big"] += 1
                continue
            fitting.append(plan(cfg, layout, hw, dpn, options))
            if base["stage"] == 1:
                break
    # Ties (to 0.1%) go to less recomputation, fewer microbatches, less tensor parallelism.
    fitting.sort(
        key=lambda p: (
            round(p.step_time, 3 - int(math.floor(math.log10(p.step_time)))),
            REMATS.index(p.layout.remat),
            p.layout.microbatches,
            p.layout.sizes["tensor"],
        )
    )
    stats["fit"] = len(fitting)
    return fitting, stats


_PARTS = {
    "compute": "compute",
    "recompute": "remat/pipeline recompute",
    "activation_comm": "tp/sp/cp/ep/pipeline communication",
    "bubble": "pipeline bubble",
    "exposed_grad_weight_comm": "exposed gradient/weight communication",
    "optimizer": "optimizer update",
}


def explain(best: Plan, others: list[Plan]) -> list[str]:
    """Sentences on why `best` wins: its time split against the runner-up's (and
    the fastest layout with a different mesh, when the runner-up shares it)."""
    lines = [
        f"best: {best.layout.describe()}: {_secs(best.step_time)}/step, MFU {best.mfu:.1%}, "
        f"{_fmt_bytes(best.memory['total'])} of {_fmt_bytes(best.hbm_usable)} usable"
    ]
    rivals = others[:1]
    other_mesh = next((o for o in others if o.layout.mesh != best.layout.mesh), None)
    if other_mesh is not None and other_mesh not in rivals:
        rivals.append(other_mesh)
    for rival in rivals:
        slower = rival.step_time / best.step_time - 1
        if slower < 1e-3:
            lines.append(
                f"ties (within 0.1%) with {rival.layout.describe()} ({_secs(rival.step_time)}); "
                "ties rank less recomputation, fewer microbatches, less tensor parallelism first"
            )
            continue
        eps = 1e-3 * best.step_time
        diffs = sorted(((rival.times[k] - best.times[k], k) for k in _PARTS), reverse=True)
        part = lambda k: f"{_PARTS[k]} {_secs(best.times[k])} vs {_secs(rival.times[k])}"  # noqa: E731
        gains = [part(k) for d, k in diffs if d > eps][:3]
        losses = [part(k) for d, k in diffs if d < -eps][-2:]
        line = f"vs {rival.layout.describe()} ({_secs(rival.step_time)}, {slower:+.1%}): " + (
            f"saves on {'; '.join(gains)}" if gains else "small savings everywhere"
        )
        if losses:
            line += f"; pays more for {'; '.join(losses)}"
        lines.append(line)
    return lines


# ---------------------------------------------------------------------------
# Output


def _fmt_bytes(b: float) -> str:
    return f"{b / GB:,.2f} GB" if b >= 0.01 * GB else f"{b / 2**20:,.2f} MiB"


def describe_nodes(nodes: int, per_node: int) -> str:
    """e.g. `2 nodes of 8`."""
    return f"{nodes} node{'s' if nodes > 1 else ''} of {per_node}"


def _secs(t: float) -> str:
    if t == 0:
        return "0 s"
    return f"{t:.3f} s" if t >= 1 else f"{t * 1e3:.3g} ms" if t >= 1e-3 else f"{t * 1e6:.3g} us"


def format_plan(p: Plan) -> str:
    """The plan as text: memory by kind, collectives, time split, MFU."""
    lay = p.layout
    nodes = math.ceil(lay.devices / p.devices_per_node)
    on_nodes = describe_nodes(nodes, p.devices_per_node)
    lines = [f"layout: {lay.describe()} on {lay.devices} x {p.hardware.name} ({on_nodes})", "memory per device:"]
    for k, v in p.memory.items():
        if k != "total" and v:
            lines.append(f"  {k:<18} {_fmt_bytes(v):>12}")
    lines.append(
        f"  {'total':<18} {_fmt_bytes(p.memory['total']):>12}  of {_fmt_bytes(p.hbm_usable)} usable: "
        + ("fits" if p.fits else "DOES NOT FIT")
    )
    lines.append("collectives per step (per device; bytes sent under ring algorithms):")
    for c, t, algo in sorted(p.collectives, key=lambda x: -x[1]):
        n_intra, n_nodes = placement(c.axes, lay.mesh, p.devices_per_node)
        where = f"{'x'.join(c.axes)}={c.group}" + (f" over {n_nodes} nodes" if n_nodes > 1 else "")
        lines.append(
            f"  {c.kind:<18} {where:<24} {c.count:>6g} x {_fmt_bytes(c.payload_bytes):>11}  "
            f"sent {_fmt_bytes(c.sent_bytes):>11}  {_secs(t):>9} {algo:<12} {c.what}"
        )
    t = p.times
    names = {**_PARTS, "grad_weight_comm": "gradient/weight communication"}
    lines.append(
        "time per step: "
        + ", ".join(
            f"{names[k]} {_secs(t[k])}"
            for k in ("compute", "recompute", "activation_comm", "bubble", "grad_weight_comm")
            if t[k]
        )
        + f" (of which hidden under compute {_secs(t['hidden_comm'])}), optimizer {_secs(t['optimizer'])}"
        + (
            f"; ring attention hops {_secs(t['ring_attention_comm'])}, "
            f"{_secs(t['ring_attention_hidden'])} of them under the attention compute"
            if t["ring_attention_comm"]
            else ""
        )
    )
    lines.append(
        f"step {_secs(p.step_time)}, {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%} "
        f"(model {p.flops['model']:.3e} FLOPs/step)"
    )
    if p.optimizer:
        lines += optimizer_lines(p.optimizer, p.memory["opt_state"], _fmt_bytes, _secs)
    return "\n".join(lines)


def config_for(cfg: Config, layout: Layout) -> Config:
    """`cfg` with its mesh, rules preset and train schedule set to `layout`."""
    raw = cfg.to_dict()
    raw["mesh"] = dict(layout.sizes)
    raw["rules"] = {**raw["rules"], "preset": layout.preset}
    if layout.overrides:  # e.g. usp's act_seq over two axes
        raw["rules"]["overrides"] = {
            **raw["rules"].get("overrides", {}),
            **{k: list(v) if isinstance(v, tuple) else v for k, v in layout.overrides},
        }
    raw["train"] = {
        **raw["train"],
        "microbatches": layout.microbatches,
        "pipeline": layout.pipeline,
        "virtual_stages": layout.virtual_stages,
        "remat": layout.remat,
        "context_parallel": layout.context_parallel,
    }
    return validate(raw, "planned layout")


def write_config(cfg: Config, layout: Layout, path: str, header: list[str] = ()) -> Config:
    """Writes `config_for(cfg, layout)` as YAML (`python -m train --config path` runs it)."""
    import pathlib

    out = config_for(cfg, layout)
    text = "".join(f"# {line}\n" for line in header) + yaml.safe_dump(out.to_dict(), sort_keys=False)
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(path).write_text(text)
    return out
