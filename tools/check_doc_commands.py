"""Runs every fenced shell command of README.md and docs/*.md as written, so none can rot.

    python3 tools/check_doc_commands.py            # small mode: training capped at a few steps
    python3 tools/check_doc_commands.py --list     # the blocks, their markers, nothing run
    python3 tools/check_doc_commands.py --full     # no caps: the commands exactly as a reader runs them
    python3 tools/check_doc_commands.py docs/moe.md --keep   # one page; keep the working folder

What runs: every fenced block whose language is `bash`, `sh`, `shell` or `console`, in document
order, README.md first, then docs/*.md by name (later pages may use the run dirs earlier ones
made, as a reader following the README would). A `bash` block runs as one bash script
(`set -eo pipefail`). In a `console` block the lines starting with `$ ` are the commands and
the other lines are their expected output: each expected line must appear in what the command
printed (unless the block is marked `output trimmed`). `python` blocks are not shell commands
and are not run.

A block is marked by an HTML comment on the line before its fence (blank lines between are
allowed); the marker says why, in the page itself, so nothing is skipped silently:

    <!-- doc-check: skip (REASON) -->   not run: e.g. `pip install`, or commands for a cluster
    <!-- doc-check: exit N -->          the command must exit with status N (default 0)
    <!-- doc-check: output trimmed -->  console output shown only in part: not compared

Where: a fresh temporary folder that links to every top-level entry of the repository (not
`runs/`), so relative run dirs (`runs/lm_tiny`) and files a block writes land there and the
checkout is untouched. `XLA_FLAGS` is removed from the environment: a command that needs N
simulated devices must say so in its own text.

Small mode (the default) caps the work without editing the text: `python3` is a script first on
PATH that appends overrides to what the command already says (the last override wins):
`python3 -m train ...` gets `train.steps=4` (or fewer if asked) with evaluation and checkpoints
at that step, `python3 -m inference lm ...` gets `--max-new-tokens 4`, and
`python3 -m inference diffusion ...` gets `--num 10 --steps 2`. A `--dry-run` is not capped.
Every `python3` of small mode compiles as the test session does, for compile speed
(tests/compile_flags.py's XLA flags, each unless the command's own `XLA_FLAGS` sets it): the
commands compile far more than they run, and the flags change how fast a program runs, not what it
computes. Small mode also points `JAX_COMPILATION_CACHE_DIR` at the working folder, so blocks that
compile the same program compile it once.

Exit status 0 when every block passed, 1 otherwise, with the file, line, command, exit status and
the tail of the output of each failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
TRAIN_STEPS = 4
_FENCE = re.compile(r"^(\s*)(```|~~~)\s*([\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*doc-check:\s*(.*?)\s*-->\s*$")
_NOT_BLOCKS = ("runs", ".git", "__pycache__", ".pytest_cache")


@dataclasses.dataclass
class Block:
    path: pathlib.Path
    line: int  # of the opening fence
    language: str
    text: str
    marker: str = ""

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def skip_reason(self) -> str | None:
        m = re.match(r"skip\b\s*(.*)", self.marker)
        return (m.group(1).strip("() ") or "no reason given") if m else None

    @property
    def expected_exit(self) -> int:
        m = re.match(r"exit\s+(\d+)", self.marker)
        return int(m.group(1)) if m else 0


def blocks_of(path: pathlib.Path) -> list[Block]:
    """The fenced blocks of one Markdown file, with the marker on the line before each."""
    out, lines = [], path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, fence, language = i, m.group(2), m.group(3).lower()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        marker, k = "", start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        if k >= 0 and (mm := _MARKER.match(lines[k])):
            marker = mm.group(1)
        out.append(Block(path, start + 1, language, "\n".join(lines[start + 1 : j]) + "\n", marker))
        i = j + 1
    return out


def doc_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def cap_args(args: list[str]) -> list[str]:
    """The overrides small mode appends to one `python3 ARGS...` call."""
    if len(args) < 2 or args[0] != "-m":
        return []
    module, rest = args[1], args[2:]
    if module in ("train", "meshwork.train") and "--dry-run" not in rest:
        given = [int(a.split("=", 1)[1]) for a in rest if re.fullmatch(r"train\.steps=\d+", a)]
        steps = min([TRAIN_STEPS, *given])
        extra = [
            f"train.steps={steps}",
            "log.every=1",
            f"log.eval_every={steps}",
            "log.eval_batches=1",
            f"checkpoint.every={steps}",
        ]
        if any(a.startswith("train.stop_after=") for a in rest):
            extra.append(f"train.stop_after={max(1, steps // 2)}")
        if any(a.startswith("log.sample_every=") for a in rest):
            extra.append("log.sample_every=null")
        return extra
    if module in ("inference", "meshwork.inference") and rest[:1] == ["lm"]:
        return ["--max-new-tokens", "4"]
    if module in ("inference", "meshwork.inference") and rest[:1] == ["diffusion"]:
        return ["--num", "10", "--steps", "2"]
    return []


def _prelude(capped: bool) -> str:
    return "set -eo pipefail\n"


def install_capping_python(bin_dir: pathlib.Path) -> None:
    """Writes `bin_dir/python3`, a script that appends small mode's caps, adds the test session's
    fast-compile XLA flags (tests/compile_flags.py) and then `exec`s the real python3; with
    `bin_dir` first on PATH every block's `python3` is it. A script rather than a shell function, so that `python3 ... &` puts the server itself behind `$!`, and a block's
    SIGTERM reaches the process it started."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    real, me = shutil.which("python3") or sys.executable, pathlib.Path(__file__).resolve()
    wrapper = bin_dir / "python3"
    # The command's own XLA_FLAGS plus each fast-compile flag it does not set (compile_flags.with_flags).
    flags = ROOT / "tests" / "compile_flags.py"
    wrapper.write_text(
        f'#!/usr/bin/env bash\nextra=$("{real}" "{me}" --cap-args "$@") || exit 2\n'
        f'XLA_FLAGS="$("{real}" "{flags}" ${{XLA_FLAGS:-}})" || exit 2\nexport XLA_FLAGS\n'
        f'exec "{real}" "$@" $extra\n'
    )
    wrapper.chmod(0o755)


def console_commands(text: str) -> list[tuple[str, list[str]]]:
    """(command, expected output lines) for each `$ ` line of a console block."""
    out: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif out and out[-1][0].endswith("\\"):
            out[-1] = (out[-1][0] + "\n" + line, out[-1][1])
        elif out:
            out[-1][1].append(line)
    return out


def run_script(script: str, workdir: pathlib.Path, env: dict, timeout: int) -> tuple[int, str]:
    try:
        p = subprocess.run(
            ["bash", "-c", script],
            cwd=workdir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
        return p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        return 124, (e.stdout or b"").decode(errors="replace") + f"\n[timed out after {timeout} s]"


def check_block(block: Block, workdir: pathlib.Path, env: dict, capped: bool, timeout: int) -> list[str]:
    """Problems of one block (empty when it passed)."""
    prelude = _prelude(capped)
    if block.language != "console":
        code, output = run_script(prelude + block.text, workdir, env, timeout)
        if code != block.expected_exit:
            return [f"exit status {code}, expected {block.expected_exit}\n{_tail(output)}"]
        return []
    problems = []
    for command, expected in console_commands(block.text):
        code, output = run_script(prelude + command + "\n", workdir, env, timeout)
        if code != block.expected_exit:
            problems.append(f"$ {command}\nexit status {code}, expected {block.expected_exit}\n{_tail(output)}")
            continue
        if "output trimmed" in block.marker:
            continue
        printed = {line.strip() for line in output.splitlines()}
        for want in filter(str.strip, expected):
            if want.strip() not in printed:
                problems.append(
                    f"$ {command}\ndid not print the line the doc shows:\n  {want.strip()}\n"
                    f"it printed:\n{_tail(output)}"
                )
    return problems


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines()[-lines:])


def make_workdir(keep: bool) -> pathlib.Path:
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="doc_commands_"))
    for entry in ROOT.iterdir():
        if entry.name not in _NOT_BLOCKS:
            (workdir / entry.name).symlink_to(entry)
    return workdir


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--cap-args"]:  # called by small mode's python3 script
        print(" ".join(cap_args(argv[1:])))
        return 0
    p = argparse.ArgumentParser(prog="python3 tools/check_doc_commands.py", description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="*", type=pathlib.Path, help="Markdown files (default: README.md, docs/*.md)")
    p.add_argument("--full", action="store_true", help="run the commands without the step caps")
    p.add_argument("--list", action="store_true", help="print the blocks and their markers; run nothing")
    p.add_argument("--keep", action="store_true", help="keep the temporary working folder")
    p.add_argument("--timeout", type=int, default=900, help="seconds per block (default 900)")
    args = p.parse_args(argv)
    files = [f.resolve() for f in args.files] or doc_files()
    blocks = [b for f in files for b in blocks_of(f) if b.language in SHELL_LANGUAGES]
    if args.list:
        for b in blocks:
            tag = f"skip: {b.skip_reason}" if b.skip_reason else (b.marker or "run")
            print(f"{b.where:28} {b.language:8} [{tag}] {b.text.strip().splitlines()[0][:90]}")
        return 0

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    workdir = make_workdir(args.keep)
    if not args.full:  # blocks that compile the same step share one compile (a cache, not a change)
        env.setdefault("JAX_COMPILATION_CACHE_DIR", str(workdir / ".jax-cache"))
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        install_capping_python(workdir / ".doc-check-bin")
        env["PATH"] = f"{workdir / '.doc-check-bin'}{os.pathsep}{env.get('PATH', '')}"
    mode = "full" if args.full else f"small (train.steps<={TRAIN_STEPS})"
    print(f"{len(blocks)} shell blocks in {len(files)} files; working folder {workdir}; mode {mode}", flush=True)
    failures, skipped, started = [], [], time.monotonic()
    try:
        for b in blocks:
            if b.skip_reason:
                skipped.append(b)
                print(f"skip {b.where}: {b.skip_reason}", flush=True)
                continue
            t0 = time.monotonic()
            problems = check_block(b, workdir, env, not args.full, args.timeout)
            status = "FAIL" if problems else "ok  "
            print(
                f"{status} {b.where} ({time.monotonic() - t0:.0f} s) {b.text.strip().splitlines()[0][:80]}", flush=True
            )
            failures += [(b, problem) for problem in problems]
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    total = time.monotonic() - started
    ran = len(blocks) - len(skipped)
    for b, problem in failures:
        print(f"\n{b.where}: a command of this {b.language} block failed:\n{problem}", file=sys.stderr)
    print(
        f"\n{ran - len({id(b) for b, _ in failures})} of {ran} blocks passed, {len(skipped)} skipped "
        f"(marked in the docs), in {total:.0f} s",
        flush=True,
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
