"""The import graph flows one way: sharding <- engine room <- models <- {train, inference}.

Read from the source with `ast` (every import, including those inside functions),
so a violation fails here with the offending line rather than as a cycle at run
time. `python3 tests/test_architecture.py` prints the modules of each layer and
every edge against the flow.
"""

from __future__ import annotations

import ast
import io
import pathlib
import sys
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Folder of each import package: src/meshwork, and the root folders its links (src/meshwork/models, ...) name.
FOLDERS = {
    "meshwork.sharding": "sharding",
    "meshwork.models": "models",
    "meshwork.train": "train",
    "meshwork.inference": "inference",
    "meshwork": "src/meshwork",
}
# What each layer may import of ours (itself included).
ALLOWED = {
    "sharding": {"sharding"},
    "engine": {"engine", "sharding"},
    "models": {"models", "engine", "sharding"},
    "train": {"train", "models", "engine", "sharding"},
    "inference": {"inference", "models", "engine", "sharding"},
}


def layer_of(module: str) -> str:
    for prefix in ("sharding", "models", "train", "inference"):
        if module == f"meshwork.{prefix}" or module.startswith(f"meshwork.{prefix}."):
            return prefix
    return "engine"


def modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> source file, for every module of the package."""
    out = {}
    for package, folder in FOLDERS.items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            if package == "meshwork" and parts[0] in ("sharding", "models", "train", "inference"):
                continue
            name = ".".join((package, *parts)).removesuffix(".__init__")
            out[name] = path
    return out


def _imported(node: ast.AST, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The modules of ours that one import statement names (a `from pkg import sub` names pkg.sub)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] in ("meshwork", *FOLDERS.values())]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:  # relative: resolve against this module's package
        package = module if is_package else module.rsplit(".", 1)[0]
        package = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    if base.split(".")[0] not in ("meshwork", "models", "sharding", "train", "inference"):
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def import_edges() -> list[tuple[str, str, int]]:
    """(importer, imported, line) for every import of ours in the package."""
    mods = modules()
    known = set(mods)
    edges = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for target in _imported(node, name, path.name == "__init__.py", known):
                edges.append((name, target, node.lineno))
    return edges


def violations() -> list[str]:
    mods = modules()
    bad = []
    for src, dst, line in import_edges():
        if not dst.startswith("meshwork"):
            bad.append(
                f"{mods[src].relative_to(ROOT)}:{line}: {src} imports {dst}, a top-level name outside "
                "the meshwork namespace (write meshwork.{dst})"
            )
        elif layer_of(dst) not in ALLOWED[layer_of(src)]:
            bad.append(
                f"{mods[src].relative_to(ROOT)}:{line}: {src} ({layer_of(src)}) imports {dst} "
                f"({layer_of(dst)}); {layer_of(src)} may import only {sorted(ALLOWED[layer_of(src)])}"
            )
    return bad


def test_imports_flow_one_way():
    bad = violations()
    assert not bad, "imports against the flow sharding <- engine <- models <- {train, inference}:\n" + "\n".join(bad)


def test_every_module_is_seen():
    """The graph covers the whole package: a module the walk missed could hide an edge."""
    names = set(modules())
    for expected in (
        "meshwork.sharding.rules",
        "meshwork.run.checkpoint",
        "meshwork.models.transformer",
        "meshwork.train.loop",
        "meshwork.models.hf",
        "meshwork.kernels.flash_attention",
    ):
        assert expected in names
    assert len(names) > 80


def test_checker_catches_a_violation(tmp_path):
    """The checker itself fails on an edge against the flow (so the test above can fail)."""
    src = "from meshwork.train.loop import Trainer\nimport meshwork.inference.lm\nfrom . import rules\n"
    tree = ast.parse(src)
    found = [
        t
        for node in ast.walk(tree)
        for t in _imported(node, "meshwork.sharding.mesh", False, {"meshwork.sharding.rules"})
    ]
    assert found == ["meshwork.train.loop", "meshwork.inference.lm", "meshwork.sharding.rules"]
    assert [layer_of(m) for m in found] == ["train", "inference", "sharding"]
    assert not {"train", "inference"} & ALLOWED["sharding"]


# A function of train/ or inference/ longer than this reads as several ideas: split it. Lines are
# Python's logical lines (statements: a wrapped call or a docstring is one), so the count does not
# depend on how `ruff format` wraps a long call, one argument per line.
MAX_FUNCTION_LINES = 60


def _statement_ends(source: str) -> list[int]:
    """The line on which each logical line of `source` ends."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [tok.start[0] for tok in tokens if tok.type == tokenize.NEWLINE]


def long_functions(folders=("train", "inference")) -> list[str]:
    """'path:line name (n lines)' for each function (nested ones counted inside their parent too)."""
    found = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            source = path.read_text()
            ends = _statement_ends(source)
            for node in ast.walk(ast.parse(source, filename=str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = sum(1 for line in ends if node.lineno <= line <= node.end_lineno)
                    if n > MAX_FUNCTION_LINES:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    return found


def test_no_function_in_train_or_inference_is_over_60_lines():
    assert not long_functions(), "split these (one idea per function):\n" + "\n".join(long_functions())


def test_the_length_check_sees_a_long_function(tmp_path, monkeypatch):
    (tmp_path / "train").mkdir()
    body = "".join(f"    x{i} = f(\n        {i},\n    )\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "train" / "x.py").write_text("def f():\n" + body)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert long_functions(("train",)) == [f"train/x.py:1 f ({MAX_FUNCTION_LINES + 1} lines)"]


if __name__ == "__main__":
    by_layer: dict[str, list[str]] = {}
    for name in modules():
        by_layer.setdefault(layer_of(name), []).append(name)
    for layer in ALLOWED:
        print(f"{layer} ({len(by_layer.get(layer, []))} modules): {', '.join(sorted(by_layer.get(layer, [])))}")
    bad = violations()
    print(f"{len(import_edges())} import edges, {len(bad)} against the flow")
    print("\n".join(bad))
    sys.exit(1 if bad else 0)
