"""Gated DeltaNet (Qwen3-Next's linear-attention layer): a fixed-size state per sequence instead of a KV cache.

Per token, x (D) is projected to queries and keys (G heads of width Kk), values and output gates z
(H = G R heads of width Kv), and per value head a write strength b and a decay input a. Queries,
keys and values go through a depthwise causal convolution (the last W = conv_kernel tokens, per
channel) and SiLU; queries and keys are L2-normalized; beta = sigmoid(b) and the log-decay
g = -exp(A_log) softplus(a + dt_bias). The gated delta rule (src/meshwork/kernels/gated_delta_rule.py)
turns them into one output per value head, which is RMS-normed (one scale of width Kv shared by the
heads), multiplied by silu(z) and projected back to D.

Training and prefill run the chunked form; decoding one token runs the recurrence. What a sequence
carries between calls (`GatedDeltaNetState`) is its last W - 1 convolution inputs and the (H, Kk, Kv)
float32 state: a fixed size however long the sequence (`state_bytes`).

Parameters hold heads on their own logical axes (`linear_k_heads` for G, `linear_heads` for H), which
the `tp` preset splits over `tensor`; value head h reads key head h // R, so a tensor split that divides
G keeps each value head beside its key head. transformers' fused projections interleave q, k, v and
z per key head; `from_hf` / `to_hf` map them to these weights and back by reshapes and slices only
(bit-exact).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshwork.config_sections import LinearAttentionConfig
from meshwork.engine.recurrent_states import state_shapes
from meshwork.kernels.gated_delta_rule import chunked_gated_delta_rule, recurrent_gated_delta_rule
from meshwork.models.layers.attention import OUT_PROJ, QKV_PROJ
from meshwork.models.layers.norm import RMSNorm
from meshwork.models.layers.params import matmul, normal, param
from meshwork.sharding.parallel import with_logical_constraint


def linear_attention_from_hf(config: Mapping, chunk_size: int = 64) -> LinearAttentionConfig:
    """The layer shape of a Qwen3-Next config.json's `linear_*` keys.

    >>> linear_attention_from_hf({"linear_num_key_heads": 2, "linear_num_value_heads": 4,
    ...     "linear_key_head_dim": 8, "linear_value_head_dim": 6, "linear_conv_kernel_dim": 4}).num_v_heads
    4
    """
    return LinearAttentionConfig(
        num_k_heads=config["linear_num_key_heads"],
        num_v_heads=config["linear_num_value_heads"],
        head_k_dim=config["linear_key_head_dim"],
        head_v_dim=config["linear_value_head_dim"],
        conv_kernel=config.get("linear_conv_kernel_dim", 4),
        chunk_size=chunk_size,
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GatedDeltaNetState:
    """What one layer carries between calls, per sequence (a pytree; B sequences).

    conv_*: the last W - 1 inputs of the convolution (the projections before it), oldest first;
    recurrent_BHKK: the delta rule's state (B, H, Kk, Kv), always float32.
    """

    conv_q_BSGK: jax.Array  # (B, W - 1, G, Kk)
    conv_k_BSGK: jax.Array  # (B, W - 1, G, Kk)
    conv_v_BSHK: jax.Array  # (B, W - 1, H, Kv)
    recurrent_BHKK: jax.Array  # (B, H, Kk, Kv) float32

    @staticmethod
    def logical_axes() -> dict[str, tuple[str | None, ...]]:
        """The logical names of each field's dimensions (batch split as activations, heads over tensor)."""
        return {
            "conv_q_BSGK": ("act_batch", None, "act_kv_heads", "act_head_dim"),
            "conv_k_BSGK": ("act_batch", None, "act_kv_heads", "act_head_dim"),
            "conv_v_BSHK": ("act_batch", None, "act_heads", "act_head_dim"),
            "recurrent_BHKK": ("act_batch", "act_heads", None, "act_head_dim"),
        }


def _uniform(bound: float):
    return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)


def _log_uniform(low: float, high: float):
    return lambda key, shape, dtype: jnp.log(jax.random.uniform(key, shape, jnp.float32, low, high)).astype(dtype)


class GatedDeltaNet(nnx.Module):
    """Qwen3-Next's Gated DeltaNet layer.

    Parameters (D model width, G/H key/value heads, R = H/G, Kk/Kv their widths, W conv taps), as the
    checkpoint fuses them: `w_qkvz` (D, G, 2Kk + 2RKv), `w_ba` (D, G, 2R), `conv` (W, 2GKk + HKv), tap
    W - 1 on the current token; `A_log`, `dt_bias` (H,); `norm.scale` (Kv,); `wo` (H, Kv, D). Inits as transformers': dt_bias ones, A = exp(A_log) uniform in [0.01, 16],
    the convolution uniform in +-W^-1/2, the norm's scale ones.
    """

    def __init__(
        self,
        d_model: int,
        cfg: LinearAttentionConfig,
        *,
        init_std: float,
        out_std: float,
        norm_eps: float,
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        D, G, H, Kk, Kv, W = d_model, cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.conv_kernel
        R = H // G
        p = lambda init, shape, names: param(init, rngs.params(), shape, param_dtype, names)  # noqa: E731
        # Fused as the checkpoint keeps them, grouped by key head: [q, k, v of its R value heads, z of
        # them] and [b of its R value heads, a of them]; a split of the key heads over `tensor` keeps
        # every value head beside its key head.
        self.w_qkvz = p(normal(init_std), (D, G, 2 * Kk + 2 * R * Kv), ("embed", "linear_k_heads", None))
        self.w_ba = p(normal(init_std), (D, G, 2 * R), ("embed", "linear_k_heads", None))
        # The convolution's channels [q (G Kk), k (G Kk), v (H Kv)]: small, replicated, sliced per use.
        self.conv = p(_uniform(W**-0.5), (W, 2 * G * Kk + H * Kv), ("conv_kw", None))
        self.A_log = p(_log_uniform(0.01, 16.0), (H,), ("linear_heads",))
        self.dt_bias = p(nnx.initializers.ones, (H,), ("linear_heads",))
        self.norm = RMSNorm(Kv, eps=norm_eps, dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs, axis="head_dim")
        self.wo = p(normal(out_std), (H, Kv, D), ("linear_heads", "head_dim", "embed"))
        self.cfg, self.dtype = cfg, dtype

    # ------------------------------------------------------------------ pieces

    def _projections(self, x_BLD: jax.Array):
        """(q, k, v before the convolution, z, b, a) of every token."""
        cfg = self.cfg
        G, H, Kk, Kv = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
        B, L, _ = x_BLD.shape
        qkvz_BLGX = matmul("BLD,DGX->BLGX", x_BLD, self.w_qkvz, self.dtype)
        q_BLGK, k_BLGK, v_BLGX, z_BLGX = jnp.split(qkvz_BLGX, np.cumsum([Kk, Kk, (H // G) * Kv]), axis=-1)
        ba_BLGX = matmul("BLD,DGX->BLGX", x_BLD, self.w_ba, self.dtype)
        b_BLH, a_BLH = (t.reshape(B, L, H) for t in jnp.split(ba_BLGX, 2, axis=-1))
        # Named as attention's projections, so remat policies that save those save these too.
        q_BLGK, k_BLGK = checkpoint_name(q_BLGK, QKV_PROJ[0]), checkpoint_name(k_BLGK, QKV_PROJ[1])
        v_BLHK = checkpoint_name(v_BLGX.reshape(B, L, H, Kv), QKV_PROJ[2])
        z_BLHK = z_BLGX.reshape(B, L, H, Kv)
        kv_names = ("act_batch", "act_seq", "act_kv_heads", "act_head_dim")
        names = ("act_batch", "act_seq", "act_heads", "act_head_dim")
        q_BLGK, k_BLGK = (with_logical_constraint(t, kv_names) for t in (q_BLGK, k_BLGK))
        v_BLHK, z_BLHK = (with_logical_constraint(t, names) for t in (v_BLHK, z_BLHK))
        return q_BLGK, k_BLGK, v_BLHK, z_BLHK, b_BLH, a_BLH

    def _conv_weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The convolution's q, k and v taps: (W, G, Kk), (W, G, Kk), (W, H, Kv)."""
        cfg = self.cfg
        G, H, Kk, Kv = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
        w = self.conv[...]
        W = w.shape[0]
        cq, ck, cv = jnp.split(w, [G * Kk, 2 * G * Kk], axis=-1)
        return cq.reshape(W, G, Kk), ck.reshape(W, G, Kk), cv.reshape(W, H, Kv)

    def _conv(self, x_BLHK: jax.Array, window_BSHK: jax.Array, weight, segment_ids_BL: jax.Array | None):
        """silu(depthwise causal convolution) of the L new inputs, the window (the W - 1 inputs before
        them) in front; a tap reaching into another document (segment id) reads zero."""
        W, L = self.cfg.conv_kernel, x_BLHK.shape[1]
        xs_BLHK = jnp.concatenate([window_BSHK.astype(x_BLHK.dtype), x_BLHK], axis=1)
        w_WHK = weight.astype(self.dtype)
        y_BLHK = jnp.zeros(x_BLHK.shape, jnp.float32)
        # W shifted multiply-adds (W = 4 in Qwen3-Next): elementwise per channel, so the heads' split over
        # the mesh carries through with no communication, and a document boundary is one mask per tap.
        for tap in range(W):
            shift = W - 1 - tap  # tokens back from the current one
            x_tap = xs_BLHK[:, tap : tap + L] * w_WHK[tap]
            if segment_ids_BL is not None and shift:
                same_BL = jnp.pad(segment_ids_BL[:, :-shift] == segment_ids_BL[:, shift:], ((0, 0), (shift, 0)))
                x_tap = jnp.where(same_BL[..., None, None], x_tap, 0)
            y_BLHK = y_BLHK + x_tap.astype(jnp.float32)
        return jax.nn.silu(y_BLHK).astype(self.dtype)

    def _rule_inputs(self, q_BLGK, k_BLGK, b_BLH, a_BLH):
        """L2-normalized queries and keys (float32, eps 1e-6 as FLA), beta and the log-decay g."""
        q_BLGK, k_BLGK = (_l2_normalize(t) for t in (q_BLGK, k_BLGK))
        beta_BLH = jax.nn.sigmoid(b_BLH.astype(jnp.float32))
        a_BLH = a_BLH.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        g_BLH = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a_BLH)
        return q_BLGK, k_BLGK, beta_BLH, g_BLH

    def _output(self, o_BLHK: jax.Array, z_BLHK: jax.Array) -> jax.Array:
        gated_BLHK = self.norm(o_BLHK) * jax.nn.silu(z_BLHK.astype(jnp.float32))
        y_BLD = matmul("BLHK,HKD->BLD", gated_BLHK.astype(self.dtype), self.wo, self.dtype)
        return checkpoint_name(y_BLD, OUT_PROJ)

    def _forward(self, x_BLD, state: GatedDeltaNetState, segment_ids_BL=None, valid_BL=None):
        """`valid_BL`: which tokens are real, a prefix of each row (None: all); the others (a padded
        prompt's tail, a finished row's decode step) leave the state as it was: their write strength
        and decay are zeroed and the convolution window keeps the last real inputs."""
        q_BLGK, k_BLGK, v_BLHK, z_BLHK, b_BLH, a_BLH = self._projections(x_BLD)
        conv_q, conv_k, conv_v = self._conv_weights()
        convolved = [
            self._conv(x, window, weight, segment_ids_BL)
            for x, window, weight in (
                (q_BLGK, state.conv_q_BSGK, conv_q),
                (k_BLGK, state.conv_k_BSGK, conv_k),
                (v_BLHK, state.conv_v_BSHK, conv_v),
            )
        ]
        qc_BLGK, kc_BLGK, vc_BLHK = convolved
        qn_BLGK, kn_BLGK, beta_BLH, g_BLH = self._rule_inputs(qc_BLGK, kc_BLGK, b_BLH, a_BLH)
        if valid_BL is not None:  # beta 0 writes nothing, g 0 decays nothing: the state passes through
            beta_BLH, g_BLH = (jnp.where(valid_BL[..., None], t, 0.0) for t in (beta_BLH, g_BLH))
        if x_BLD.shape[1] == 1:
            o_BLHK, recurrent_BHKK = recurrent_gated_delta_rule(
                qn_BLGK, kn_BLGK, vc_BLHK, g_BLH, beta_BLH, state.recurrent_BHKK
            )
        else:
            o_BLHK, recurrent_BHKK = chunked_gated_delta_rule(
                qn_BLGK,
                kn_BLGK,
                vc_BLHK,
                g_BLH,
                beta_BLH,
                self.cfg.chunk_size,
                state.recurrent_BHKK,
                segment_ids_BL=segment_ids_BL,
            )
        o_BLHK = with_logical_constraint(o_BLHK, ("act_batch", "act_seq", "act_heads", "act_head_dim"))
        # The next call's window: the last W - 1 inputs of (this window, these L tokens), of the real ones.
        n_B = x_BLD.shape[1] if valid_BL is None else jnp.sum(valid_BL, axis=1)
        windows = [
            _last_inputs(jnp.concatenate([window, x.astype(window.dtype)], axis=1), n_B, window.shape[1])
            for window, x in ((state.conv_q_BSGK, q_BLGK), (state.conv_k_BSGK, k_BLGK), (state.conv_v_BSHK, v_BLHK))
        ]
        new_state = GatedDeltaNetState(*windows, recurrent_BHKK)
        return self._output(o_BLHK, z_BLHK), new_state

    # ------------------------------------------------------------------ public

    def init_state(self, batch: int, dtype: jnp.dtype | None = None) -> GatedDeltaNetState:
        """Zeros: the state before a sequence's first token (conv window in `dtype`, the compute dtype
        by default; the recurrent state float32); what the serving engine keeps per slot
        (src/meshwork/engine/recurrent_states.py `state_shapes`)."""
        shapes = state_shapes(self.cfg, dtype or self.dtype)
        return GatedDeltaNetState(*(jnp.zeros((batch, *shape), dt) for shape, dt in shapes))

    def __call__(
        self, x_BLD: jax.Array, positions_BL: jax.Array | None = None, segment_ids_BL: jax.Array | None = None
    ) -> jax.Array:
        """The layer over whole sequences from an empty state (training, full forward passes), as
        `Attention.__call__`. Tokens must be in order: `positions_BL` is accepted for the common
        signature and unused (no RoPE here). `segment_ids_BL`: packed documents; each starts from an
        empty state and an empty convolution window, so it computes what it computes alone."""
        del positions_BL
        y_BLD, _ = self._forward(x_BLD, self.init_state(x_BLD.shape[0]), segment_ids_BL)
        return y_BLD

    def cached(self, x_BLD: jax.Array, state: GatedDeltaNetState) -> tuple[jax.Array, GatedDeltaNetState]:
        """The layer over the next L tokens of each sequence, continuing from `state`: (y, the state
        after them). L > 1 (prefill, or a chunk of one) runs the chunked form from the state, L = 1
        (decoding) the recurrence. Every row takes all L tokens: a batch of prompts of different
        lengths is prefilled row by row or in equal pieces."""
        return self._forward(x_BLD, state)

    def cached_view(self, x_BLD: jax.Array, positions_BL: jax.Array, view):
        """`cached` over the serving engine's per-layer view of its sequences' states
        (src/meshwork/engine/kv_cache.py `cache.linear_layer(j)`): (y, the view with the new states).
        Tokens the view says are not real (positions past the cache) leave their row's state as it was."""
        state = GatedDeltaNetState(*view.read())
        y_BLD, new = self._forward(x_BLD, state, valid_BL=view.valid(positions_BL))
        return y_BLD, view.write(dataclasses.astuple(new))


def _last_inputs(xs_BTNK: jax.Array, n_B, width: int) -> jax.Array:
    """Rows' inputs n .. n + width - 1 of (window, new inputs): the window after n new real inputs."""
    if isinstance(n_B, int):
        return xs_BTNK[:, n_B : n_B + width]
    index_BW = n_B[:, None] + jnp.arange(width)[None]
    return jnp.take_along_axis(xs_BTNK, index_BW[:, :, None, None], axis=1)


def _l2_normalize(x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + 1e-6)


# ---------------------------------------------------------------------- transformers' layout

# One Qwen3NextGatedDeltaNet's tensors, as named under its `model.layers.N.linear_attn.` prefix.
HF_NAMES = (
    "in_proj_qkvz.weight",
    "in_proj_ba.weight",
    "conv1d.weight",
    "A_log",
    "dt_bias",
    "norm.weight",
    "out_proj.weight",
)


def from_hf(tensors: Mapping[str, np.ndarray], cfg: LinearAttentionConfig) -> dict[str, np.ndarray]:
    """This layer's parameters (keys as `nnx.to_flat_state` paths joined by dots: `w_qkvz`, ...,
    `norm.scale`) from one transformers `Qwen3NextGatedDeltaNet`'s tensors (keys without the
    `model.layers.N.linear_attn.` prefix). Transposes and reshapes only: bit-exact.

    transformers' layout (torch Linear weights are (out, in)):
    - `in_proj_qkvz.weight` (G (2 Kk + 2 R Kv), D): per key head g, contiguous: q_g (Kk), k_g (Kk),
      v of value heads gR .. gR + R - 1 (R Kv), z of the same heads (R Kv) -> w_qkvz (D, G, 2Kk + 2RKv).
    - `in_proj_ba.weight` (G 2R, D): per key head g: b of its R value heads, then a -> w_ba (D, G, 2R).
    - `conv1d.weight` (2 G Kk + H Kv, 1, W): channels [q (G Kk), k (G Kk), v (H Kv)], head-major;
      tap W - 1 multiplies the current token -> conv (W, channels).
    - `A_log`, `dt_bias` (H,): as they are; `norm.weight` (Kv,) -> norm.scale.
    - `out_proj.weight` (D, H Kv) -> wo (H, Kv, D).
    """
    G, H, Kv = cfg.num_k_heads, cfg.num_v_heads, cfg.head_v_dim
    qkvz = np.asarray(tensors["in_proj_qkvz.weight"]).T
    D = qkvz.shape[0]
    return {
        "w_qkvz": qkvz.reshape(D, G, -1),
        "w_ba": np.asarray(tensors["in_proj_ba.weight"]).T.reshape(D, G, -1),
        "conv": np.asarray(tensors["conv1d.weight"])[:, 0, :].T,
        "A_log": np.asarray(tensors["A_log"]),
        "dt_bias": np.asarray(tensors["dt_bias"]),
        "norm.scale": np.asarray(tensors["norm.weight"]),
        "wo": np.asarray(tensors["out_proj.weight"]).T.reshape(H, Kv, D),
    }


def to_hf(params: Mapping[str, np.ndarray], cfg: LinearAttentionConfig) -> dict[str, np.ndarray]:
    """The inverse of `from_hf`: transformers' tensors (contiguous arrays) from this layer's parameters."""
    H, Kv = cfg.num_v_heads, cfg.head_v_dim
    p = {name: np.asarray(value) for name, value in params.items()}
    D = p["w_qkvz"].shape[0]
    out = {
        "in_proj_qkvz.weight": p["w_qkvz"].reshape(D, -1).T,
        "in_proj_ba.weight": p["w_ba"].reshape(D, -1).T,
        "conv1d.weight": p["conv"].T[:, None, :],
        "A_log": p["A_log"],
        "dt_bias": p["dt_bias"],
        "norm.weight": p["norm.scale"],
        "out_proj.weight": p["wo"].reshape(H * Kv, D).T,
    }
    return {name: np.ascontiguousarray(value) for name, value in out.items()}
