"""The docs' command checker (tools/check_doc_commands.py) reads the pages the way it should:
every shell block of README.md and docs/ is either run or carries a marker with a reason, a
command that sets a mesh axis above 1 says how many devices it simulates, and small mode's caps
are appended overrides, never edits of the text, and its `python3` adds the test session's
fast-compile XLA flags. No jax; the commands themselves run
in CI after the suite (`python3 tools/check_doc_commands.py`).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

from compile_flags import FAST_COMPILE_FLAGS

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


def test_small_modes_python3_compiles_as_the_tests_do_unless_the_command_says_otherwise(tmp_path):
    """Every fast-compile flag is added to what the command's own XLA_FLAGS say; a flag it sets keeps its value."""
    checker.install_capping_python(tmp_path)
    show = ["-c", "import os; print(os.environ['XLA_FLAGS'])"]

    def flags_seen(env_flags: str | None) -> list[str]:
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        if env_flags is not None:
            env["XLA_FLAGS"] = env_flags
        out = subprocess.run([str(tmp_path / "python3"), *show], env=env, capture_output=True, text=True, check=True)
        return out.stdout.split()

    assert flags_seen(None) == FAST_COMPILE_FLAGS
    own = ["--xla_force_host_platform_device_count=4", "--xla_backend_optimization_level=3"]
    seen = flags_seen(" ".join(own))
    assert seen[:2] == own and sorted(seen[2:]) == sorted(FAST_COMPILE_FLAGS[1:])


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
