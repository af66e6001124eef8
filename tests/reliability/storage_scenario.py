"""Runs one storage-fault scenario on a real tmpfs, from inside a mount namespace of its own.

`python storage_scenario.py {full|read_only} OUT DISK_BYTES CACHE` mounts a tmpfs of DISK_BYTES at
OUT/disk, runs the tiny trainer there (tests/reliability/harness.py) through the scenario's steps,
remounting the disk between them, then copies the run dir to OUT/run and writes what each step
returned to OUT/steps.json. test_storage_faults.py starts it under
`unshare --user --map-root-user --mount`: the mounts need no root on the host and vanish with the
namespace when it ends.
"""

import json
import pathlib
import shutil
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from harness import run  # noqa: E402


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True)


def _remount(disk: pathlib.Path, options: str) -> None:
    # The type and source named again: in a user namespace, mount(8) cannot look them up itself.
    _mount("-t", "tmpfs", "-o", f"remount,{options}", "tmpfs", str(disk))


def _step(run_dir: pathlib.Path, cache: pathlib.Path, *extra: str) -> dict:
    done = run(run_dir, cache, *extra, timeout=300)
    ckpts = run_dir / "checkpoints"
    names = sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else []
    return {
        "returncode": done.returncode,
        "stdout": done.stdout,
        "stderr": done.stderr,
        "checkpoints": names,
        "manifests": [n for n in names if (ckpts / n / "meshwork_manifest.json").is_file()],
    }


def main(scenario: str, out: pathlib.Path, disk_bytes: int, cache: pathlib.Path) -> None:
    disk = out / "disk"
    disk.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={disk_bytes}", "tmpfs", str(disk))
    run_dir = disk / "run"
    if scenario == "full":  # fills during a checkpoint or a metrics row; then room again
        steps = [_step(run_dir, cache)]
        _remount(disk, "size=64m")
        steps.append(_step(run_dir, cache))
    elif scenario == "read_only":  # 10 steps, then the disk turns read-only, then writable again
        steps = [_step(run_dir, cache, "train.stop_after=10")]
        _remount(disk, "ro")
        steps.append(_step(run_dir, cache))
        _remount(disk, "rw,size=64m")
        steps.append(_step(run_dir, cache))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    shutil.copytree(run_dir, out / "run", symlinks=True)
    (out / "steps.json").write_text(json.dumps(steps))


if __name__ == "__main__":
    main(sys.argv[1], pathlib.Path(sys.argv[2]), int(sys.argv[3]), pathlib.Path(sys.argv[4]))
