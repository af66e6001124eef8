"""Muon (optimizer.name=muon): one device equals a NumPy transcription of the update; which
weights it treats as matrices; its Newton-Schulz, gathered to owners or iterated on shards,
equals the one-device iteration on every placement the presets make."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ROOT
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshwork.config import load_config
from meshwork.models.build import build_model, split_model
from meshwork.optimizers.matrices import matrix_layout
from meshwork.optimizers.muon import muon_labels
from meshwork.optimizers.newton_schulz import newton_schulz, orthogonalize, placement
from meshwork.sharding.mesh import make_mesh
from meshwork.train.optim import make_optimizer

# A MoE model so that the update meets every kind of matrix: attention (heads grouped with
# head_dim), a dense MLP, the router, stacked experts and a shared expert.
TINY_MOE = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=48",
    "model.tie_embeddings=false",
    "model.kind=moe",
    "model.moe.n_experts=4",
    "model.moe.top_k=2",
    "model.moe.d_expert=16",
    "model.moe.first_dense_layers=1",
    "model.moe.n_shared_experts=1",
]
OPTIMIZER = [
    "optimizer.name=muon",
    "optimizer.lr=0.01",
    "optimizer.muon.lr=0.02",
    "optimizer.warmup_steps=2",
    "optimizer.init_lr_ratio=0.5",
    "optimizer.min_lr_ratio=0.1",
    "optimizer.weight_decay=0.1",
    "optimizer.clip_norm=1.0",
    "train.steps=3",
]


def _schedule(peak, step, cfg):
    """optax's warmup-cosine schedule, written out: linear from init to peak over the warmup, then a half cosine to the end value."""
    o = cfg.optimizer
    if step < o.warmup_steps:
        return peak * o.init_lr_ratio + (peak - peak * o.init_lr_ratio) * step / o.warmup_steps
    frac = (step - o.warmup_steps) / (cfg.train.steps - o.warmup_steps)
    end = peak * o.min_lr_ratio
    return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * frac))


def _reference_matrix(path: str, shape) -> tuple[int, int, int] | None:
    """(matrices, rows, cols) of each weight Muon owns, by its name: the reference's own reading."""
    if "norm" in path or path in ("embed.table", "head.lm_head"):
        return None
    stack = 2 if ".moe.w_" in path else 1  # (layers, experts) or (layers,)
    rows = 2 if path.endswith("attn.wo") else 1  # heads x head_dim -> embed
    return math.prod(shape[:stack]), math.prod(shape[stack : stack + rows]), math.prod(shape[stack + rows :])


def _numpy_newton_schulz(x, steps):
    a, b, c = 3.4445, -4.775, 2.0315
    out = []
    for m in x:
        t = m.shape[0] > m.shape[1]
        m = m.T if t else m
        m = m / (np.linalg.norm(m) + 1e-7)
        for _ in range(steps):
            g = m @ m.T
            m = a * m + (b * g + c * g @ g) @ m
        out.append(m.T if t else m)
    return np.stack(out)


def _numpy_muon(params, grads_per_step, cfg):
    """Three steps of clip -> (Muon | AdamW) in float64, from the formulas."""
    o, mu = cfg.optimizer, cfg.optimizer.muon
    p = {k: v.astype(np.float64) for k, v in params.items()}
    m1 = {k: np.zeros_like(v) for k, v in p.items()}
    m2 = {k: np.zeros_like(v) for k, v in p.items()}
    for t, grads in enumerate(grads_per_step):
        g = {k: v.astype(np.float64) for k, v in grads.items()}
        norm = math.sqrt(sum(float(np.sum(v * v)) for v in g.values()))
        if norm > o.clip_norm:
            g = {k: v * o.clip_norm / norm for k, v in g.items()}
        for k in p:
            kmn = _reference_matrix(k, p[k].shape)
            if kmn is not None:
                m1[k] = mu.beta * m1[k] + g[k]
                d = (mu.beta * m1[k] + g[k]).reshape(kmn)
                u = _numpy_newton_schulz(d, mu.ns_steps).reshape(p[k].shape) * 0.2 * math.sqrt(max(kmn[1:]))
                p[k] = p[k] - _schedule(mu.lr, t, cfg) * (u + o.weight_decay * p[k])
            else:
                m1[k] = o.b1 * m1[k] + (1 - o.b1) * g[k]
                m2[k] = o.b2 * m2[k] + (1 - o.b2) * g[k] ** 2
                u = (m1[k] / (1 - o.b1 ** (t + 1))) / (np.sqrt(m2[k] / (1 - o.b2 ** (t + 1))) + o.eps)
                decay = 0.0 if "norm" in k else o.weight_decay
                p[k] = p[k] - _schedule(o.lr, t, cfg) * (u + decay * p[k])
    return p


def _flat(state) -> dict[str, np.ndarray]:
    """{"moe_blocks.moe.w_up": array, ...}: dotted paths without the Variables' `.value`."""
    names = lambda path: [str(getattr(k, "key", getattr(k, "name", k))) for k in path]  # noqa: E731
    return {
        ".".join(n for n in names(path) if n != "value"): np.asarray(v)
        for path, v in jax.tree_util.tree_leaves_with_path(state)
    }


def _three_steps(dtype):
    """(weights before, the NumPy transcription's after, the optimizer's after) for 3 steps of fixed gradients."""
    cfg = load_config(ROOT / "configs/lm_tiny.yaml", [*TINY_MOE, *OPTIMIZER])
    _, params, _ = split_model(build_model(cfg), cfg)
    params = jax.tree.map(lambda v: v.astype(dtype), params)
    tx, _ = make_optimizer(cfg.optimizer, cfg.train.steps)
    rng = np.random.default_rng(0)
    start = _flat(params)
    grads_per_step = [{k: rng.standard_normal(v.shape).astype(dtype) * 0.1 for k, v in start.items()} for _ in range(3)]
    opt_state = tx.init(params)
    update = jax.jit(tx.update)
    for grads in grads_per_step:
        g = jax.tree.unflatten(jax.tree.structure(params), [jnp.asarray(grads[k]) for k in start])
        updates, opt_state = update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
    assert sum(_reference_matrix(k, v.shape) is not None for k, v in start.items()) == 18
    return start, _numpy_muon(start, grads_per_step, cfg), _flat(params)


def test_one_device_equals_a_numpy_transcription_for_three_steps():
    """In float64 the update itself (the weights' change over 3 steps) agrees within 1e-6 relative
    (measured 2.2e-8, the float32 of optax's learning-rate schedule). In float32, what training runs, the weights agree within
    1e-5 relative (measured 4.9e-6): float32 rounding in the momentum, magnified by the quintic's
    slope of 3.4 at zero over 5 iterations in the momentum's smallest singular directions."""
    with jax.enable_x64(True):
        start, want, got = _three_steps(np.float64)
    for k in start:
        moved = want[k] - start[k]
        assert np.max(np.abs((got[k] - start[k]) - moved)) <= 1e-6 * np.max(np.abs(moved)), k
    start, want, got = _three_steps(np.float32)
    for k in start:
        assert np.max(np.abs(got[k] - want[k])) <= 1e-5 * np.max(np.abs(want[k])), k


def test_the_matrices_are_the_weights_muon_owns_the_rest_stay_with_adamw():
    cfg = load_config(ROOT / "configs/lm_tiny.yaml", TINY_MOE)
    _, params, _ = split_model(build_model(cfg), cfg)
    labels = {k: v for k, v in _flat(muon_labels(params)).items()}
    for path, value in _flat(params).items():
        assert (labels[path] == "muon") == (_reference_matrix(path, value.shape) is not None), path


# (logical names, global shape, spec on each mesh): attention in and out, an MLP, stacked experts,
# an unstacked matrix; meshes with FSDP, data x FSDP x tensor, experts, data x FSDP on one
# dimension (zero1's state), and pipeline stages over the layers.
MATRICES = [
    (("layers", "embed", "mlp"), (3, 16, 24)),
    (("layers", "heads", "head_dim", "embed"), (3, 4, 4, 16)),
    (("layers", "embed", "heads", "head_dim"), (3, 16, 4, 4)),
    (("layers", "expert", "embed", "mlp"), (2, 4, 16, 8)),
    (("embed", "mlp"), (16, 8)),
]
MESHES = {
    "fsdp 8": (
        {"fsdp": 8},
        [P(None, "fsdp"), P(None, None, None, "fsdp"), P(None, "fsdp"), P(None, None, "fsdp"), P("fsdp")],
    ),
    "data 2 x fsdp 2 x tensor 2": (
        {"data": 2, "fsdp": 2, "tensor": 2},
        [
            P(None, "fsdp", "tensor"),
            P(None, "tensor", None, "fsdp"),
            P(None, "fsdp", "tensor"),
            P(None, None, "fsdp", "tensor"),
            P("fsdp", "tensor"),
        ],
    ),
    "data 2 x expert 4": ({"data": 2, "expert": 4}, [P(), P(), P(), P(None, "expert"), P()]),
    "(data, fsdp) 2x4 on one dimension": (
        {"data": 2, "fsdp": 4},
        [P(None, ("data", "fsdp"))] + [P(None, "fsdp")] * 2 + [P(), P()],
    ),
    "stage 2 x fsdp 4": (
        {"stage": 2, "fsdp": 4},
        [P(None, "fsdp")] + [P(None, None, None, "fsdp"), P(None, "fsdp"), P("stage", None, "fsdp"), P("fsdp")],
    ),
}


@pytest.mark.parametrize("variant", ["gather", "sharded"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_both_variants_equal_the_one_device_iteration_on_every_placement(mesh_name, variant):
    sizes, specs = MESHES[mesh_name]
    mesh = make_mesh(sizes)
    rng = np.random.default_rng(1)
    values = [jnp.asarray(rng.standard_normal(shape), jnp.float32) for _, shape in MATRICES]
    layouts = [matrix_layout(names) for names, _ in MATRICES]
    want = [newton_schulz(v.reshape(lay.shape(v.shape)), 5).reshape(v.shape) for v, lay in zip(values, layouts)]
    placements = [placement(lay, v.shape, s, dict(mesh.shape)) for lay, v, s in zip(layouts, values, specs)]
    with jax.set_mesh(mesh):
        placed = [jax.device_put(v, NamedSharding(mesh, s)) for v, s in zip(values, specs)]
        got = jax.jit(lambda *xs: orthogonalize(list(xs), placements, variant, 5))(*placed)
    for g, w, s in zip(got, want, specs):
        assert g.sharding.spec == s or g.sharding.is_equivalent_to(NamedSharding(mesh, s), g.ndim)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(w))))


def test_the_one_device_iteration_orthogonalizes():
    """Five quintic steps leave every singular value of a random matrix in the iteration's band
    (~0.7..1.2, not exactly 1: the coefficients trade accuracy for speed) with the singular vectors kept."""
    x = np.random.default_rng(2).standard_normal((1, 24, 40)).astype(np.float32)
    o = np.asarray(newton_schulz(jnp.asarray(x), 5))[0]
    s = np.linalg.svd(o, compute_uv=False)
    assert 0.6 < s.min() and s.max() < 1.25, s
    u, _, vt = np.linalg.svd(x[0], full_matrices=False)
    np.testing.assert_allclose(u.T @ o @ vt.T, np.diag(np.diag(u.T @ o @ vt.T)), atol=1e-2)
