"""The docs' command checker (tools/check_doc_commands.py) reads the pages the way it should:
every shell block of README.md and docs/ is either run or carries a marker with a reason, a
command that sets a mesh axis above 1 says how many devices it simulates, and small mode's caps
are appended overrides, never edits of the text. Pure text, no jax; the commands themselves run
in CI after the suite (`python3 tools/check_doc_commands.py`).
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_doc_commands", ROOT / "tools" / "check_doc_commands.py")
checker = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("check_doc_commands", checker)  # its dataclass looks itself up there
_spec.loader.exec_module(checker)


def shell_blocks():
    return [b for f in checker.doc_files() for b in checker.blocks_of(f) if b.language in checker.SHELL_LANGUAGES]


def test_every_block_runs_or_says_why_not():
    blocks = shell_blocks()
    assert len(blocks) >= 15
    for b in blocks:
        assert b.marker == "" or re.fullmatch(r"skip \(.+\)|exit \d+|output trimmed", b.marker), (b.where, b.marker)
    assert sum(b.skip_reason is None for b in blocks) >= 15


def test_commands_that_need_devices_say_how_many():
    """A command that puts more than one device on a mesh axis carries XLA_FLAGS in its text, so it
    runs as written on a one-device CPU machine."""
    for b in shell_blocks():
        if b.skip_reason:
            continue
        for command in re.split(r"\n(?!\s)", b.text.replace("\\\n", " ")):
            sizes = [int(n) for n in re.findall(r"\bmesh\.\w+=(\d+)", command)]
            if any(n > 1 for n in sizes):
                assert "xla_force_host_platform_device_count" in command, (b.where, command)


def test_small_mode_appends_caps_and_keeps_the_command():
    cap = checker.cap_args
    assert cap(["-m", "train", "--config", "c.yaml", "train.steps=700", "log.sample_every=350"]) == [
        "train.steps=4",
        "log.every=1",
        "log.eval_every=4",
        "log.eval_batches=1",
        "checkpoint.every=4",
        "log.sample_every=null",
    ]
    assert cap(["-m", "train", "--config", "c.yaml", "train.steps=2", "train.stop_after=1"])[0] == "train.steps=2"
    assert cap(["-m", "train", "--config", "c.yaml", "--dry-run"]) == []
    assert cap(["-m", "inference", "lm", "--checkpoint", "r"]) == ["--max-new-tokens", "4"]
    assert cap(["-m", "inference", "diffusion", "--checkpoint", "r"]) == ["--num", "10", "--steps", "2"]
    assert cap(["-m", "train.plan", "--config", "c.yaml"]) == [] and cap(["-c", "print(1)"]) == []


def test_markers_and_console_blocks_are_read(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "\n".join(
            [
                "<!-- doc-check: skip (needs a cluster) -->",
                "```bash",
                "srun x",
                "```",
                "",
                "<!-- doc-check: exit 2 -->",
                "",
                "```console",
                "$ false \\",
                "  --flag",
                "error: one line",
                "```",
                "```python",
                "print(1)",
                "```",
            ]
        )
        + "\n"
    )
    skip, console, python = checker.blocks_of(page)
    assert (skip.skip_reason, skip.line) == ("needs a cluster", 2)
    assert console.expected_exit == 2 and console.skip_reason is None
    assert checker.console_commands(console.text) == [("false \\\n  --flag", ["error: one line"])]
    assert python.language == "python"
