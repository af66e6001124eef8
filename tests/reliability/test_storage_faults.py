"""A real full disk and a real read-only one (small tmpfs mounts): one line naming the problem, the
previous checkpoint intact, and once the storage is back the same command ends bit-exact."""

import os
import pathlib
import subprocess

import pytest

from harness import assert_same_final_state, run


def _mount(point: pathlib.Path, size: int, *options: str) -> None:
    point.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs", str(point)],
                          capture_output=True, text=True)
    if done.returncode != 0:  # root without CAP_SYS_ADMIN (some containers)
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


@pytest.fixture
def small_disk(tmp_path, reference_run):
    """A tmpfs that holds two of the run's checkpoints but not the third one being written."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs (a real full file system) needs root")
    one = sum(p.stat().st_size for p in (reference_run / "checkpoints" / "60").rglob("*") if p.is_file())
    point = tmp_path / "disk"
    _mount(point, int(2.6 * one) + (256 << 10))
    yield point
    subprocess.run(["umount", "-l", str(point)], check=False)


@pytest.mark.slow
def test_full_disk_keeps_the_last_checkpoint_and_resumes_bit_exact(small_disk, reference_run, compile_cache):
    run_dir = small_disk / "run"
    full = run(run_dir, compile_cache)
    assert full.returncode == 74, full.stderr[-2000:]
    # meshwork's report is the only line: no traceback of ours, Orbax's or TensorStore's writer threads.
    lines = full.stderr.strip().splitlines()
    assert len(lines) == 1, full.stderr[-3000:]
    last = lines[0]
    # The disk fills while a checkpoint or a metrics row is written, whichever comes first.
    assert last.startswith("error: ") and "no space left on device while " in last, last
    names = [p.name for p in (run_dir / "checkpoints").iterdir()]
    assert all(n.isdigit() for n in names), names  # nothing cut short is left behind
    kept = sorted(map(int, names))
    assert kept and f"the checkpoint of step {kept[-1]} is intact" in last
    assert all((run_dir / "checkpoints" / str(s) / "meshwork_manifest.json").is_file() for s in kept)
    print(f"full disk: {last}")

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    done = run(run_dir, compile_cache)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_same_final_state(run_dir, reference_run)


def test_read_only_run_dir_is_refused_and_resumes_once_writable(small_disk, reference_run, compile_cache):
    run_dir = small_disk / "run"
    first = run(run_dir, compile_cache, "train.stop_after=10")
    assert first.returncode == 0, first.stderr[-2000:]
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    refused = run(run_dir, compile_cache)
    assert refused.returncode == 2, refused.stderr[-2000:]
    (line,) = refused.stderr.strip().splitlines()
    assert "is not writable" in line and "parameters" not in refused.stdout  # refused before the compile
    subprocess.run(["mount", "-o", "remount,rw,size=64m", str(small_disk)], check=True)
    done = run(run_dir, compile_cache)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_same_final_state(run_dir, reference_run)
