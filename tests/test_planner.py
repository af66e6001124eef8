"""The parallelism planner (src/meshwork/perf/planner*.py, train/plan.py).

Three kinds of evidence: the planner's predictions against what XLA compiled
for the same config on 8 fake CPU devices (state bytes from the shard shapes,
collective bytes from the HLO, FLOPs from cost_analysis); against published
tables (ZeRO, PaLM, Megatron, GPipe); and the search end to end, down to a
chosen layout that trains.
"""

import contextlib
import io
import json
import math

import jax
import pytest
from conftest import ROOT, tiny_overrides

from meshwork.config import dump_config, load_config
from meshwork.perf.flops import matmul_params, param_counts, train_flops_per_token
from meshwork.perf.hardware import Accelerator, get_hardware
from meshwork.perf.planner import PlanOptions, compiled_step_flops, layout_from_config, plan, search, step_flops
from meshwork.perf.planner_comm import CommOptions, algorithm_time, placement, step_collectives, summarize
from meshwork.perf.planner_layout import make_layout
from meshwork.perf.planner_memory import (
    MIXED_PRECISION_ADAM,
    korthikanti_layer_bytes,
    layer_activation_bytes,
    state_memory,
    token_shape,
    zero_memory,
)
from meshwork.perf.planner_weights import model_weights
from meshwork.train import plan as plan_cli

H100 = get_hardware("h100")
# 8 fake CPU devices as one node: what the e2e search test plans for.
CPU8 = Accelerator(
    name="cpu8",
    peak_flops={"fp32": 2e10, "bf16": 2e10},
    hbm_bytes=2e9,
    hbm_bandwidth=2e10,
    intra_node_bandwidth=5e9,
    intra_node_latency=20e-6,
    inter_node_bandwidth=5e9,
    inter_node_latency=20e-6,
    devices_per_node=8,
)
LAYOUTS = {
    "dp": ["rules.preset=dp", "mesh.data=8"],
    "zero1": ["rules.preset=zero1", "mesh.data=8"],
    "zero2": ["rules.preset=zero2", "mesh.data=8"],
    "fsdp": ["rules.preset=fsdp", "mesh.data=1", "mesh.fsdp=8"],
    "tp": ["rules.preset=tp", "mesh.data=4", "mesh.tensor=2"],
}


def tiny_cfg(run_dir, name, *extra):
    """The tiny LM at 8 scanned layers (the stack dominates the embedding and head,
    as in real models) and 512 tokens per device (the optimizer's FLOPs stay small)."""
    return load_config(
        ROOT / "configs/lm_tiny.yaml",
        [
            *tiny_overrides(run_dir),
            "model.n_layers=8",
            "data.seq_len=64",
            "train.global_batch=64",
            *LAYOUTS[name],
            *extra,
        ],
    )


@pytest.fixture(scope="session")
def compiled(tmp_path_factory):
    """name -> (config, what `python -m train --dry-run --json` reports), each compiled once, on first use."""
    from meshwork.train import cli

    cache = {}

    def get(name):
        if name not in cache:
            tmp = tmp_path_factory.mktemp(name)
            cfg = tiny_cfg(tmp, name)
            (tmp / "config.yaml").write_text(dump_config(cfg))
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert cli.main(["--config", str(tmp / "config.yaml"), "--dry-run", "--json"]) == 0
            cache[name] = cfg, json.loads(out.getvalue().strip().splitlines()[-1])
        return cache[name]

    return get


# --- the model's weights ---------------------------------------------------------------


@pytest.mark.parametrize(
    "config, extra",
    [
        ("lm_tiny.yaml", ["model.qkv_bias=true", "model.tie_embeddings=true", "model.qk_norm=true"]),
        (
            "moe_tiny.yaml",
            ["model.moe.n_shared_experts=1", "model.moe.shared_expert_gate=true", "model.moe.router=noisy"],
        ),
    ],
)
def test_weights_mirror_the_model(config, extra):
    from flax import nnx

    from meshwork.train.optim import make_optimizer
    from meshwork.train.state import abstract_state

    cfg = load_config(ROOT / "configs" / config, extra)
    _, abstract = abstract_state(cfg, make_optimizer(cfg.optimizer, 10)[0])
    real = {
        ".".join(map(str, path)): (tuple(v.shape), tuple(v.get_metadata()["out_sharding"]))
        for path, v in nnx.to_flat_state(abstract.params)
    }
    assert {w.path: (w.shape, w.names) for w in model_weights(cfg.model)} == real


# --- against the compiled program --------------------------------------------------------


# zero1 and zero2 compile programs no other test here needs: the slow tier checks them.
@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=[pytest.mark.slow] if name in ("zero1", "zero2") else []) for name in LAYOUTS]
)
def test_state_bytes_match_the_dry_run(compiled, name):
    cfg, report = compiled(name)
    got = state_memory(cfg, layout_from_config(cfg, 8))
    for kind in ("params", "grads", "opt_state"):
        assert got[kind] == report["state"][kind], kind  # exact, byte for byte, for all five layouts


@pytest.mark.parametrize(
    "name, kinds",
    [
        ("dp", ["all-reduce"]),  # the gradients
        ("fsdp", ["all-gather", "reduce-scatter"]),  # weights twice per layer, gradients once
        ("tp", ["all-reduce"]),  # Megatron's per-layer all-reduces + data-parallel grads
        ("zero2", ["all-gather", "reduce-scatter"]),
    ],
)
def test_collective_bytes_match_the_hlo(compiled, name, kinds):
    cfg, report = compiled(name)
    predicted = summarize(step_collectives(cfg, layout_from_config(cfg, 8)))
    measured = report["collectives"]
    # Measured (jax 0.10.2, benchmarks/planner_accuracy.py): within 1e-4 everywhere but fsdp's
    # reduce-scatter, 5.2% above the HLO's (which has a 115 KB all-reduce the planner does not predict).
    for kind in kinds:
        assert predicted[kind]["bytes"] == pytest.approx(measured[kind]["bytes"], rel=0.06), kind
    total = lambda s: sum(v["bytes"] for v in s.values())  # noqa: E731
    assert total(predicted) == pytest.approx(total(measured), rel=0.03)  # measured: at most 1.7%


def test_tp_layer_all_reduces_match_the_hlo(compiled):
    """meshwork's separate q, k, v and gate, up projections: 2 all-reduces forward and
    5 backward per layer, each of one (b, s, h) activation, as XLA compiled them."""
    cfg, report = compiled("tp")
    layers = [c for c in step_collectives(cfg, layout_from_config(cfg, 8)) if c.what.startswith("tp layers")]
    assert sum(c.count for c in layers) == 7 * cfg.model.n_layers
    activation = 64 // 4 * 64 * cfg.model.d_model * 4  # (b/data, s, h) float32
    assert {c.payload_bytes for c in layers} == {activation}


def test_flops_match_cost_analysis(compiled):
    """cost_analysis counts the scanned layer once: compare with the planner's
    FLOPs for one layer plus the optimizer's elementwise work."""
    cfg, report = compiled("dp")
    # Measured (jax 0.10.2): 5.3% below XLA's count, which adds the elementwise work.
    assert compiled_step_flops(cfg, layout_from_config(cfg, 8)) == pytest.approx(report["flops"], rel=0.06)


# --- published tables -----------------------------------------------------------------------


@pytest.mark.parametrize("stage, gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.88)])
def test_zero_paper_table_1(stage, gb):
    """Rajbhandari et al. 2020, Table 1: 7.5B parameters, N_d = 64, K = 12."""
    assert zero_memory(7.5e9, 64, stage) / 1e9 == pytest.approx(gb, abs=0.05)


@pytest.mark.parametrize(
    "stage, preset, kw", [(0, "dp", {}), (1, "zero1", {"zero": 1}), (2, "zero2", {"zero": 2}), (3, "fsdp", {"zero": 3})]
)
def test_per_weight_state_follows_zero(stage, preset, kw):
    """The per-weight shard accounting of a 7B model reproduces ZeRO's closed form."""
    cfg = load_config(ROOT / "configs/llama7b.yaml")
    layout = make_layout(**({"fsdp": 64} if stage == 3 else {"data": 64}), **kw)
    assert layout.preset == preset
    got = state_memory(cfg, layout, MIXED_PRECISION_ADAM)["total"]
    assert got == pytest.approx(zero_memory(param_counts(cfg.model)["total"], 64, stage), rel=0.01)


def test_palm_flops_6n_plus_attention():
    """PaLM (Chowdhery et al. 2022, App. B): 6N + 12 L H Q T per token; the planner reuses it."""
    cfg = load_config(ROOT / "configs/llama7b.yaml")
    m, T = cfg.model, cfg.data.seq_len
    N = matmul_params(m)
    assert N == pytest.approx(6.74e9 - 32000 * 4096, rel=0.01)  # Llama-2-7B minus the input lookup
    assert train_flops_per_token(m, T) == 6 * N + 12 * m.n_layers * m.n_heads * m.resolved_head_dim * T
    tokens = cfg.train.global_batch * T
    assert step_flops(cfg, make_layout(fsdp=64))["model"] == train_flops_per_token(m, T) * tokens
    assert step_flops(cfg, make_layout(fsdp=64, remat="full"))["recompute"] == pytest.approx(
        (train_flops_per_token(m, T) - 6 * m.vocab_size * m.d_model) / 3 * tokens
    )


def test_megatron_two_all_reduces_forward_two_backward():
    """Shoeybi et al. 2019: with fused QKV and fc1 matmuls, each layer all-reduces
    its (b, s, h) activation twice in the forward and twice in the backward pass."""
    cfg = load_config(ROOT / "configs/llama7b.yaml")
    layout = make_layout(data=8, tensor=8, microbatches=4)
    cs = step_collectives(cfg, layout, CommOptions(fused_projections=True))
    count = lambda what: sum(c.count for c in cs if c.what == what)  # noqa: E731
    per_layer = cfg.model.n_layers * layout.microbatches
    assert count("tp layers forward") == 2 * per_layer and count("tp layers backward") == 2 * per_layer
    b, s, h = 1024 // 8 // 4, 4096, 4096
    assert {c.payload_bytes for c in cs if c.what.startswith("tp layers")} == {b * s * h * 2}
    assert all(
        c.group == 8 and placement(c.axes, layout.mesh, 8) == (8, 1) for c in cs if c.what.startswith("tp")
    )  # tensor on one node's neighbours


@pytest.mark.parametrize("P, M", [(4, 4), (4, 16), (8, 8)])
def test_gpipe_bubble(P, M):
    """GPipe (Huang et al. 2019): the idle fraction is (P-1)/(M+P-1), also in the schedule meshwork runs."""
    from meshwork.sharding.pipeline_schedules import idle_fraction, schedule_table

    cfg = load_config(ROOT / "configs/llama7b.yaml")
    p = plan(cfg, make_layout(stage=P, data=64 // P, microbatches=M, schedule="gpipe"), H100)
    t = p.times
    busy = t["compute"] + t["recompute"] + t["activation_comm"]
    assert t["bubble"] / (busy + t["bubble"]) == pytest.approx((P - 1) / (M + P - 1))
    assert idle_fraction(schedule_table("gpipe", P, M)) == pytest.approx((P - 1) / (M + P - 1))


def test_korthikanti_activation_formulas():
    """Korthikanti et al. 2022, Table 2, and the planner's block formula's divisors."""
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    none = korthikanti_layer_bytes(s, b, h, a)
    assert korthikanti_layer_bytes(s, b, h, a, t, sp=True) == pytest.approx(none / t)
    assert korthikanti_layer_bytes(s, b, h, a, t) == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert korthikanti_layer_bytes(s, b, h, a, remat="full") == 2 * s * b * h
    # meshwork's block: tp + sp divides every term by t; tp alone leaves the residual-stream terms.
    cfg = load_config(ROOT / "configs/llama7b.yaml")
    base = token_shape(cfg, make_layout(data=64))
    sp = token_shape(cfg, make_layout(data=8, tensor=8, sequence_parallel=True))
    tp = token_shape(cfg, make_layout(data=8, tensor=8))
    per_token = lambda ts: layer_activation_bytes(cfg.model, ts, 2) / ts.tokens  # noqa: E731
    assert per_token(sp) == pytest.approx(per_token(base) / 8)
    assert per_token(base) / 8 < per_token(tp) < per_token(base)
    full = layer_activation_bytes(cfg.model, base, 2, "full")
    assert full == base.tokens * cfg.model.d_model * 2  # the layer input only


def test_algorithm_costs():
    hw, S = H100, 1e9
    ring = algorithm_time("all-reduce", S, 8, 1, hw, "ring")
    assert ring == pytest.approx(2 * 7 / 8 * S / hw.intra_node_bandwidth + 14 * hw.intra_node_latency)
    assert algorithm_time("all-gather", S, 8, 1, hw, "ring") == pytest.approx(ring / 2)
    # Across 8 nodes of 8: a flat ring crosses the network with all of S, the
    # hierarchical one with S / 8; a tree wins only when latency dominates.
    flat = algorithm_time("all-reduce", S, 8, 8, hw, "ring")
    hier = algorithm_time("all-reduce", S, 8, 8, hw, "hierarchical")
    assert flat == pytest.approx(2 * 63 / 64 * S / hw.inter_node_bandwidth + 126 * hw.inter_node_latency)
    assert hier < flat / 4
    tiny = 1e3
    assert algorithm_time("all-reduce", tiny, 8, 8, hw, "tree") < algorithm_time("all-reduce", tiny, 8, 8, hw, "ring")
    assert algorithm_time("all-reduce", S, 8, 8, hw, "tree") > flat
    assert algorithm_time("all-reduce", tiny, 8, 8, hw, "tree") == pytest.approx(
        2 * tiny / hw.inter_node_bandwidth + 2 * 6 * hw.inter_node_latency
    )


# --- search --------------------------------------------------------------------------------


@pytest.mark.parametrize("config", ["llama7b.yaml", pytest.param("mixtral8x7b.yaml", marks=pytest.mark.slow)])
def test_search_on_64_h100s(config, tmp_path, capsys):
    out = tmp_path / "best.yaml"
    assert (
        plan_cli.main(
            [
                "--config",
                str(ROOT / "configs" / config),
                "--hardware",
                "h100",
                "--devices",
                "64",
                "--nodes",
                "8",
                "--search",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "why:" in text and "best:" in text and "vs " in text, text
    print(text)
    cfg = load_config(out)  # the best layout, as a config `python -m train` accepts
    assert math.prod(cfg.mesh.sizes().values()) == 64
    p = plan(cfg, layout_from_config(cfg, 64), H100, 8)
    assert p.fits and p.memory["total"] <= 0.9 * H100.hbm_bytes
    assert p.layout.describe() in text.split("why:")[0].splitlines()[2]  # ranked first
    assert (cfg.model.kind == "moe") == config.startswith("mixtral")


def test_searched_layout_trains_on_the_cpu_mesh(tmp_path, capsys):
    """The best layout for lm_tiny on the 8 fake devices, written as a config, trains."""
    from meshwork.perf.planner import explain, write_config
    from meshwork.train.loop import train

    cfg = load_config(ROOT / "configs/lm_tiny.yaml", [*tiny_overrides(tmp_path / "run"), "train.steps=2"])
    plans, stats = search(cfg, CPU8, 8, options=PlanOptions())
    assert plans and all(p.fits for p in plans) and stats["fit"] == len(plans)
    assert all(b.step_time >= a.step_time * (1 - 1e-3) for a, b in zip(plans, plans[1:]))
    out = write_config(cfg, plans[0].layout, tmp_path / "best.yaml", explain(plans[0], plans[1:]))
    loaded = load_config(tmp_path / "best.yaml")
    assert loaded == out and math.prod(loaded.mesh.sizes().values()) == 8
    summary = train(loaded, devices=jax.devices()[:8])
    assert summary["last_step"] == 2


@pytest.mark.parametrize(
    "args, phrase",
    [
        (["--hardware", "h900", "--devices", "64"], "unknown accelerator"),
        (["--hardware", "h100", "--devices", "64", "--nodes", "7"], "--nodes 7"),
        (["--hardware", "h100", "--devices", "64", "--config", "nope.yaml"], "config file not found"),
        (["--hardware", "h100", "--devices", "6", "mesh.fsdp=4"], "mesh"),
        (["--hardware", "h100", "--devices", "6"], "does not split"),
    ],
)
def test_bad_input_is_one_line_and_status_2(args, phrase, capsys):
    if "--config" not in args:
        args = ["--config", str(ROOT / "configs/llama7b.yaml"), *args]
    assert plan_cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and phrase in err, err


def test_cli_plans_the_configs_own_layout():
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "train.plan",
            "--config",
            str(ROOT / "configs/llama7b.yaml"),
            "--hardware",
            "h100",
            "--devices",
            "64",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout
    report = json.loads(out)
    assert report["layout"]["mesh"]["fsdp"] == 64 and report["layout"]["preset"] == "fsdp"
    assert set(report["collectives"]) >= {"all-gather", "reduce-scatter"} and 0 < report["mfu"] < 1
    assert report["memory"]["params"] == pytest.approx(
        4 * param_counts(load_config(ROOT / "configs/llama7b.yaml").model)["total"] / 64, rel=0.001
    )


@pytest.mark.parametrize("seq_len, hidden", [(1024, "partly"), (65536, "all")])
def test_ring_attention_hops_hide_under_the_attention_compute(seq_len, hidden):
    """The ring's hops overlap their layer's attention compute (half of PaLM's square, causal):
    at 1K tokens on sequence=8 most of their time is exposed, at 64K all of it is hidden, while
    all_gather and ulysses pay theirs on the critical path at any length."""
    cfg = load_config(ROOT / "configs/llama7b.yaml", [f"data.seq_len={seq_len}", "train.global_batch=64"])
    plans = {cp: plan(cfg, make_layout(fsdp=8, sequence=8, context_parallel=cp), H100, 8) for cp in ("ring", "ulysses")}
    t = plans["ring"].times
    assert 0 < t["ring_attention_hidden"] <= t["ring_attention_comm"]
    assert (t["ring_attention_hidden"] == t["ring_attention_comm"]) == (hidden == "all")
    u = plans["ulysses"].times
    assert u["ring_attention_comm"] == 0 and u["activation_comm"] > 0
    cp = [c for c in plans["ulysses"].collectives if c[0].what.startswith("cp ulysses")]
    assert cp and all(c[0].kind == "all-to-all" and not c[0].overlappable for c in cp)
