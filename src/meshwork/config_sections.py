"""The typed sections of a run's configuration, one frozen pydantic model each.

`run`, `model` (with its `moe`, `unet` and `diffusion` parts), `data`,
`optimizer`, `train` (with `offload`), `mesh`, `rules`, `checkpoint`, `log`,
`comm` and `finetune`; the docstring under each field documents it. Unknown
keys and wrong types are errors, so a typo never silently falls back to a
default. `meshwork.config.Config` gathers the sections and checks the fields
that depend on each other.
"""

from __future__ import annotations

from typing import Annotated, Literal, NamedTuple

import pydantic

from meshwork.rope_scaling import rope_type_of

MESH_AXES = ("stage", "data", "fsdp", "expert", "sequence", "tensor")


class Section(pydantic.BaseModel):
    # allow_inf_nan=False: no float setting has a meaning at inf or nan (lr=.inf would train a NaN model).
    model_config = pydantic.ConfigDict(frozen=True, extra="forbid", populate_by_name=True, allow_inf_nan=False)

    @pydantic.field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value, info):
        """YAML reads `true` as a bool, which pydantic would take as the number 1 (train.steps=true)."""
        annotation = cls.model_fields[info.field_name].annotation
        numeric = annotation in (int, float) or annotation in (int | None, float | None)
        if isinstance(value, bool) and numeric:
            raise ValueError(f"expected a number, not the boolean {str(value).lower()}")
        return value


class RunConfig(Section):
    dir: str = "runs/lm_tiny"
    """Output directory: resolved config, metrics.jsonl, TensorBoard events, checkpoints/."""
    seed: int = 0
    """Seeds parameter init and data order."""
    name: str = "lm_tiny"
    overwrite: bool = False
    """Replace what `dir` holds when it belongs to a run of another config (its checkpoints and
    metrics are deleted); without it such a run.dir is refused and left untouched."""
    allow_changes: tuple[str, ...] = ()
    """Optimizer settings (dotted keys under `optimizer.`, e.g. [optimizer.lr]) that may differ
    from the run stored in `dir` when it resumes: the change applies from the resumed step on
    and is recorded in `dir`/config_history.jsonl. Any other difference from the config saved in the newest checkpoint is
    refused (the checkpoints hold its shapes, data order and batch)."""
    mttf_hours: float | None = pydantic.Field(None, gt=0)
    """Mean time to failure of the whole job, in hours: what checkpoint.every=auto trades the
    checkpoint cost against (perf/reliability.py `cluster_mttf` turns a device MTTF into it)."""

    @pydantic.field_validator("allow_changes")
    @classmethod
    def _only_optimizer_keys(cls, keys: tuple[str, ...]) -> tuple[str, ...]:
        # optimizer.name is not one of them: another optimizer's state has another shape.
        allowed = [f"optimizer.{f}" for f in OptimizerConfig.model_fields if f not in ("name", "muon")]
        allowed += [f"optimizer.muon.{f}" for f in MuonConfig.model_fields]
        for key in keys:
            if key not in allowed:
                raise ValueError(f"{key!r} cannot change within a run; name optimizer keys only ({', '.join(allowed)})")
        return keys


class MoEConfig(Section):
    """Mixture-of-Experts feed-forward layers (models/layers/moe.py, moe_routing.py, moe_dispatch.py); used when model.kind = moe."""

    n_experts: int = pydantic.Field(8, gt=0)
    """Routed experts per MoE layer."""
    top_k: int = pydantic.Field(2, gt=0)
    """Routed experts each token is sent to."""
    d_expert: int = pydantic.Field(192, gt=0)
    """Hidden size of one routed expert's SwiGLU (fine-grained experts: d_ff / m)."""
    n_shared_experts: int = pydantic.Field(0, ge=0)
    """Always-on experts every token passes through (DeepSeekMoE); their hidden size is d_expert each."""
    d_shared: int | None = pydantic.Field(None, gt=0)
    """Hidden size of the shared expert(s) SwiGLU; null: n_shared_experts * d_expert."""
    shared_expert_gate: bool = False
    """Qwen2-MoE: scale the shared experts' output by sigmoid(x . w_gate)."""
    router: Literal["softmax", "noisy", "sigmoid"] = "softmax"
    """softmax top-k (Mixtral); noisy top-k (Shazeer et al., noise in training only);
    sigmoid scores with a selection-only bias (DeepSeek-V3)."""
    norm_topk_prob: bool = True
    """Renormalize the k selected weights to sum to 1. With router softmax this is a softmax over
    the k selected logits only (gpt-oss, Mixtral)."""
    router_bias: bool = False
    """gpt-oss: the router is a linear layer with a learned bias, logits = x W_r + b_r, for
    selection, weights and the aux and z losses alike (parameter `b_router`; not DeepSeek-V3's
    selection-only bias, which router sigmoid keeps as `router_bias`)."""
    noise_std: float = pydantic.Field(1.0, ge=0)
    """Noisy top-k: scale of the learned-softplus noise."""
    n_groups: int = pydantic.Field(1, gt=0)
    """DeepSeek-V3 group-limited routing: experts split into this many groups..."""
    topk_groups: int = pydantic.Field(1, gt=0)
    """...of which each token may use this many."""
    routed_scaling_factor: float = 1.0
    """Multiplies the routed experts' combined output (DeepSeek-V3: 2.5)."""
    expert_bias: bool = False
    """gpt-oss: the routed experts' gate, up and down projections have learned biases
    (`b_gate`, `b_up` (E, F), `b_down` (E, D)), so an expert maps x to act(x W_g + b_g,
    x W_u + b_u) W_d + b_d."""
    activation: Literal["swiglu", "clamped_swiglu"] = "swiglu"
    """The routed experts' gated activation: swiglu silu(g) * u; clamped_swiglu (gpt-oss)
    g' = min(g, swiglu_limit), u' = clip(u, -swiglu_limit, swiglu_limit),
    (u' + 1) * g' * sigmoid(swiglu_alpha * g')."""
    swiglu_limit: float = pydantic.Field(7.0, gt=0)
    """clamped_swiglu: the clamp on the gate (above) and on the up projection (both sides)."""
    swiglu_alpha: float = pydantic.Field(1.702, gt=0)
    """clamped_swiglu: the sigmoid's slope, g * sigmoid(alpha * g) (1.702: a GELU approximation)."""
    bias_update_rate: float = pydantic.Field(0.0, ge=0)
    """Auxiliary-loss-free balancing: after each step the selection bias moves by this
    rate toward under-loaded experts (0 disables)."""
    capacity_factor: float | None = pydantic.Field(None, gt=0)
    """Tokens per expert = capacity_factor * tokens * top_k / n_experts; overflow tokens
    skip the experts (GShard). null: dropless (grouped matmul over sorted tokens)."""
    aux_loss_coef: float = pydantic.Field(0.01, ge=0)
    """Switch/GShard load-balancing loss coefficient."""
    z_loss_coef: float = pydantic.Field(0.001, ge=0)
    """Router z-loss coefficient (ST-MoE)."""
    first_dense_layers: int = pydantic.Field(0, ge=0)
    """The first k layers use the dense MLP (d_ff), the rest MoE (DeepSeek-V3)."""
    dense_layers: tuple[pydantic.NonNegativeInt, ...] | None = None
    """Any layers that use the dense MLP (d_ff) instead of experts, by index from 0, in increasing
    order: the general form of first_dense_layers (set one or the other), e.g. [0, 2] for
    Qwen2-MoE's decoder_sparse_step 2 in 4 layers, or its mlp_only_layers. null: none listed
    (so a run saved before this key existed reads as the same run)."""

    def dense_layer_indices(self, n_layers: int) -> tuple[int, ...]:
        """The layers (of a model of `n_layers`) with a dense MLP, in increasing order.

        >>> [MoEConfig(first_dense_layers=2).dense_layer_indices(4), MoEConfig(dense_layers=[1]).dense_layer_indices(4)]
        [(0, 1), (1,)]
        """
        return tuple(i for i in (self.dense_layers or range(self.first_dense_layers)) if i < n_layers)

    def n_moe_layers(self, n_layers: int) -> int:
        """How many of the `n_layers` layers route to experts."""
        return n_layers - len(self.dense_layer_indices(n_layers))

    def layer_runs(self, n_layers: int, linear_layers: tuple[int, ...] = ()) -> tuple[LayerRun, ...]:
        """The model's layers as runs of consecutive layers of one kind, in order; the MoE model
        (models/moe.py) stacks and scans each run as one group, under the run's `name`.

        Dense layers only in front (or none) keep the names `dense_blocks` and `moe_blocks`, so
        such a model's parameters (and checkpoints) are named as they always were; any other
        pattern names each run by its kind and first layer (`dense_blocks_0`, `moe_blocks_1`, ...).

        >>> [tuple(r) for r in MoEConfig(first_dense_layers=1).layer_runs(4)]
        [('dense_blocks', False, 0, 1, False), ('moe_blocks', True, 1, 3, False)]
        >>> [r.name for r in MoEConfig(dense_layers=[0, 2]).layer_runs(4)]
        ['dense_blocks_0', 'moe_blocks_1', 'dense_blocks_2', 'moe_blocks_3']

        `linear_layers`: the layers whose attention is linear (a hybrid model's Gated DeltaNet layers,
        `ModelConfig.linear_layers`), which also end a run and name theirs `linear_..._<start>`.

        >>> [r.name for r in MoEConfig().layer_runs(4, linear_layers=(0, 1, 2))]
        ['linear_moe_blocks_0', 'moe_blocks_3']
        """
        dense, linear = set(self.dense_layer_indices(n_layers)), set(linear_layers)
        runs: list[list] = []
        for i in range(n_layers):
            kind = (i not in dense, i in linear)
            if runs and runs[-1][0] == kind:
                runs[-1][2] += 1
            else:
                runs.append([kind, i, 1])
        classic = not linear and [moe for (moe, _), _, _ in runs] in ([True], [False, True])
        return tuple(
            LayerRun(
                ("linear_" if lin else "") + f"{'moe' if moe else 'dense'}_blocks" + ("" if classic else f"_{start}"),
                moe,
                start,
                n,
                lin,
            )
            for (moe, lin), start, n in runs
        )


class LayerRun(NamedTuple):
    """Consecutive layers of one kind (MoE or dense) of a MoE model: `MoEConfig.layer_runs`."""

    name: str
    """The model attribute (and parameter tree key) of the run's stacked layers."""
    moe: bool
    start: int
    """The index of the run's first layer in the model."""
    count: int
    linear: bool = False
    """The run's layers attend linearly (Gated DeltaNet: `ModelConfig.linear_attention`)."""


class UNetConfig(Section):
    """An image UNet (models/unet.py) whose fields mirror diffusers' UNet2DModel config,
    so its weights load; used when model.kind = unet."""

    sample_size: int = pydantic.Field(16, gt=0)
    in_channels: int = pydantic.Field(1, gt=0)
    out_channels: int = pydantic.Field(1, gt=0)
    block_out_channels: list[int] = [32, 64]
    """Channels of each resolution level, from the input resolution down."""
    down_block_types: list[Literal["DownBlock2D", "AttnDownBlock2D"]] = ["DownBlock2D", "AttnDownBlock2D"]
    up_block_types: list[Literal["UpBlock2D", "AttnUpBlock2D"]] = ["AttnUpBlock2D", "UpBlock2D"]
    layers_per_block: int = pydantic.Field(1, gt=0)
    norm_num_groups: int = pydantic.Field(8, gt=0)
    norm_eps: float = 1e-5
    attention_head_dim: int = pydantic.Field(8, gt=0)
    mid_block_attention: bool = True
    num_class_embeds: int | None = pydantic.Field(None, gt=0)
    """Class conditioning (digits: 10); an extra null class is not added: classifier-free
    guidance drops labels to class `num_class_embeds - 1` only if you reserve one."""
    flip_sin_to_cos: bool = True
    freq_shift: int = 0


class DiffusionConfig(Section):
    """The denoising objective and its noise schedule; used when model.kind = unet."""

    num_train_timesteps: int = pydantic.Field(1000, gt=0)
    schedule: Literal["linear", "cosine"] = "linear"
    beta_start: float = pydantic.Field(1e-4, gt=0)
    beta_end: float = pydantic.Field(0.02, gt=0)
    prediction: Literal["epsilon", "v"] = "epsilon"
    ema_decay: float = pydantic.Field(0.999, ge=0, lt=1)
    label_dropout: float = pydantic.Field(0.1, ge=0, le=1)
    """Classifier-free guidance training: share of labels replaced by the null class."""


class MLAConfig(Section):
    """Multi-head latent attention (DeepSeek-V2/V3; models/layers/mla.py): keys and values are
    up-projected from one low-rank latent per token, which is all the KV cache keeps."""

    q_lora_rank: int | None = pydantic.Field(None, gt=0)
    """Rank of the queries' low-rank projection (with an RMSNorm between); null: a full q projection."""
    kv_lora_rank: int = pydantic.Field(64, gt=0)
    """Width of the compressed key/value latent the cache holds per token."""
    qk_nope_head_dim: int = pydantic.Field(32, gt=0)
    """Per-head query/key dims without RoPE (up-projected from the latent)."""
    qk_rope_head_dim: int = pydantic.Field(16, gt=0)
    """Per-head query dims with RoPE, and the one RoPE key shared by all heads (cached beside the latent)."""
    v_head_dim: int = pydantic.Field(32, gt=0)
    """Per-head value dims."""

    @pydantic.field_validator("qk_rope_head_dim")
    @classmethod
    def _even(cls, value: int) -> int:
        if value % 2:
            raise ValueError(f"{value} is odd; RoPE rotates pairs of dims, so use an even number")
        return value


class LinearAttentionConfig(Section):
    """Gated DeltaNet layers (Qwen3-Next; models/layers/gated_deltanet.py), for the layers
    `model.layer_types` marks linear_attention: a fixed-size state per sequence instead of a KV cache."""

    num_k_heads: int = pydantic.Field(2, gt=0)
    """Query/key heads (transformers: linear_num_key_heads)."""
    num_v_heads: int = pydantic.Field(4, gt=0)
    """Value heads, a multiple of num_k_heads (linear_num_value_heads)."""
    head_k_dim: int = pydantic.Field(32, gt=0)
    head_v_dim: int = pydantic.Field(32, gt=0)
    conv_kernel: int = pydantic.Field(4, gt=0)
    """Taps of the causal depthwise convolution over q, k, v (linear_conv_kernel_dim)."""
    chunk_size: int = pydantic.Field(64, gt=0)
    """Tokens per chunk of the chunked form that training and prefill run (decoding runs the recurrence)."""

    @pydantic.model_validator(mode="after")
    def _heads_divide(self) -> LinearAttentionConfig:
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"model.linear_attention.num_v_heads={self.num_v_heads} must be a multiple of num_k_heads={self.num_k_heads}"
            )
        return self


class MTPConfig(Section):
    """Multi-token prediction (DeepSeek-V3; models/mtp.py): `depth` extra modules, module k
    predicting the token k + 1 places after the next from the previous depth's hidden state
    and the embedding of the token k places ahead, sharing the model's embedding and head."""

    depth: int = pydantic.Field(0, ge=0)
    """Number of MTP modules (DeepSeek-V3: 1); 0: none."""
    loss_coef: float = pydantic.Field(0.3, ge=0)
    """Weight of the mean over depths of the MTP cross-entropies in the objective (DeepSeek-V3: 0.3, then 0.1)."""


class ModelConfig(Section):
    kind: Literal["transformer", "moe", "unet"] = "transformer"
    vocab_size: int = pydantic.Field(256, gt=0)
    """256 for the byte-level tokenizer; larger for a user token file."""
    d_model: int = pydantic.Field(128, gt=0)
    n_layers: int = pydantic.Field(4, gt=0)
    n_heads: int = pydantic.Field(4, gt=0)
    n_kv_heads: int = pydantic.Field(2, gt=0)
    """Grouped-query attention: n_heads must be a multiple of n_kv_heads."""
    head_dim: int | None = pydantic.Field(None, gt=0)
    """Defaults to d_model // n_heads."""
    d_ff: int = pydantic.Field(384, gt=0)
    """Hidden size of the SwiGLU MLP."""
    rope_theta: float = pydantic.Field(10000.0, gt=0)
    rope_scaling: dict[str, bool | int | float | str] | None = None
    """Scaled RoPE frequencies, in Hugging Face's `rope_scaling` form: `rope_type` one of
    llama3, linear, dynamic, yarn, with that type's keys (e.g. `factor`,
    `original_max_position_embeddings`); null for plain RoPE. models/layers/rope.py."""
    norm_eps: float = pydantic.Field(1e-5, gt=0)
    attention: Literal["xla", "pallas", "cudnn", "reference"] = "xla"
    """Attention kernel: XLA's fusion of jax.nn.dot_product_attention; meshwork's Pallas flash
    attention (interpret mode on CPU: slow, for tests); cuDNN's (GPU only); or the plain
    reference that materializes the scores. A sequence split by context parallelism attends by
    `train.context_parallel` (ring, all_gather, ulysses or usp; sharding/context_parallel.py)."""
    qkv_bias: bool = False
    """Biases on the q, k, v projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over each head's q and k before RoPE, one learned scale per head_dim (Qwen3)."""
    sliding_window: int | None = pydantic.Field(None, gt=0)
    """A query at position i attends to keys at i - sliding_window < j <= i only (Mistral);
    null attends to every earlier key. Honoured by every attention path and the KV cache."""
    tie_embeddings: bool = False
    """Reuse the input embedding as the output projection."""
    layer_types: list[Literal["full_attention", "sliding_attention", "linear_attention"]] | None = None
    """Each layer's attention, in Hugging Face's names: full causal attention, within
    `sliding_window` (Gemma 2 alternates them, Gemma 3 has 5 sliding to 1 full, gpt-oss alternates),
    or Gated DeltaNet (`linear_attention`; Qwen3-Next has 3 linear to 1 full); null: every layer
    sliding if `sliding_window` is set, else every layer full."""
    linear_attention: LinearAttentionConfig | None = None
    """The shape of the linear_attention layers (needed when `layer_types` has any)."""
    attention_output_gate: bool = False
    """The attention output is multiplied by sigmoid of a per-head gate that q_proj also produces
    (Qwen3-Next: q_proj's output per head is [query, gate])."""
    partial_rotary_factor: float = pydantic.Field(1.0, gt=0, le=1)
    """RoPE rotates the first partial_rotary_factor x head_dim dims of each head (Qwen3-Next: 0.25)."""
    local_rope_theta: float | None = pydantic.Field(None, gt=0)
    """RoPE base of the sliding_attention layers, when it differs from `rope_theta` (Gemma 3's
    rope_local_base_freq); those layers then take `local_rope_scaling`, not `rope_scaling`."""
    local_rope_scaling: dict[str, bool | int | float | str] | None = None
    attn_logit_softcap: float | None = pydantic.Field(None, gt=0)
    """Attention scores become cap * tanh(score / cap) before the mask (Gemma 2's 50)."""
    final_logit_softcap: float | None = pydantic.Field(None, gt=0)
    """Output logits become cap * tanh(logit / cap) (Gemma 2's 30)."""
    attention_sinks: bool = False
    """A learned logit per query head in each attention softmax's denominator (gpt-oss)."""
    attention_out_bias: bool = False
    """A bias on the attention output projection (gpt-oss's attention_bias also biases q, k, v: qkv_bias)."""
    query_pre_attn_scalar: float | None = pydantic.Field(None, gt=0)
    """Attention scores scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5 (Gemma)."""
    sandwich_norm: bool = False
    """RMSNorms on the attention's and the MLP's outputs too, before each residual add (Gemma 2/3)."""
    zero_centered_norm: bool = False
    """Every RMSNorm scales by 1 + weight, the weight starting at 0 (Gemma, Qwen3-Next)."""
    scale_embeddings: bool = False
    """Token embeddings multiplied by sqrt(d_model) on input, not in the tied head (Gemma)."""
    mlp_activation: Literal["silu", "gelu_tanh"] = "silu"
    """The gated MLP's activation: SwiGLU's silu, or GeGLU's tanh-approximated gelu (Gemma)."""
    init_std: float = 0.02
    mla: MLAConfig | None = None
    """Multi-head latent attention in every layer instead of grouped-query attention (n_kv_heads
    and head_dim are then unused); null: grouped-query attention."""
    mtp: MTPConfig = MTPConfig()
    """Multi-token prediction modules (trained beside the model; a draft for speculative decoding)."""
    moe: MoEConfig = MoEConfig()
    """Used when kind = moe."""
    unet: UNetConfig = UNetConfig()
    """Used when kind = unet."""
    diffusion: DiffusionConfig = DiffusionConfig()
    """Used when kind = unet."""

    @pydantic.field_validator("rope_scaling", "local_rope_scaling")
    @classmethod
    def _a_scaling_meshwork_computes(cls, scaling: dict | None) -> dict | None:
        rope_type_of(scaling)  # ValueError naming the unknown type or the missing or unused key
        return scaling

    @pydantic.model_validator(mode="after")
    def _layer_types_fit(self) -> ModelConfig:
        if self.layer_types is not None:
            if len(self.layer_types) != self.n_layers:
                raise ValueError(
                    f"model.layer_types has {len(self.layer_types)} entries for n_layers={self.n_layers}; give one per layer"
                )
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("model.layer_types has sliding_attention layers but no model.sliding_window; set one")
            if self.mla is not None and len(set(self.layer_types)) > 1:
                raise ValueError(
                    "model.layer_types mixes kinds of layers, which multi-head latent attention (model.mla) "
                    "does not take; drop layer_types or model.mla"
                )
            if "linear_attention" in self.layer_types:
                if self.linear_attention is None:
                    raise ValueError("model.layer_types has linear_attention layers; set model.linear_attention")
                if self.kind != "moe":
                    raise ValueError(
                        "linear_attention layers are built in model.kind moe (Qwen3-Next's layout); "
                        "use kind moe (moe.dense_layers can make any layer dense)"
                    )
                if self.mtp.depth or self.mla is not None:
                    raise ValueError("linear_attention layers take neither model.mtp nor model.mla")
        return self

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The indices of the linear_attention (Gated DeltaNet) layers."""
        return tuple(i for i, t in enumerate(self.layer_types or ()) if t == "linear_attention")

    def layer_runs(self) -> tuple[LayerRun, ...]:
        """A MoE model's runs of consecutive layers of one kind (MoE or dense, linear or not)."""
        return self.moe.layer_runs(self.n_layers, self.linear_layers)

    @property
    def norm_offset(self) -> float:
        """What RMSNorm adds to its weight: 1 for zero-centered norms, else 0."""
        return 1.0 if self.zero_centered_norm else 0.0

    @property
    def attention_kinds(self) -> list[str]:
        """Each layer's attention kind (`layer_types`, or what `sliding_window` implies for all)."""
        if self.layer_types is not None:
            return list(self.layer_types)
        return ["sliding_attention" if self.sliding_window else "full_attention"] * self.n_layers

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads


class DataConfig(Section):
    source: Literal["stdlib", "stdlib_docs", "tokens", "text", "chat", "digits", "images"] = "stdlib"
    """`stdlib`: this Python's own standard-library sources, byte-tokenized.
    `stdlib_docs`: English prose, the reference-manual topics pydoc ships (pydoc_data), byte-tokenized.
    `tokens`: nanoGPT-style uint16 files `train_path` and `val_path`.
    `text`: your own documents (`text_files`), tokenized once by `tokenizer` and packed into
    windows whose attention and loss stay inside each document (meshwork/data/user_text.py).
    `chat`: your conversations (`.jsonl` `text_files`, OpenAI-style `messages`), rendered with the
    chat template of `tokenizer`'s folder and packed like `text`; the loss counts only the
    assistant's tokens (meshwork/data/chat.py).
    `digits`: scikit-learn's handwritten digits (for model.kind=unet).
    `images`: the PNG/JPEG files under `image_dir` (subfolders are classes)."""
    image_dir: str | None = None
    train_path: str | None = None
    val_path: str | None = None
    seq_len: int = pydantic.Field(128, gt=0)
    text_files: list[str] = []
    """source=text: files or globs (`~` expanded, `**` recursive). A `.jsonl` file holds one document
    per line and a `.parquet` file one per row (both in `text_field`); any other file (`.txt`,
    `.md`, ...) is one UTF-8 document."""
    text_field: str = "text"
    """source=text: the JSON field or Parquet column that holds a document's text."""
    messages_field: str = "messages"
    """source=chat: the JSON field that holds a conversation's list of `{"role", "content"}` messages."""
    tokenizer: str | None = None
    """source=text or chat: a `tokenizer.json` file, or a folder holding one (a Hugging Face
    checkpoint); its post-processor adds BOS, and the EOS its `tokenizer_config.json` names ends
    every document. null: the byte tokenizer (ids 0..255, no special tokens). source=chat renders
    with the folder's chat template (`chat_template.jinja` or `tokenizer_config.json`'s), or,
    with none or the byte tokenizer, one `role: content` line per message."""
    val_fraction: float = pydantic.Field(0.02, gt=0, lt=1)
    """Share of stdlib files, or of text documents (both chosen by a hash of their path, and line or
    row), held out for validation."""
    cache_dir: str | None = None
    """Where the tokenized stdlib corpus is cached; default ~/.cache/meshwork (or $MESHWORK_CACHE).
    Tokenized text goes in a hidden `.meshwork-tokens-*` folder beside the first text file, or here
    when that folder is not writable or this is set."""

    @pydantic.field_validator("text_files", mode="before")
    @classmethod
    def _one_file_is_a_list(cls, value):
        return [value] if isinstance(value, str) else value


class MuonConfig(Section):
    """Muon (src/meshwork/optimizers/muon.py): momentum orthogonalized by a Newton-Schulz iteration
    for the weight matrices (per layer of a scanned stack, per expert), AdamW (the fields of
    `optimizer`) for the embedding, the head, norms, biases and other non-matrix weights."""

    newton_schulz: Literal["gather", "sharded"] = "gather"
    """How the iteration runs on a sharded matrix (optimizers/newton_schulz.py). gather: each
    matrix is assembled whole on one owner device (owners round-robin over every device that holds
    a piece or a copy of it, by all-to-alls), iterated there, and sent back. sharded: every device
    iterates on its own shard; the Gram products are all-reduced over the sharded dimension."""
    ns_steps: int = pydantic.Field(5, gt=0)
    """Newton-Schulz iterations per step (the quintic of Jordan et al., 2024)."""
    beta: float = pydantic.Field(0.95, ge=0, lt=1)
    """Momentum of the matrices' gradients."""
    nesterov: bool = True
    """Orthogonalize beta * momentum + gradient (Nesterov) instead of the momentum itself."""
    lr: float | None = pydantic.Field(None, gt=0)
    """Peak learning rate of the matrices (same warmup and decay as `optimizer.lr`); null: `optimizer.lr`."""
    scaling: Literal["rms_match", "shape"] = "rms_match"
    """Scale of the orthogonalized update of an m x n matrix. rms_match (Moonlight): 0.2 sqrt(max(m, n)),
    an update as large as AdamW's, so AdamW's learning rate and weight decay carry over; shape (Jordan
    et al.): sqrt(max(1, n / m)) for n outputs, m inputs, with learning rates near 0.02."""


class OptimizerConfig(Section):
    name: Literal["adamw", "muon"] = "adamw"
    """adamw for every weight; muon: Muon for the weight matrices, AdamW for the rest (`optimizer.muon`)."""
    muon: MuonConfig | None = None
    """Muon's own settings (only with name: muon; null there means the defaults)."""
    lr: float = pydantic.Field(3e-3, gt=0)
    """Peak learning rate, reached after `warmup_steps`."""
    init_lr_ratio: float = pydantic.Field(0.0, ge=0, le=1)
    """Learning rate at step 0 as a fraction of `lr`."""
    warmup_steps: int = pydantic.Field(20, ge=0)
    min_lr_ratio: float = pydantic.Field(0.1, ge=0, le=1)
    """Cosine decay ends at `lr * min_lr_ratio` on the last step."""
    b1: float = pydantic.Field(0.9, ge=0, lt=1)
    b2: float = pydantic.Field(0.95, ge=0, lt=1)
    eps: float = pydantic.Field(1e-8, gt=0)
    weight_decay: float = pydantic.Field(0.1, ge=0)
    """Decoupled (AdamW) decay; norm scales are not decayed."""
    clip_norm: float | None = pydantic.Field(1.0, ge=0)
    """Global-norm gradient clipping; null disables it."""

    @property
    def muon_settings(self) -> MuonConfig:
        """Muon's settings: `muon`, or the defaults where it is null."""
        return self.muon or MuonConfig()

    @pydantic.model_validator(mode="after")
    def _muon_fields_need_muon(self) -> OptimizerConfig:
        if self.muon is not None and self.name != "muon":
            raise ValueError(
                f"optimizer.muon is set but optimizer.name is {self.name}; set optimizer.name=muon or remove optimizer.muon"
            )
        return self


class OffloadConfig(Section):
    """Host offload through JAX memory kinds (train/state.py, train/step.py): state that lives in
    `pinned_host` memory between steps and is streamed to the device when the step needs it."""

    optimizer: bool = False
    """ZeRO-Offload: Adam's moments live in pinned host memory (same partition spec as without
    offload, so it composes with zero1/zero2/fsdp); the step streams them in, updates and
    streams them back out."""
    params: bool = False
    """FSDP CPU offload: the scanned layers' parameters live in pinned host memory and each
    layer's slice is brought to the device inside the scan, when that layer runs (dense
    transformer, no pipeline; embedding and head stay on the device)."""


class DPOConfig(Section):
    """Direct Preference Optimization (train.objective=dpo; objectives/preference.py `dpo_loss`)."""

    beta: float = pydantic.Field(0.1, gt=0)
    """How far the policy may move from the reference: the rewards are beta x the log-probability
    ratios, and the loss is -log sigmoid of their difference."""
    label_smoothing: float = pydantic.Field(0.0, ge=0, lt=0.5)
    """Conservative DPO's eps: the chance a pair's labels are flipped (0: plain DPO)."""
    reference: Literal["adapters_off", "precomputed", "frozen_copy"] = "adapters_off"
    """Where the reference model's log-probabilities come from. adapters_off: the same forward
    pass with the LoRA/QLoRA factors zeroed (the base model exactly, B = 0 at the start), so no
    second copy of the weights; needs finetune.method lora or qlora. precomputed: the base's
    log-probability of every pair computed once before training and cached beside the data
    (train/dpo_reference.py), so full fine-tuning needs no second copy either; frozen_copy: the
    base's weights held frozen beside the policy, each batch's reference computed just before its
    step (a second copy of the weights, no pass before training). Both: any finetune.method but none."""


class GRPOConfig(Section):
    """Group Relative Policy Optimization (train.objective=grpo; train/rollouts.py, objectives/grpo.py):
    prompts from data.text_files, completions sampled by meshwork's paged serving engine, scored by
    `rewards`, and the clipped policy-gradient objective with a KL penalty to the reference."""

    rewards: list[str] = ["exact_answer"]
    """Reward functions, summed: built-ins (exact_match, exact_answer, number_only: train/rewards.py) or
    `module:function` names of your own, each called as f(prompt, completion, fields) -> float."""
    reward_weights: list[float] | None = None
    """One weight per reward (null: all 1)."""
    group_size: int = pydantic.Field(8, ge=2)
    """G: completions sampled per prompt; advantages are normalized within each group."""
    max_new_tokens: int = pydantic.Field(32, gt=0)
    """The longest completion; a prompt plus this must fit data.seq_len + 1 tokens."""
    temperature: float = pydantic.Field(1.0, gt=0)
    """The engine's sampling temperature for rollouts (evaluation samples greedily). The
    log-probabilities of the ratio and the KL are the untempered model's (the engine's raw
    logprobs, as vLLM returns them), so at 1 they are the sampling policy's; TRL divides the
    logits by the temperature instead."""
    updates_per_rollout: int = pydantic.Field(1, gt=0)
    """Optimizer steps per rollout batch: each batch holds updates_per_rollout x train.global_batch
    completions, and each step trains on the next train.global_batch of them (the policy moves
    away from the one that sampled, so the ratio and its clipping matter from the second step on)."""
    clip_eps: float = pydantic.Field(0.2, gt=0, lt=1)
    """The importance ratio is clipped to [1 - clip_eps, 1 + clip_eps_high]."""
    clip_eps_high: float | None = pydantic.Field(None, gt=0)
    """The upper clip (DAPO's clip-higher); null: clip_eps."""
    kl_coef: float = pydantic.Field(0.0, ge=0)
    """Weight of the k3 KL estimate to the reference (the fine-tuning base: the LoRA adapters off,
    or for full fine-tuning a frozen copy of the base weights); 0: no reference is computed."""
    aggregation: Literal["token", "sequence"] = "token"
    """token: the loss is the mean over every completion token of the batch (DAPO, TRL's bnpo);
    sequence: the mean over completions of each one's token mean (the GRPO paper)."""
    scale_rewards: bool = True
    """Divide the group-centred rewards by the group's standard deviation (false: Dr. GRPO)."""
    placement: Literal["colocated", "split"] = "colocated"
    """colocated: the engine runs on the trainer's devices, time-shared; split: the trainer takes
    the first half of the devices and the engine the second half."""
    engine_tensor: int = pydantic.Field(1, gt=0)
    """The engine's tensor-parallel size; its data-parallel replicas are its devices / this."""
    engine_slots: int = pydantic.Field(64, gt=0)
    """Sequences the engine decodes at once (a multiple of its data replicas)."""
    page_size: int = pydantic.Field(16, gt=0)
    """Tokens per KV page; the G completions of a prompt share the prompt's full pages."""
    off_policy: bool = False
    """One-step off-policy (asynchronous GRPO): each rollout batch is sampled by the weights from
    before the previous batch's updates, on the host and the engine while those updates run on the
    device; `staleness` logs the updates between sampling and the first update on a batch
    (updates_per_rollout here, 0 on-policy)."""
    eval_prompts: int = pydantic.Field(64, gt=0)
    """Held-out prompts that evaluation answers greedily and scores (val_reward)."""


class TrainConfig(Section):
    steps: int = pydantic.Field(300, gt=0, lt=2**31)
    """Length of the run; the learning-rate schedule spans exactly this many steps (the step
    counter is an int32)."""
    stop_after: int | None = pydantic.Field(None, gt=0, lt=2**31)
    """End this invocation after this step (checkpointing there), as a scheduler's
    time limit would; re-running the same config resumes toward `steps`."""
    global_batch: int = pydantic.Field(16, gt=0)
    """Sequences per optimizer step, summed over all devices and microbatches."""
    microbatches: int = pydantic.Field(1, gt=0)
    """Gradient accumulation: the global batch is split into this many sequential parts."""
    pipeline: Literal["none", "gpipe", "1f1b", "interleaved", "zb-h1"] = "none"
    """Pipeline schedule over mesh.stage > 1 stages, with `microbatches` microbatches
    (sharding/pipeline_schedules.py): gpipe (all forwards, then all backwards), 1f1b (one forward,
    one backward: at most P stashed inputs), interleaved (1F1B over `virtual_stages` model
    chunks per stage: a smaller bubble, more sends), zb-h1 (1F1B with each backward split
    into its input and weight halves, the weight halves filling the bubble)."""
    virtual_stages: int = pydantic.Field(1, gt=0)
    """Model chunks per pipeline stage under pipeline=interleaved (Narayanan et al. 2021):
    stage s holds layer chunks s, s+P, s+2P, ... of n_layers / (stage x virtual_stages)
    layers each, and the bubble shrinks about v times; 1 for every other schedule."""
    context_parallel: Literal["ring", "all_gather", "ulysses", "usp"] = "ring"
    """How attention runs when the rules split the sequence (the cp preset; sharding/context_parallel.py):
    ring (K/V blocks passed round the sequence axis, overlapped with the blocks' compute), all_gather
    (K/V all-gathered, Llama 3's), ulysses (all-to-all to a head split: needs heads divisible by the
    sequence axis), usp (act_seq split over two mesh axes: a ring over the first, Ulysses within the
    second, e.g. rules.overrides act_seq=[sequence, tensor]). docs/parallelism.md says when to pick which."""
    remat: Literal[
        "none",
        "full",
        "dots_saveable",
        "dots_with_no_batch_dims_saveable",
        "save_qkv_proj",
        "save_out_proj",
        "save_qkv_and_out_proj",
        "offload_dots",
    ] = "none"
    """What the scanned layers keep for the backward pass (jax.checkpoint policy): full keeps only
    each layer's input, dots_saveable every matmul's output, dots_with_no_batch_dims_saveable the
    weight matmuls' (not attention's), save_qkv_proj / save_out_proj / save_qkv_and_out_proj the
    attention projections named so; offload_dots keeps every weight matmul's output in pinned host
    memory instead of recomputing it."""
    loss_chunk: Annotated[int, pydantic.Field(gt=0)] | Literal["auto"] | None = "auto"
    """Token rows (of the batch's B x L) per chunk of a fused head + cross-entropy that never holds
    the whole (B*L, V) float32 logits nor their gradient (objectives/fused_ce.py); null: plain loss;
    auto: fused for a language model with a vocabulary of 8,192 or more and a plain head weight,
    in chunks of at most 64 MiB of float32 logits (objectives/next_token.auto_loss_chunk), plain otherwise."""
    offload: OffloadConfig = OffloadConfig()
    """Which parts of the train state live in host memory between steps."""
    scan_layers: bool = True
    """Run the dense transformer's layers as one lax.scan loop (one compiled block); false
    unrolls them (compile time grows with depth; XLA may fuse across layers)."""
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    on_nan: Literal["skip", "rollback", "stop"] = "stop"
    """A step whose loss or gradient norm is not finite never changes the weights; then
    skip: go on with the next batch; rollback: reload the last checkpoint and replay without
    the offending batch; stop: end the run with status 3, naming the step."""
    objective: Literal["next_token", "dpo", "grpo"] = "next_token"
    """What a language model trains for. next_token: the cross-entropy of each next token (of the
    assistant's tokens with data.source=chat); dpo: Direct Preference Optimization on preference
    pairs (data.source=chat, data.text_files of pairs: data/preference_pairs.py), with `dpo`;
    grpo: reinforcement learning from rewards on rollouts of the serving engine (data.source=chat,
    data.text_files of prompts: data/prompts.py), with `grpo`."""
    dpo: DPOConfig = DPOConfig()
    """train.objective=dpo's beta, label smoothing and reference."""
    grpo: GRPOConfig = GRPOConfig()
    """train.objective=grpo's rewards, group size, sampling, clipping, KL and engine placement."""
    inject_nan_at: list[int] = []
    """Fault injection for testing on_nan: these steps' loss and gradients become NaN."""
    elastic: bool = False
    """In-process elasticity (train/elastic.py): at each step boundary the trainer reads fault_file;
    devices it names are lost, the mesh shrinks onto the others (a smaller data-parallel size) and
    grows back when they are named no more, without the process exiting."""
    fault_file: str | None = None
    """The file that names lost devices, one fault per line: `4 5 6 7` (lost now) or
    `4 5 6 7 @ 10-20` (a drill: lost after step 10, back after step 20); null: run.dir/lost_devices.
    A missing or empty file: every device is there."""


class MeshConfig(Section):
    """Device-mesh axis sizes; their product must equal the device count (one may be -1)."""

    stage: int = 1
    data: int = -1
    fsdp: int = 1
    expert: int = 1
    sequence: int = 1
    tensor: int = 1

    @pydantic.field_validator(*MESH_AXES)
    @classmethod
    def _positive_or_fill(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError("must be a positive size or -1 (fill with the remaining devices)")
        return v

    @pydantic.model_validator(mode="after")
    def _one_fill(self) -> MeshConfig:
        if sum(getattr(self, a) == -1 for a in MESH_AXES) > 1:
            raise ValueError("at most one mesh axis may be -1")
        return self

    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in MESH_AXES}


class RulesConfig(Section):
    preset: str = pydantic.Field("dp", pattern=r"^[a-z0-9]+(\+[a-z0-9]+)*$")
    """A preset of sharding/rules.py (dp, zero1, zero2, fsdp, tp, sp, cp, pp, ep) or several joined by `+`."""
    overrides: dict[str, str | list[str] | None] = {}
    """logical axis -> mesh axis (or list of them, or null), applied over the preset."""


class CheckpointConfig(Section):
    every: int | Literal["auto"] = 100
    """Save the persistent tier every this many steps (and always after the last step); auto: the
    Young/Daly interval from this run's measured checkpoint stall and run.mttf_hours, recomputed
    after every save (`CheckpointSchedule`, src/meshwork/run/checkpoint.py)."""
    keep: int = pydantic.Field(2, gt=0)
    async_: bool = pydantic.Field(True, alias="async")
    """Write checkpoints in a background thread while training continues (both tiers: the step
    that saves only copies the state to host memory); false: the step waits for the write."""
    fast_every: int | None = pydantic.Field(None, gt=0)
    """The fast tier (src/meshwork/run/fast_tier.py): a host copy of the state every this many
    steps, kept in RAM (fast_path null) or written to fast_path; null: no fast tier."""
    fast_path: str | None = None
    """A local-disk folder for the fast tier; it survives a kill of the process (RAM does not)."""

    @pydantic.field_validator("every", mode="before")
    @classmethod
    def _positive_every(cls, v: int | str) -> int | str:
        if isinstance(v, bool) or (isinstance(v, int) and v < 1):
            raise ValueError("must be a positive number of steps or auto")
        return v


class LogConfig(Section):
    every: int = pydantic.Field(10, gt=0)
    """Write a metrics line every this many steps."""
    eval_every: int = pydantic.Field(100, gt=0)
    eval_batches: int = pydantic.Field(4, gt=0)
    sample_every: int | None = pydantic.Field(None, gt=0)
    """Diffusion: write a grid of samples (EMA weights) to run.dir/samples/ every this many steps."""
    tensorboard: bool = True
    progress: bool = True


class CommConfig(Section):
    """Communication optimizations (train/comm.py, sharding/overlap.py, sharding/collective_matmul.py)."""

    overlap: bool = False
    """Schedule collectives asynchronously so they overlap compute (XLA's latency-hiding
    scheduler and async collectives, where the backend has them)."""
    combine_threshold_bytes: int | None = pydantic.Field(None, gt=0)
    """Combine small all-reduces / all-gathers / reduce-scatters up to this many bytes
    (the analogue of DDP's gradient buckets); null: XLA's default."""
    xla_options: dict[str, bool | int | float | str] = {}
    """Further XLA options for compiling the train step, by name."""
    collective_matmul: bool = False
    """Tensor-parallel projections as ppermute rings overlapped with partial matmuls
    instead of one all-gather / reduce-scatter."""
    compression: Literal["none", "bf16", "int8", "powersgd"] = "none"
    """Data-parallel gradient all-reduce in bf16, int8 (reduce-scatter + all-gather of
    int8 blocks) or PowerSGD low rank; rules.preset dp or zero1."""
    rank: int = pydantic.Field(4, gt=0)
    """PowerSGD rank."""
    error_feedback: bool = True
    """Add each replica's compression error to its next gradient."""
    local_steps: int = pydantic.Field(1, gt=0)
    """Local SGD / DiLoCo: replicas take this many inner steps without synchronizing, then
    average (1: ordinary synchronous data parallelism)."""
    outer_lr: float = pydantic.Field(0.7, gt=0)
    """DiLoCo's outer learning rate on the averaged parameter change."""
    outer_momentum: float = pydantic.Field(0.9, ge=0, lt=1)
    """DiLoCo's outer Nesterov momentum."""
    stale_gradients: bool = False
    """Apply step t-1's averaged gradient at step t, so its all-reduce can overlap step t's compute."""


FINETUNE_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


class FinetuneConfig(Section):
    """Parameter-efficient fine-tuning of a trained run (models/lora.py, models/adapters.py)."""

    method: Literal["none", "full", "lora", "qlora", "adapter", "prefix"] = "none"
    """none: ordinary training; full: train every weight from `base`; lora: low-rank deltas on
    `targets`, base frozen; qlora: the same over a 4-bit base; adapter: bottleneck MLPs after
    attention and MLP; prefix: trainable per-layer key/value prefixes."""
    base: str | None = None
    """The starting point: the run.dir of a trained run (its latest checkpoint), or a Hugging Face
    checkpoint folder (config.json + *.safetensors; its config.json decides `model`, and with
    method full this is continued pre-training)."""
    targets: list[Literal["q", "k", "v", "o", "gate", "up", "down", "q_a", "q_b", "kv_a", "kv_b"]] = ["q", "v"]
    """Projections that get LoRA deltas (q/k/v/o of attention, gate/up/down of the MLP; with model.mla:
    q (without q-LoRA), q_a and q_b (with it), kv_a, kv_b and o)."""
    rank: int = pydantic.Field(8, gt=0)
    """LoRA rank r, adapter bottleneck width."""
    alpha: float = pydantic.Field(16.0, gt=0)
    """LoRA scaling: the delta is (alpha / rank) * B A."""
    dropout: float = pydantic.Field(0.0, ge=0, lt=1)
    """Dropout on the LoRA branch's input during training."""
    prefix_len: int = pydantic.Field(8, gt=0)
    """Prefix tuning: key/value positions per layer."""
    prefix_hidden: int = pydantic.Field(0, ge=0)
    """Prefix tuning: hidden width of the reparameterization MLP (0: train the prefixes directly)."""
    group_size: int = pydantic.Field(32, gt=0)
    """QLoRA: weights per 4-bit quantization group (along the input dimension)."""


def chunk_runs(runs: tuple[LayerRun, ...], n_chunks: int) -> tuple[LayerRun, ...] | None:
    """The runs of one pipeline chunk (names `run0`, `run1`, ...; starts within the chunk) when
    all `n_chunks` equal chunks of the layers have the same dense/MoE pattern; None otherwise.

    >>> [tuple(r) for r in chunk_runs((LayerRun("a", False, 0, 1), LayerRun("b", True, 1, 1),
    ...                                LayerRun("c", False, 2, 1), LayerRun("d", True, 3, 1)), 2)]
    [('run0', False, 0, 1, False), ('run1', True, 1, 1, False)]
    >>> chunk_runs((LayerRun("a", False, 0, 1), LayerRun("b", True, 1, 3)), 2) is None
    True
    """
    kinds = [run.moe for run in runs for _ in range(run.count)]
    n = len(kinds) // n_chunks
    if len(kinds) % n_chunks or any(kinds[c * n : (c + 1) * n] != kinds[:n] for c in range(n_chunks)):
        return None
    out: list[list] = []
    for i, moe in enumerate(kinds[:n]):
        if out and out[-1][0] == moe:
            out[-1][2] += 1
        else:
            out.append([moe, i, 1])
    return tuple(LayerRun(f"run{j}", moe, start, count) for j, (moe, start, count) in enumerate(out))
