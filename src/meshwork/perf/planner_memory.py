"""Planner: what one device holds under a layout, in bytes.

- state: every weight's shard (`planner_weights.shard_size`) under its role's
  rules, parameters, gradients and the optimizer's moments: Adam's two, or under
  Muon one momentum for each matrix stack (`planner_optimizer.moments`). Bytes
  per element follow `StateBytes`: meshwork's own accounting (parameters,
  gradients and moments in `train.param_dtype`) or the ZeRO paper's mixed
  precision (2 + 2 bytes of fp16 parameters and gradients, K = 12 bytes of fp32
  master copy and moments; Rajbhandari et al. 2020, "ZeRO", section 3.1).
- activations: `layer_activation_bytes`, the Korthikanti et al. (2022,
  "Reducing Activation Recomputation in Large Transformer Models", section 4)
  accounting applied to meshwork's block (pre-norm RMSNorm, grouped-query
  attention, SwiGLU or routed experts, no dropout), with their TP and SP
  divisors; remat `full` keeps only each layer's input plus one layer's
  working set; a pipeline stashes stage inputs and recomputes the stage.
- `kv_cache_bytes` for inference (MLA: the latent cache, `kv_bytes_per_token`).
- multi-token prediction: each MTP module's parameters are weights like any
  other (`planner_weights`); its block, norms and logits are `mtp_activation_bytes`.

    >>> from meshwork.config import Config
    >>> from meshwork.perf.planner_layout import make_layout
    >>> mem = state_memory(Config(), make_layout(fsdp=8))
    >>> mem["params"] * 8 == state_memory(Config(), make_layout(data=8))["params"]
    True
"""

from __future__ import annotations

import dataclasses
import math

from meshwork.config import Config
from meshwork.config_sections import ModelConfig
from meshwork.perf.planner_layout import Layout
from meshwork.perf.planner_pipeline import pipeline_schedule
from meshwork.perf.planner_remat import kept_during_backward, kept_elements_per_token, recomputes_matmuls
from meshwork.perf.planner_weights import model_weights, shard_size, token_axes

ITEMSIZE = {"float32": 4, "bfloat16": 2}


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
    """Optimizer bytes per element of a weight that AdamW updates (its two moments and any master copy)."""
    name: str = ""
    counters: int = 0
    """Bytes of replicated scalars in the optimizer state."""
    moment: float | None = None
    """Bytes per element of one moment (None: half of `optimizer`): a Muon matrix keeps one
    moment fewer than AdamW's two."""

    @classmethod
    def meshwork(cls, cfg: Config) -> StateBytes:
        from meshwork.perf.planner_optimizer import counter_bytes

        b = ITEMSIZE[cfg.train.param_dtype]
        moments = "Muon momentum, Adam moments" if cfg.optimizer.name == "muon" else "Adam moments"
        # + optax's int32 step counters (planner_optimizer.COUNTERS: adamw's two, muon's three).
        return cls(
            b, b, 2 * b, f"meshwork ({cfg.train.param_dtype} params, grads, {moments})", counter_bytes(cfg.optimizer), b
        )

    def optimizer_bytes(self, moments: int) -> float:
        """Bytes per element of a weight whose optimizer keeps `moments` moments (AdamW 2, Muon 1)."""
        return self.optimizer - (2 - moments) * (self.optimizer / 2 if self.moment is None else self.moment)


MIXED_PRECISION_ADAM = StateBytes(2, 2, 12, "ZeRO mixed precision (2 + 2 + K=12 bytes/param)", moment=4)


def state_memory(cfg: Config, layout: Layout, accounting: StateBytes | None = None) -> dict[str, float]:
    """Per-device bytes of parameters, gradients and optimizer state, from each
    weight's shard under its role's rules (what `sharding/report.state_bytes`
    reads from the compiled program's shard shapes).

    >>> from meshwork.config import Config
    >>> from meshwork.perf.planner_layout import make_layout
    >>> dp, z3 = (state_memory(Config(), make_layout(**kw)) for kw in ({"data": 8}, {"fsdp": 8}))
    >>> round(dp["opt_state"] / z3["opt_state"])
    8
    """
    from meshwork.perf.planner_optimizer import moments

    acc = accounting or StateBytes.meshwork(cfg)
    weights = model_weights(cfg.model)
    params = sum(shard_size(w, layout, "params") for w in weights)
    grads = sum(shard_size(w, layout, "grads") for w in weights)
    opt = sum(shard_size(w, layout, "opt_state") * acc.optimizer_bytes(moments(cfg.optimizer, w)) for w in weights)
    out = {"params": params * acc.param, "grads": grads * acc.grad, "opt_state": opt + acc.counters}
    out["total"] = out["params"] + out["grads"] + out["opt_state"]
    return out


def offload_memory(cfg: Config, layout: Layout, accounting: StateBytes | None = None) -> dict[str, float]:
    """Per-device bytes that `cfg.train.offload` keeps in host memory instead of device memory,
    and the bytes each step moves over the host link (both directions summed).

    Optimizer offload keeps the moments on the host: they cross the link in and out once per
    step. Remat "offload_dots" keeps the weight products' outputs there (what
    "dots_with_no_batch_dims_saveable" would keep on the device beyond "full"), returned
    apart as "activations": they were never part of the device's bytes. Parameter offload
    keeps the scanned layers' parameters there: each layer's slice comes
    in for the forward pass and again for the backward pass, its gradient goes out, and the
    update streams the parameters in and out once more. The embedding and head stay on device.

    >>> from meshwork.config import Config
    >>> from meshwork.perf.planner_layout import make_layout
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
    activations = 0.0
    if layout.remat == "offload_dots":
        # The weight products' outputs of one microbatch at a time; each microbatch's go out in
        # its forward pass and come back for its backward pass.
        activations = (
            kept_by_layers(cfg, layout, kept_during_backward(layout.remat)) - kept_by_layers(cfg, layout, "full")
        ) / layout.sizes["stage"]
        host += activations
        transfer += 2 * activations * layout.microbatches
    return {"host": host, "transfer": transfer, "activations": activations}


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


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, remat: str = "none") -> float:
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

    b: float  # sequences per device per microbatch
    s: int  # tokens per sequence on this device (s / cp)
    seq: int  # the full sequence length (attention's key length)
    t_heads: int  # ways heads are split (tp)
    t_kv: int  # ways kv heads are split
    t_mlp: int  # ways the MLP hidden dimension is split
    t_norm: int  # ways the residual stream between blocks is split (sp, cp counted in s)
    t_vocab: int  # ways the vocabulary (logits) is split

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
    return TokenShape(
        b=b,
        s=seq // s_ways,
        seq=seq,
        t_heads=layout.ways("act_heads"),
        t_kv=layout.ways("act_kv_heads"),
        t_mlp=layout.ways("act_mlp"),
        t_norm=max(1, norm_ways // s_ways),
        t_vocab=layout.ways("act_vocab"),
    )


def layer_activation_bytes(
    m: ModelConfig,
    ts: TokenShape,
    p: int,
    remat: str = "none",
    moe: bool = False,
    materialized_scores: bool = True,
    capacity_factor: float = 1.0,
) -> float:
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
    Multi-head latent attention (training's expanded form) has q = kv = a x
    max(Dq, Dv) (keys and values per head, values zero-padded to the key
    width) and adds its latent path, never split: the latent's and (q-LoRA)
    the query latent's norm inputs and outputs, 2 R + 2 R_q.
    Any other policy keeps the layer input (h / t_sp) and the tensors
    planner_remat.KEPT names for it: "full" nothing more, "dots_saveable" q, k,
    v, the scores, the attention output, its projection, gate and up.
    """
    h, a = m.d_model, m.n_heads
    q, kv = a * m.resolved_head_dim, m.n_kv_heads * m.resolved_head_dim
    qkv_kept, latent = (q + 2 * kv) / ts.t_heads, 0.0
    if m.mla is not None:
        # The expanded form: q, k and v per head at one width (values zero-padded), and the
        # attention output; the latent path (never split) keeps its norms' inputs and outputs.
        # Partial policies keep the three named products: q, the latent projection, wkv_b's output.
        e = m.mla
        width = max(e.qk_nope_head_dim + e.qk_rope_head_dim, e.v_head_dim)
        q = kv = a * width
        latent = 2 * e.kv_lora_rank + 2 * (e.q_lora_rank or 0)
        qkv_kept = a * (e.qk_nope_head_dim * 2 + e.qk_rope_head_dim + e.v_head_dim) / ts.t_heads + (
            e.kv_lora_rank + e.qk_rope_head_dim
        )
    scores = a * ts.seq / ts.t_heads if materialized_scores else 0.0
    mlp_in, kept_experts = 2 * m.d_ff / ts.t_mlp, 0.0  # what partial policies may keep of the MLP
    if moe:
        e = m.moe
        slots = e.top_k * capacity_factor  # routed rows per token
        experts = slots * (h + 3 * e.d_expert) / ts.t_mlp
        shared = e.d_shared or e.n_shared_experts * e.d_expert
        ffn = experts + 3 * shared / ts.t_mlp
        router = 2 * e.n_experts * 4 / p
        # Partial policies: the router's float32 logits, the shared experts' gate and up, and
        # (gated shared experts) the shared output and its gate's logit are unbatched dots;
        # under capacity dispatch the routed gate, up and down are dots batched over the experts
        # (dropless dispatch's ragged_dot is no dot to any policy).
        gated = 1.0 if shared and e.shared_expert_gate else 0.0
        mlp_in = e.n_experts * 4 / p + 2 * shared / ts.t_mlp + gated * (h / ts.t_norm + 4 / p)
        if e.capacity_factor is not None:
            kept_experts = slots * (2 * e.d_expert + h) / ts.t_mlp
    else:
        experts, ffn, router = 0.0, 3 * m.d_ff / ts.t_mlp, 0.0
    if remat == "none":
        per_token = 4 * h / ts.t_norm + (2 * q + 2 * kv) / ts.t_heads + latent + scores + ffn + router
    else:
        per_token = kept_elements_per_token(
            remat,
            h=h / ts.t_norm,
            qkv=qkv_kept,
            attention=scores + q / ts.t_heads,
            out_proj=h / ts.t_norm,
            mlp_in=mlp_in,
            experts=kept_experts,
        )
    return per_token * ts.tokens * p


def kept_by_layers(cfg: Config, layout: Layout, remat: str, one: bool = False) -> float:
    """Bytes all layers (`one`: one layer, a MoE one if the model has any) keep for their
    backward pass under `remat`, for one microbatch on one device."""
    m, p = cfg.model, ITEMSIZE[cfg.train.compute_dtype]
    ts = token_shape(cfg, layout)
    n_moe = m.moe.n_moe_layers(m.n_layers) if m.kind == "moe" else 0
    kw = dict(materialized_scores=m.attention not in ("pallas", "cudnn"), capacity_factor=m.moe.capacity_factor or 1.0)
    if one:
        return layer_activation_bytes(m, ts, p, remat, moe=n_moe > 0, **kw)
    per_dense = layer_activation_bytes(m, ts, p, remat, **kw)
    per_moe = layer_activation_bytes(m, ts, p, remat, moe=True, **kw) if n_moe else 0.0
    return (m.n_layers - n_moe) * per_dense + n_moe * per_moe


def _kv_width(m: ModelConfig, ts: TokenShape) -> float:
    """Elements per token of one of K, V on a device (MLA's expanded form: every head, padded)."""
    if m.mla is None:
        return m.n_kv_heads / ts.t_kv * m.resolved_head_dim
    e = m.mla
    return m.n_heads / ts.t_heads * max(e.qk_nope_head_dim + e.qk_rope_head_dim, e.v_head_dim)


def activation_memory(cfg: Config, layout: Layout) -> dict[str, float]:
    """Per-device activation bytes at the peak of the backward pass.

    Without a pipeline, one microbatch at a time: every layer's
    `layer_activation_bytes`, plus, under a policy whose backward runs the
    layer's products again (`recomputes_matmuls`), what one layer recomputes:
    all of it under full and offload_dots (whose kept products come back from
    the host), the part the policy did not keep otherwise. A
    meshwork pipeline stashes stage inputs (`stash_size` of its schedule
    table: M under GPipe, min(P, M) under 1F1B) and the output cotangents
    waiting for a backward (`cotangent_stash_size`), and recomputes a stage's forward inside its backward, so holds one
    stage's activations at a time. Logits are float32: the logits and their
    gradient, (b s V / t) x 4 bytes each, for the rows the loss holds at once: all of the
    microbatch's, or one chunk's under the fused loss (train.loss_chunk).
    """
    m, p = cfg.model, ITEMSIZE[cfg.train.compute_dtype]
    ts = token_shape(cfg, layout)
    P = layout.sizes["stage"]
    # While a layer's backward recomputes, it holds what the policy did not keep: all of the
    # layer under full (and offload_dots, whose kept products come back from the host).
    working = 0.0
    if recomputes_matmuls(layout.remat):
        whole = kept_by_layers(cfg, layout, "none", one=True)
        working = (
            whole
            if layout.remat in ("full", "offload_dots")
            else max(whole - kept_by_layers(cfg, layout, layout.remat, one=True), 0.0)
        )
    out: dict[str, float] = {}
    if layout.pipeline != "none":
        sched = pipeline_schedule(layout)  # the schedule table the executor runs
        one_input = ts.tokens * m.d_model * p / ts.t_norm
        out["pipeline_stash"] = sched.stash * one_input
        out["pipeline_cotangents"] = sched.cotangents * one_input
        out["layers"] = kept_by_layers(cfg, layout, layout.remat) / P + working
    else:
        out["layers"] = kept_by_layers(cfg, layout, layout.remat) + working
    out["logits"] = 2 * ts.tokens * _loss_rows_fraction(cfg, layout) * m.vocab_size / ts.t_vocab * 4
    if layout.context_parallel == "all_gather" and layout.split("act_seq") and layout.pipeline == "none":
        # The all-gathered keys and values are the local formula's residuals: each layer keeps the
        # other devices' n-1 blocks too (only the layer being recomputed under a remat policy).
        layers = m.n_layers if layout.remat == "none" else 1
        out["cp_gathered_kv"] = layers * (layout.ways("act_seq") - 1) * 2 * ts.tokens * _kv_width(m, ts) * p
    if m.mtp.depth:
        out["mtp"] = mtp_activation_bytes(cfg, layout)
    return out


def mtp_activation_bytes(cfg: Config, layout: Layout) -> float:
    """Bytes the MTP modules (models/mtp.py) keep for the backward pass, one microbatch on one
    device: they run outside the layer scan, so each keeps all of its block's activations (remat
    "none"), its two input norms' outputs and the projection's input (2h + 2h), and its own float32
    logits and their gradient over every row (the module's loss is not chunked).

    >>> from meshwork.perf.planner_layout import make_layout
    >>> mtp_activation_bytes(Config(), make_layout(data=8))
    0.0
    """
    from meshwork.perf.flops import mtp_block_is_moe

    m, n = cfg.model, cfg.model.mtp.depth
    if not n:
        return 0.0
    p, ts = ITEMSIZE[cfg.train.compute_dtype], token_shape(cfg, layout)
    kw = dict(materialized_scores=m.attention not in ("pallas", "cudnn"), capacity_factor=m.moe.capacity_factor or 1.0)
    block = layer_activation_bytes(m, ts, p, "none", moe=mtp_block_is_moe(m), **kw)
    own = 4 * m.d_model / ts.t_norm * ts.tokens * p
    logits = 2 * ts.tokens * m.vocab_size / ts.t_vocab * 4
    return n * (block + own + logits)


def _loss_rows_fraction(cfg: Config, layout: Layout) -> float:
    """The share of a microbatch's token rows whose logits the loss holds at once: 1 for the
    plain loss, chunk / rows for the fused one (its chunks are strided over the devices)."""
    from meshwork.objectives.next_token import auto_loss_chunk

    rows = cfg.train.global_batch * cfg.data.seq_len // cfg.train.microbatches
    chunk = cfg.train.loss_chunk
    if layout.pipeline != "none" or cfg.model.kind == "unet":
        return 1.0
    if chunk == "auto":
        chunk = auto_loss_chunk(cfg.model.vocab_size, rows)
    return 1.0 if chunk is None else min(1.0, chunk / rows)


def kv_bytes_per_token(m: ModelConfig, dtype_bytes: int = 2) -> int:
    """Bytes one token adds to an inference cache (src/meshwork/engine/kv_cache.py's
    `cache_bytes_per_token`): keys and values, 2 x layers x n_kv_heads x head_dim x bytes, or
    under MLA the latent and the RoPE key, layers x (kv_lora_rank + qk_rope_head_dim) x bytes.
    The cache holds one more layer per MTP module (the draft's).

    >>> from meshwork.config_sections import MLAConfig   # DeepSeek-V3's shape: 61 layers, 512 + 64
    >>> kv_bytes_per_token(ModelConfig(n_layers=61, mla=MLAConfig(kv_lora_rank=512, qk_rope_head_dim=64)))
    70272
    """
    layers = m.n_layers + m.mtp.depth
    if m.mla is not None:
        return layers * (m.mla.kv_lora_rank + m.mla.qk_rope_head_dim) * dtype_bytes
    return 2 * layers * m.n_kv_heads * m.resolved_head_dim * dtype_bytes


def kv_cache_splits(m: ModelConfig, tensor: int) -> int:
    """Into how many pieces tensor parallelism over `tensor` devices cuts the cache: the kv heads'
    split (when they divide), 1 under MLA (its one latent is read by every head: replicated)."""
    if m.mla is not None or m.n_kv_heads % tensor:
        return 1
    return tensor


def kv_cache_bytes(m: ModelConfig, batch: int, seq_len: int, dtype_bytes: int = 2, tensor: int = 1) -> float:
    """Bytes of an inference KV cache per device: `kv_bytes_per_token` x batch x seq_len,
    2 x n_layers x batch x seq_len x n_kv_heads x head_dim x dtype_bytes for dense attention,
    with the kv heads split over `tensor` (tp shards the cache with the heads); MLA's latent
    cache is not split.

    >>> from meshwork.config_sections import ModelConfig   # Llama-2-7B: 32 layers, 32 kv heads of 128
    >>> kv_cache_bytes(ModelConfig(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=32), 1, 4096) / 2**30
    2.0
    """
    if m.mla is not None:
        return kv_bytes_per_token(m, dtype_bytes) * batch * seq_len
    return 2 * (m.n_layers + m.mtp.depth) * batch * seq_len * m.n_kv_heads * m.resolved_head_dim * dtype_bytes / tensor


# ---------------------------------------------------------------------------
# Transient buffers: gathered weights, gradient accumulator


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
