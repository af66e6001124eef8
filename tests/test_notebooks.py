"""Every notebook in notebooks/ runs top to bottom without an error, prints a handful of lines per
cell (no progress bar: training detects the kernel), and is committed without outputs.

Each notebook runs in a fresh `python3` kernel (its first cell sets up 8 simulated CPU
devices before jax is imported; the kernel inherits conftest's JAX_PLATFORMS=cpu) with
MESHWORK_NOTEBOOK_SMALL=1, so every size and step count is the toy one, and its runs go
to a temporary folder. The kernel imports meshwork as the rest of the tests do: from the
editable install of this checkout (`pip install -e .`), as a user's notebook would.
"""

import re
import time

import nbformat
import pytest
from conftest import ROOT
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 120
MAX_PROGRESS_LINES_PER_CELL = 15  # a training cell: ~10 progress lines and a few at evaluations; not one per step
PROGRESS_LINE = re.compile(r"^step \d+/\d+: ", re.MULTILINE)
ANSI_COLOR = re.compile(r"\x1b\[[0-9;]*m")


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 6, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert not dirty, f"{path.name}: cells {dirty} hold outputs; clear them before committing"


# The quick tier runs the quickstart (a kernel of its own, a training run, plots); the slow tier the
# planner and the four that train bigger runs.
QUICK_NOTEBOOKS = ("01_quickstart",)


# A notebook starts its own kernel (jax imported again) and trains: over the 20 s budget cold.
RUNS_A_KERNEL = pytest.mark.over_budget(
    "a Jupyter kernel of its own that imports jax and trains: ~21 s cold", seconds=45
)


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, id=p.stem, marks=[RUNS_A_KERNEL] if p.stem in QUICK_NOTEBOOKS else [pytest.mark.slow])
        for p in NOTEBOOKS
    ],
)
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv("MESHWORK_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("MESHWORK_NOTEBOOK_RUNS", str(tmp_path))
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK_DIR)}}
    )
    start = time.perf_counter()
    try:
        client.execute()
    except CellExecutionError as e:  # the message holds the cell's source and its (colored) traceback
        pytest.fail(f"{path.name}: {ANSI_COLOR.sub('', str(e))}", pytrace=False)
    print(f"{path.name}: {time.perf_counter() - start:.1f} s")
    errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == "error"]
    assert not errors, errors
    for i, cell in enumerate(nb.cells):
        text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.output_type == "stream")
        assert "\r" not in text and "it/s" not in text, f"{path.name} cell {i}: a progress bar\n{text[:500]}"
        progress = len(PROGRESS_LINE.findall(text))
        assert progress <= MAX_PROGRESS_LINES_PER_CELL, f"{path.name} cell {i}: {progress} progress lines"
