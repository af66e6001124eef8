"""A run dir's config.yaml is a copy: the config saved inside the newest verified checkpoint is what
the run is. Edited, emptied, binary or deleted, config.yaml decides nothing (one warning line) and
the resume is bit-exact with an uninterrupted run; a command that differs from the checkpoint's
config is refused in one line naming the key and both values, exit 2, nothing written.
Only without a verified checkpoint is config.yaml all there is: unreadable, it is refused in one line.

Two runs of the tiny LM are shared by the module (8 steps straight; 4 of 8, then stopped), each
case works on a copy of the stopped one; the CLI's `main` runs in-process.
"""

from __future__ import annotations

import shutil

import pytest
import yaml
from conftest import ROOT, tiny_overrides
from reliability.harness import tree_digest

from meshwork.run.checkpoint import Checkpointer
from meshwork.run.metrics import read_metrics
from meshwork.run.saved_config import differences
from meshwork.train.cli import main

STEPS = ["train.steps=8", "checkpoint.every=4", "log.every=1", "log.eval_every=8"]


def _argv(run_dir, *extra: str) -> list[str]:
    return ["--config", str(ROOT / "configs/lm_tiny.yaml"), *tiny_overrides(run_dir), *STEPS, *extra]


def _losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir) if "loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the uninterrupted run's dir, the dir of the same run stopped after its checkpoint of step 4)."""
    base = tmp_path_factory.mktemp("config_copy")
    straight, stopped = base / "straight", base / "stopped"
    assert main(_argv(straight)) == 0
    assert main(_argv(stopped, "train.stop_after=4")) == 0
    assert len(_losses(straight)) == 8 and len(_losses(stopped)) == 4
    return straight, stopped


def _copy(stopped, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    return run


def _checkpoint_config(run, step: int) -> dict:
    ckpt = Checkpointer(run / "checkpoints", every=1, keep=2, use_async=False)
    try:
        return ckpt.saved_config(step)
    finally:
        ckpt.close()


def _refused(run, capsys, *extra: str) -> str:
    """Runs the command on `run`; asserts exit 2, nothing compiled or written; returns the one stderr line."""
    before = tree_digest(run)
    capsys.readouterr()
    assert main(_argv(run, *extra)) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "parameters" not in out, err  # refused before the compile
    (line,) = err.strip().splitlines()
    assert tree_digest(run) == before  # no config.yaml, metrics, checkpoint or owner.json written
    return line


def test_a_shape_in_config_yaml_and_the_command_is_refused_against_the_checkpoint(runs, tmp_path, capsys):
    run = _copy(runs[1], tmp_path)
    path = run / "config.yaml"
    path.write_text(path.read_text().replace("d_model: 64", "d_model: 128"))
    line = _refused(run, capsys, "model.d_model=128")
    assert line.startswith("error: model.d_model: ") and "model.d_model=64, not 128" in line, line
    assert "(the config saved in its newest checkpoint)" in line and "run.overwrite=true" in line, line


def test_an_optimizer_key_in_config_yaml_needs_allow_changes(runs, tmp_path, capsys):
    run = _copy(runs[1], tmp_path)
    path = run / "config.yaml"
    path.write_text(path.read_text().replace("  lr: 0.003\n", "  lr: 0.01\n"))
    line = _refused(run, capsys, "optimizer.lr=0.01")
    assert line.startswith("error: optimizer.lr: ") and "optimizer.lr=0.003, not 0.01" in line, line
    assert "(the config saved in its newest checkpoint)" in line, line
    assert "use run.allow_changes=[optimizer.lr] to change it" in line, line

    # Named, the change is made from the checkpoint's value, and recorded so.
    assert main(_argv(run, "optimizer.lr=0.01", "run.allow_changes=[optimizer.lr]")) == 0
    out, err = capsys.readouterr()
    assert "changed from step 4: optimizer.lr 0.003 -> 0.01" in out
    assert "optimizer.lr is 0.01 in it, 0.003 in the checkpoint" in err
    (row,) = [yaml.safe_load(ln) for ln in (run / "config_history.jsonl").read_text().splitlines()]
    assert row["step"] == 4 and row["changes"] == {"optimizer.lr": [0.003, 0.01]}


def _edited(path):
    path.write_text(path.read_text().replace("d_model: 64", "d_model: 128"))


@pytest.mark.parametrize(
    "damage, said",
    [
        (_edited, "differs from the checkpoint of step 4: model.d_model is 128 in it, 64 in the checkpoint"),
        (lambda path: path.write_text(""), "is empty"),
        (lambda path: path.write_bytes(bytes(range(256)) * 4), "is not a text file"),
        (lambda path: path.unlink(), "is missing"),
    ],
    ids=["edited", "emptied", "binary", "deleted"],
)
def test_a_damaged_config_yaml_resumes_from_the_checkpoints_config_bit_exact(runs, tmp_path, capsys, damage, said):
    straight, stopped = runs
    run = _copy(stopped, tmp_path)
    damage(run / "config.yaml")
    capsys.readouterr()
    assert main(_argv(run)) == 0
    out, err = capsys.readouterr()
    (line,) = err.strip().splitlines()
    assert line.startswith(f"warning: {run / 'config.yaml'} {said}; the checkpoint's config is the run's"), line
    assert "restoring the checkpoint of step 4" in out
    assert _losses(run) == _losses(straight)  # bit for bit: the JSON floats are the exact values
    assert [r.get("val_loss") for r in read_metrics(run)] == [r.get("val_loss") for r in read_metrics(straight)]
    copy = yaml.safe_load((run / "config.yaml").read_text())  # written again, from this command's config
    assert copy["run"]["dir"] == str(run) and differences(_checkpoint_config(run, 8), copy) == []


def test_an_unreadable_config_yaml_without_a_verified_checkpoint_is_one_line(runs, tmp_path, capsys):
    run = _copy(runs[1], tmp_path)
    (run / "checkpoints" / "4" / "meshwork_manifest.json").unlink()  # committed, never verified
    (run / "config.yaml").write_bytes(bytes(range(256)) * 4)
    line = _refused(run, capsys)
    assert line.startswith(f"error: run.dir: {run / 'config.yaml'} is not a text file, and no checkpoint"), line
    assert "run.overwrite=true" in line, line


@pytest.mark.parametrize(
    "damage, said",
    [
        (_edited, "differs from the checkpoint of step 8: model.d_model is 128 in it, 64 in the checkpoint"),
        (lambda path: path.unlink(), "is missing"),
    ],
    ids=["edited", "deleted"],
)
def test_inference_loads_a_run_with_its_checkpoints_config(runs, tmp_path, capsys, damage, said):
    """`inference lm/serve --checkpoint` read the same truth: the model is built from the checkpoint's
    config whatever config.yaml says (a warning names the difference), and `attention` is the one
    model setting a loader may change, since it changes no weight."""
    from meshwork.inference.runs import load_run

    run = _copy(runs[0], tmp_path)
    damage(run / "config.yaml")
    before = tree_digest(run)
    capsys.readouterr()
    cfg, model, step = load_run(run, attention="pallas")
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == f"warning: {run / 'config.yaml'} {said}; loading with the checkpoint's config"
    assert step == 8 and cfg.model.d_model == 64 and cfg.model.attention == "pallas"
    assert model.blocks.attn.impl == "pallas"
    assert tree_digest(run) == before  # loading wrote nothing
