"""What training prints: the start-up block, messages, the end-of-run summary and what to run next.

    say("warning: ...")                       # through tqdm.write: never glued to a progress bar
    for line in startup_lines(trainer, start=None): say(line)
    print("\\n".join(summary_lines(summary, cfg)))

A progress bar is drawn only on a terminal (`interactive()`); in a pipe, a log
file or a Jupyter kernel the step logger prints a line now and then instead
(train/logger.py), so a notebook cell holds a handful of lines, not hundreds of
bar refreshes.
"""

from __future__ import annotations

import shlex
import sys
from typing import Any

from tqdm import tqdm

from meshwork.config import Config


def in_notebook() -> bool:
    """True inside a Jupyter/IPython kernel (a notebook, Colab), where bar refreshes pile up as cell outputs."""
    shell = sys.modules.get("IPython")
    if shell is None or "ipykernel" not in sys.modules:
        return False
    try:
        return shell.get_ipython() is not None and hasattr(shell.get_ipython(), "kernel")
    except Exception:  # an IPython too old or too new to ask: assume a kernel, since ipykernel is loaded
        return True


def interactive() -> bool:
    """Whether a progress bar may be drawn: stderr is a terminal and this is not a notebook kernel."""
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty()) and not in_notebook()


def say(msg: str) -> None:
    """Prints one message on stdout, clearing and redrawing any progress bar around it."""
    tqdm.write(msg, file=sys.stdout)
    sys.stdout.flush()


def _mesh_line(mesh_shape: dict[str, int], preset: str) -> str:
    split = {k: v for k, v in mesh_shape.items() if v > 1} or {"data": 1}
    rest = [k for k in mesh_shape if k not in split]
    return (
        "mesh: "
        + " x ".join(f"{k}={v}" for k, v in split.items())
        + (f" ({', '.join(rest)} = 1)" if rest else "")
        + f"; rules.preset={preset}"
    )


def startup_lines(trainer, model_line: str, *, start: int | None, run_dir: Any) -> list[str]:
    """The block printed before the compile: devices, mesh, model, batch, run dir.

    >>> startup_lines(trainer, "transformer model: 106,816 parameters", start=None, run_dir="runs/x")  # doctest: +SKIP
    ['devices: 8 x cpu (cpu)', 'mesh: data=8 (stage, fsdp, expert, sequence, tensor = 1); rules.preset=dp', ...]
    """
    import jax

    cfg, mesh = trainer.cfg, trainer.mesh
    devices = list(mesh.devices.flat)
    of_all = f" of {jax.device_count()}" if jax.device_count() != len(devices) else ""
    procs = f", {jax.process_count()} processes" if jax.process_count() > 1 else ""
    batch = cfg.train.global_batch
    micro = f" in {cfg.train.microbatches} microbatches" if cfg.train.microbatches > 1 else ""
    if trainer.task.name == "lm":
        per_step = (
            f"batch: {batch} sequences x {cfg.data.seq_len} tokens = {trainer.task.items_per_step():,} "
            f"tokens per step{micro}"
        )
    elif trainer.task.name == "dpo":
        per_step = (
            f"batch: {batch} preference pairs, chosen and rejected rows of {cfg.data.seq_len} tokens = "
            f"{trainer.task.items_per_step():,} tokens per step{micro}"
        )
    elif trainer.task.name == "grpo":
        g = cfg.train.grpo
        per_step = (
            f"batch: {batch // g.group_size} prompts x {g.group_size} completions (rows of {cfg.data.seq_len} tokens) "
            f"per step; a rollout batch every {g.updates_per_rollout} step(s), sampled by the serving engine "
            f"({g.placement}, tensor {g.engine_tensor})"
        )
    else:
        size = cfg.model.unet.sample_size
        per_step = f"batch: {batch} images of {size}x{size} per step{micro}"
    where = "new run" if start is None else f"resuming from step {start}"
    return [
        f"devices: {len(devices)}{of_all} x {devices[0].device_kind} ({devices[0].platform}){procs}",
        _mesh_line(dict(mesh.shape), cfg.rules.preset),
        model_line,
        per_step,
        f"run dir: {run_dir} ({where}; train.steps={cfg.train.steps})",
    ]


def _commands() -> tuple[str, str]:
    """How to call train.plot and inference, spelled as this process was started."""
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    if main is not None and main.name.split(".")[0] == "train":  # `python3 -m train` in a checkout
        return "python3 -m train.plot", "python3 -m inference"
    return "python3 -m meshwork.train.plot", "python3 -m meshwork.inference"


def next_commands(cfg: Config, run_dir: Any, *, last_step: int) -> list[str]:
    """Commands worth running after this run: resume it, plot it, sample from it."""
    plot, infer = _commands()
    d = shlex.quote(str(run_dir))
    out = []
    if cfg.train.stop_after and last_step >= cfg.train.stop_after and last_step < cfg.train.steps:
        out.append("the same command with a larger train.stop_after (or none) resumes from this step")
    elif last_step < cfg.train.steps:
        out.append("the same command again (resumes from the last checkpoint)")
    out.append(f"{plot} {d}   (loss curves -> {run_dir}/loss.png)")
    if cfg.model.kind == "unet":
        out.append(f"{infer} diffusion --checkpoint {d} --out grid.png   (one row per class)")
    elif cfg.data.source == "chat":  # its prompts are conversations: the chat endpoint renders them
        out.append(f"{infer} serve --checkpoint {d}   (OpenAI's /v1/chat/completions on 127.0.0.1:8000)")
    elif cfg.finetune.method != "prefix":
        prompt = {"stdlib": '--prompt "def "', "stdlib_docs": '--prompt "The "', "text": '--prompt "The "'}.get(
            cfg.data.source, "--prompt-ids 1,2,3"
        )
        out.append(f"{infer} lm --checkpoint {d} {prompt}")
    return out


def validation_phrase(summary: dict[str, Any], cfg: Config) -> str:
    """The last validation loss and the step it was really evaluated at (not the last step's, unless it is)."""
    vals, last, resumed = summary.get("val_loss") or {}, summary["last_step"], summary.get("resumed_from")
    cadence = f"log.eval_every={cfg.log.eval_every}"
    if vals:
        at = max(vals)
        phrase = f"validation loss {vals[at]:.4f} at step {at}"
        if at == last:
            return phrase
        if at == 0:
            return f"{phrase}, before training (not evaluated since; {cadence})"
        return f"{phrase} (not evaluated at step {last}; {cadence})"
    if resumed is not None and resumed != last:
        return f"no validation loss since the resume from step {resumed} ({cadence})"
    return ""


def summary_lines(summary: dict[str, Any], cfg: Config, *, hint: bool = True) -> list[str]:
    """The end of a run: where it stopped and why, the last evaluated loss, the time account, what next."""
    last, steps = summary["last_step"], cfg.train.steps
    if summary.get("preempted"):
        how = f"preempted at step {last} of {steps}"
    elif last >= steps:
        how = f"done: step {last} of {steps}"
    else:
        how = f"stopped at step {last} of {steps}" + (
            f" (train.stop_after={cfg.train.stop_after})" if cfg.train.stop_after else ""
        )
    val = validation_phrase(summary, cfg)
    lines = [f"{how}{', ' + val if val else ''}; run dir {summary['run_dir']}"]
    g = summary.get("goodput")
    if g:
        lines.append(
            f"goodput {g['goodput']:.1%} of {g['wall_s']:.1f} s: "
            + ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in g.items() if k.endswith("_s") and k != "wall_s")
        )
    if hint and last > 0:  # step 0 has no checkpoint to plot or sample from
        cmds = next_commands(cfg, summary["run_dir"], last_step=last)
        lines.append("next: " + cmds[0])
        lines += ["      " + c for c in cmds[1:]]
    return lines
