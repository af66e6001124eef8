"""Context parallelism's four algorithms (train.context_parallel: ring, all_gather, ulysses, usp;
sharding/context_parallel.py) against one device, on 8 fake CPU devices.

Three kinds of evidence: attention + an output projection (loss and gradients of q, k, v, the
projection and the sinks) equal one device's within 1e-5 relative, per algorithm, per mesh
(sequence 8; sequence 4 x tensor 2, with tensor-parallel heads, or for usp the ring over
sequence and Ulysses over tensor), causal, with packed documents, a sliding window, soft-capping
and sinks, in the zigzag layout; a small LM's loss and gradients equal one device's for each
algorithm; and the bytes each sends, read from the compiled HLO, equal the planner's formula
(src/meshwork/perf/planner_context.py). Refusals are one line naming the fix.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, tiny_overrides
from test_sharded_step import Lazy

from meshwork.config import ConfigError, load_config
from meshwork.models.layers.attention_local import local_attention
from meshwork.perf.planner_comm import ring_sent, step_collectives, summarize
from meshwork.perf.planner_context import AttentionShard, cp_collectives
from meshwork.perf.planner_layout import layout_from_config
from meshwork.sharding.hlo import collective_summary
from meshwork.sharding.mesh import make_mesh
from meshwork.sharding.parallel import ParallelContext, current_parallel, use_parallel
from meshwork.sharding.ring_attention import zigzag_permutation
from meshwork.sharding.rules import rules_for

B, L, H, G, K, D = 2, 32, 8, 2, 8, 16
TOL = 1e-5
ALGORITHMS = ("ring", "all_gather", "ulysses", "usp")
USP = {"act_seq": ("sequence", "tensor"), "act_norm_seq": ("sequence", "tensor")}
# Two meshes per algorithm: (mesh sizes, rules preset, rule overrides).
MESHES = {
    "seq8": ({"sequence": 8}, "cp", {}),
    "seq4 x tp2": ({"sequence": 4, "tensor": 2}, "cp+tp", {}),
    "ring4 x ulysses2": ({"sequence": 4, "tensor": 2}, "cp", USP),
    "ring2 x ulysses4": ({"sequence": 2, "tensor": 4}, "cp", USP),
}
MESHES_OF = {a: ("ring4 x ulysses2", "ring2 x ulysses4") if a == "usp" else ("seq8", "seq4 x tp2") for a in ALGORITHMS}
FEATURES = {
    "causal": {},
    "documents": dict(documents=True),
    "window": dict(window=6),
    "softcap+sinks": dict(softcap=5.0, sinks=True),
    "all": dict(documents=True, window=6, softcap=5.0, sinks=True),
}


def rel_err(got, want) -> float:
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    # Four documents of uneven lengths per row, the second row's boundaries elsewhere.
    seg = np.stack([np.repeat([0, 1, 2, 3], [5, 11, 9, 7]), np.repeat([0, 1, 2, 3], [13, 3, 8, 8])]).astype(np.int32)
    return dict(
        q=normal(B, L, H, K),
        k=normal(B, L, G, K),
        v=normal(B, L, G, K),
        w=normal(H, K, D) / 4,
        sinks=normal(H),
        seg=seg,
    )


def attention_loss(impl="xla", window=None, softcap=None):
    """loss(q, k, v, w, sinks, positions, segment ids): attention through the current context, then
    an output projection and a non-linear readout (every element gets its own cotangent)."""

    def loss(q, k, v, w, sinks, pos, seg):
        local = local_attention(impl, q, k, pos, causal=True, scale=None, window=window, softcap=softcap)
        o = current_parallel().attention(
            local,
            q,
            k,
            v,
            pos,
            causal=True,
            scale=None,
            segment_ids_BL=seg,
            window=window,
            softcap=softcap,
            sinks_H=sinks,
        )
        return jnp.sum(jnp.sin(jnp.einsum("BLHK,HKD->BLD", o, w)) * jnp.arange(1, D + 1))

    return loss


def context(algorithm, mesh_name):
    sizes, preset, overrides = MESHES[mesh_name]
    return make_mesh(sizes), ParallelContext(rules_for(preset, overrides), context_parallel=algorithm)


def compare(inputs, algorithm, mesh_name, impl="xla", layout="zigzag", window=None, softcap=None, **features):
    """max relative error of the sharded loss and gradients against one device's."""
    i = inputs
    sinks = i["sinks"] if features.get("sinks") else None
    seg = jnp.asarray(i["seg"]) if features.get("documents") else None
    args = (i["q"], i["k"], i["v"], i["w"], sinks)
    grad = jax.value_and_grad(attention_loss(impl, window, softcap), argnums=(0, 1, 2, 3, 4))
    want = jax.jit(grad)(*args, None, seg)
    mesh, parallel = context(algorithm, mesh_name)
    order = zigzag_permutation(L, mesh.shape["sequence"]) if layout == "zigzag" else np.arange(L)
    pos = jnp.broadcast_to(jnp.asarray(order, jnp.int32), (B, L)) if layout == "zigzag" else None
    permuted = (*(x[:, order] for x in args[:3]), *args[3:], pos, None if seg is None else seg[:, order])
    with jax.set_mesh(mesh), use_parallel(parallel):
        got = jax.jit(lambda *a: grad(*a))(*permuted)  # a fresh function: jit does not key on the context
    back = np.argsort(order)
    errs = [rel_err(got[0], want[0])]
    for n, (g, w) in enumerate(zip(got[1], want[1])):
        if w is not None:
            errs.append(rel_err(g[:, back] if n < 3 else g, w))
    return max(errs)


# --- attention + projection, equal to one device -----------------------------------------------

QUICK = {("all", 0), ("all", 1), ("causal", 0)}


@pytest.mark.parametrize(
    "algorithm, mesh_index, feature",
    [
        pytest.param(a, m, f, marks=[] if (f, m) in QUICK else [pytest.mark.slow], id=f"{a}-{MESHES_OF[a][m]}-{f}")
        for a in ALGORITHMS
        for f in FEATURES
        for m in (0, 1)
    ],
)
def test_attention_equals_one_device(inputs, algorithm, mesh_index, feature, request):
    err = compare(inputs, algorithm, MESHES_OF[algorithm][mesh_index], **FEATURES[feature])
    print(f"{request.node.callspec.id}: max relative error {err:.2e}")
    assert err < TOL


@pytest.mark.parametrize(
    "impl, mesh_name, layout",
    [
        ("pallas", "seq8", "zigzag"),  # the kernel gets the tokens sorted by position
        pytest.param("pallas", "seq4 x tp2", "in order", marks=pytest.mark.slow),  # the trainer's ulysses layout
        pytest.param("reference", "seq4 x tp2", "zigzag", marks=pytest.mark.slow),
    ],
)
def test_ulysses_runs_the_kernels_on_whole_rows(inputs, impl, mesh_name, layout):
    err = compare(inputs, "ulysses", mesh_name, impl=impl, layout=layout, **FEATURES["all"])
    print(f"ulysses {impl} {mesh_name} {layout}: max relative error {err:.2e}")
    assert err < TOL


def test_the_ring_runs_its_own_block_math_whatever_the_impl(inputs):
    """ring with model.attention=pallas: the ring folds blocks by online softmax itself (a kernel
    returns no log-sum-exp to fold), so the impl does not enter; the result is the formula's."""
    assert compare(inputs, "ring", "seq8", impl="pallas", **FEATURES["all"]) < TOL


# --- bytes: compiled HLO == the planner's formula ------------------------------------------------


# Not "ring2 x ulysses4" here: a ring of 2 makes its one-trip loops straight-line code, and XLA then
# reuses the forward's hop for the backward's (the same K/V, one program): one hop less than the
# formula. A train step's scanned layers keep them apart, as the formula counts
# (test_train_step_hlo_bytes_equal_the_planner runs that mesh).
@pytest.mark.parametrize(
    "algorithm, mesh_name",
    [(a, m) for a in ALGORITHMS for m in MESHES_OF[a] if m != "ring2 x ulysses4"],
)
def test_hlo_bytes_equal_the_formula(inputs, algorithm, mesh_name):
    """Forward and backward of one attention call with packed documents (segment ids travel too),
    in the layouts the trainer uses (zigzag; Ulysses in order)."""
    i = inputs
    mesh, parallel = context(algorithm, mesh_name)
    order = np.arange(L) if algorithm == "ulysses" else zigzag_permutation(L, mesh.shape["sequence"])
    pos = None if algorithm == "ulysses" else jnp.broadcast_to(jnp.asarray(order, jnp.int32), (B, L))
    loss = attention_loss()
    grad = jax.grad(lambda q, k, v, seg, pos: loss(q, k, v, i["w"], None, pos, seg), argnums=(0, 1, 2))
    with jax.set_mesh(mesh), use_parallel(parallel):
        hlo = jax.jit(grad).lower(i["q"], i["k"], i["v"], jnp.asarray(i["seg"]), pos).compile().as_text()
        seq_axes, tp = parallel.split("act_seq"), mesh.shape["tensor"] if parallel.split("act_heads") else 1
    # The rest is the projection's: under tensor parallelism its head-split product is all-reduced.
    measured = {k: v["bytes"] for k, v in collective_summary(hlo).items() if v["bytes"] and k != "all-reduce"}
    n = int(np.prod([mesh.shape[a] for a in seq_axes]))
    shard = AttentionShard(B, L // n, H // tp, G // tp, K, 4, segments=True, positions=pos is not None)
    formula: dict[str, float] = {}
    for c in cp_collectives(algorithm, shard, seq_axes, dict(mesh.shape)):
        formula[c.kind] = formula.get(c.kind, 0) + c.count * ring_sent(c.kind, mesh.shape[c.axes[0]], c.payload_bytes)
    print(f"{algorithm} {mesh_name}: HLO {measured}, formula {formula}")
    assert measured == pytest.approx(formula, rel=1e-12)


# --- a small LM's train step ---------------------------------------------------------------------

LM = ["model.n_heads=8", "model.n_kv_heads=2", "model.tie_embeddings=false", "train.loss_chunk=null"]
USP_OVERRIDES = ["rules.overrides.act_seq=[sequence, tensor]", "rules.overrides.act_norm_seq=[sequence, tensor]"]
STEP_MESHES = {
    "seq8": ["mesh.data=1", "mesh.sequence=8", "rules.preset=cp"],
    "seq4 x tp2": ["mesh.data=1", "mesh.sequence=4", "mesh.tensor=2", "rules.preset=cp+tp"],
    "ring4 x ulysses2": [
        "mesh.data=1",
        "mesh.sequence=4",
        "mesh.tensor=2",
        "rules.preset=cp",
        *USP_OVERRIDES,
    ],
    "ring2 x ulysses4": [
        "mesh.data=1",
        "mesh.sequence=2",
        "mesh.tensor=4",
        "rules.preset=cp",
        *USP_OVERRIDES,
    ],
}
STEP_MESHES_OF = {a: tuple(MESHES_OF[a]) for a in ALGORITHMS}
STEP_FEATURES = {
    "causal": [],
    "documents": [],
    "window": ["model.sliding_window=8"],
    "softcap+sinks": ["model.attn_logit_softcap=5.0", "model.attention_sinks=true"],
}


def lm_grads(tmp_path, overrides, n_devices, documents=False, lower_only=False):
    """(loss, gradients, compiled HLO text, config) of the next-token objective on one batch."""
    from meshwork.train.trainer import build_trainer, check_runtime

    cfg = load_config(ROOT / "configs/lm_tiny.yaml", [*tiny_overrides(tmp_path), *LM, *overrides])
    devices = jax.devices()[:n_devices]
    task = check_runtime(cfg, devices)
    trainer = build_trainer(cfg, task, devices)
    rng = np.random.default_rng(1)
    rows = (cfg.train.global_batch, cfg.data.seq_len)
    batch = {k: rng.integers(0, cfg.model.vocab_size, rows).astype(np.int32) for k in ("inputs", "targets")}
    if documents:  # packed documents: the objective reads `segment_ids` from the batch
        batch["segment_ids"] = np.cumsum(rng.random(rows) < 0.15, axis=1).astype(np.int32)
    objective = task.objective(trainer.graphdef)
    with trainer.context():
        state = trainer.init_state()
        shardings = trainer.shardings
        sharded = trainer.to_device(batch)
        f = jax.jit(
            jax.value_and_grad(lambda p, b, x: objective(p, b, x)[0]),
            in_shardings=(shardings.params, shardings.buffers, {k: trainer.batch_sharding for k in sharded}),
            out_shardings=(None, shardings.params),
        )
        compiled = f.lower(state.params, state.buffers, sharded).compile()
        if lower_only:
            return None, None, compiled.as_text(), cfg
        loss, grads = compiled(state.params, state.buffers, sharded)
    return float(loss), jax.device_get(grads), compiled.as_text(), cfg


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return Lazy(
        lambda feature: lm_grads(
            tmp_path_factory.mktemp("ref"), STEP_FEATURES[feature], 1, documents=feature == "documents"
        )
    )


STEP_QUICK = {("ring", 0, "causal"), ("all_gather", 1, "documents"), ("ulysses", 0, "window"), ("usp", 0, "documents")}


@pytest.mark.parametrize(
    "algorithm, mesh_index, feature",
    [
        pytest.param(
            a,
            m,
            f,
            marks=[] if (a, m, f) in STEP_QUICK else [pytest.mark.slow],
            id=f"{a}-{STEP_MESHES_OF[a][m]}-{f}",
        )
        for a in ALGORITHMS
        for m in (0, 1)
        for f in STEP_FEATURES
    ],
)
def test_lm_step_equals_one_device(tmp_path, one_device, algorithm, mesh_index, feature):
    mesh = STEP_MESHES[STEP_MESHES_OF[algorithm][mesh_index]]
    loss, grads, hlo, _ = lm_grads(
        tmp_path,
        [*mesh, *STEP_FEATURES[feature], f"train.context_parallel={algorithm}"],
        8,
        documents=feature == "documents",
    )
    want_loss, want_grads, *_ = one_device[feature]
    errs = [abs(loss - want_loss) / abs(want_loss)]
    errs += [rel_err(g, w) for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads))]
    print(f"LM step {algorithm} {STEP_MESHES_OF[algorithm][mesh_index]} {feature}: max relative error {max(errs):.2e}")
    assert max(errs) < TOL
    kinds = {"ring": "collective-permute", "all_gather": "all-gather", "ulysses": "all-to-all", "usp": "all-to-all"}
    assert collective_summary(hlo)[kinds[algorithm]]["count"] > 0  # the algorithm really ran


@pytest.mark.parametrize(
    "algorithm, mesh_name, remat",
    [
        ("ring", "seq8", "none"),
        ("all_gather", "seq4 x tp2", "none"),
        ("ulysses", "seq8", "none"),
        ("usp", "ring2 x ulysses4", "none"),
        pytest.param("ring", "seq4 x tp2", "full", marks=pytest.mark.slow),
        pytest.param("ring", "seq8", "dots_saveable", marks=pytest.mark.slow),  # the ring's forward is kept
        pytest.param("all_gather", "seq8", "dots_saveable", marks=pytest.mark.slow),
        pytest.param("ulysses", "seq4 x tp2", "full", marks=pytest.mark.slow),
        pytest.param("usp", "ring4 x ulysses2", "dots_saveable", marks=pytest.mark.slow),
    ],
)
def test_train_step_hlo_bytes_equal_the_planner(tmp_path, algorithm, mesh_name, remat):
    """The step's context-parallel collectives (scanned layers, the trainer's layouts) against
    planner_comm.step_collectives for the same config; under a remat policy the backward runs
    the attention's forward again, collectives included."""
    *_, hlo, cfg = lm_grads(
        tmp_path,
        [*STEP_MESHES[mesh_name], f"train.context_parallel={algorithm}", f"train.remat={remat}"],
        8,
        lower_only=True,
    )
    planned = summarize(step_collectives(cfg, layout_from_config(cfg, 8)))
    measured = collective_summary(hlo)
    # Everything but the all-reduces (the gradients' sum, tensor parallelism's), which the cp
    # preset's replicated weights leave as the only other collectives.
    kinds = ("all-gather", "reduce-scatter", "all-to-all", "collective-permute")
    got = {k: measured[k]["bytes"] for k in kinds if measured[k]["bytes"]}
    want = {k: planned[k]["bytes"] for k in kinds if planned[k]["bytes"]}
    print(f"train step {algorithm} {mesh_name} remat={remat}: HLO {got}, planner {want}")
    assert got == pytest.approx(want, rel=1e-9)


# --- inside a pipeline stage --------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_device_4_layers(tmp_path_factory):
    from test_sharded_step import one_step

    return one_step(tmp_path_factory.mktemp("ref4"), ["mesh.data=1", "model.n_layers=4"], 1)


@pytest.mark.parametrize("algorithm", ["ulysses", pytest.param("all_gather", marks=pytest.mark.slow)])
def test_pipeline_stage_step_equals_one_device(tmp_path, one_device_4_layers, algorithm):
    """2 stages x data 2 x sequence 2, 1F1B over 2 microbatches, 3 optimizer steps: each stage
    holds half of every row's tokens; ulysses all-to-alls inside the stage's shard_map (the tokens
    in order, with positions: a stage sees only its shard), all_gather gathers K/V there."""
    from test_sharded_step import assert_same_step, one_step

    pipeline = ["model.n_layers=4", "mesh.stage=2", "mesh.data=2", "mesh.sequence=2", "rules.preset=cp"]
    got = one_step(
        tmp_path, [*pipeline, "train.pipeline=1f1b", "train.microbatches=2", f"train.context_parallel={algorithm}"], 8
    )
    kind = {"ulysses": "all-to-all", "all_gather": "all-gather"}[algorithm]
    assert collective_summary(got[3].step_fn.as_text())[kind]["count"] > 0
    assert_same_step(got, one_device_4_layers)


# --- refusals ------------------------------------------------------------------------------------


def _runtime(tmp_path, *overrides):
    from meshwork.train.trainer import check_runtime

    cfg = load_config(ROOT / "configs/lm_tiny.yaml", [*tiny_overrides(tmp_path), *overrides])
    return check_runtime(cfg, jax.devices()[:8])


@pytest.mark.parametrize(
    "overrides, phrase",
    [
        (["model.n_heads=4", "train.context_parallel=ulysses", *STEP_MESHES["seq8"]], "4 query heads"),
        (
            [
                "model.n_heads=6",
                "model.n_kv_heads=6",
                "model.d_model=48",
                "train.context_parallel=ulysses",
                *STEP_MESHES["seq4 x tp2"],
            ],
            "query heads",
        ),
        (
            ["model.n_heads=12", "model.n_kv_heads=6", "model.d_model=96", "train.context_parallel=ulysses"]
            + ["mesh.data=2", "mesh.sequence=4", "rules.preset=cp"],
            "6 kv heads",
        ),
        (["train.context_parallel=usp", *STEP_MESHES["seq8"]], "usp needs act_seq split over 2"),
        ([*LM, "train.context_parallel=ring", *STEP_MESHES["ring4 x ulysses2"]], "use train.context_parallel=usp"),
        (["train.context_parallel=all_gather", "model.attention=pallas", *STEP_MESHES["seq8"]], "model.attention=xla"),
        (["train.context_parallel=ring", "data.seq_len=40", *STEP_MESHES["seq8"]], "zigzag"),
        (
            [
                "model.n_layers=4",
                "mesh.stage=2",
                "train.pipeline=1f1b",
                "train.microbatches=2",
                "model.attention=pallas",
            ]
            + ["mesh.data=1", "mesh.sequence=4", "rules.preset=cp", "train.context_parallel=ulysses"],
            "inside a pipeline",
        ),
        (
            ["model.n_layers=4", "mesh.stage=2", "train.pipeline=1f1b", "train.microbatches=2", *LM]
            + ["mesh.data=1", "mesh.sequence=2", "mesh.tensor=2", "rules.preset=cp", *USP_OVERRIDES]
            + ["train.context_parallel=usp"],
            "usp inside a pipeline",
        ),
    ],
    ids=[
        "ulysses heads",
        "ulysses heads x tp",
        "ulysses kv heads",
        "usp one axis",
        "two axes",
        "all_gather pallas",
        "seq_len",
        "pipeline pallas",
        "pipeline usp",
    ],
)
def test_impossible_combinations_are_refused_in_one_line(tmp_path, overrides, phrase):
    with pytest.raises(ConfigError) as e:
        _runtime(tmp_path, *overrides)
    msg = str(e.value)
    assert phrase in msg and "\n" not in msg, msg


def test_the_cli_exits_2_with_one_line(tmp_path, capsys):
    from meshwork.train import cli

    args = ["--config", str(ROOT / "configs/lm_tiny.yaml"), *tiny_overrides(tmp_path), *STEP_MESHES["seq8"]]
    assert cli.main([*args, "model.n_heads=4", "train.context_parallel=ulysses", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ulysses" in err, err


def test_refusals_inside_the_algorithms(inputs):
    """What the ParallelContext refuses while tracing, whatever the config said."""
    i = inputs

    def trace(algorithm, impl="xla", q=i["q"], w=i["w"]):
        loss = attention_loss(impl)
        with use_parallel(ParallelContext(rules_for("cp"), context_parallel=algorithm)):
            jax.jit(lambda *a: loss(*a)).trace(q, q[:, :, :G], q[:, :, :G], w, None, None, None)

    with jax.set_mesh(make_mesh({"sequence": 8})):
        with pytest.raises(ValueError, match="model.attention=xla"):  # all_gather masks by position
            trace("all_gather", "pallas")
        with pytest.raises(ValueError, match="act_seq split over 2"):
            trace("usp")
        with pytest.raises(ValueError, match="6 query heads"):
            trace("ulysses", q=jnp.zeros((B, L, 6, K)), w=jnp.zeros((6, K, D)))


def test_planner_search_picks_among_the_algorithms():
    """At 64K tokens on 64 H100s each algorithm has a best layout; the ring hides its hops under the
    attention compute, all_gather and ulysses pay theirs on the critical path."""
    from meshwork.perf.hardware import get_hardware
    from meshwork.perf.planner import search

    cfg = load_config(
        ROOT / "configs/llama7b.yaml", ["data.seq_len=65536", "train.global_batch=64", "model.attention=xla"]
    )
    plans, _ = search(cfg, get_hardware("h100"), 64, 8)
    best = {}
    for p in plans:
        if p.layout.split("act_seq"):
            best.setdefault(p.layout.context_parallel, p)
    assert set(best) == set(ALGORITHMS)
    assert best["ring"].times["ring_attention_hidden"] > 0 and best["ulysses"].times["ring_attention_comm"] == 0
    assert plans[0].layout.split("act_seq")  # at 64K tokens the search chooses context parallelism


def test_docstring_examples():
    import doctest

    import meshwork.perf.planner_context
    import meshwork.sharding.context_parallel

    for module in (meshwork.sharding.context_parallel, meshwork.perf.planner_context):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.attempted and result.failed == 0, module.__name__
