"""One import name: the wheel installs `meshwork` and nothing else, and a user's own
`models/`, `train.py` or `sharding.py` next to their code cannot shadow ours."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Import package -> folder: src/meshwork, and the root folders its links (src/meshwork/models, ...) name.
FOLDERS = {
    "meshwork": "src/meshwork",
    "meshwork/sharding": "sharding",
    "meshwork/models": "models",
    "meshwork/train": "train",
    "meshwork/inference": "inference",
}
SCRIPTS = ("meshwork-train", "meshwork-infer", "meshwork-plan", "meshwork-plot")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel pip builds from a copy of the sources (building in place would leave build/ behind)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in FOLDERS.values():
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.glob("meshwork-*.whl")
    return zipfile.ZipFile(path)


def test_wheel_installs_one_top_level_name(wheel):
    names = wheel.namelist()
    info = next(n for n in names if n.endswith(".dist-info/WHEEL")).rsplit("/", 1)[0]
    tops = {n.split("/")[0] for n in names if not n.startswith(info)}
    assert tops == {"meshwork"}, f"the wheel installs {sorted(tops)}"
    top_level = f"{info}/top_level.txt"
    if top_level in names:
        assert wheel.read(top_level).decode().split() == ["meshwork"]


def test_wheel_holds_every_module(wheel):
    """pyproject lists packages explicitly: a package folder missing from the list would ship without it,
    and a kernel's C++ source (compiled on first use) missing from its package data without the kernel."""
    shipped = set(wheel.namelist())
    expected = set()
    for package, folder in FOLDERS.items():
        for path in [*(ROOT / folder).rglob("*.py"), *(ROOT / folder).rglob("*.cc")]:
            rel = path.relative_to(ROOT / folder)
            if package == "meshwork" and rel.parts[0] in ("sharding", "models", "train", "inference"):
                continue
            expected.add(f"{package}/{rel.as_posix()}")
    missing = sorted(expected - shipped)
    assert not missing, f"not in the wheel (add their packages to pyproject.toml): {missing}"


def test_wheel_declares_the_console_scripts(wheel):
    entry_points = next(n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt"))
    text = wheel.read(entry_points).decode()
    for script in SCRIPTS:
        assert f"{script} = meshwork." in text


@pytest.fixture
def user_folder(tmp_path) -> pathlib.Path:
    """Research code with its own `models/`, `train.py` and `sharding.py`, each failing loudly if imported."""
    (tmp_path / "models").mkdir()
    for path in (
        tmp_path / "models/__init__.py",
        tmp_path / "train.py",
        tmp_path / "sharding.py",
        tmp_path / "inference.py",
    ):
        path.write_text(f"raise RuntimeError('the user\\'s own {path.relative_to(tmp_path)} was imported')\n")
    return tmp_path


def _run(args, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_cli_and_imports_work_beside_a_users_own_packages(user_folder):
    proc = _run([sys.executable, "-m", "meshwork.train", "--help"], user_folder)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--config" in proc.stdout
    code = (
        "import meshwork.sharding.rules as r, meshwork.models.transformer, meshwork.train.loop, "
        "meshwork.models.hf; import sys; "
        "print(r.rules_for('fsdp') is not None, [m for m in ('models', 'train', 'sharding', 'inference') "
        "if m in sys.modules])"
    )
    proc = _run([sys.executable, "-c", code], user_folder)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "[]"]  # nothing of the user's (or a stray top-level name) loaded


@pytest.mark.parametrize("module", ["train", "train.plan", "train.plot", "inference"])
def test_checkout_short_forms_run(module):
    """In a checkout, `python3 -m train` (and the others) call the same code as `python3 -m meshwork.train`."""
    proc = _run([sys.executable, "-m", module, "--help"], ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


def test_console_scripts_run(user_folder):
    bindir = pathlib.Path(sys.executable).parent
    for script in SCRIPTS:
        exe = shutil.which(script, path=os.pathsep.join([str(bindir), os.environ.get("PATH", "")]))
        assert exe, f"{script} is not installed: run `python3 -m pip install -e .`"
        proc = _run([exe, "--help"], user_folder)
        assert proc.returncode == 0, (script, proc.stderr[-2000:])
        assert "usage:" in proc.stdout
