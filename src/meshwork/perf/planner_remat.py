"""Planner: what each `train.remat` policy keeps for the backward pass, and which forward matmuls
its backward runs again.

A policy (models/transformer.py's REMAT_POLICIES) names the tensors the layer scan may keep; jax
keeps those of them the backward pass reads and recomputes the rest from the layer's input. The
tensors, per token of one layer (h = d_model, q = n_heads x head_dim, kv = n_kv_heads x head_dim,
F = d_ff, a = n_heads, s = the sequence length; the tensor-parallel divisors as in
planner_memory.layer_activation_bytes):

    qkv          the q, k and v projections' outputs             (q + 2 kv) / t
    attention    the score matrix (unless flash) and the
                 probabilities x values product                  a s / t + q / t
    out_proj     the attention output projection's output        h / t_sp
    mlp_in       SwiGLU's gate and up projections               2 F / t
                 (a MoE layer: the router's logits in float32,
                 the shared experts' gate and up, and, where a
                 sigmoid gate scales the shared experts, their
                 output and the gate's logit)                    E + 2 F_s / t (+ h / t_sp + 1)
    experts      a MoE layer's routed experts under capacity     k cf (2 F_e + h) / t
                 dispatch: gate, up and down, batched over the
                 experts, so only the policies that keep batched
                 dots keep them. The down projection's output is
                 read by the routing weights' gradient. Dropless
                 dispatch runs them as `ragged_dot`, which no
                 policy saves: they are always recomputed.

A dense MLP's down projection is never kept: its output only joins the residual stream, which
the backward pass does not read. `tests/test_remat_policies.py` checks these counts against the
residuals jax saves (`jax.ad_checkpoint.print_saved_residuals`).

A partial policy's backward runs the layer's forward products again except the kept tensors'
and the dense down projections' (whose output it never reads); "full" counts the whole forward, as
Korthikanti et al. do. Elementwise work (norms, softmax, SwiGLU) is left to the planner's
memory-bound term.
"""

from __future__ import annotations

# policy -> the tensors it keeps on the device ("none" keeps everything; see planner_memory)
KEPT = {
    "full": (),
    "dots_saveable": ("qkv", "attention", "out_proj", "mlp_in", "experts"),
    "dots_with_no_batch_dims_saveable": ("qkv", "out_proj", "mlp_in"),
    "save_qkv_proj": ("qkv",),
    "save_out_proj": ("out_proj",),
    "save_qkv_and_out_proj": ("qkv", "out_proj"),
    # The weight products go to host memory and come back for the backward pass: the device
    # keeps what "full" keeps, and only attention's batched dots run again.
    "offload_dots": (),
}
# policy -> the tensors whose forward products its backward does not run again
NOT_RECOMPUTED = {**KEPT, "offload_dots": KEPT["dots_with_no_batch_dims_saveable"]}
POLICIES = ("none", *KEPT)


def kept_elements_per_token(
    remat: str, *, h: float, qkv: float, attention: float, out_proj: float, mlp_in: float, experts: float = 0.0
) -> float:
    """Elements one layer keeps per token under a policy other than "none": its input (the
    residual stream, `h`, already divided by its split) plus the kept tensors' sizes."""
    sizes = {"qkv": qkv, "attention": attention, "out_proj": out_proj, "mlp_in": mlp_in, "experts": experts}
    return h + sum(sizes[t] for t in KEPT[remat])


def recompute_fraction(remat: str, flops: dict[str, float]) -> float:
    """The share of a layer's forward FLOPs its backward runs again: 1 for "full", 0 for "none";
    `flops` holds the forward FLOPs of "qkv", "attention", "out_proj", "mlp_in", "experts",
    "mlp_out" (the down projections whose output the backward never reads) and "total"; what
    no key names (dropless experts) every partial policy runs again."""
    if remat == "none":
        return 0.0
    if remat == "full":
        return 1.0
    not_run = flops["mlp_out"] + sum(flops[t] for t in NOT_RECOMPUTED[remat])
    return max(flops["total"] - not_run, 0.0) / flops["total"]


def kept_during_backward(remat: str) -> str:
    """The policy whose kept tensors a layer's backward pass finds on the device: offload_dots
    brings its products back from the host, so it is dots_with_no_batch_dims_saveable there."""
    return "dots_with_no_batch_dims_saveable" if remat == "offload_dots" else remat


def recomputes_matmuls(remat: str) -> bool:
    """Whether the backward pass runs some of a layer's products again (and so holds one
    layer's working set while it does)."""
    return remat not in ("none", "dots_saveable")
