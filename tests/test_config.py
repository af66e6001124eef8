"""Config parsing, includes, overrides, and the one-line errors of the CLI."""

import pathlib
import subprocess

import pydantic
import pytest

from meshwork.config import Config, ConfigError, load_config
from meshwork.config_sections import ModelConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    assert isinstance(load_config(path), Config)


def test_include_and_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text("model: {d_model: 64, n_layers: 3}\ntrain: {steps: 10}\n")
    (tmp_path / "child.yaml").write_text("include: base.yaml\nmodel: {n_layers: 5}\n")
    cfg = load_config(tmp_path / "child.yaml", ["train.steps=7", "rules.preset=fsdp", "checkpoint.async=false"])
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.train.steps) == (64, 5, 7)
    assert cfg.rules.preset == "fsdp" and cfg.checkpoint.async_ is False
    with pytest.raises(ValueError, match="frozen"):  # pydantic's ValidationError
        cfg.train.steps = 3


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.stepz=3", "train.stepz"),
        ("train.steps=abc", "train.steps"),
        ("optimizer.lr=-1", "optimizer.lr"),
        ("model.n_kv_heads=3", "model.n_kv_heads"),
        (
            'model.rope_scaling={"rope_type":"yarm","factor":4}',
            "model.rope_scaling: rope_scaling rope_type 'yarm' is not",
        ),
        ("rules.preset=FSDP!", "rules.preset"),
        ("mesh.stage=2", "train.pipeline"),
        ("train.pipeline=1f1b", "train.pipeline"),
        ("train.pipeline=1f1b mesh.stage=2 model.kind=unet", "train.pipeline"),
        ("train.pipeline=1f1b mesh.stage=2 model.kind=moe model.moe.first_dense_layers=1", "model.moe"),
        ("train.pipeline=1f1b mesh.stage=2 model.kind=moe model.moe.router=noisy", "model.moe.router"),
        ("optimizer.name=muon train.offload.optimizer=true", "optimizer.name"),
        ("optimizer.name=muon model.kind=unet", "optimizer.name"),
        ("run.allow_changes=[optimizer.name]", "run.allow_changes"),
    ],
)
def test_bad_values_name_their_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        load_config(ROOT / "configs/lm_tiny.yaml", override.split())
    assert "\n" not in str(e.value)


def _cli(capsys, *args) -> subprocess.CompletedProcess:
    """`python -m train --config lm_tiny.yaml ARGS`, called in this process (the command line's own
    process, exit status and stderr are checked once, in reliability/test_bad_inputs.py)."""
    from meshwork.train.cli import main

    capsys.readouterr()
    code = main(["--config", str(ROOT / "configs/lm_tiny.yaml"), *args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.stepz=3", "train.stepz"),  # unknown key
        ("train.global_batch=lots", "train.global_batch"),  # wrong type
        ("mesh.data=3", "mesh"),  # 3 devices of 8
        ("train.global_batch=12", "train.global_batch"),  # 12 sequences over data=8
        ("rules.preset=fsdp+zero9", "rules.preset"),  # no such preset
        (
            "data.source=tokens data.train_path=/nonexistent/train.bin data.val_path=/nonexistent/val.bin",
            "data.train_path",
        ),  # missing data file
        ("optimizer.muon.ns_steps=3", "optimizer.muon is set but optimizer.name is adamw"),  # Muon's fields with AdamW
        ("optimizer.name=muon optimizer.muon.ns_steps=0", "optimizer.muon.ns_steps"),  # no iteration
        ("optimizer.name=muon optimizer.muon.ns_steps=-2", "optimizer.muon.ns_steps"),
        (
            "optimizer.name=muon optimizer.muon.newton_schulz=allgather",
            "optimizer.muon.newton_schulz",
        ),  # no such variant
        ("optimizer.name=sgd", "optimizer.name"),  # no such optimizer
    ],
)
def test_cli_bad_input_exits_2_with_one_line_and_touches_nothing(tmp_path, capsys, override, key):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sentinel = {"config.yaml": "previous run's config\n", "metrics.jsonl": '{"step": 1, "loss": 1.0}\n'}
    for name, text in sentinel.items():
        (run_dir / name).write_text(text)
    proc = _cli(capsys, f"run.dir={run_dir}", *override.split())
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(sentinel)
    for name, text in sentinel.items():
        assert (run_dir / name).read_text() == text


def test_dry_run_prints_report_and_writes_nothing(tmp_path, capsys):
    proc = _cli(capsys, f"run.dir={tmp_path / 'run'}", "--dry-run", "rules.preset=fsdp", "mesh.data=2", "mesh.fsdp=4")
    assert proc.returncode == 0, proc.stderr
    assert "per-device temp" in proc.stdout and "all-gather" in proc.stdout
    assert not (tmp_path / "run").exists()


def test_dry_run_json_has_state_bytes_and_collectives(tmp_path, capsys):
    import json

    proc = _cli(
        capsys, f"run.dir={tmp_path / 'run'}", "--dry-run", "--json", "rules.preset=fsdp", "mesh.data=1", "mesh.fsdp=8"
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    state = report["state"]
    assert state["total"] == state["params"] + state["grads"] + state["opt_state"]
    # fp32 Adam under ZeRO-3 on 8 devices: 16 bytes per parameter / 8 per device.
    assert abs(state["total"] / (state["params"] * 4) - 1) < 0.01
    assert report["collectives"]["all-gather"]["count"] > 0 and report["temp_bytes"] > 0


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(n_layers=3, layer_types=["full_attention"] * 2), "has 2 entries for n_layers=3"),
        (dict(n_layers=2, layer_types=["sliding_attention", "full_attention"]), "no model.sliding_window"),
        (
            dict(n_layers=2, kind="moe", layer_types=["linear_attention", "full_attention"]),
            "set model.linear_attention",
        ),
        (
            dict(n_layers=2, layer_types=["linear_attention", "full_attention"], linear_attention={}),
            "built in model.kind moe",
        ),
        (
            dict(n_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=4, mla={}),
            "does not take",
        ),
    ],
)
def test_layer_types_that_cannot_be_built_are_refused(fields, message):
    """model.layer_types (Gemma, gpt-oss, Qwen3-Next patterns): each impossible combination is one error."""
    with pytest.raises(pydantic.ValidationError, match=message):
        ModelConfig(**fields)
