"""Mixture-of-Experts feed-forward layer: routers, GShard capacity, dropless grouped matmul, expert parallelism.

Each token x picks X of E routed experts (SwiGLU MLPs of hidden size F); its output is

    y = routed_scaling_factor * sum_k w_k * expert_{e_k}(x)  +  shared(x) [* sigmoid(x . g)]

gpt-oss (`router_bias`, `expert_bias`, `activation: clamped_swiglu`): router logits x W_r + b_r,
softmax over the k best logits (router softmax with norm_topk_prob), and experts
clamped_swiglu(x W_g + b_g, x W_u + b_u) W_d + b_d (models/layers/moe_dispatch.py).

The router and its balancing statistics are in models/layers/moe_routing.py; sending the
assignments to the experts (capacity or dropless, expert parallelism) in
models/layers/moe_dispatch.py.

Shape letters (docs/architecture.md#shape-letters): B batch, L sequence, D model, E experts, F expert
hidden, X choices per token, Q capacity slots per expert and group, T tokens (B*L), A assignments
(T*X), Z dispatch-buffer slots, N devices along the expert axes, U expert groups.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from meshwork.config_sections import MoEConfig
from meshwork.models.layers.mlp import SwiGLU
from meshwork.models.layers.moe_dispatch import (
    ALL_TO_ALL_IMPLS,
    Experts,
    capacity_experts,
    capacity_per_group,
    capacity_slots,
    clamped_swiglu,
    dropless_experts,
    run_experts,
    swiglu,
)
from meshwork.models.layers.moe_routing import (
    F32,
    RouterBias,
    expert_load,
    load_balancing_loss,
    router_z_loss,
    select_experts,
    token_mean,
)
from meshwork.models.layers.params import normal, param
from meshwork.sharding.parallel import current_rules
from meshwork.sharding.rules import manual_axes, split_axes


class MoE(nnx.Module):
    """Routed (and optional shared) SwiGLU experts; returns (y_BLD, stats).

    Parameters (names the checkpoint loaders rely on): `router` (D, E) ("embed", "router");
    `noise` (D, E) for router="noisy"; `router_bias` (E,) a `RouterBias` for router="sigmoid";
    `w_gate`, `w_up` (E, D, F) ("expert", "embed", "mlp"), `w_down` (E, F, D) ("expert", "mlp",
    "embed"); `shared` a `SwiGLU` when n_shared_experts > 0; `shared_gate` (D, 1) ("embed", None)
    when shared_expert_gate. gpt-oss's biases, zero at init: `b_router` (E,) ("router",) when
    router_bias; `b_gate`, `b_up` (E, F) ("expert", "mlp") and `b_down` (E, D) ("expert", "embed")
    when expert_bias, split over the expert axes like the expert weights
    (models/hf/gpt_oss_experts.py maps Hugging Face's fused gate_up_proj to these).

    stats (float32, over the whole global batch, no coefficients applied):
    `aux_loss` (Switch/GShard, 1.0 when balanced), `z_loss`, `load` (E,) share of assignments
    per expert before any drop (sums to 1; feed it to `updated_router_bias`), and
    `dropped_fraction` of assignments dropped by capacity (0 when dropless).

    Expert parallelism (see models/layers/moe_dispatch.py) moves, per device and direction, an
    (E, B_local * Q, D) buffer in capacity mode and N * (B_local * L * X) rows of D in dropless
    mode (the no-drop worst case). `all_to_all="hierarchical"` exchanges in two levels
    (`meshwork.sharding.all_to_all_algorithms.hierarchical_all_to_all`) when `expert` maps to two mesh axes, e.g.
    ("data", "expert"): first inside the inner axis, then across the outer one; with one expert
    axis it is the plain `lax.all_to_all`.

    >>> from meshwork.config_sections import MoEConfig
    >>> moe = MoE(8, MoEConfig(n_experts=4, top_k=2, d_expert=16), init_std=0.02, out_std=0.02,
    ...           dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    >>> y, stats = moe(jnp.ones((2, 3, 8)))
    >>> y.shape, stats["load"].shape, float(stats["dropped_fraction"])
    ((2, 3, 8), (4,), 0.0)
    """

    def __init__(
        self,
        d_model: int,
        cfg: MoEConfig,
        *,
        init_std: float,
        out_std: float,
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
        all_to_all: str = "lax",
    ):
        D, E, F = d_model, cfg.n_experts, cfg.d_expert
        if cfg.top_k > E:
            raise ValueError(f"MoE: top_k={cfg.top_k} exceeds n_experts={E}; choose top_k <= n_experts")
        if cfg.router == "sigmoid" and (
            E % cfg.n_groups or cfg.topk_groups > cfg.n_groups or cfg.top_k > cfg.topk_groups * (E // cfg.n_groups)
        ):
            raise ValueError(
                f"MoE: {E} experts in n_groups={cfg.n_groups} with topk_groups={cfg.topk_groups} "
                f"cannot supply top_k={cfg.top_k} experts; groups must divide the experts and "
                f"topk_groups * experts-per-group must be >= top_k"
            )
        if cfg.shared_expert_gate and not cfg.n_shared_experts:
            raise ValueError("MoE: shared_expert_gate needs a shared expert; set n_shared_experts >= 1")
        if cfg.n_shared_experts and (cfg.expert_bias or cfg.activation != "swiglu"):
            raise ValueError(
                f"MoE: expert_bias={cfg.expert_bias} and activation={cfg.activation!r} apply to routed experts "
                f"only, but n_shared_experts={cfg.n_shared_experts} shared experts would stay plain biasless "
                f"SwiGLUs; set n_shared_experts=0 (gpt-oss has none) or expert_bias=false and activation=swiglu"
            )
        if all_to_all not in ALL_TO_ALL_IMPLS:
            raise ValueError(f"MoE: all_to_all={all_to_all!r}; choose one of {ALL_TO_ALL_IMPLS}")
        self.router = param(normal(init_std), rngs.params(), (D, E), param_dtype, ("embed", "router"))
        zeros = nnx.initializers.zeros_init()
        if cfg.router_bias:
            self.b_router = param(zeros, rngs.params(), (E,), param_dtype, ("router",))
        if cfg.router == "noisy":
            # Zero init as in Shazeer et al.: the noise starts at softplus(0) * noise_std.
            self.noise = param(zeros, rngs.params(), (D, E), param_dtype, ("embed", "router"))
        if cfg.router == "sigmoid":
            # float32 whatever param_dtype: it accumulates many tiny updates.
            self.router_bias = RouterBias(jnp.zeros((E,), F32), out_sharding=("router",), eager_sharding=False)
        self.w_gate = param(normal(init_std), rngs.params(), (E, D, F), param_dtype, ("expert", "embed", "mlp"))
        self.w_up = param(normal(init_std), rngs.params(), (E, D, F), param_dtype, ("expert", "embed", "mlp"))
        self.w_down = param(normal(out_std), rngs.params(), (E, F, D), param_dtype, ("expert", "mlp", "embed"))
        if cfg.expert_bias:
            self.b_gate = param(zeros, rngs.params(), (E, F), param_dtype, ("expert", "mlp"))
            self.b_up = param(zeros, rngs.params(), (E, F), param_dtype, ("expert", "mlp"))
            self.b_down = param(zeros, rngs.params(), (E, D), param_dtype, ("expert", "embed"))
        if cfg.n_shared_experts:
            self.shared = SwiGLU(
                D,
                cfg.d_shared or cfg.n_shared_experts * F,
                init_std=init_std,
                out_std=out_std,
                dtype=dtype,
                param_dtype=param_dtype,
                rngs=rngs,
            )
        if cfg.shared_expert_gate:
            self.shared_gate = param(normal(init_std), rngs.params(), (D, 1), param_dtype, ("embed", None))
        self.cfg, self.dtype, self.all_to_all = cfg, dtype, all_to_all

    def router_logits(self, x_BLD: jax.Array) -> jax.Array:
        """x W_r (+ b_r) in float32; HIGHEST precision so that top-k does not flip on bf16 passes (TPU)."""
        logits_BLE = jnp.einsum(
            "BLD,DE->BLE", x_BLD.astype(F32), self.router[...].astype(F32), precision=lax.Precision.HIGHEST
        )
        if self.cfg.router_bias:
            logits_BLE = logits_BLE + self.b_router[...].astype(F32)
        return logits_BLE

    def experts(self) -> Experts:
        """The routed experts' weights (and biases) in the compute dtype."""
        w = lambda p: p[...].astype(self.dtype)  # noqa: E731
        biases = (w(self.b_gate), w(self.b_up), w(self.b_down)) if self.cfg.expert_bias else ()
        return Experts(w(self.w_gate), w(self.w_up), w(self.w_down), *biases)

    def activation(self):
        """The routed experts' act(gate, up)."""
        cfg = self.cfg
        if cfg.activation == "clamped_swiglu":
            return functools.partial(clamped_swiglu, limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha)
        return swiglu

    def __call__(self, x_BLD: jax.Array, *, noise_key: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """noise_key: draws the noisy router's noise (pass one per step in training; None to evaluate)."""
        cfg = self.cfg
        L = x_BLD.shape[1]
        E, X = cfg.n_experts, cfg.top_k
        logits_BLE = self.router_logits(x_BLD)
        gate_logits_BLE = logits_BLE
        if cfg.router == "noisy" and noise_key is not None:
            noise_scale_BLE = cfg.noise_std * jax.nn.softplus(
                jnp.einsum(
                    "BLD,DE->BLE", x_BLD.astype(F32), self.noise[...].astype(F32), precision=lax.Precision.HIGHEST
                )
            )
            gate_logits_BLE = logits_BLE + jax.random.normal(noise_key, logits_BLE.shape, F32) * noise_scale_BLE
        expert_BLX, weight_BLX, probs_BLE = select_experts(
            gate_logits_BLE,
            router=cfg.router,
            k=X,
            norm_topk_prob=cfg.norm_topk_prob,
            bias_E=self.router_bias[...] if cfg.router == "sigmoid" else None,
            n_groups=cfg.n_groups,
            topk_groups=cfg.topk_groups,
        )
        across = _manual_token_axes()
        stats = {
            "aux_loss": load_balancing_loss(probs_BLE, expert_BLX, across),
            "z_loss": router_z_loss(logits_BLE, across),
            "load": expert_load(expert_BLX, E, across),
        }

        x_BLD = x_BLD.astype(self.dtype)
        if cfg.capacity_factor is not None:
            Q = capacity_per_group(cfg.capacity_factor, L, X, E)
            routes_BLX = capacity_slots(expert_BLX, E, Q)
            stats["dropped_fraction"] = token_mean(jnp.mean((routes_BLX == E * Q).astype(F32)), across)
            body = functools.partial(capacity_experts, n_experts=E, capacity=Q, act=self.activation())
        else:
            routes_BLX = expert_BLX
            stats["dropped_fraction"] = jnp.zeros((), F32)
            body = functools.partial(dropless_experts, n_experts=E, act=self.activation())
        y_BLD = run_experts(
            body, x_BLD, routes_BLX, weight_BLX.astype(self.dtype), self.experts(), n_experts=E, impl=self.all_to_all
        )
        if cfg.routed_scaling_factor != 1.0:
            y_BLD = y_BLD * cfg.routed_scaling_factor
        if cfg.n_shared_experts:
            shared_BLD = self.shared(x_BLD)
            if cfg.shared_expert_gate:
                gate_BL1 = jax.nn.sigmoid(x_BLD.astype(F32) @ self.shared_gate[...].astype(F32))
                shared_BLD = shared_BLD * gate_BL1.astype(self.dtype)
            y_BLD = y_BLD + shared_BLD
        return y_BLD, stats


def _manual_token_axes() -> tuple[str, ...]:
    """The batch's and sequence's mesh axes that are manual where the layer runs (a pipeline
    stage with its data shards, or context-parallel shards, manual): the routing statistics are
    averaged across them, so they stay the whole batch's."""
    rules, mesh = current_rules(), jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty:
        return ()
    shape, manual = dict(mesh.shape), manual_axes()
    return tuple(a for name in ("act_batch", "act_seq") for a in split_axes(name, rules, shape) if a in manual)
