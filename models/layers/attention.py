"""Grouped-query self-attention with RoPE, and the one attention dispatch.

`attend` is the single entry point for the attention math: the single-device formulas (XLA,
Pallas flash attention, cuDNN, the reference) are chosen here by `impl`, and the current
ParallelContext (sharding/parallel.py) runs the chosen one on the mesh (ring, all-gathered keys and
values, Ulysses' all-to-alls, per-device `shard_map`), so the model never changes when a kernel or a parallel
implementation lands.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshwork.models.layers.attention_local import local_attention
from meshwork.models.layers.layer_pattern import LayerPattern
from meshwork.models.layers.norm import RMSNorm
from meshwork.models.layers.params import matmul, normal, param
from meshwork.sharding.parallel import current_parallel, with_logical_constraint

# Names of the projections' outputs, for remat policies that save them by name (models/transformer.py).
QKV_PROJ = ("query_proj", "key_proj", "value_proj")
OUT_PROJ = "out_proj"


def attend(*args, **kwargs) -> jax.Array:
    """softmax(q k^T * scale + mask) v: `_attend` (below, which documents the arguments) under the name
    scope `attention_core`, so that profiles (perf/step_profile.py) tell the attention itself from
    the projections around it."""
    with jax.named_scope("attention_core"):
        return _attend(*args, **kwargs)


def _attend(
    q_BLHK: jax.Array,
    k_BSGK: jax.Array,
    v_BSGK: jax.Array,
    positions_BL: jax.Array | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    impl: str = "xla",
    segment_ids_BL: jax.Array | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks_H: jax.Array | None = None,
) -> jax.Array:
    """softmax(q k^T * scale + mask) v, with G key/value heads shared by H/G query heads.

    impl (model.attention in the config):
    - "xla": `jax.nn.dot_product_attention`, which handles grouped heads
      without materializing repeated K/V and lets XLA pick the fusion;
    - "pallas": meshwork's flash-attention kernel (src/meshwork/kernels), run
      per device inside `shard_map` (batch and heads split as the rules say);
    - "cudnn": cuDNN's fused attention (GPU only);
    - "reference": the plain formula, materializing the L x S scores.
    How it runs on the mesh is the current ParallelContext's choice (sharding/parallel.py): a
    sequence split over the mesh (context parallelism, the `cp` preset) goes to the algorithm
    `train.context_parallel` names (ring, all_gather, ulysses, usp: sharding/context_parallel.py),
    each masking causally by `positions_BL`, so any token layout (e.g. the load-balancing zigzag)
    is correct.

    segment_ids_BL: the document each token belongs to, when several are packed
    into one row (data.source: text); a token sees only keys of its own document.
    window: a query at position i sees keys at i - window < j <= i only (Mistral's
    sliding window); None sees every earlier key.
    softcap: scores become softcap * tanh(score / softcap) before the mask (Gemma 2).
    sinks_H: one logit per query head in the softmax's denominator, weighing no value (gpt-oss).
    models/layers/attention_local.py has the formulas.
    """
    parallel = current_parallel()
    if positions_BL is not None and causal and impl != "xla" and not parallel.split("act_seq"):
        raise ValueError(f"attention impl {impl!r} takes tokens in order 0..L-1; use xla for permuted positions")
    local = local_attention(
        impl, q_BLHK, k_BSGK, positions_BL, causal=causal, scale=scale, window=window, softcap=softcap
    )
    return parallel.attention(
        local,
        q_BLHK,
        k_BSGK,
        v_BSGK,
        positions_BL,
        causal=causal,
        scale=scale,
        segment_ids_BL=segment_ids_BL,
        window=window,
        opaque=impl == "pallas",
        softcap=softcap,
        sinks_H=sinks_H,
    )


class Attention(nnx.Module):
    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        rope_theta: float,
        rope_scaling: dict | None = None,
        init_std: float,
        out_std: float,
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-5,
        impl: str = "xla",
        window: int | None = None,
        pattern: LayerPattern | None = None,
        softcap: float | None = None,
        sinks: bool = False,
        out_bias: bool = False,
        scale: float | None = None,
        norm_offset: float = 0.0,
        output_gate: bool = False,
        rotary_dim: int | None = None,
    ):
        """qkv_bias: add learned biases to the q, k, v projections (Qwen2); they start at zero.
        qk_norm: RMSNorm (epsilon `norm_eps`, scale offset `norm_offset`) over each head's q and k
        before RoPE (Qwen3, Gemma 3).
        rope_scaling: scaled RoPE frequencies in Hugging Face's form (models/layers/rope.py).
        window: the sliding window (keys within `window` positions of the query), or None.
        pattern: per-layer windows and RoPE (models/layers/layer_pattern.py), instead of `window`,
        `rope_theta` and `rope_scaling`, for a stack whose layers differ in them (Gemma 2/3, gpt-oss).
        softcap: attention scores become softcap * tanh(score / softcap) (Gemma 2).
        sinks: a learned logit per query head in the softmax's denominator (gpt-oss).
        out_bias: a bias on the output projection (gpt-oss). scale: the scores' scale (None: K ** -0.5).
        output_gate: the output is multiplied by sigmoid of a per-head gate the query projection also
        makes (Qwen3-Next: `wq` is (D, H, 2K), each head's [query, gate]).
        rotary_dim: RoPE rotates only each head's first rotary_dim dims (Qwen3-Next's partial rotary)."""
        D, H, G, K = d_model, n_heads, n_kv_heads, head_dim
        Q = 2 * K if output_gate else K
        self.wq = param(normal(init_std), rngs.params(), (D, H, Q), param_dtype, ("embed", "heads", "head_dim"))
        self.wk = param(normal(init_std), rngs.params(), (D, G, K), param_dtype, ("embed", "kv_heads", "head_dim"))
        self.wv = param(normal(init_std), rngs.params(), (D, G, K), param_dtype, ("embed", "kv_heads", "head_dim"))
        self.wo = param(normal(out_std), rngs.params(), (H, K, D), param_dtype, ("heads", "head_dim", "embed"))
        zeros = nnx.initializers.zeros
        if qkv_bias:
            self.bq = param(zeros, rngs.params(), (H, K), param_dtype, ("heads", "head_dim"))
            self.bk = param(zeros, rngs.params(), (G, K), param_dtype, ("kv_heads", "head_dim"))
            self.bv = param(zeros, rngs.params(), (G, K), param_dtype, ("kv_heads", "head_dim"))
        if out_bias:
            self.bo = param(zeros, rngs.params(), (D,), param_dtype, ("embed",))
        if sinks:
            self.sinks = param(normal(init_std), rngs.params(), (H,), param_dtype, ("heads",))
        if qk_norm:
            kw = dict(eps=norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs, axis="head_dim")
            self.q_norm, self.k_norm = RMSNorm(K, offset=norm_offset, **kw), RMSNorm(K, offset=norm_offset, **kw)
        self.qkv_bias, self.qk_norm, self.out_bias, self.has_sinks = qkv_bias, qk_norm, out_bias, sinks
        self.pattern = pattern or LayerPattern.uniform(window, rope_theta, rope_scaling)
        self.dtype, self.impl, self.softcap, self.scale = dtype, impl, softcap, scale
        self.output_gate, self.rotary_dim = output_gate, rotary_dim if rotary_dim and rotary_dim < K else None
        # This layer's index in the stack, set on each layer's copy by the scan that runs it
        # (models/transformer.py), when the pattern has more than one kind of layer.
        self.layer_index = nnx.data(None)
        self.prefix = nnx.data(None)  # trainable key/value prefixes (models/adapters.py, prefix tuning)

    @property
    def window(self) -> int | None:
        """The window of a stack whose layers all have the same one (None for a mixed pattern)."""
        return None if self.pattern.mixed else self.pattern.windows[0]

    @window.setter
    def window(self, window: int | None) -> None:
        """One window for every layer, keeping the RoPE."""
        self.pattern = self.pattern.with_window(window)

    def _sinks(self) -> jax.Array | None:
        return self.sinks[...].astype(jnp.float32) if self.has_sinks else None

    def __call__(
        self, x_BLD: jax.Array, positions_BL: jax.Array | None = None, segment_ids_BL: jax.Array | None = None
    ) -> jax.Array:
        """positions_BL: each token's position, when the layout is not simply 0..L-1 (e.g. zigzag).
        segment_ids_BL: each token's document in a packed row; attention stays within one."""
        q_BLHK, k_BLGK, v_BLGK, gate_BLHK = self.project_qkv(x_BLD, positions_BL)
        if self.prefix is not None:
            if segment_ids_BL is not None or self.window is not None or self.pattern.mixed:
                raise NotImplementedError(
                    "prefix tuning over packed documents or a sliding window is not implemented; use LoRA or adapters"
                )
            if self.softcap is not None or self.has_sinks or self.scale is not None:
                raise NotImplementedError(
                    "prefix tuning of attention with soft-capping, sinks or a custom scale is not implemented; "
                    "use LoRA or adapters"
                )
            o_BLHK = self.prefix.attend(q_BLHK, k_BLGK, v_BLGK, positions_BL)
        else:
            attend_in = functools.partial(
                attend,
                q_BLHK,
                k_BLGK,
                v_BLGK,
                positions_BL,
                causal=True,
                scale=self.scale,
                impl=self.impl,
                segment_ids_BL=segment_ids_BL,
                softcap=self.softcap,
                sinks_H=self._sinks(),
            )
            # XLA's formula takes a traced window (the mask is data); kernels and the ring take one of
            # the pattern's windows as a constant, chosen per layer by lax.switch.
            traced = self.impl == "xla" and not current_parallel().split("act_seq")
            o_BLHK = self.pattern.by_window(lambda window: attend_in(window=window), self.layer_index, traced)
        return checkpoint_name(self._out(o_BLHK, gate_BLHK), OUT_PROJ)

    def _split_gate(self, q_BLHQ: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """(queries, the output gate's logits or None): a gated projection's [query, gate] halves per head."""
        if not self.output_gate:
            return q_BLHQ, None
        K = q_BLHQ.shape[-1] // 2
        return q_BLHQ[..., :K], q_BLHQ[..., K:]

    def _out(self, o_BLHK: jax.Array, gate_BLHK: jax.Array | None = None) -> jax.Array:
        if gate_BLHK is not None:
            o_BLHK = o_BLHK * jax.nn.sigmoid(gate_BLHK.astype(jnp.float32)).astype(o_BLHK.dtype)
        y_BLD = matmul("BLHK,HKD->BLD", o_BLHK, self.wo, self.dtype)
        return y_BLD + self.bo[...].astype(self.dtype) if self.out_bias else y_BLD

    def cached(self, x_BLD: jax.Array, positions_BL: jax.Array, kv):
        """Attention of new tokens at `positions_BL` over a KV cache: (output, updated cache).

        `kv` is one layer's view of a cache (src/meshwork/engine/kv_cache.py): it stores
        this call's keys and values at their positions and attends the queries
        over every key cached for the sequence so far, causally (within the
        layer's sliding window, when it has one).
        """
        if self.prefix is not None:
            raise NotImplementedError(
                "KV-cache decoding of a prefix-tuned model is not implemented; "
                "generate with the full forward pass (model(tokens)) instead"
            )
        q_BLHK, k_BLGK, v_BLGK, gate_BLHK = self.project_qkv(x_BLD, positions_BL)
        attend_kv = functools.partial(
            kv.attend,
            q_BLHK,
            k_BLGK,
            v_BLGK,
            positions_BL,
            impl=self.impl,
            scale=self.scale,
            softcap=self.softcap,
            sinks_H=self._sinks(),
        )
        o_BLHK, kv = self.pattern.by_window(
            lambda window: attend_kv(window=window), self.layer_index, traced=self.impl == "xla"
        )
        return self._out(o_BLHK, gate_BLHK), kv

    def project_qkv(self, x_BLD: jax.Array, positions_BL: jax.Array | None) -> tuple[jax.Array, ...]:
        """Queries, keys and values of x, with RoPE applied at `positions_BL` (None: 0..L-1), and the
        output gate's logits (None without `output_gate`)."""
        B, L, _ = x_BLD.shape
        rope_pos_BL = positions_BL if positions_BL is not None else jnp.broadcast_to(jnp.arange(L), (B, L))
        q_BLHK = matmul("BLD,DHK->BLHK", x_BLD, self.wq, self.dtype)
        k_BLGK = matmul("BLD,DGK->BLGK", x_BLD, self.wk, self.dtype)
        v_BLGK = matmul("BLD,DGK->BLGK", x_BLD, self.wv, self.dtype)
        if self.qkv_bias:
            w = lambda p: p[...].astype(self.dtype)  # noqa: E731
            q_BLHK, k_BLGK, v_BLGK = q_BLHK + w(self.bq), k_BLGK + w(self.bk), v_BLGK + w(self.bv)
        q_BLHK, k_BLGK, v_BLGK = (checkpoint_name(x, name) for x, name in zip((q_BLHK, k_BLGK, v_BLGK), QKV_PROJ))
        q_BLHK, gate_BLHK = self._split_gate(q_BLHK)
        if self.qk_norm:
            q_BLHK, k_BLGK = self.q_norm(q_BLHK), self.k_norm(k_BLGK)
        q_BLHK = with_logical_constraint(
            self._rope(q_BLHK, rope_pos_BL), ("act_batch", "act_seq", "act_heads", "act_head_dim")
        )
        k_BLGK = with_logical_constraint(
            self._rope(k_BLGK, rope_pos_BL), ("act_batch", "act_seq", "act_kv_heads", "act_head_dim")
        )
        return q_BLHK, k_BLGK, v_BLGK, gate_BLHK

    def _rope(self, x_BLNK: jax.Array, positions_BL: jax.Array) -> jax.Array:
        """This layer's RoPE on x, on the first `rotary_dim` dims of each head when partial."""
        rope = functools.partial(self.pattern.rope, positions_BL=positions_BL, layer_index=self.layer_index)
        if self.rotary_dim is None:
            return rope(x_BLNK)
        return jnp.concatenate([rope(x_BLNK[..., : self.rotary_dim]), x_BLNK[..., self.rotary_dim :]], axis=-1)
