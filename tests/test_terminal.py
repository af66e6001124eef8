"""What training prints: the start-up block before the compile, one bar draw per step on a terminal and
progress lines elsewhere, messages that clear the bar, an honest summary, and next commands that parse."""

import shlex
import sys
import types

import jax
import jax.numpy as jnp
import pytest
from conftest import LM_TINY_STEPS, ROOT

from meshwork.config import load_config
from meshwork.inference.cli import parse_args as inference_args
from meshwork.train import logger as logger_module
from meshwork.train import terminal
from meshwork.train.logger import StepLogger
from meshwork.train.loop import train
from meshwork.train.terminal import say, summary_lines


class _Rows:
    def __init__(self):
        self.rows = []

    def write(self, step, row):
        self.rows.append((step, row))


def _logger(tmp_path, *, steps: int, terminal_like: bool, monkeypatch, **log):
    monkeypatch.setattr(logger_module, "interactive", lambda: terminal_like)
    cfg = load_config(
        ROOT / "configs/lm_tiny.yaml",
        [f"run.dir={tmp_path}", f"train.steps={steps}", "log.progress=true", *[f"log.{k}={v}" for k, v in log.items()]],
    )
    return StepLogger(cfg, _Rows(), 1e9, 256, "tokens", start=0, last=steps, enabled=True, n_devices=1)


def _run_steps(logger, steps, evals=()):
    for step in range(1, steps + 1):
        if step in evals:
            logger.add(step, val_loss=2.5)
        logger.step_dispatched(step, {"loss": jnp.float32(3.0)})
    logger.close()


def test_the_bar_is_drawn_once_per_step_and_messages_clear_it(tmp_path, monkeypatch):
    logger = _logger(tmp_path, steps=12, terminal_like=True, monkeypatch=monkeypatch)
    bar = logger.pbar
    assert not bar.disable
    bar.mininterval, bar.miniters = 0, 0  # draw at every chance, to count the chances
    draws, clears = [], []
    display, clear = bar.display, bar.clear
    monkeypatch.setattr(bar, "display", lambda *a, **k: draws.append(bar.n) or display(*a, **k))
    monkeypatch.setattr(bar, "clear", lambda *a, **k: clears.append(bar.n) or clear(*a, **k))
    for step in range(1, 7):
        logger.step_dispatched(step, {"loss": jnp.float32(3.0)})
    steps_drawn = [n for n in draws]
    assert steps_drawn == list(range(1, 6)), steps_drawn  # step 6 is still pending (read one step late)
    say("preempted: a message")  # through tqdm.write: the bar is cleared first, then drawn again
    assert clears and draws[-1] == 5 and len(draws) == 6
    logger.close()


def test_no_bar_off_a_terminal_only_a_handful_of_lines(tmp_path, monkeypatch, capsys):
    logger = _logger(tmp_path, steps=200, terminal_like=False, monkeypatch=monkeypatch, every=5)
    assert logger.pbar.disable
    _run_steps(logger, 200, evals=(100, 200))
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert err == ""
    assert [line.split(":")[0] for line in lines] == [f"step {s}/200" for s in range(20, 201, 20)], lines
    assert "validation loss 2.5000" in lines[4] and "validation loss" not in lines[3]
    assert "tokens/s" in lines[0] and "eta " in lines[0] and "eta" not in lines[-1]


def test_a_notebook_kernel_gets_no_bar(monkeypatch):
    kernel = types.SimpleNamespace(kernel=object())
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: kernel))
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    monkeypatch.setattr(sys, "stderr", types.SimpleNamespace(isatty=lambda: True, write=lambda s: None))
    assert terminal.in_notebook() and not terminal.interactive()
    monkeypatch.delitem(sys.modules, "ipykernel")
    assert not terminal.in_notebook() and terminal.interactive()


def _summary(**kw):
    return {
        "run_dir": "runs/x",
        "resumed_from": None,
        "val_loss": {},
        "preempted": False,
        "last_step": 600,
        "goodput": None,
        "state": None,
        **kw,
    }


def test_the_summary_reports_the_step_the_loss_was_evaluated_at(tmp_path):
    cfg = load_config(ROOT / "configs/lm_tiny.yaml", [f"run.dir={tmp_path}"])
    # Ctrl-C at step 37: the only evaluation was the untrained model's.
    first = summary_lines(_summary(val_loss={0: 5.5451}, preempted=True, last_step=37), cfg)[0]
    assert first.startswith("preempted at step 37 of 600, validation loss 5.5451 at step 0, before training")
    first = summary_lines(_summary(val_loss={0: 5.5, 100: 2.3456}, preempted=True, last_step=137), cfg)[0]
    assert "validation loss 2.3456 at step 100 (not evaluated at step 137; log.eval_every=100)" in first
    # Resumed at 300, stopped at 350: nothing evaluated in this invocation.
    first = summary_lines(_summary(resumed_from=300, last_step=350, preempted=True), cfg)[0]
    assert "no validation loss since the resume from step 300" in first and "at step 0" not in first
    first = summary_lines(_summary(val_loss={0: 5.5, 600: 1.2345}), cfg)[0]
    assert first == "done: step 600 of 600, validation loss 1.2345 at step 600; run dir runs/x"


@pytest.mark.parametrize("config, command", [("lm_tiny", "lm"), ("unet_digits", "diffusion")])
def test_the_next_commands_parse(config, command, tmp_path, monkeypatch):
    from meshwork.train.plot import main as plot_main

    cfg = load_config(ROOT / f"configs/{config}.yaml", [f"run.dir={tmp_path}"])
    lines = summary_lines(_summary(run_dir=str(tmp_path), last_step=30, preempted=True), cfg)
    assert lines[1] == "next: the same command again (resumes from the last checkpoint)"
    plot, infer = (shlex.split(line.removeprefix("next:").split("   (")[0]) for line in lines[2:4])
    assert plot[:3] == ["python3", "-m", "meshwork.train.plot"] and plot[3] == str(tmp_path)
    assert plot_main(plot[3:]) == 2  # parsed; no metrics.jsonl in this empty run dir
    assert infer[:3] == ["python3", "-m", "meshwork.inference"] and infer[3] == command
    assert inference_args(infer[3:]).checkpoint == str(tmp_path)


def test_a_short_run_prints_the_startup_block_before_the_compile(tmp_path, capsys):
    # lm_tiny_runs["1dev"]'s config (tests/conftest.py), stopped early: its compiled programs come
    # from the session's compilation cache when that run was trained first.
    cfg = load_config(
        ROOT / "configs/lm_tiny.yaml",
        [
            f"run.dir={tmp_path}",
            f"train.steps={LM_TINY_STEPS}",
            "log.eval_every=100",
            "log.progress=false",
            "mesh.data=1",
            "train.stop_after=4",
        ],
    )
    summary = train(cfg, devices=jax.devices()[:1])
    lines = capsys.readouterr().out.splitlines() + summary_lines(summary, cfg)
    assert lines[:8] == [
        "devices: 1 of 8 x cpu (cpu)",
        "mesh: data=1 (stage, fsdp, expert, sequence, tensor = 1); rules.preset=dp",
        "transformer model: 853,120 parameters, 853,120 activated per token",
        "batch: 16 sequences x 128 tokens = 2,048 tokens per step",
        f"run dir: {tmp_path} (new run; train.steps={LM_TINY_STEPS})",
        "compiling the train step...",
        "evaluating step 0 (4 validation batches)...",
        f"step 4/{LM_TINY_STEPS}: " + lines[7].split(": ", 1)[1],
    ], lines
    assert "tokens/s" in lines[7] and "eta" not in lines[7] and "validation" not in lines[7]  # the last step
    assert lines[8] == "saving the checkpoint of step 4..."
    # Stopped by train.stop_after: the only evaluation was the untrained model's, and the summary says so.
    assert lines[9].startswith(f"stopped at step 4 of {LM_TINY_STEPS} (train.stop_after=4), validation loss ")
    assert "at step 0, before training (not evaluated since; log.eval_every=100)" in lines[9]
    assert lines[10].startswith("goodput ")
    assert lines[11] == "next: the same command with a larger train.stop_after (or none) resumes from this step"
    assert lines[12] == f"      python3 -m meshwork.train.plot {tmp_path}   (loss curves -> {tmp_path}/loss.png)"
    assert lines[13] == f'      python3 -m meshwork.inference lm --checkpoint {tmp_path} --prompt "def "'
    assert len(lines) == 14
