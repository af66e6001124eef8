"""What GRPO's serving engine adds beside the trainer (`train.objective: grpo`): its KV pages, its
copy of the weights, and the bytes one weight sync moves. Arithmetic on the config, no device:
`python -m train.plan` and `python -m train --dry-run` print it under the trainer's plan.

The engine is train/rollouts.py's: `engine_tensor`-way tensor parallel, its other devices data
replicas (the trainer's devices when colocated, as many others when split), `engine_slots` rows
shared by the replicas, and a pool of pages that holds every slot at its full length
(data.seq_len + 1 rounded up to `page_size`) plus a null page per replica, so no rollout is ever
preempted; the cache is in train.compute_dtype (per token `planner_memory.kv_bytes_per_token`:
per-head keys and values, or MLA's latent and RoPE key, which tensor parallelism does not split;
one more layer per MTP module). The weights are train.param_dtype; a replica's copy is split over `tensor` (the small
replicated vectors, norms and biases, are counted as split: "about"). A sync moves every
trainable parameter into every replica (LoRA: the adapters only).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from meshwork.config import Config

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class EnginePlan:
    devices: int
    replicas: int
    tensor: int
    slots: int
    page_size: int
    pages: int  # in the whole pool, null pages included
    kv_bytes_per_device: int
    weight_bytes_per_device: int  # about: replicated vectors counted as split
    sync_bytes: int  # one sync, summed over the engine's devices (every replica's copy)
    placement: str

    def to_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        where = "the trainer's devices" if self.placement == "colocated" else "devices of its own"
        return [
            f"serving engine (grpo rollouts, {self.placement}: {where}): {self.devices} devices = "
            f"{self.replicas} data replicas x tensor {self.tensor}, {self.slots} slots",
            f"  KV pages: {self.pages:,} of {self.page_size} tokens = {_size(self.kv_bytes_per_device)} per device; "
            f"weights about {_size(self.weight_bytes_per_device)} per device",
            f"  weight sync: {_size(self.sync_bytes)} per sync into the engine's layout (summed over its devices)",
        ]


def _size(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.2f} MiB"


@dataclass(frozen=True)
class EngineGeometry:
    """The engine train/rollouts.py builds: its replicas, slots, longest sequence and pool."""

    replicas: int
    slots: int
    max_len: int
    pages: int


def engine_geometry(cfg: Config, devices: int) -> EngineGeometry:
    """The engine of `cfg` on `devices` devices; ConfigError when `engine_tensor` cannot split them
    or the model's heads (the same refusal as the run's, before anything is written)."""
    from meshwork.config import ConfigError

    g, m = cfg.train.grpo, cfg.model
    kv_heads = m.n_kv_heads if m.mla is None else g.engine_tensor  # MLA's latent cache is not split
    if devices % g.engine_tensor or m.n_heads % g.engine_tensor or kv_heads % g.engine_tensor:
        raise ConfigError(
            f"train.grpo.engine_tensor: {g.engine_tensor} must divide the engine's {devices} devices and the "
            f"model's {m.n_heads} heads and {m.n_kv_heads} kv heads; choose a divisor of all three"
        )
    replicas = devices // g.engine_tensor
    per_replica_slots = -(-g.engine_slots // replicas)
    max_len = -(-(cfg.data.seq_len + 1) // g.page_size) * g.page_size
    pages_per_replica = per_replica_slots * max_len // g.page_size + 1  # every slot at full length, a null page
    return EngineGeometry(replicas, per_replica_slots * replicas, max_len, pages_per_replica * replicas)


def engine_plan(cfg: Config, trainer_devices: int, trainable_params: int) -> EnginePlan:
    """The engine of `cfg` beside a trainer on `trainer_devices` devices that trains
    `trainable_params` parameters (all of them, or LoRA's adapters)."""
    from meshwork.perf.flops import param_counts
    from meshwork.perf.planner_memory import kv_bytes_per_token, kv_cache_splits

    g, m = cfg.train.grpo, cfg.model
    devices, tensor = trainer_devices, g.engine_tensor
    shape = engine_geometry(cfg, devices)
    pages_per_replica = shape.pages // shape.replicas
    itemsize = DTYPE_BYTES[cfg.train.param_dtype]
    kv_heads_split = kv_cache_splits(m, tensor)  # MLA's latent: replicated over tensor
    kv_item = DTYPE_BYTES[cfg.train.compute_dtype]  # the cache holds what the layers compute in
    kv = pages_per_replica * g.page_size * kv_bytes_per_token(m, kv_item)
    weights = param_counts(m)["total"] * itemsize
    return EnginePlan(
        devices=devices,
        replicas=shape.replicas,
        tensor=tensor,
        slots=shape.slots,
        page_size=g.page_size,
        pages=shape.pages,
        kv_bytes_per_device=kv // kv_heads_split,
        weight_bytes_per_device=weights // tensor,
        sync_bytes=trainable_params * itemsize * shape.replicas,
        placement=g.placement,
    )
