"""A real full disk and a real read-only one (small tmpfs mounts): one line naming the problem, the
previous checkpoint intact, and once the storage is back the same command ends bit-exact.

The mounts live in a mount namespace of the scenario's own (`storage_scenario.py` under
`unshare --user --map-root-user --mount`), so the tests need no root where the kernel allows user
namespaces; they skip only where it does not, and fail instead under CI=true.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from harness import STEPS, assert_same_final_state

SCENARIO = pathlib.Path(__file__).with_name("storage_scenario.py")


def _namespace_prefix() -> list[str]:
    """The command that gives the scenario mounts of its own, or a skip naming why there is none."""
    why = None
    if shutil.which("unshare") is None:
        why = "no `unshare` (util-linux) to make a mount namespace"
    else:
        probe = subprocess.run(
            ["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True, text=True
        )
        if probe.returncode == 0:
            return ["unshare", "--user", "--map-root-user", "--mount"]
        why = f"user namespaces are not allowed here: {probe.stderr.strip()}"
    if os.environ.get("CI") == "true":
        pytest.fail(f"the storage tests cannot mount a tmpfs: {why}")
    pytest.skip(why)


def _scenario(name: str, tmp_path: pathlib.Path, reference_run: pathlib.Path, cache: pathlib.Path) -> list[dict]:
    prefix = _namespace_prefix()
    # A disk that holds two of the run's checkpoints but not the third one being written.
    one = sum(p.stat().st_size for p in (reference_run / "checkpoints" / str(STEPS)).rglob("*") if p.is_file())
    size = int(2.6 * one) + (256 << 10)
    done = subprocess.run(
        [*prefix, sys.executable, str(SCENARIO), name, str(tmp_path), str(size), str(cache)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp_path / "steps.json").read_text())


@pytest.mark.slow
def test_full_disk_keeps_the_last_checkpoint_and_resumes_bit_exact(reference_run, compile_cache, tmp_path):
    full, done = _scenario("full", tmp_path, reference_run, compile_cache)
    assert full["returncode"] == 74, full["stderr"][-2000:]
    # meshwork's report is the only line: no traceback of ours, Orbax's or TensorStore's writer threads.
    lines = full["stderr"].strip().splitlines()
    assert len(lines) == 1, full["stderr"][-3000:]
    last = lines[0]
    # The disk fills while a checkpoint or a metrics row is written, whichever comes first.
    assert last.startswith("error: ") and "no space left on device while " in last, last
    names = full["checkpoints"]
    assert all(n.isdigit() for n in names), names  # nothing cut short is left behind
    kept = sorted(map(int, names))
    assert kept and f"the checkpoint of step {kept[-1]} is intact" in last
    assert sorted(map(int, full["manifests"])) == kept
    print(f"full disk: {last}")

    assert done["returncode"] == 0, done["stderr"][-2000:]
    assert_same_final_state(tmp_path / "run", reference_run)


@pytest.mark.over_budget("three trainer processes on a tmpfs in a namespace of their own: 17-20 s", seconds=45)
def test_read_only_run_dir_is_refused_and_resumes_once_writable(reference_run, compile_cache, tmp_path):
    first, refused, done = _scenario("read_only", tmp_path, reference_run, compile_cache)
    assert first["returncode"] == 0, first["stderr"][-2000:]
    assert refused["returncode"] == 2, refused["stderr"][-2000:]
    (line,) = refused["stderr"].strip().splitlines()
    assert "is not writable" in line and "parameters" not in refused["stdout"]  # refused before the compile
    assert done["returncode"] == 0, done["stderr"][-2000:]
    assert_same_final_state(tmp_path / "run", reference_run)
