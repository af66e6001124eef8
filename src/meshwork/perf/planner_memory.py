"""Planner, part 1: a layout, the model's weights, and what one device holds.

A `Layout` is what a meshwork config says about parallelism: the six mesh
axis sizes, the rules preset (`sharding/rules.py`), microbatches, the pipeline
schedule and the remat policy. The planner never re-states what a preset
does: it asks the same rules table the trainer uses which mesh axes split
each logical dimension, so `fsdp` splits `embed` over `fsdp`, `tp` splits
heads, MLP and vocabulary over `tensor`, `zero1`/`zero2` split the moments
(and gradients) over `data` x `fsdp`, exactly as in training.

Memory per device, in bytes:

- state: every weight of the model (`model_weights`, a mirror of models/ that
  a test checks against the real abstract state) is cut by the mesh axes its
  logical names map to, per role: parameters by the "params" rules, gradients
  by "grads", Adam's two moments by "opt_state". Bytes per element follow
  `StateBytes`: meshwork's own accounting (parameters, gradients and both
  moments in `train.param_dtype`) or the ZeRO paper's mixed precision
  (2 + 2 bytes of fp16 parameters and gradients, K = 12 bytes of fp32 master
  copy and moments; Rajbhandari et al. 2020, "ZeRO", section 3.1).
- activations: `layer_activation_bytes`, the Korthikanti et al. (2022,
  "Reducing Activation Recomputation in Large Transformer Models", section 4)
  accounting applied to meshwork's block (pre-norm RMSNorm, grouped-query
  attention, SwiGLU or routed experts, no dropout), with their TP and SP
  divisors; remat `full` keeps only each layer's input plus one layer's
  working set; a pipeline stashes stage inputs and recomputes the stage.
- `kv_cache_bytes` for inference.

    >>> from meshwork.config import Config
    >>> layout = make_layout(fsdp=8)
    >>> layout.preset, layout.sizes["fsdp"]
    ('fsdp', 8)
    >>> mem = state_memory(Config(), layout)
    >>> mem["params"] * 8 == state_memory(Config(), make_layout(data=8))["params"]
    True
"""

from __future__ import annotations

import dataclasses
import functools
import math

from meshwork.config import Config, ConfigError, ModelConfig
from meshwork.sharding.mesh import MESH_AXES
from meshwork.sharding.rules import axes_of, rules_for

ITEMSIZE = {"float32": 4, "bfloat16": 2}
REMATS = ("none", "dots_saveable", "full")


# ---------------------------------------------------------------------------
# Layout


@dataclasses.dataclass(frozen=True)
class Layout:
    """Mesh sizes, rules preset and the schedule knobs: what a config's `mesh`,
    `rules` and `train.{microbatches,pipeline,remat}` say.

    `mesh` holds all six axes in `MESH_AXES` order, no -1. Build one with
    `make_layout` (from parallelism degrees) or `layout_from_config`.
    """

    mesh: tuple[tuple[str, int], ...]
    preset: str = "dp"
    microbatches: int = 1
    pipeline: str = "none"
    remat: str = "none"
    overrides: tuple[tuple[str, object], ...] = ()

    @functools.cached_property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh)

    @property
    def devices(self) -> int:
        return math.prod(self.sizes.values())

    def rules(self, role: str = "params"):
        """The rules table for `role`, with `+pp` added under a pipeline as the Trainer does."""
        return _rules(self._preset, self.overrides, role)

    @functools.cached_property
    def _preset(self) -> str:
        return self.preset + ("+pp" if self.pipeline != "none" else "")

    @functools.cached_property
    def _memo(self) -> dict:
        return {}

    def axes(self, name: str | None, role: str = "params") -> tuple[str, ...]:
        """Mesh axes logical dimension `name` maps to under `role` (any size)."""
        return _table(self._preset, self.overrides, role).get(name, ()) if name else ()

    def split(self, name: str, role: str = "params") -> tuple[str, ...]:
        """Mesh axes of size > 1 that split logical dimension `name`."""
        key = ("split", name, role)
        if key not in self._memo:
            self._memo[key] = tuple(a for a in self.axes(name, role) if self.sizes[a] > 1)
        return self._memo[key]

    def ways(self, name: str, role: str = "params") -> int:
        """Into how many pieces logical dimension `name` is cut."""
        return math.prod(self.sizes[a] for a in self.split(name, role))

    def weight_split(self, weight: "Weight", role: str = "params") -> tuple[tuple[str, ...], ...]:
        """Per dimension of `weight`, the mesh axes splitting it under `role` (as
        `sharding.rules.logical_to_spec`: a mesh axis splits at most one
        dimension of an array, the first that names it)."""
        return _weight_split(self._preset, self.overrides, role, weight.names)

    def weight_axes(self, weight: "Weight", role: str = "params") -> tuple[str, ...]:
        """Mesh axes of size > 1 that split some dimension of `weight` under `role`."""
        return tuple(a for axes in self.weight_split(weight, role) for a in axes if self.sizes[a] > 1)

    def describe(self) -> str:
        """e.g. `data=8 x fsdp=8, fsdp, remat=full, mb=4`."""
        mesh = " x ".join(f"{a}={n}" for a, n in self.mesh if n > 1) or "1 device"
        extra = [f"remat={self.remat}"] if self.remat != "none" else []
        if self.microbatches > 1:
            extra.append(f"mb={self.microbatches}")
        if self.pipeline != "none":
            extra.append(self.pipeline)
        return ", ".join([mesh, self.preset, *extra])


@functools.lru_cache(maxsize=None)
def _rules(preset: str, overrides: tuple, role: str):
    return rules_for(preset, dict(overrides), role)


@functools.lru_cache(maxsize=None)
def _weight_split(preset: str, overrides: tuple, role: str, names: tuple) -> tuple[tuple[str, ...], ...]:
    table = _table(preset, overrides, role)
    used: set[str] = set()
    dims = []
    for name in names:
        axes = tuple(a for a in (table.get(name, ()) if name else ()) if a not in used)
        used.update(axes)
        dims.append(axes)
    return tuple(dims)


@functools.lru_cache(maxsize=None)
def _table(preset: str, overrides: tuple, role: str) -> dict[str, tuple[str, ...]]:
    return {name: axes_of(name, _rules(preset, overrides, role)) for name, _ in _rules(preset, overrides, role)}


def make_layout(*, data: int = 1, fsdp: int = 1, expert: int = 1, sequence: int = 1, tensor: int = 1,
                stage: int = 1, zero: int = 0, sequence_parallel: bool = False, microbatches: int = 1,
                remat: str = "none", schedule: str = "1f1b") -> Layout:
    """A Layout from parallelism degrees, with the preset meshwork needs for them.

    `zero` (0, 1, 2) is the ZeRO stage over the data-parallel axes when
    `fsdp` is 1; `fsdp` > 1 is ZeRO-3 over `fsdp` (hybrid with `data`).
    `tensor` > 1 adds `tp` (`sp` with `sequence_parallel`), `sequence` > 1
    `cp`, `expert` > 1 `ep`; `stage` > 1 runs the pipeline `schedule`.

    >>> make_layout(data=2, fsdp=2, tensor=2).preset
    'fsdp+tp'
    >>> make_layout(data=8, zero=2).preset
    'zero2'
    """
    if zero not in (0, 1, 2, 3):
        raise ConfigError(f"zero={zero}: the ZeRO stages are 0, 1, 2 and 3 (= fsdp)")
    if remat not in REMATS:
        raise ConfigError(f"remat={remat!r}; choose one of {', '.join(REMATS)}")
    parts = ["fsdp" if fsdp > 1 or zero == 3 else ("dp", "zero1", "zero2")[zero]]
    if tensor > 1:
        parts.append("sp" if sequence_parallel else "tp")
    if sequence > 1:
        parts.append("cp")
    if expert > 1:
        parts.append("ep")
    sizes = dict(stage=stage, data=data, fsdp=fsdp, expert=expert, sequence=sequence, tensor=tensor)
    return Layout(tuple((a, sizes[a]) for a in MESH_AXES), "+".join(parts), microbatches,
                  schedule if stage > 1 else "none", remat)


def layout_from_config(cfg: Config, n_devices: int) -> Layout:
    """The Layout a config asks for on `n_devices` (its one -1 mesh axis filled in)."""
    from meshwork.sharding.mesh import MeshSizeError, resolve_mesh_shape

    try:
        shape = resolve_mesh_shape(cfg.mesh.sizes(), n_devices)
    except MeshSizeError as e:
        raise ConfigError(f"{e} (devices: {n_devices})") from None
    overrides = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in cfg.rules.overrides.items()))
    layout = Layout(tuple(zip(MESH_AXES, shape)), cfg.rules.preset, cfg.train.microbatches, cfg.train.pipeline,
                    cfg.train.remat, overrides)
    try:
        layout.rules()
    except KeyError as e:
        raise ConfigError(str(e.args[0])) from None
    return layout


# ---------------------------------------------------------------------------
# The model's weights


@dataclasses.dataclass(frozen=True)
class Weight:
    """One trainable array: its shape, the logical name of each dimension, and
    what kind of tokens reach it ("dense", "norm": the residual stream that
    Megatron-SP splits, "expert": routed tokens, "embedding": a lookup)."""

    path: str
    shape: tuple[int, ...]
    names: tuple[str | None, ...]
    kind: str = "dense"

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def scanned(self) -> bool:
        """Stacked along `layers` and applied by the layer scan."""
        return "layers" in self.names


def _block_weights(m: ModelConfig, prefix: str, n: int, moe: bool) -> list[Weight]:
    D, H, G, K = m.d_model, m.n_heads, m.n_kv_heads, m.resolved_head_dim
    L = ("layers",)
    w = [Weight(f"{prefix}.attn_norm.scale", (n, D), L + ("embed",), "norm"),
         Weight(f"{prefix}.attn.wq", (n, D, H, K), L + ("embed", "heads", "head_dim")),
         Weight(f"{prefix}.attn.wk", (n, D, G, K), L + ("embed", "kv_heads", "head_dim")),
         Weight(f"{prefix}.attn.wv", (n, D, G, K), L + ("embed", "kv_heads", "head_dim")),
         Weight(f"{prefix}.attn.wo", (n, H, K, D), L + ("heads", "head_dim", "embed"))]
    if m.qkv_bias:
        w += [Weight(f"{prefix}.attn.bq", (n, H, K), L + ("heads", "head_dim")),
              Weight(f"{prefix}.attn.bk", (n, G, K), L + ("kv_heads", "head_dim")),
              Weight(f"{prefix}.attn.bv", (n, G, K), L + ("kv_heads", "head_dim"))]
    w.append(Weight(f"{prefix}.mlp_norm.scale", (n, D), L + ("embed",), "norm"))
    if not moe:
        F = m.d_ff
        return w + [Weight(f"{prefix}.mlp.w_gate", (n, D, F), L + ("embed", "mlp")),
                    Weight(f"{prefix}.mlp.w_up", (n, D, F), L + ("embed", "mlp")),
                    Weight(f"{prefix}.mlp.w_down", (n, F, D), L + ("mlp", "embed"))]
    e = m.moe
    E, F = e.n_experts, e.d_expert
    w.append(Weight(f"{prefix}.moe.router", (n, D, E), L + ("embed", "router")))
    if e.router == "noisy":
        w.append(Weight(f"{prefix}.moe.noise", (n, D, E), L + ("embed", "router")))
    w += [Weight(f"{prefix}.moe.w_gate", (n, E, D, F), L + ("expert", "embed", "mlp"), "expert"),
          Weight(f"{prefix}.moe.w_up", (n, E, D, F), L + ("expert", "embed", "mlp"), "expert"),
          Weight(f"{prefix}.moe.w_down", (n, E, F, D), L + ("expert", "mlp", "embed"), "expert")]
    if e.n_shared_experts:
        S = e.d_shared or e.n_shared_experts * F
        w += [Weight(f"{prefix}.moe.shared.w_gate", (n, D, S), L + ("embed", "mlp")),
              Weight(f"{prefix}.moe.shared.w_up", (n, D, S), L + ("embed", "mlp")),
              Weight(f"{prefix}.moe.shared.w_down", (n, S, D), L + ("mlp", "embed"))]
    if e.shared_expert_gate:
        w.append(Weight(f"{prefix}.moe.shared_gate", (n, D, 1), L + ("embed", None)))
    return w


def model_weights(m: ModelConfig) -> tuple[Weight, ...]:
    """Every trainable weight of meshwork's Transformer / MoETransformer for `m`,
    with the logical names models/ gives it (checked against the real model by
    tests/test_planner.py).

    >>> [w.path for w in model_weights(ModelConfig())][:3]
    ['embed.table', 'blocks.attn_norm.scale', 'blocks.attn.wq']
    """
    if m.kind == "unet":
        raise ConfigError("model.kind: the planner models language models (transformer, moe), not unet")
    return _model_weights(m.model_dump_json())


@functools.lru_cache(maxsize=64)
def _model_weights(model_json: str) -> tuple[Weight, ...]:
    m = ModelConfig.model_validate_json(model_json)
    D, V = m.d_model, m.vocab_size
    w = [Weight("embed.table", (V, D), ("vocab", "embed"), "embedding")]
    if m.kind == "moe":
        n_dense = m.moe.first_dense_layers
        if n_dense:
            w += _block_weights(m, "dense_blocks", n_dense, moe=False)
        w += _block_weights(m, "moe_blocks", m.n_layers - n_dense, moe=True)
    else:
        w += _block_weights(m, "blocks", m.n_layers, moe=False)
    w.append(Weight("head.final_norm.scale", (D,), ("embed",), "norm"))
    if not m.tie_embeddings:
        w.append(Weight("head.lm_head", (D, V), ("embed", "vocab")))
    return tuple(w)


def shard_size(weight: Weight, layout: Layout, role: str = "params") -> int:
    """Elements of `weight` one device holds under `role`'s rules (uneven splits round up)."""
    sizes = layout.sizes
    return math.prod(-(-dim // math.prod(sizes[a] for a in axes))
                     for dim, axes in zip(weight.shape, layout.weight_split(weight, role)))


def indivisible(weights: tuple[Weight, ...], layout: Layout) -> str | None:
    """The first weight dimension that its mesh axes do not divide evenly, described; else None."""
    sizes = layout.sizes
    for role in ("params", "grads", "opt_state"):
        for w in weights:
            for dim, name, axes in zip(w.shape, w.names, layout.weight_split(w, role)):
                ways = math.prod(sizes[a] for a in axes)
                if dim % ways:
                    return f"{w.path} dimension {name}={dim} over {'x'.join(axes)}={ways}"
    return None


# ---------------------------------------------------------------------------
# State: parameters, gradients, optimizer


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter element of the train state.

    `meshwork(cfg)`: what the trainer holds (parameters, gradients and Adam's
    two moments in `train.param_dtype`). `MIXED_PRECISION_ADAM`: the ZeRO
    paper's accounting, 2 + 2 bytes (fp16 parameters and gradients) plus
    K = 12 bytes of optimizer state (fp32 parameters, momentum, variance).
    """

    param: float
    grad: float
    optimizer: float
    name: str = ""
    counters: int = 0
    """Bytes of replicated scalars in the optimizer state."""

    @classmethod
    def meshwork(cls, cfg: Config) -> "StateBytes":
        b = ITEMSIZE[cfg.train.param_dtype]
        # + optax's adamw step count and the schedule's: two int32 scalars.
        return cls(b, b, 2 * b, f"meshwork ({cfg.train.param_dtype} params, grads, Adam moments)", 8)


MIXED_PRECISION_ADAM = StateBytes(2, 2, 12, "ZeRO mixed precision (2 + 2 + K=12 bytes/param)")


def state_memory(cfg: Config, layout: Layout, accounting: StateBytes | None = None) -> dict[str, float]:
    """Per-device bytes of parameters, gradients and optimizer state, from each
    weight's shard under its role's rules (what `sharding/report.state_bytes`
    reads from the compiled program's shard shapes).

    >>> from meshwork.config import Config
    >>> dp, z3 = (state_memory(Config(), make_layout(**kw)) for kw in ({"data": 8}, {"fsdp": 8}))
    >>> round(dp["opt_state"] / z3["opt_state"])
    8
    """
    acc = accounting or StateBytes.meshwork(cfg)
    weights = model_weights(cfg.model)
    params = sum(shard_size(w, layout, "params") for w in weights)
    grads = sum(shard_size(w, layout, "grads") for w in weights)
    opt = sum(shard_size(w, layout, "opt_state") for w in weights)
    out = {"params": params * acc.param, "grads": grads * acc.grad,
           "opt_state": opt * acc.optimizer + acc.counters}
    out["total"] = out["params"] + out["grads"] + out["opt_state"]
    return out


def offload_memory(cfg: Config, layout: Layout, accounting: StateBytes | None = None) -> dict[str, float]:
    """Per-device bytes that `cfg.train.offload` keeps in host memory instead of device memory,
    and the bytes each step moves over the host link (both directions summed).

    Optimizer offload keeps the moments on the host: they cross the link in and out once per
    step. Parameter offload keeps the scanned layers' parameters there: each layer's slice comes
    in for the forward pass and again for the backward pass, its gradient goes out, and the
    update streams the parameters in and out once more. The embedding and head stay on device.

    >>> from meshwork.config import Config
    >>> cfg = Config.model_validate({"train": {"offload": {"optimizer": True}}})
    >>> mem = offload_memory(cfg, make_layout(data=8))
    >>> mem["host"] == state_memory(cfg, make_layout(data=8))["opt_state"] == mem["transfer"] / 2
    True
    """
    acc = accounting or StateBytes.meshwork(cfg)
    off = cfg.train.offload
    host = transfer = 0.0
    if off.optimizer:
        opt = state_memory(cfg, layout, acc)["opt_state"]
        host += opt
        transfer += 2 * opt
    if off.params:
        layers = [w for w in model_weights(cfg.model) if "layers" in w.names]
        params = sum(shard_size(w, layout, "params") for w in layers) * acc.param
        host += params
        transfer += 4 * params + sum(shard_size(w, layout, "grads") for w in layers) * acc.grad
    return {"host": host, "transfer": transfer}


def zero_memory(n_params: float, n_devices: int, stage: int, accounting: StateBytes = MIXED_PRECISION_ADAM) -> float:
    """Per-device model-state bytes of ZeRO-DP stage 0-3 (Rajbhandari et al. 2020, Figure 1):

        stage 0 (baseline)  (2 + 2 + K) Psi
        stage 1 (P_os)      (2 + 2) Psi + K Psi / N
        stage 2 (P_os+g)    2 Psi + (2 + K) Psi / N
        stage 3 (P_os+g+p)  (2 + 2 + K) Psi / N

    >>> round(zero_memory(7.5e9, 64, 1) / 1e9, 1)   # the paper's Table 1: 31.4 GB
    31.4
    """
    p, g, k = accounting.param, accounting.grad, accounting.optimizer
    N = n_devices
    return n_params * {0: p + g + k, 1: p + g + k / N, 2: p + (g + k) / N, 3: (p + g + k) / N}[stage]


# ---------------------------------------------------------------------------
# Activations


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            remat: str = "none") -> float:
    """Activation bytes of one GPT transformer layer in fp16 (Korthikanti et al. 2022, Table 2):

        no parallelism      s b h (34 + 5 a s / h)
        tensor parallel     s b h (10 + 24 / t + 5 a s / (h t))
        tensor + sequence   s b h (34 / t + 5 a s / (h t))
        full recompute      2 s b h   (the layer input only)

    >>> korthikanti_layer_bytes(2048, 1, 12288, 96) == 2048 * 12288 * (34 + 5 * 96 * 2048 / 12288)
    True
    """
    if remat == "full":
        return 2 * s * b * h / (t if sp else 1)
    if t == 1:
        return s * b * h * (34 + 5 * a * s / h)
    if sp:
        return s * b * h * (34 / t + 5 * a * s / (h * t))
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


@dataclasses.dataclass(frozen=True)
class TokenShape:
    """The activations one device sees per microbatch: b sequences of s tokens
    (after the batch and context-parallel splits), and the tensor splits."""

    b: float          # sequences per device per microbatch
    s: int            # tokens per sequence on this device (s / cp)
    seq: int          # the full sequence length (attention's key length)
    t_heads: int      # ways heads are split (tp)
    t_kv: int         # ways kv heads are split
    t_mlp: int        # ways the MLP hidden dimension is split
    t_norm: int       # ways the residual stream between blocks is split (sp, cp counted in s)
    t_vocab: int      # ways the vocabulary (logits) is split

    @property
    def tokens(self) -> float:
        return self.b * self.s


def token_shape(cfg: Config, layout: Layout) -> TokenShape:
    """How one device's activations are cut: batch over the `act_batch` axes and
    microbatches, sequence over `act_seq` (cp), heads/MLP/vocab over tensor."""
    seq = cfg.data.seq_len
    s_ways = layout.ways("act_seq")
    norm_ways = layout.ways("act_norm_seq")
    b = cfg.train.global_batch / (layout.ways("act_batch") * layout.microbatches)
    return TokenShape(b=b, s=seq // s_ways, seq=seq, t_heads=layout.ways("act_heads"),
                      t_kv=layout.ways("act_kv_heads"), t_mlp=layout.ways("act_mlp"),
                      t_norm=max(1, norm_ways // s_ways), t_vocab=layout.ways("act_vocab"))


def layer_activation_bytes(m: ModelConfig, ts: TokenShape, p: int, remat: str = "none", moe: bool = False,
                           materialized_scores: bool = True, capacity_factor: float = 1.0) -> float:
    """Bytes one layer keeps for its backward pass, for one microbatch on one device.

    Korthikanti et al.'s accounting (each tensor a backward matmul or
    nonlinearity reads, stored once, p bytes per element), for meshwork's
    block with h = d_model, q = n_heads x head_dim, kv = n_kv_heads x
    head_dim, F = d_ff, a = n_heads, per token:

        norm inputs and outputs (residual stream, split by SP)    4h / t_sp
        q and k after RoPE, v, attention output                   (2q + 2kv) / t
        softmax probabilities (unless flash attention)            a s / t
        SwiGLU gate, up and their product                         3F / t
        MoE instead: k cf (h + 3 F_e) routed rows, router 2E fp32

    (their GPT block, with dropout and a 4h GeLU MLP, gives 34h + 5as.)
    remat "full" keeps the layer input only (h / t_sp); "dots_saveable" keeps
    the matmul outputs: q, k, v, scores, the attention output, gate, up and
    the two projections back to h.
    """
    h, a = m.d_model, m.n_heads
    q, kv = a * m.resolved_head_dim, m.n_kv_heads * m.resolved_head_dim
    scores = a * ts.seq / ts.t_heads if materialized_scores else 0.0
    if moe:
        e = m.moe
        ffn = e.top_k * capacity_factor * (h + 3 * e.d_expert) / ts.t_mlp
        shared = e.d_shared or e.n_shared_experts * e.d_expert
        ffn += 3 * shared / ts.t_mlp
        router = 2 * e.n_experts * 4 / p
    else:
        ffn, router = 3 * m.d_ff / ts.t_mlp, 0.0
    if remat == "full":
        per_token = h / ts.t_norm
    elif remat == "dots_saveable":
        per_token = (h / ts.t_norm + (2 * q + 2 * kv) / ts.t_heads + scores + 2 * h / ts.t_norm
                     + (2 / 3) * ffn + router)
    else:
        per_token = 4 * h / ts.t_norm + (2 * q + 2 * kv) / ts.t_heads + scores + ffn + router
    return per_token * ts.tokens * p


def activation_memory(cfg: Config, layout: Layout) -> dict[str, float]:
    """Per-device activation bytes at the peak of the backward pass.

    Without a pipeline, one microbatch at a time: remat none/dots_saveable
    keep every layer's `layer_activation_bytes`; full remat keeps each layer
    input plus one layer's working set (recomputed during its backward). A
    meshwork pipeline stashes stage inputs (M under GPipe, min(P, M) under
    1F1B) and recomputes a stage's forward inside its backward, so holds one
    stage's activations at a time. Logits are float32: the logits and their
    gradient, (b s V / t) x 4 bytes each.
    """
    m, p = cfg.model, ITEMSIZE[cfg.train.compute_dtype]
    ts = token_shape(cfg, layout)
    P = layout.sizes["stage"]
    n_moe = (m.n_layers - m.moe.first_dense_layers) if m.kind == "moe" else 0
    n_dense = m.n_layers - n_moe
    flash = m.attention in ("pallas", "cudnn")
    cf = m.moe.capacity_factor or 1.0

    def layers(remat: str, fraction: float = 1.0) -> float:
        per_dense = layer_activation_bytes(m, ts, p, remat, materialized_scores=not flash)
        per_moe = layer_activation_bytes(m, ts, p, remat, moe=True, materialized_scores=not flash,
                                         capacity_factor=cf) if n_moe else 0.0
        return fraction * (n_dense * per_dense + n_moe * per_moe)

    working = max(layer_activation_bytes(m, ts, p, "none", moe=n_moe > 0, materialized_scores=not flash,
                                         capacity_factor=cf), 0.0)
    out: dict[str, float] = {}
    if layout.pipeline != "none":
        stash = layout.microbatches if layout.pipeline == "gpipe" else min(P, layout.microbatches)
        out["pipeline_stash"] = stash * ts.tokens * m.d_model * p / ts.t_norm
        stage = layers(layout.remat, 1 / P)
        out["layers"] = stage + (working if layout.remat == "full" else 0.0)
    else:
        out["layers"] = layers(layout.remat) + (working if layout.remat == "full" else 0.0)
    out["logits"] = 2 * ts.tokens * m.vocab_size / ts.t_vocab * 4
    return out


def kv_cache_bytes(m: ModelConfig, batch: int, seq_len: int, dtype_bytes: int = 2, tensor: int = 1) -> float:
    """Bytes of an inference KV cache per device: keys and values of every layer,
    2 x n_layers x batch x seq_len x n_kv_heads x head_dim x dtype_bytes,
    with the kv heads split over `tensor` (tp shards the cache with the heads).

    >>> from meshwork.config import ModelConfig   # Llama-2-7B: 32 layers, 32 kv heads of 128
    >>> kv_cache_bytes(ModelConfig(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=32), 1, 4096) / 2**30
    2.0
    """
    return 2 * m.n_layers * batch * seq_len * m.n_kv_heads * m.resolved_head_dim * dtype_bytes / tensor


def token_axes(weight: Weight, layout: Layout) -> tuple[str, ...]:
    """Mesh axes over which different tokens reach `weight`, so its gradient is
    summed over them: the batch axes and context parallelism's sequence axes;
    for norm scales also the axes Megatron-SP splits the residual stream over;
    for experts not the axes that split the experts (tokens travel to them).

    >>> w = model_weights(ModelConfig())[2]          # blocks.attn.wq
    >>> token_axes(w, make_layout(data=2, fsdp=2, tensor=2))
    ('data', 'fsdp')
    """
    axes = list(layout.split("act_batch"))
    axes += [a for a in layout.split("act_seq") if a not in axes]
    if weight.kind == "norm":
        axes += [a for a in layout.split("act_norm_seq") if a not in axes]
    if weight.kind == "expert":
        routed = layout.split("expert")
        axes = [a for a in axes if a not in routed]
    return tuple(axes)


def gathered_weight_bytes(cfg: Config, layout: Layout, accounting: StateBytes | None = None) -> float:
    """Transient bytes of weights all-gathered over token axes (ZeRO-3 / FSDP):
    two layers' worth (the layer in use and the next one, prefetched), plus
    the non-scanned weights (embedding, LM head) gathered whole."""
    acc = accounting or StateBytes.meshwork(cfg)
    total = 0.0
    for w in model_weights(cfg.model):
        gathered = set(token_axes(w, layout)) & set(layout.weight_axes(w))
        if not gathered:
            continue
        full = shard_size(w, layout) * math.prod(layout.sizes[a] for a in gathered)
        total += full * acc.param * (2 / w.shape[0] if w.scanned else 1)
    return total


def grad_accumulator_bytes(cfg: Config, layout: Layout) -> float:
    """Gradient accumulation over microbatches (no pipeline) sums in a float32
    buffer shaped and split like the gradients."""
    if layout.microbatches == 1 or layout.pipeline != "none":
        return 0.0
    return 4.0 * sum(shard_size(w, layout, "grads") for w in model_weights(cfg.model))
