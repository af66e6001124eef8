"""The planner's optimizer figures (perf/planner_optimizer.py) against what the trainer builds and
XLA compiles, on 8 simulated CPU devices: the optimizer state one device holds (AdamW and Muon)
and, for both Newton-Schulz variants, every byte the compiled step's orthogonalization sends.

Three layouts: fsdp 8 (rows split), data 2 x fsdp 2 x tensor 2 (rows and columns split, copies
over data) and a MoE on fsdp 2 x expert 4 (experts split as a batch, the dense weights copied over
`expert`). Each (layout, variant) step is compiled once and shared by the tests that read it.
"""

import collections

import jax
import pytest
from conftest import ROOT, tiny_overrides

from meshwork.config import Config, load_config
from meshwork.perf.hardware import get_hardware
from meshwork.perf.planner import format_plan, make_layout, plan
from meshwork.perf.planner_comm import step_collectives, summarize
from meshwork.perf.planner_layout import layout_from_config
from meshwork.perf.planner_memory import state_memory
from meshwork.perf.planner_optimizer import COUNTERS, VARIANTS, is_muon_matrix, newton_schulz_cost
from meshwork.perf.planner_weights import model_weights, shard_size
from meshwork.sharding.hlo import list_collectives
from meshwork.sharding.report import state_bytes
from meshwork.train.optimizer_report import NEWTON_SCHULZ_SCOPE
from meshwork.train.trainer import build_trainer, check_runtime

LAYOUTS = {
    "fsdp 8": ("lm_tiny.yaml", ["mesh.data=1", "mesh.fsdp=8", "rules.preset=fsdp"]),
    "data 2 x fsdp 2 x tensor 2": (
        "lm_tiny.yaml",
        ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "rules.preset=fsdp+tp"],
    ),
    "moe fsdp 2 x expert 4": ("moe_tiny.yaml", ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=4", "rules.preset=fsdp+ep"]),
}

# Compiling a step per layout and variant is most of this file's time: the quick tier compares the
# planner with the compiled step on the layout where both variants send the most (the MoE one:
# fsdp and expert axes, gathered and sharded matrices); the slow tier on the other two as well.
COMPILED_LAYOUTS = [
    layout if layout.startswith("moe") else pytest.param(layout, marks=pytest.mark.slow) for layout in LAYOUTS
]


def make_cfg(run_dir, layout: str, optimizer: str):
    config, mesh = LAYOUTS[layout]
    name, _, variant = optimizer.partition(":")
    muon = [f"optimizer.muon.newton_schulz={variant}"] if variant else []
    return load_config(ROOT / "configs" / config, [*tiny_overrides(run_dir), *mesh, f"optimizer.name={name}", *muon])


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    """get(layout, "adamw" | "muon:gather" | "muon:sharded", compiled) -> (cfg, trainer), each built
    (and compiled) once."""
    built, compiled = {}, {}

    def get(layout, optimizer, compile=False):
        key = (layout, optimizer)
        if key not in built:
            cfg = make_cfg(tmp_path_factory.mktemp("run"), layout, optimizer)
            built[key] = (cfg, build_trainer(cfg, check_runtime(cfg)))
        if compile and key not in compiled:
            cfg, trainer = built[key]
            compiled[key] = (cfg, trainer.compile())
        return compiled[key] if compile else built[key]

    return get


def per_group(pairs):
    """{(kind, group size): (total payload bytes, operations)} of (collective, executions) pairs."""
    out = collections.defaultdict(lambda: [0, 0])
    for kind, group, payload, count in pairs:
        out[(kind, group)][0] += payload * count
        out[(kind, group)][1] += count
    return dict(out)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout", COMPILED_LAYOUTS)
def test_newton_schulz_bytes_equal_the_compiled_step(trainers, layout, variant):
    cfg, trainer = trainers(layout, f"muon:{variant}", compile=True)
    compiled = per_group(
        (c.kind, c.group_size, c.payload_bytes, c.multiplier)
        for c in list_collectives(trainer.step_fn.as_text(), NEWTON_SCHULZ_SCOPE)
    )
    cost = newton_schulz_cost(cfg, layout_from_config(cfg, 8))
    planned = per_group((c.kind, c.group, c.payload_bytes, c.count) for c in cost.collectives)
    assert compiled, "the orthogonalization sends something on every one of these layouts"
    assert {k: v[0] for k, v in planned.items()} == {k: v[0] for k, v in compiled.items()}
    for (kind, group), (_, count) in planned.items():
        if kind == "all-reduce":
            # XLA's all-reduce combiner joins some matrices' norm all-reduce with another matrix's
            # Gram all-reduce (independent, same group): fewer operations, the same bytes.
            n_matrices = sum(is_muon_matrix(cfg.optimizer, w) for w in model_weights(cfg.model))
            assert count - n_matrices <= compiled[(kind, group)][1] <= count
        else:
            assert compiled[(kind, group)][1] == count, (kind, group)
    # The planner's step carries the configured variant's bytes, per kind.
    step = summarize([c for c in step_collectives(cfg, layout_from_config(cfg, 8)) if c.optimizer])
    for kind, sent in summarize(list(cost.collectives)).items():
        assert step[kind]["bytes"] == pytest.approx(sent["bytes"], rel=1e-12) and step[kind]["count"] == sent["count"]


@pytest.mark.parametrize("layout", COMPILED_LAYOUTS)
def test_newton_schulz_flops_are_what_the_variants_add(trainers, layout):
    """The two variants' steps differ only in the orthogonalization: XLA's FLOP count of one minus
    the other is the planner's difference of the matrix products, plus their elementwise work."""
    flops = {}
    for variant in VARIANTS:
        cfg, trainer = trainers(layout, f"muon:{variant}", compile=True)
        cost = trainer.step_fn.cost_analysis()
        flops[variant] = (
            (cost[0] if isinstance(cost, list) else cost)["flops"],
            newton_schulz_cost(cfg, layout_from_config(cfg, 8)).flops,
        )
    measured = flops["sharded"][0] - flops["gather"][0]
    planned = flops["sharded"][1] - flops["gather"][1]
    # Measured: 0.7-0.9% apart (the elementwise normalization and sums, the gather's zero padding).
    assert planned == pytest.approx(measured, rel=0.02)


@pytest.mark.parametrize("optimizer", ["adamw", "muon:gather"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_optimizer_state_bytes_equal_the_trainers(trainers, layout, optimizer):
    cfg, trainer = trainers(layout, optimizer)
    real = state_bytes(trainer.abstract.parts(), trainer.shardings.parts(), trainer.grad_shardings)
    got = state_memory(cfg, layout_from_config(cfg, 8))
    for kind in ("params", "grads", "opt_state"):
        assert got[kind] == real[kind], kind  # byte for byte


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_counters_are_the_optax_states(name):
    from meshwork.train.optim import make_optimizer
    from meshwork.train.state import abstract_state

    cfg = load_config(ROOT / "configs/lm_tiny.yaml", [f"optimizer.name={name}", "model.n_layers=1"])
    _, abstract = abstract_state(cfg, make_optimizer(cfg.optimizer, 10)[0])
    scalars = [x for x in jax.tree.leaves(abstract.opt_state) if x.ndim == 0]
    assert len(scalars) == COUNTERS[name] and all(x.dtype == "int32" for x in scalars)


def test_adamw_state_is_two_moments_and_muon_drops_one_for_the_matrices():
    layout = make_layout(data=2, fsdp=4)
    adamw, muon = (Config.model_validate({"optimizer": {"name": n}}) for n in ("adamw", "muon"))
    opt = {w.path: shard_size(w, layout, "opt_state") for w in model_weights(adamw.model)}
    assert state_memory(adamw, layout)["opt_state"] == 8 * sum(opt.values()) + 8  # unchanged for AdamW
    matrices = sum(
        n for path, n in opt.items() if path.split(".")[-1] in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    )
    assert state_memory(muon, layout)["opt_state"] == 8 * sum(opt.values()) - 4 * matrices + 12


def test_plan_shows_both_variants_and_the_cheaper():
    cfg = load_config(ROOT / "configs/llama7b.yaml", ["optimizer.name=muon"])
    p = plan(cfg, make_layout(fsdp=64), get_hardware("h100"))
    ns = p.to_dict()["optimizer"]["newton_schulz"]
    times = {v: ns["variants"][v]["time_s"] for v in VARIANTS}
    assert ns["cheaper"] == min(times, key=times.get) and ns["configured"] == "gather"
    # The optimizer's time is the state's read and write plus the configured variant.
    state = sum(p.memory[k] for k in ("params", "grads", "opt_state"))
    assert p.times["optimizer"] == pytest.approx(2 * state / p.hardware.hbm_bandwidth + times["gather"])
    text = format_plan(p)
    assert "optimizer: muon" in text and all(f"    {v} " in text for v in VARIANTS)
    assert "newton-schulz (gather)" in text  # among the step's collectives


def test_dry_run_prints_compiled_and_planned_newton_schulz(tmp_path, capsys):
    from test_config import _cli

    overrides = [o for o in tiny_overrides(tmp_path / "run") if not o.startswith("run.dir")]
    proc = _cli(
        capsys, f"run.dir={tmp_path / 'run'}", "--dry-run", *overrides, *LAYOUTS["fsdp 8"][1], "optimizer.name=muon"
    )
    assert proc.returncode == 0, proc.stderr
    lines = {
        line.split(" per step, ")[1].split(":")[0]: line.split(": ", 1)[1]
        for line in proc.stdout.splitlines()
        if "newton-schulz (gather) per step" in line
    }
    assert lines["compiled"].startswith("all-to-all 10 x") and lines["planner"].startswith(lines["compiled"])
    assert "newton-schulz (sharded) per step, planner, if newton_schulz=sharded: all-reduce" in proc.stdout
    state = next(line for line in proc.stdout.splitlines() if line.startswith("optimizer muon: state"))
    real, planned = state.split("state ")[1].split(" per device; planner: ")
    assert real == planned


def test_docstring_examples():
    import doctest

    import meshwork.perf.planner_optimizer

    assert doctest.testmod(meshwork.perf.planner_optimizer).failed == 0
