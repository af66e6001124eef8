"""Graph insight (sharding/graph_report.py): ops vs kernels, fusion savings, the
operator-class FLOPs against cost_analysis, the eager-vs-graph benchmark and
`python -m train --dry-run --graph`, on lm_tiny at the suite's tiny shape."""

from __future__ import annotations

import pytest
from conftest import ROOT, XLA_EMITTERS, tiny_overrides, xla_options_override


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from meshwork.config import load_config
    from meshwork.sharding.graph_report import graph_report
    from meshwork.train.cli import step_jaxpr
    from meshwork.train.trainer import build_trainer, check_runtime

    # XLA's own fusion emitters (the session turns them off for compile speed): the counts are what
    # a user's compile gives.
    cfg = load_config(
        ROOT / "configs/lm_tiny.yaml",
        [*tiny_overrides(tmp_path_factory.mktemp("graph")), xla_options_override(XLA_EMITTERS)],
    )
    trainer = build_trainer(cfg, check_runtime(cfg)).compile()  # 8 devices, dp
    return graph_report(trainer.step_fn, step_jaxpr(trainer))


def test_kernels_far_fewer_than_jaxpr_ops(report):
    # Measured (jax 0.10.2, 8 CPU devices, dp; benchmarks/graph_counts.py, 2026-12-02, after the NaN
    # guard became a lax.cond): 814 jaxpr ops vs 309 HLO kernels (1337 HLO ops inside 278 fusions);
    # per step 1009 vs 451. At lm_tiny's own shape (docs/graph-insight.md's dry-run): 814 vs 309.
    # The counts are asserted within 5%: a different jax may fuse a little differently, a broken
    # fusion pass or a lost op shows.
    h, jaxpr = report["hlo"], report["jaxpr"]
    assert jaxpr["ops"] == pytest.approx(814, rel=0.05) and h["kernels"] == pytest.approx(309, rel=0.05), (jaxpr, h)
    assert jaxpr["per_step"] == pytest.approx(1009, rel=0.05) and h["kernels_per_step"] == pytest.approx(451, rel=0.05)
    assert h["fusions"] == pytest.approx(278, rel=0.05) and h["fused_ops"] == pytest.approx(1337, rel=0.05)
    assert h["kernels"] < jaxpr["ops"] / 2


def test_fusion_saves_the_measured_share_of_bytes(report):
    # Measured: fusion saves 62.4% of the unfused bytes at this shape; 49.4% at lm_tiny's own shape
    # (docs/graph-insight.md's "49%"; benchmarks/graph_counts.py prints both).
    h = report["hlo"]
    assert h["saved_bytes"] / h["unfused_bytes"] == pytest.approx(0.624, abs=0.05)


def test_fusion_saves_bytes_and_every_fusion_moves_at_most_its_ops_bytes(report):
    assert report["hlo"]["saved_bytes"] > 0
    assert report["hlo"]["saved_bytes"] == report["hlo"]["unfused_bytes"] - report["hlo"]["kernel_bytes"]
    for f in report["fusions"]:
        assert f["bytes"] <= f["unfused_bytes"], f
    assert all(f["saved_bytes"] > 0 and f["ops"] for f in report["largest_fusions"])


def test_class_flops_match_cost_analysis(report):
    # cost_analysis() counts a while (scan) body once, so the comparison uses the same
    # convention on our side (`flops_once_per_body`, loop multipliers left out), and
    # XLA's transcendentals, which it keeps apart from flops, are added back (we count
    # them as one FLOP per element). Measured: 1.4814e7 vs 1.4885e7 (0.5% apart).
    cost = report["cost_analysis"]
    assert report["hlo"]["flops_once_per_body"] == pytest.approx(cost["flops"] + cost["transcendentals"], rel=0.05)
    # The per-step class table sums to the per-step total, and the matmuls carry most of it.
    classes = report["classes"]
    assert sum(r["flops"] for r in classes.values()) == pytest.approx(report["hlo"]["flops"], rel=1e-9)
    assert classes["matmul"]["flops"] > classes["elementwise"]["flops"]
    assert classes["matmul"]["intensity_unfused"] > classes["elementwise"]["intensity_unfused"]
    assert classes["collective"]["kernels"] >= 1  # dp: the gradient all-reduces


@pytest.mark.slow
def test_eager_vs_graph_benchmark_runs(capsys):
    from benchmarks.eager_vs_graph import main

    # One layer and square shapes: fewer distinct ops to compile one by one in eager mode.
    result = main(["--tiny", "--steps", "1", "model.n_layers=1", "model.n_kv_heads=4", "model.d_ff=64"])
    out = capsys.readouterr().out
    assert "ratio eager/graph: time" in out and "launches" in out
    assert result["eager_dispatches"] > result["graph_kernels_per_step"]


def test_cli_dry_run_graph(tmp_path, capsys):
    from meshwork.train.cli import main

    assert (
        main(["--config", str(ROOT / "configs/lm_tiny.yaml"), "--dry-run", "--graph", *tiny_overrides(tmp_path)]) == 0
    )
    out = capsys.readouterr().out
    for section in ("== ops vs kernels", "== fusion: bytes", "== operator classes", "== collectives in the schedule"):
        assert section in out
    assert "all-reduce" in out
