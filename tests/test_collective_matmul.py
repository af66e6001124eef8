"""Collective matmul is the plain tensor-parallel layer, forward and backward, and its
compiled program sends the same bytes as collective-permutes where the plain one
all-gathers and reduce-scatters, each permute free to overlap a matmul.

Each (layer, mesh, version) is compiled once, forward and gradient, and run once;
the tests read values, gradients and the optimized HLO from that one case.
"""

import doctest
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, tiny_overrides
from jax.sharding import PartitionSpec as P

import meshwork.sharding.collective_matmul as cm
from meshwork.sharding.hlo import collective_summary
from meshwork.sharding.mesh import make_mesh

B, L, D, F = 4, 16, 32, 64  # L and F split into 8 along `tensor`
TOL = 1e-5  # max |error| relative to max |reference|
MESHES = {"2x4": dict(data=2, tensor=4), "4x2": dict(data=4, tensor=2), "1x8": dict(tensor=8)}
SEQ, REP = P(("data", "fsdp"), "tensor", None), P(("data", "fsdp"), None, "tensor")
COLUMN, ROW = P(None, "tensor"), P("tensor", None)


def _random(shape, seed, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


# layer -> (global inputs, in_specs, out_spec, body(collective) | None for tp_mlp,
#           decomposed (all-gathers, reduce-scatters) in the forward pass, unsharded reference)
LAYERS = {
    "all_gather_matmul": (
        (_random((B, L, D), 0), _random((D, F), 1, D**-0.5)),
        (SEQ, COLUMN),
        REP,
        lambda c: lambda x, w: cm.all_gather_matmul(x, w, "tensor", collective=c),
        (1, 0),
        lambda x, w: x @ w,
    ),
    "matmul_reduce_scatter": (
        (_random((B, L, F), 2), _random((F, D), 3, F**-0.5)),
        (REP, ROW),
        SEQ,
        lambda c: lambda h, w: cm.matmul_reduce_scatter(h, w, "tensor", collective=c),
        (0, 1),
        lambda h, w: h @ w,
    ),
    "mlp": (
        (_random((B, L, D), 4), _random((D, F), 5, D**-0.5), _random((D, F), 6, D**-0.5), _random((F, D), 7, F**-0.5)),
        None,
        None,
        None,
        (1, 1),
        lambda x, wg, wu, wd: (jax.nn.silu(x @ wg) * (x @ wu)) @ wd,
    ),
}


@functools.cache
def _case(layer: str, mesh_name: str, collective: bool):
    """(output, gradients w.r.t. every input, forward HLO, gradient HLO), all on host."""
    args, in_specs, out_spec, body, *_ = LAYERS[layer]
    mesh = make_mesh(MESHES[mesh_name])
    if body is None:
        f = lambda *a: cm.tp_mlp(*a, mesh, collective=collective)  # noqa: E731
    else:
        f = jax.shard_map(body(collective), mesh=mesh, in_specs=in_specs, out_specs=out_spec)
    probe = _random((B, L, D if layer != "all_gather_matmul" else F), 8)
    # A random probe gives every output element its own cotangent; value_and_grad
    # keeps the forward pass whole in the gradient program, as a train step does.
    loss = lambda *a: jnp.sum(f(*a) * probe)  # noqa: E731
    fwd = jax.jit(f).lower(*args).compile()
    grad = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))))).lower(*args).compile()
    return (np.asarray(fwd(*args)), [np.asarray(g) for g in grad(*args)[1]], fwd.as_text(), grad.as_text())


def _rel_err(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


# The single rings on two meshes; the MLP also on 4x2, whose ring is one step.
CASES = [(layer, mesh) for layer in LAYERS for mesh in MESHES if layer == "mlp" or mesh != "4x2"]
IDS = [f"{layer}-{mesh}" for layer, mesh in CASES]


@pytest.mark.parametrize("layer,mesh", CASES, ids=IDS)
def test_values_and_gradients_equal_the_plain_layer(layer, mesh):
    y, grads, *_ = _case(layer, mesh, True)
    y_plain, grads_plain, *_ = _case(layer, mesh, False)
    assert _rel_err(y, y_plain) < TOL
    assert _rel_err(y_plain, LAYERS[layer][-1](*LAYERS[layer][0])) < TOL  # and both are the math
    for g, g_plain in zip(grads, grads_plain, strict=True):
        assert _rel_err(g, g_plain) < TOL


@pytest.mark.parametrize("layer,mesh", CASES, ids=IDS)
def test_ring_of_permutes_replaces_gather_and_scatter_with_the_same_bytes(layer, mesh):
    n = MESHES[mesh]["tensor"]
    gathers, scatters = LAYERS[layer][4]
    rings = gathers + scatters
    *_, fwd, grad = _case(layer, mesh, True)
    *_, fwd_plain, grad_plain = _case(layer, mesh, False)
    # Forward: one ring of n-1 permutes per decomposed collective. Backward: each
    # ring's transpose, a ring the other way: the plain backward reduce-scatters
    # what its forward all-gathered, and vice versa.
    for hlo, hlo_plain, plain_counts in ((fwd, fwd_plain, (gathers, scatters)), (grad, grad_plain, (rings, rings))):
        got, plain = collective_summary(hlo), collective_summary(hlo_plain)
        assert got["collective-permute"]["count"] == sum(plain_counts) * (n - 1)
        assert got["all-gather"]["count"] == got["reduce-scatter"]["count"] == 0  # nor all-reduce + slice
        assert (plain["all-gather"]["count"], plain["reduce-scatter"]["count"]) == plain_counts
        assert plain["collective-permute"]["count"] == 0
        # Same bytes per device, up to collective_summary rounding each op to a byte.
        plain_bytes = plain["all-gather"]["bytes"] + plain["reduce-scatter"]["bytes"]
        assert abs(got["collective-permute"]["bytes"] - plain_bytes) <= got["collective-permute"]["count"]
        # The weight gradients' sum over `data` is the same one all-reduce in both.
        assert got["all-reduce"] == plain["all-reduce"]


def _entry_graph(hlo: str) -> tuple[dict[str, set[str]], set[str], list[str]]:
    """ENTRY's instructions as {name: operand names}, the names that run a matmul
    (a dot, or a fusion of one), and the collective-permutes, from optimized HLO text."""
    blocks = re.split(r"\n(?=\S)", hlo)  # a computation starts at column 0
    with_dot = {m.group(1) for b in blocks if " dot(" in b for m in [re.match(r"%?(\S+)", b)] if m}
    entry = next(b for b in blocks if b.startswith("ENTRY"))
    deps, dots, permutes = {}, set(), []
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%(\S+) = \S+ ([\w-]+)\((.*)", line)
        if not m:
            continue
        name, op, rest = m.groups()
        deps[name] = {o for o in re.findall(r"%([\w.\-]+)", rest) if o in deps}
        callee = re.search(r"calls=%([\w.\-]+)", rest)
        if op == "dot" or (callee and callee.group(1) in with_dot):
            dots.add(name)
        if op == "collective-permute":
            permutes.append(name)
    return deps, dots, permutes


def test_every_permute_has_a_matmul_to_overlap_with():
    """In the scheduled forward HLO of the MLP, every collective-permute has a
    matmul that neither feeds it nor waits for it: the partial product of the
    chunk already on the device. Nothing forces XLA to serialize the two."""
    *_, fwd, _ = _case("mlp", "2x4", True)
    deps, dots, permutes = _entry_graph(fwd)
    users = {name: {u for u, ops in deps.items() if name in ops} for name in deps}

    def closure(start, edges):
        seen, todo = set(), [start]
        while todo:
            for nxt in edges[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    assert len(permutes) == 2 * 3 and len(dots) >= 4  # two rings over 4 devices; a matmul per chunk at least
    for p in permutes:
        free = dots - closure(p, deps) - closure(p, users)
        assert free, f"{p}: every matmul depends on it or feeds it"


def _train(tmp_path, collective: bool, steps: int = 2):
    """(last metrics, params, compiled step HLO) of `steps` steps of the tiny LM under
    `sp` on data=2 x tensor=4, its MLPs traced as collective matmuls or not."""
    from meshwork.config import load_config
    from meshwork.data.text import train_iterator
    from meshwork.train.trainer import build_trainer, check_runtime

    # Nonzero lr at step 0 (a warmup from 0 makes step 1 a no-op); 4 K/V heads split over
    # tensor=4; one layer, since the compile is most of this test's time.
    cfg = load_config(
        ROOT / "configs/lm_tiny.yaml",
        [
            *tiny_overrides(tmp_path),
            "optimizer.init_lr_ratio=0.1",
            "optimizer.warmup_steps=10",
            "mesh.data=2",
            "mesh.tensor=4",
            "rules.preset=sp",
            "model.n_kv_heads=4",
            "model.n_layers=1",
            f"comm.collective_matmul={str(collective).lower()}",
        ],
    )
    files = check_runtime(cfg, jax.devices())
    trainer = build_trainer(cfg, files, jax.devices()).compile()
    batches = train_iterator(str(files.train), cfg.data.seq_len, cfg.train.global_batch, seed=0)
    state = trainer.init_state()
    for _ in range(steps):
        state, metrics = trainer.step_fn(state, trainer.to_device(next(batches)))
    return jax.device_get(metrics), jax.device_get(state.params), trainer.step_fn.as_text(), cfg


def test_train_step_with_collective_matmul_equals_the_plain_one(tmp_path):
    metrics, params, hlo, cfg = _train(tmp_path / "ring", True)
    metrics_plain, params_plain, hlo_plain, _ = _train(tmp_path / "plain", False)
    np.testing.assert_allclose(metrics["loss"], metrics_plain["loss"], rtol=1e-6)
    np.testing.assert_allclose(metrics["grad_norm"], metrics_plain["grad_norm"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params_plain), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    # Per layer, four rings of n-1 = 3 permutes: the forward gather and scatter and their transposes.
    got, plain = collective_summary(hlo), collective_summary(hlo_plain)
    assert got["collective-permute"]["count"] == cfg.model.n_layers * 4 * 3
    assert plain["collective-permute"]["count"] == 0
    moved = lambda s, kinds: sum(s[k]["bytes"] for k in kinds)  # noqa: E731
    # No more traffic than GSPMD's own sequence-parallel MLP (which in fact sends a little more).
    assert moved(got, ("all-gather", "reduce-scatter", "collective-permute")) <= moved(
        plain, ("all-gather", "reduce-scatter")
    )


def test_docstring_examples():
    result = doctest.testmod(cm, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
