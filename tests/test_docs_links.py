"""The docs cannot rot: every relative link in README.md and docs/*.md points at a
file that exists, and every symbol named in a link of the form [`name`](path.py)
is defined in that file.

What is checked, per Markdown file (fenced code blocks skipped):

- inline links and images `[text](target)`, reference definitions `[ref]: target`
  and HTML `href="..."` / `src="..."`: a relative target (no scheme) must exist
  inside the repository, resolved from the Markdown file's folder; a `#fragment`
  into a Markdown file (or a bare `#anchor`) must name one of its headings
  (GitHub's slugs);
- [`name`](file.py): `name` (optionally `Class.member`, optionally ending in
  `()`) must be a top-level function, class or assignment of that file, found
  with `ast` (a member: a def or assignment in that class's body);
- [`some/file.py`](../some/file.py): a code span that is a file name must be
  the tail of the path it links to, so the label says where the link goes.

Pure Python, no jax: a fraction of a second.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Known broken links that cannot be fixed in the file that holds them: (markdown file, target).
# Empty on purpose; add an entry only with a note saying why and who will fix it.
KNOWN_BROKEN: set[tuple[str, str]] = set()

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target "title") or ![alt](target); text may hold one level of nested brackets.
_INLINE = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'][^\"']*[\"'])?\s*\)")
_REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+[\"'(].*)?$")
_HTML = re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']+)["']""")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
_SYMBOL = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?$")
# A code span that names a file (a path, or a name with a file extension), not a symbol.
_FILE_LABEL = re.compile(r"^(?:[\w.-]*/[\w./-]*|[\w.-]+\.(?:py|md|yaml|yml|json|toml|txt|sh|png|npz|safetensors))$")


def markdown_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _lines_outside_fences(text: str):
    """(line number, line) of every line not inside a fenced code block."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def _blank_code_spans_holding_links(line: str) -> str:
    """`[a](b)` written inside a code span is code, not a link: blank such spans out."""
    return _CODE_SPAN.sub(lambda m: " " * len(m.group(0)) if "](" in m.group(2) else m.group(0), line)


def links(text: str) -> list[tuple[int, str, str]]:
    """(line, label, target) of every link in Markdown `text`; label is "" where there is none."""
    found = []
    for number, line in _lines_outside_fences(text):
        line = _blank_code_spans_holding_links(line)
        found += [(number, m.group(1), m.group(2)) for m in _INLINE.finditer(line)]
        if m := _REFDEF.match(line):
            found.append((number, "", m.group(1)))
        found += [(number, "", m.group(1)) for m in _HTML.finditer(line)]
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def anchors(path: pathlib.Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in _lines_outside_fences(path.read_text(encoding="utf-8")):
        if m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line):
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return frozenset(out)


@functools.cache
def definitions(path: pathlib.Path) -> dict[str, frozenset[str]]:
    """Names a Python file defines at top level -> the names defined in that class's body
    (empty for functions and assignments)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))

    def assigned(node: ast.stmt) -> list[str]:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        else:
            return []
        names = []
        for t in targets:
            names += [n.id for n in ast.walk(t) if isinstance(n, ast.Name)]
        return names

    def body_names(body: list[ast.stmt]) -> list[str]:
        out = []
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.append(node.name)
            out += assigned(node)
            if isinstance(node, (ast.If, ast.Try)):  # definitions under `if TYPE_CHECKING:` / try-except
                out += body_names(node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", []))
                for handler in getattr(node, "handlers", []):
                    out += body_names(handler.body)
        return out

    result: dict[str, frozenset[str]] = {}
    for name in body_names(tree.body):
        result.setdefault(name, frozenset())
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            result[node.name] = frozenset(body_names(node.body))
    return result


def symbol_problem(name: str, path: pathlib.Path) -> str | None:
    """Why `name` is not defined in Python file `path`, or None."""
    name = name.removesuffix("()")
    if not _SYMBOL.match(name):
        return f"`{name}` is not a Python name (use `name` or `Class.member`)"
    defs = definitions(path)
    head, _, member = name.partition(".")
    if head not in defs:
        return f"`{head}` is not defined at the top level of {path.relative_to(ROOT)}"
    if member and member not in defs[head]:
        return f"`{name}`: `{head}` has no member `{member}` in {path.relative_to(ROOT)}"
    return None


def problems(md: pathlib.Path) -> list[str]:
    """One line per broken link or missing symbol in Markdown file `md`."""
    rel = md.relative_to(ROOT)
    out = []
    for line, label, target in links(md.read_text(encoding="utf-8")):
        if _SCHEME.match(target) or target.startswith("//"):
            continue  # http(s), mailto: checked by nobody here
        if (str(rel), target) in KNOWN_BROKEN:
            continue
        where = f"{rel}:{line}: ({target})"
        file_part, _, fragment = target.partition("#")
        dest = (md.parent / file_part).resolve() if file_part else md
        if not dest.is_relative_to(ROOT):
            out.append(f"{where} -> points outside the repository, at {dest}")
            continue
        if not dest.exists():
            out.append(f"{where} -> no such file {dest.relative_to(ROOT)}")
            continue
        if fragment and dest.suffix == ".md" and fragment.lower() not in anchors(dest):
            out.append(f"{where} -> no heading with anchor #{fragment} in {dest.relative_to(ROOT)}")
        code = re.fullmatch(r"\s*`([^`]+)`\s*", label)
        if not code:
            continue
        name = code.group(1).strip()
        if _FILE_LABEL.match(name):
            if not dest.as_posix().endswith("/" + name.lstrip("./").rstrip("/")):
                out.append(f"{where} -> labelled `{name}` but points at {dest.relative_to(ROOT)}")
        elif dest.suffix == ".py" and dest.is_file():
            if problem := symbol_problem(name, dest):
                out.append(f"{where} -> {problem}")
    return out


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_named_symbols_exist(md):
    found = problems(md)
    assert not found, f"{len(found)} broken link(s):\n" + "\n".join(found)


def test_the_concepts_page_links_code_and_tests():
    text = (ROOT / "docs" / "concepts.md").read_text(encoding="utf-8")
    targets = [t for _, _, t in links(text)]
    assert sum(t.startswith("../tests/") for t in targets) >= 30
    assert sum(t.endswith(".py") and not t.startswith("../tests/") for t in targets) >= 60


def test_the_checker_catches_rot(tmp_path, monkeypatch):
    """A missing file, a missing symbol, a missing member, a wrong file label and a missing
    anchor are each reported; links in code, external links and good links are not."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        "import typing\nX = 1\nif typing.TYPE_CHECKING:\n    Y: int = 2\n"
        "class C:\n    z = 3\n    def m(self): pass\ndef f(): pass\n"
    )
    (tmp_path / "docs" / "other.md").write_text("# A `Title`, with: punctuation\n")
    md = tmp_path / "docs" / "page.md"
    md.write_text(
        "\n".join(
            [
                "[`f`](../pkg/mod.py) [`X`](../pkg/mod.py) [`Y`](../pkg/mod.py) [`C.m()`](../pkg/mod.py)",
                "[`C.z`](../pkg/mod.py) [`pkg/mod.py`](../pkg/mod.py) [`mod.py`](../pkg/mod.py) [`docs/`](../docs)",
                "[other](other.md#a-title-with-punctuation)",
                "[web](https://example.com/x) `[code](not/a/link.md)` ![img](other.md)",
                "```",
                "[fenced](no/such/file.md)",
                "```",
                "[`g`](../pkg/mod.py)",  # 1: no such function
                "[`C.q`](../pkg/mod.py)",  # 2: no such member
                "[gone](../pkg/missing.py)",  # 3: no such file
                "[`pkg/other.py`](../pkg/mod.py)",  # 4: label names another file
                "[bad](other.md#nope)",  # 5: no such heading
                "[ref]: ../nowhere.md",  # 6: reference definition to nothing
            ]
        )
    )
    found = problems(md)
    assert len(found) == 6, "\n".join(found)
    for expected in (
        "`g` is not defined",
        "has no member `q`",
        "no such file pkg/missing.py",
        "labelled `pkg/other.py`",
        "anchor #nope",
        "no such file nowhere.md",
    ):
        assert any(expected in p for p in found), (expected, found)


def test_the_tests_readme_names_every_test_file():
    """tests/README.md has a line for every test file, and names none that is gone."""
    text = (ROOT / "tests" / "README.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`((?:reliability/)?test_\w+\.py)`", text))
    present = {p.relative_to(ROOT / "tests").as_posix() for p in (ROOT / "tests").rglob("test_*.py")}
    assert not present - named, f"tests/README.md has no line for {sorted(present - named)}"
    assert not named - present, f"tests/README.md names missing files {sorted(named - present)}"
