"""A measured figure quoted in the docs is one that benchmarks/RESULTS.md holds, so the two
cannot drift apart.

The rule, applied to README.md and docs/*.md:

- Only prose counts: fenced and indented code blocks, inline code spans, link targets and HTML
  comments are skipped (a command's output, a formula or a config value is not a claim about a
  measurement). Table cells are prose, and a bare number in a cell takes the unit named in its
  column's header (``decode tok/s`` -> ``502`` is ``502 tok/s``).
- A *figure* is a number written with a unit of measure right after it, or written in
  scientific notation:
    percent (``48.2%``), ratio (``1.82x``, ``x1.82``, ``2.3×``),
    time (``ms``, ``s``, ``min``, ``minutes``, ``s/step``, ``ms/step``),
    bytes (``B``, ``KB``, ``KiB``, ``MB``, ``MiB``, ``GB``, ``GiB``, ``TB``),
    rates (``tok/s``, ``tokens/s``, ``samples/s``, ``GFLOP/s``, ``TFLOP/s``, ``GB/s``, ``TB/s``),
    and ``3e-6``-style numbers.
  In a range such as ``0.28-0.56x`` or ``7-19%`` both ends carry the unit.
- Each figure must also be a figure of benchmarks/RESULTS.md: the same unit and the same value
  (commas, a leading sign and trailing zeros do not matter; ``48%`` and ``48.2%`` differ).
  RESULTS.md's figures are read by the same rule (its fenced blocks too, and a figure wrapped
  over two lines of a paragraph).
- ALLOWED lists the figures that are not measurements of this project (data-sheet values,
  worked examples of formulas a test checks), each with a phrase that must stand on the same
  line and a reason; an entry nothing uses fails the test. Keep it short: a new measured figure belongs in
  RESULTS.md, with its date, machine and command.

Pure text, no jax: well under a second.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"

# Figures that may appear without being in RESULTS.md: (figure as written, a phrase that must be
# on the same line, why). The phrase keeps an entry from excusing the same number elsewhere.
ALLOWED: list[tuple[str, str, str]] = [
    # Data-sheet values of src/meshwork/perf/hardware.py (each with its source there).
    ("64 GB/s", "PCIe 5", "the host link of the planner's hardware table"),
    ("3.35 TB/s", "H100's bf16 data sheet", "H100 memory bandwidth"),
    ("450 GB/s", "per direction inside a node", "H100 NVLink bandwidth"),
    ("50 GB/s", "per direction inside a node", "H100 inter-node bandwidth per GPU"),
    # Worked examples of formulas and published tables, each asserted by a test.
    ("1.88 GB", "120 / 31.4 / 16.6", "ZeRO paper, Table 1 (tests/test_planner.py)"),
    ("4x", "beats a flat ring", "a bound asserted by tests/test_planner.py::test_algorithm_costs"),
    ("4x", "the sequence one device holds", "the test's setup, not a measurement"),
    ("14.4 minutes", "fail as a cluster every", "cluster MTTF example (tests/test_perf_units.py)"),
    ("5.37 min", "Young gives", "Young interval example (tests/test_perf_units.py)"),
    ("4.72 min", "Young gives", "Daly interval example (tests/test_perf_units.py)"),
    ("58.5%", "goodput", "goodput formula example (tests/test_perf_units.py)"),
    ("9.1 min", "117, 57 and 9.1 min", "Daly's published example (tests/test_perf_units.py)"),
]

# Longest spellings first, so that "ms/step" wins over "ms" and "MiB" over "B".
_UNITS = {
    "tokens/s": "tok/s",
    "tok/s": "tok/s",
    "samples/s": "samples/s",
    "TFLOP/s": "TFLOP/s",
    "GFLOP/s": "GFLOP/s",
    "TB/s": "TB/s",
    "GB/s": "GB/s",
    "ms/step": "ms",
    "s/step": "s",
    "minutes": "min",
    "min": "min",
    "ms": "ms",
    "s": "s",
    "KiB": "KiB",
    "MiB": "MiB",
    "GiB": "GiB",
    "KB": "KB",
    "MB": "MB",
    "GB": "GB",
    "TB": "TB",
    "B": "B",
    "%": "%",
    "×": "x",
    "x": "x",
}
_UNIT_ALT = "|".join(re.escape(u) for u in sorted(_UNITS, key=len, reverse=True))
_NUM = r"\d[\d,]*(?:\.\d+)?"
# "7-19%", "0.28-0.56x", "5.2 %", "1.82x", "3 min": a number (or range), then a unit that ends there.
_SUFFIXED = re.compile(rf"(?<![\w.])({_NUM})(?:\s*[-–]\s*({_NUM}))?\s?({_UNIT_ALT})(?![\w/])", re.UNICODE)
# "x1.82" (RESULTS.md's ratio style): an x that does not follow a number or letter.
_PREFIXED = re.compile(rf"(?<![\w.])[x×]({_NUM})(?![\w.])")
_SCIENTIFIC = re.compile(r"(?<![\w.])(\d(?:\.\d+)?[eE][-+]?\d+)(?![\w.])")

_UNIT_ALT_SUFFIX = re.compile(rf"\d\s?(?:{_UNIT_ALT})(?![\w/])")

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+).+?\1")
_LINK_TARGET = re.compile(r"\]\([^)]*\)")
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)


def _value(number: str) -> str:
    """A number's value as text: '17,555' -> '17555', '0.50' -> '0.5', '3.0e-6' -> '3e-06'."""
    number = number.replace(",", "").lstrip("+-")
    if "e" in number.lower():
        return repr(float(number))
    if "." in number:
        number = number.rstrip("0").rstrip(".")
    return number or "0"


def prose_lines(text: str):
    """(line number, text) of the prose of a Markdown file: fences, code spans, link targets
    and HTML comments removed."""
    text = _COMMENT.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    fenced = indented = False
    previous = ""
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        # An indented code block: 4 spaces after a blank line (a formula, not a claim).
        indented = line.startswith("    ") and (indented or not previous.strip())
        previous = line
        if not fenced and not indented:
            yield number, _LINK_TARGET.sub("]", _CODE_SPAN.sub(" ", line))


def figures_in(line: str) -> list[tuple[str, str, str]]:
    """(unit, value, as written) of every figure in one line of prose."""
    found = []
    for m in _SUFFIXED.finditer(line):
        unit = _UNITS[m.group(3)]
        if unit == "x" and re.match(r"\s*\d", line[m.end() :]):
            continue  # "2x4", "16 x 128": a shape, not a ratio
        if m.start() >= 2 and line[m.start() - 1] == "-" and line[m.start() - 2].isalnum():
            continue  # "CRC-32s", "1e-5 x": part of a name or of another number
        if m.group(3) == "B" and not line[m.start(3) - 1].isspace():
            continue  # "7B", "671B": billions of parameters, not bytes
        for number in filter(None, (m.group(1), m.group(2))):
            found.append((unit, _value(number), m.group(0).strip()))
    found += [("x", _value(m.group(1)), m.group(0)) for m in _PREFIXED.finditer(line)]
    found += [("e", _value(m.group(1)), m.group(1)) for m in _SCIENTIFIC.finditer(line)]
    return found


def _header_unit(cell: str) -> str | None:
    """The unit a table column's header names ('decode tok/s' -> 'tok/s'), if one."""
    for m in re.finditer(rf"(?<![\w.])({_UNIT_ALT})(?![\w/])", cell):
        if m.group(1) not in ("x", "×", "s", "B"):  # too easily a word's letter or a ratio label
            return _UNITS[m.group(1)]
    if re.match(r"\s*vs\b", cell) or " / " in cell:
        return "x"  # "vs f32", "measured / planned": a ratio column
    return None


def figures_of(text: str) -> list[tuple[int, str, str, str]]:
    """(line, unit, value, as written) of every figure in a Markdown text: its prose by the rule
    above, and the bare numbers of its tables with the unit of their column's header."""
    found = []
    header: list[str | None] = []
    for number, line in prose_lines(text):
        found += [(number, *f) for f in figures_in(line)]
        if not line.lstrip().startswith("|"):
            header = []
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not header:
            header = [_header_unit(c) for c in cells]
            continue
        for unit, cell in zip(header, cells):
            if unit and not re.search(_UNIT_ALT_SUFFIX, cell):  # a cell with its own unit was read above
                found += [
                    (number, unit, _value(n), f"{n} ({unit}, from the column header)")
                    for n in re.findall(rf"(?<![\w.=]){_NUM}", cell.replace("*", ""))
                ]
    return found


def results_figures(text: str) -> set[tuple[str, str]]:
    """(unit, value) of every figure in RESULTS.md, fenced blocks included (a script's printed
    table is a result too)."""
    found = {(unit, value) for _, unit, value, _ in figures_of(text)}
    # A figure wrapped across two lines of a paragraph ("0.41\nms") counts too.
    for paragraph in re.split(r"\n\s*\n", "\n".join(line for _, line in prose_lines(text))):
        found |= {(unit, value) for unit, value, _ in figures_in(" ".join(paragraph.split()))}
    for m in re.finditer(r"```.*?```", text, re.DOTALL):
        for line in m.group(0).splitlines():
            found |= {(unit, value) for unit, value, _ in figures_in(line)}
    return found


def _allowed(unit: str, value: str, line: str) -> bool:
    for written, phrase, _ in ALLOWED:
        if phrase in line and any((u, v) == (unit, value) for u, v, _ in figures_in(written)):
            return True
    return False


def doc_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def problems(md: pathlib.Path, known: set[tuple[str, str]]) -> list[str]:
    """One line per figure of `md` that RESULTS.md does not hold."""
    out = []
    lines = md.read_text(encoding="utf-8").splitlines()
    for number, unit, value, written in figures_of(md.read_text(encoding="utf-8")):
        if (unit, value) in known or _allowed(unit, value, lines[number - 1]):
            continue
        out.append(
            f"{md.relative_to(ROOT)}:{number}: '{written}' is not a figure of "
            f"benchmarks/RESULTS.md (quote it from there, or drop it)"
        )
    return out


@pytest.fixture(scope="module")
def known() -> set[tuple[str, str]]:
    return results_figures(RESULTS.read_text(encoding="utf-8"))


@pytest.mark.parametrize("md", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_figure_in_the_docs_is_in_results(md, known):
    found = problems(md, known)
    assert not found, f"{len(found)} figure(s) not in benchmarks/RESULTS.md:\n" + "\n".join(found)


def test_the_rule_finds_figures_and_ignores_the_rest():
    line = (
        "48.2% MFU, 1.82x faster, x2.3, 0.28-0.56x of cuDNN, 3e-6, 502 tok/s, 3 min, "
        "17,555 tokens/s, a 2x4 mesh, 16 x 128 tokens, 8 devices, 4 layers, 2 stages"
    )
    assert [(u, v) for u, v, _ in figures_in(line)] == [
        ("%", "48.2"),
        ("x", "1.82"),
        ("x", "0.28"),
        ("x", "0.56"),
        ("tok/s", "502"),
        ("min", "3"),
        ("tok/s", "17555"),
        ("x", "2.3"),
        ("e", "3e-06"),
    ]
    assert list(prose_lines("a `5%` b\n```\n7%\n```\n[9%](x_10%.md) <!-- 11% -->\n")) == [(1, "a   b"), (5, "[9%] ")]


def test_results_table_cells_take_their_header_unit():
    table = "| batch | decode tok/s | ratio |\n|---|---|---|\n| 1 | 502 | x1.08 |\n"
    assert {("tok/s", "502"), ("x", "1.08")} <= results_figures(table)
    assert ("tok/s", "1") not in results_figures(table)


def test_every_allowed_entry_is_used():
    """An excuse that no line needs any more is removed, so the list cannot grow stale."""
    lines = [line for md in doc_files() for line in md.read_text(encoding="utf-8").splitlines()]
    for written, phrase, why in ALLOWED:
        ((unit, value, _),) = figures_in(written)
        assert any(
            phrase in line and any((u, v) == (unit, value) for _, u, v, _ in figures_of(line)) for line in lines
        ), f"ALLOWED entry {written!r} ({why}) is not used; remove it"
