"""Editors follow every `meshwork.*` import into the checkout.

After the README's `pip install -e .`, the installed `.pth` names `src/`, where `meshwork.models`,
`.sharding`, `.train` and `.inference` are links to the root folders users know; a static tool
(jedi, pyright/Pylance) reads the path and needs no import hook. This test makes a fresh venv,
installs the checkout editable into it, and asks jedi for the definition of public names across the
five layers: each must land in the checkout file that defines it.

Pyright, by hand (npm's `pyright`): `python3 tests/test_editor_imports.py DIR` writes DIR/probe.py
importing the same names and DIR/pyrightconfig.json pointing at the active venv; then
`npx pyright -p DIR` should report 0 errors.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pathlib
import subprocess
import sys
import venv

import jedi
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# (module, name): public names from each layer (sharding, engine room, models, train, inference).
NAMES = [
    ("meshwork.sharding.mesh", "make_mesh"),
    ("meshwork.sharding.rules", "rules_for"),
    ("meshwork.sharding.rules", "logical_to_sharding"),
    ("meshwork.sharding.parallel", "ParallelContext"),
    ("meshwork.sharding.ring_attention", "ring_attention"),
    ("meshwork.sharding.collective_matmul", "tp_mlp"),
    ("meshwork.config", "load_config"),
    ("meshwork.run.checkpoint", "Checkpointer"),
    ("meshwork.partitioning", "variable_shardings"),
    ("meshwork.kernels.flash_attention", "flash_attention"),
    ("meshwork.perf.planner", "plan"),
    ("meshwork.models.transformer", "Transformer"),
    ("meshwork.models.build", "build_model"),
    ("meshwork.models.lora", "add_lora"),
    ("meshwork.models.unet", "UNet"),
    ("meshwork.models.layers.attention", "Attention"),
    ("meshwork.objectives.next_token", "next_token_loss"),
    ("meshwork.train.trainer", "build_trainer"),
    ("meshwork.train.trainer", "Trainer"),
    ("meshwork.train.gradients", "gradient_strategy"),
    ("meshwork.train.hooks.persistent", "PersistentCheckpoint"),
    ("meshwork.train.loop", "train"),
    ("meshwork.train.optim", "make_optimizer"),
    ("meshwork.train.state", "init_state"),
    ("meshwork.engine.generate", "Generator"),
    ("meshwork.engine.serving", "Server"),
    ("meshwork.engine.kv_cache", "KVCache"),
    ("meshwork.engine.validation", "RequestError"),
]


def probe_source() -> str:
    """One import line per name, in NAMES' order."""
    return "".join(f"from {module} import {name}\n" for module, name in NAMES)


def defining_file(module: str, name: str) -> pathlib.Path:
    return pathlib.Path(inspect.getsourcefile(getattr(importlib.import_module(module), name))).resolve()


@pytest.mark.slow
def test_jedi_resolves_public_names_to_the_checkout_from_an_editable_install(tmp_path):
    env_dir = tmp_path / "venv"
    # The packages of the Python running the tests (pip, jedi's target), and pip builds the editable
    # wheel with setuptools as tests/test_packaging.py's wheel does.
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    proc = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    user = tmp_path / "user"
    user.mkdir()
    source = probe_source()
    (user / "probe.py").write_text(source)
    script = jedi.Script(
        source, path=str(user / "probe.py"), environment=jedi.create_environment(str(python), safe=False)
    )
    landed = {}
    for line, (module, name) in enumerate(NAMES, start=1):
        column = len(f"from {module} import ")
        found = script.goto(line, column, follow_imports=True)
        landed[f"{module}.{name}"] = pathlib.Path(found[0].module_path).resolve() if found else None
    want = {f"{module}.{name}": defining_file(module, name) for module, name in NAMES}
    assert landed == want
    assert all(path.is_relative_to(ROOT) for path in want.values())


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.py").write_text(probe_source())
    env = pathlib.Path(os.environ.get("VIRTUAL_ENV", sys.prefix))
    (out / "pyrightconfig.json").write_text(
        json.dumps({"venvPath": str(env.parent), "venv": env.name, "include": ["probe.py"]}, indent=1)
    )
    print(f"wrote {out}/probe.py and pyrightconfig.json; run: npx pyright -p {out}")
