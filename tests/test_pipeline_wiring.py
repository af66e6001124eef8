"""Everything around the pipeline executor: the train step hands it the parameters' shardings
(pp + fsdp/zero keep per-device state as the planner says), the interleaved layout and its
config checks, the planner's bubble and stash read from the executor's own schedule tables,
what `--dry-run` prints, and the schedules' figure."""

import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import ROOT, tiny_overrides
from jax.sharding import PartitionSpec

from meshwork.config import ConfigError, load_config
from meshwork.perf.hardware import get_hardware
from meshwork.perf.planner import plan
from meshwork.perf.planner_layout import layout_from_config, make_layout
from meshwork.perf.planner_memory import activation_memory, state_memory
from meshwork.perf.planner_pipeline import compact_table, pipeline_schedule
from meshwork.sharding import pipeline_schedules as pipeline
from meshwork.train import pipeline_step as step_lib
from meshwork.train.trainer import build_trainer, check_runtime

# lm_tiny's model (d 128, 4 layers, 4 heads of 32, 2 kv heads, d_ff 384, vocab 256) on short rows.
LM_TINY = [
    "data.seq_len=32",
    "train.global_batch=8",
    "log.progress=false",
    "log.tensorboard=false",
    "model.tie_embeddings=false",
    "train.pipeline=1f1b",
    "train.microbatches=2",
]
LAYOUTS = {
    "fsdp": ["mesh.stage=2", "mesh.data=1", "mesh.fsdp=4", "rules.preset=fsdp"],
    "zero2": ["mesh.stage=2", "mesh.data=4", "rules.preset=zero2"],
    "zero1": ["mesh.stage=2", "mesh.data=4", "rules.preset=zero1"],
}


def _schedule_loop_carry(hlo: str) -> list[str]:
    """Array types carried by the executor's loop over schedule time steps (the outermost
    while of the shard_map), as per-device shapes such as f32[2,32,4,32]."""
    loops = [line for line in hlo.splitlines() if " while(" in line and re.search(r'shard_map/while"', line)]
    assert len(loops) == 1, [line[:200] for line in loops]
    return re.findall(r"\b([a-z]+\d*\[[\d,]*\])", loops[0].split(" while(")[0])


@pytest.mark.parametrize("layout", ["zero2", *(pytest.param(x, marks=pytest.mark.slow) for x in ("fsdp", "zero1"))])
def test_pp_state_bytes_match_planner_and_accumulators_are_sharded(tmp_path, monkeypatch, layout):
    cfg = load_config(ROOT / "configs/lm_tiny.yaml", [f"run.dir={tmp_path}", *LM_TINY, *LAYOUTS[layout]])
    seen = {}
    real = step_lib.pipeline_value_and_grad

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(step_lib, "pipeline_value_and_grad", spy)
    trainer = build_trainer(cfg, check_runtime(cfg, jax.devices()), jax.devices()).compile()
    state = trainer.init_state()
    on_device = {
        k: sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(getattr(state, k)))
        for k in ("params", "opt_state")
    }
    want = state_memory(cfg, layout_from_config(cfg, 8))
    assert on_device == {"params": want["params"], "opt_state": want["opt_state"]}

    # The step gave the executor the weights' layout: stage first, then the rules' own split.
    wq_spec = seen["stage_specs"]["run0"]["attn"]["wq"].get_value()
    embed_axis = "fsdp" if layout == "fsdp" else None
    assert wq_spec == PartitionSpec("stage", None, embed_axis, None, None)
    assert seen["head_specs"]["head"]["lm_head"].get_value() == PartitionSpec(embed_axis, None)
    # ...and the float32 accumulators it carries through the schedule hold this device's piece:
    # wq is (L/P, D, H, K) = (2, 128, 4, 32) per stage, D split 4 ways under fsdp.
    carry = _schedule_loop_carry(trainer.step_fn.as_text())
    if layout == "fsdp":
        assert "f32[2,32,4,32]" in carry and "f32[32,256]" in carry  # wq and lm_head accumulators
        assert "f32[2,128,4,32]" not in carry and "f32[128,256]" not in carry
    else:  # zero1/zero2 replicate the weights over data: so are their accumulators
        assert "f32[2,128,4,32]" in carry


@pytest.fixture(scope="module")
def reference_4_layers(tmp_path_factory):
    from test_sharded_step import one_step

    return one_step(tmp_path_factory.mktemp("ref4"), ["mesh.data=1", "model.n_layers=4"], 1)


@pytest.mark.over_budget("a pipelined fsdp step and its 1-device reference compiled: ~14-17 s cold", seconds=40)
def test_pp_fsdp_step_equals_single_device(tmp_path, reference_4_layers):
    from test_sharded_step import assert_same_step, one_step

    got = one_step(tmp_path, ["model.n_layers=4", *LAYOUTS["fsdp"], "train.pipeline=1f1b", "train.microbatches=2"], 8)
    wq = got[2].params["blocks"]["attn"]["wq"]
    assert tuple(wq.sharding.spec)[:2] == ("stage", "fsdp")
    assert_same_step(got, reference_4_layers)


@pytest.mark.parametrize("kind, v", [("interleaved", 2), ("zb-h1", 1)])
def test_newer_schedules_step_equals_single_device(tmp_path, reference_4_layers, kind, v):
    from test_sharded_step import assert_same_step, one_step

    # interleaved: 2 stages x 2 chunks of one layer each; data axes summed once after the schedule.
    got = one_step(
        tmp_path,
        [
            "model.n_layers=4",
            "mesh.stage=2",
            "mesh.data=4",
            f"train.pipeline={kind}",
            f"train.virtual_stages={v}",
            "train.microbatches=2",
        ],
        8,
    )
    assert_same_step(got, reference_4_layers)


@pytest.mark.parametrize(
    "kind, v, layout",
    [
        ("1f1b", 1, ["rules.preset=cp", "mesh.data=2", "mesh.sequence=2"]),
        pytest.param(
            "interleaved",
            2,
            ["rules.preset=cp+tp", "mesh.data=1", "mesh.sequence=2", "mesh.tensor=2"],
            marks=pytest.mark.slow,
        ),
    ],
)
def test_context_parallelism_inside_a_pipeline_step_equals_single_device(tmp_path, reference_4_layers, kind, v, layout):
    """Each stage holds half of every row's tokens (zigzag order) and all-gathers the keys and values."""
    from test_sharded_step import assert_same_step, one_step

    got = one_step(
        tmp_path,
        [
            "model.n_layers=4",
            "mesh.stage=2",
            *layout,
            f"train.pipeline={kind}",
            f"train.virtual_stages={v}",
            "train.microbatches=2",
        ],
        8,
    )
    assert_same_step(got, reference_4_layers)


def test_stage_layout_puts_chunk_c_times_p_plus_s_on_stage_s():
    L, P, v = 8, 2, 2
    blocks = {"w": np.arange(L)}
    stages = step_lib.stage_layout(blocks, P, v)["w"]  # (P, v, L/(P v))
    for s in range(P):
        for c in range(v):
            chunk = c * P + s
            assert stages[s, c].tolist() == list(range(chunk * L // (P * v), (chunk + 1) * L // (P * v)))
    # The gradients go back to model order through the layout's transpose (the step's vjp).
    _, back = jax.vjp(lambda b: step_lib.stage_layout(b, P, v), {"w": np.arange(L, dtype=np.float32)})
    assert back({"w": stages.astype(np.float32)})[0]["w"].tolist() == list(range(L))
    assert step_lib.stage_layout(blocks, 4)["w"].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.virtual_stages=2 train.pipeline=1f1b mesh.stage=2 train.microbatches=2", "train.virtual_stages"),
        ("train.virtual_stages=2 train.pipeline=interleaved mesh.stage=4 train.microbatches=4", "model.n_layers"),
        ("train.virtual_stages=2 train.pipeline=interleaved mesh.stage=2 train.microbatches=1", "train.microbatches"),
        ("train.virtual_stages=0", "train.virtual_stages"),
    ],
)
def test_interleaved_config_errors_name_their_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        load_config(ROOT / "configs/lm_tiny.yaml", override.split())
    assert "\n" not in str(e.value)


def test_interleaved_config_is_accepted():
    cfg = load_config(
        ROOT / "configs/lm_tiny.yaml",
        ["train.pipeline=interleaved", "train.virtual_stages=2", "mesh.stage=2", "train.microbatches=4"],
    )
    assert cfg.train.virtual_stages == 2 and layout_from_config(cfg, 8).virtual_stages == 2


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("M", [4, 8, 16])
def test_planner_bubble_and_stash_come_from_the_schedule_table(kind, M):
    P = 4
    cfg = load_config(ROOT / "configs/llama7b.yaml")
    layout = make_layout(stage=P, data=64 // P, microbatches=M, schedule=kind)
    sched = pipeline_schedule(layout)
    table = pipeline.schedule_table(kind, P, M)
    assert sched.idle == pipeline.idle_fraction(table) == pytest.approx((P - 1) / (M + P - 1))
    assert sched.stash == pipeline.stash_size(table) == (M if kind == "gpipe" else min(P, M))
    t = plan(cfg, layout, get_hardware("h100")).times
    busy = t["compute"] + t["recompute"] + t["activation_comm"]
    assert t["bubble"] / (busy + t["bubble"]) == pytest.approx((P - 1) / (M + P - 1))
    # The stash the planner charges: that many stage inputs (and cotangents), (b, s, d_model) each.
    gpipe = make_layout(stage=P, data=64 // P, microbatches=M, schedule="gpipe")
    one_input = activation_memory(cfg, gpipe)["pipeline_stash"] / M
    mem = activation_memory(cfg, layout)
    assert mem["pipeline_stash"] == pytest.approx(one_input * sched.stash)
    assert mem["pipeline_cotangents"] == pytest.approx(one_input * pipeline.cotangent_stash_size(table))


def test_planner_charges_newer_schedules_their_table_s_bubble():
    cfg = load_config(ROOT / "configs/llama7b.yaml")
    bubbles = {}
    for kind, v in (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)):
        layout = make_layout(stage=4, data=16, microbatches=8, schedule=kind, virtual_stages=v)
        idle = pipeline.idle_fraction(pipeline.schedule_table(kind, 4, 8, virtual_stages=v))
        t = plan(cfg, layout, get_hardware("h100")).times
        busy = t["compute"] + t["recompute"] + t["activation_comm"]
        assert t["bubble"] / (busy + t["bubble"]) == pytest.approx(idle)
        bubbles[kind] = t["bubble"]
    assert bubbles["zb-h1"] < bubbles["interleaved"] < bubbles["1f1b"]


def test_compact_table_keeps_both_ends():
    table = pipeline.schedule_table("1f1b", 4, 64)
    text = compact_table(table, max_steps=20)
    lines = text.splitlines()
    assert len(lines) == 4 and all("..." in line for line in lines)
    full = str(table).splitlines()
    assert all(f.split()[2] == c.split()[2] and f.split()[-1] == c.split()[-1] for f, c in zip(full, lines))
    assert compact_table(pipeline.schedule_table("1f1b", 4, 4)) == str(pipeline.schedule_table("1f1b", 4, 4))


@pytest.mark.slow  # a whole --dry-run compile; test_config.py runs a plain one in the quick tier
def test_dry_run_prints_the_schedule_table(tmp_path, capsys):
    from test_config import _cli

    proc = _cli(
        capsys,
        f"run.dir={tmp_path / 'run'}",
        "--dry-run",
        *tiny_overrides(tmp_path / "run")[1:],
        "mesh.stage=2",
        "mesh.data=4",
        "train.pipeline=1f1b",
        "train.microbatches=2",
    )
    assert proc.returncode == 0, proc.stderr
    table = str(pipeline.schedule_table("1f1b", 2, 2))
    assert table in proc.stdout, proc.stdout
    idle = pipeline.idle_fraction(pipeline.schedule_table("1f1b", 2, 2))
    assert f"pipeline idle fraction: {idle:.4f}" in proc.stdout and idle == pytest.approx(1 / 3)


def test_schedule_figure_script(tmp_path):
    out = tmp_path / "schedules.png"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/pipeline_schedules.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert 0 < out.stat().st_size < 200 * 1024
    assert "| gpipe | 4 | 8 | 22 | 27.3% | 27.3% | 8 |" in proc.stdout
    assert "| 1f1b | 4 | 8 | 22 | 27.3% | 27.3% | 4 | 1 |" in proc.stdout


@pytest.mark.parametrize("kind", ["1f1b", "interleaved"])
def test_planner_pipeline_collectives_match_the_compiled_step(tmp_path, kind):
    """Stage 2 x data 4: gradients summed over data once after the schedule, one send each way per
    table step, and under interleaving the blocks' all-to-all into chunk order and back."""
    from meshwork.perf.planner_comm import CommOptions, step_collectives, summarize

    cfg = load_config(
        ROOT / "configs/lm_tiny.yaml",
        [
            f"run.dir={tmp_path}",
            "data.seq_len=32",
            "train.global_batch=16",
            "log.progress=false",
            "log.tensorboard=false",
            "mesh.stage=2",
            "mesh.data=4",
            f"train.pipeline={kind}",
            "train.microbatches=4",
            f"train.virtual_stages={2 if kind == 'interleaved' else 1}",
        ],
    )
    trainer = build_trainer(cfg, check_runtime(cfg, jax.devices()), jax.devices()).compile()
    got = trainer.report_dict()["collectives"]
    want = summarize(step_collectives(cfg, layout_from_config(cfg, 8), CommOptions()))
    assert got["collective-permute"]["count"] == want["collective-permute"]["count"]
    for k in ("all-reduce", "all-to-all", "collective-permute"):
        assert got[k]["bytes"] == pytest.approx(want[k]["bytes"], rel=0.05, abs=1), k
