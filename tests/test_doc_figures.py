"""A measured figure quoted in the docs names the benchmarks/RESULTS.md entry it comes from, by
key, and is that entry's figure: the newest one of its key, so a re-measured figure cannot
survive in the docs.

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
  In a range such as ``0.28-0.56x`` or ``7-19%`` both ends carry the unit. A number, a spaced
  ``x`` and a word (``stage 2 x data 4``, ``16 x 128 tokens``) is a product or a shape, not a ratio.
- RESULTS.md declares keys. An entry (``## YYYY-MM-DD — ...``) that measured a figure the docs
  quote, or the ``###`` part of it that did, ends with a table whose header row is
  ``| key | figure |``; a row names a key (lowercase, dotted: ``area.thing.measure``) and the
  figure as the docs write it (``0.56x``, ``5 min 5 s``; every figure the cell holds counts), a
  figure its entry states. A ``###`` sub-entry with a date in its title, ``(YYYY-MM-DD)``, has
  that date; one without has its entry's. The newest declaration of a key is the one with the latest date, and among
  the same date the one nearer the top of the file.
- A doc line names its keys in an HTML comment on the same line: ``<!-- fig: KEY -->``, or
  ``<!-- fig: KEY1 KEY2 -->``, or several comments (in a table, in the row's last cell). Each
  figure of the line must be a figure of the newest declaration of one of the line's keys: the
  same unit and value (commas, a leading sign and trailing zeros do not matter; ``48%`` and
  ``48.2%`` differ). A figure that is only an older declaration's is superseded, and fails
  naming the newer entry; a key no table declares fails; a figure on a line with no key fails.
- ALLOWED lists the figures that are not measurements of this project (data-sheet values,
  worked examples of formulas, the tolerances that tests assert), each with a phrase that must
  stand on the same line and a reason; an entry nothing uses fails the test. Keep it short: a new measured figure belongs in RESULTS.md, with its date, machine,
  commit and command, and a key.

``python3 tests/test_doc_figures.py --report`` lists every doc figure that fails, with the
RESULTS.md keys and entries that hold its value, newest first.

Pure text, no jax: well under a second.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"

# Figures that may appear without a key: (figure as written, a phrase that must be on the same
# line, why). The phrase keeps an entry from excusing the same number elsewhere.
ALLOWED: list[tuple[str, str, str]] = [
    # Data-sheet values of src/meshwork/perf/hardware.py (each with its source there).
    ("64 GB/s", "PCIe 5", "the host link of the planner's hardware table"),
    ("989 TFLOP/s", "H100's bf16 data sheet", "H100 dense bf16 peak"),
    ("3.35 TB/s", "H100's bf16 data sheet", "H100 memory bandwidth"),
    ("450 GB/s", "per direction inside a node", "H100 NVLink bandwidth"),
    ("50 GB/s", "per direction inside a node", "H100 inter-node bandwidth per GPU"),
    # Worked examples of formulas and published tables, each asserted by a test.
    ("1.88 GB", "120 / 31.4 / 16.6", "ZeRO paper, Table 1 (tests/test_planner.py)"),
    ("1.5x", "data parallelism's 2Ψ", "3Ψ over 2Ψ, FSDP's traffic formula (tests/test_report.py)"),
    ("4x", "beats a flat ring", "a bound asserted by tests/test_planner.py::test_algorithm_costs"),
    ("4x", "the sequence one device holds", "the test's setup, not a measurement"),
    ("14.4 minutes", "fail as a cluster every", "cluster MTTF example (tests/test_perf_units.py)"),
    ("5%", "the test allows 5% below it", "the tolerance tests/test_planner_mla.py asserts on MLA FLOPs"),
    ("5.37 min", "Young gives", "Young interval example (tests/test_perf_units.py)"),
    ("4.72 min", "Young gives", "Daly interval example (tests/test_perf_units.py)"),
    ("58.5%", "goodput", "goodput formula example (tests/test_perf_units.py)"),
    ("9.1 min", "117, 57 and 9.1 min", "Daly's published example (tests/test_perf_units.py)"),
    # Tolerances the tests assert, and a bound the docs compare a measurement with: not measurements.
    ("10%", "within 10% above XLA's count", "tests/test_model.py::test_flops_formula_matches_compiled_step"),
    ("2%", "(loss within 2%)", "tests/test_model.py::test_bfloat16_compute_tracks_float32"),
    ("10%", "within 10% on the whole step", "tests/test_report.py's bound on FSDP's traffic"),
    ("6%", "of collective within 6%", "tests/test_planner.py's bound per collective kind"),
    ("3%", "all collectives together within 3%", "tests/test_planner.py's bound on all collectives"),
    ("6%", "within 6%. Measured", "tests/test_planner.py's bound on FLOPs"),
    ("5%", "within 5%, that the fusion bytes", "tests/test_graph_report.py's bound on the counts"),
    ("10%", "10% of cuDNN", "a bound the measured ratios are compared with (0.28-0.56x of cuDNN)"),
    ("1e-5", "merged equals unmerged to 1e-5", "tests/test_lora.py"),
    ("1e-5", "within 1e-5 in float32 under each placement", "tests/test_grpo.py's engine-trainer bound"),
    ("1e-5", "full forward pass to 1e-5", "tests/test_kv_cache.py"),
    ("1e-5", "for step, to 1e-5", "tests/test_multiprocess.py"),
    ("1e-5", "absolute difference of 1e-5", "tests/test_hf_parity.py"),
    ("1e-5", "1e-5 of the largest logit", "tests/test_hf_parity.py"),
    ("1e-6", "plain loss's within 1e-6", "tests/test_fused_ce.py"),
    ("1e-5", "(rtol 1e-5)", "tests/test_fused_ce.py"),
    ("1e-5", "over the same tokens gives, within 1e-5", "tests/test_logprobs.py"),
    ("1e-5", "logits (within 1e-5 relative)", "tests/test_dpo.py"),
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
# "x1.82" (RESULTS.md's ratio style): an x that does not follow a number or letter. A sentence's
# full stop may follow it ("x2.3."), a decimal point may not.
_PREFIXED = re.compile(rf"(?<![\w.])[x×]({_NUM})(?![\w]|\.\d)")
_SCIENTIFIC = re.compile(r"(?<![\w.])(\d(?:\.\d+)?[eE][-+]?\d+)(?![\w]|\.\d)")

_UNIT_ALT_SUFFIX = re.compile(rf"\d\s?(?:{_UNIT_ALT})(?![\w/])")

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+).+?\1")
_LINK_TARGET = re.compile(r"\]\([^)]*\)")
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)

# The key scheme.
_CITE = re.compile(r"<!--\s*fig:\s*(.*?)\s*-->")
_KEY = re.compile(r"[a-z0-9_]+(?:\.[a-z0-9_]+)+")
_KEY_HEADER = re.compile(r"^\|\s*key\s*\|\s*figure\s*\|\s*$")
_ENTRY = re.compile(r"^## (\d{4}-\d{2}-\d{2}) ")
_SUB_ENTRY = re.compile(r"^### .*\((\d{4}-\d{2}-\d{2})\)\s*$")


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
        if unit == "x" and (re.match(r"\s*\d", line[m.end() :]) or m.group(0)[-2].isspace()):
            continue  # "2x4", "16 x 128", "stage 2 x data 4": a shape or a product, not a ratio
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
    """(unit, value) of every figure in a RESULTS.md text, fenced blocks included (a script's
    printed table is a result too)."""
    found = {(unit, value) for _, unit, value, _ in figures_of(text)}
    # A figure wrapped across two lines of a paragraph ("0.41\nms") counts too.
    for paragraph in re.split(r"\n\s*\n", "\n".join(line for _, line in prose_lines(text))):
        found |= {(unit, value) for unit, value, _ in figures_in(" ".join(paragraph.split()))}
    for m in re.finditer(r"```.*?```", text, re.DOTALL):
        for line in m.group(0).splitlines():
            found |= {(unit, value) for unit, value, _ in figures_in(line)}
    return found


# --------------------------------------------------------------------------------------------
# RESULTS.md's entries and keys
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Entry:
    """A `## YYYY-MM-DD — ...` entry of RESULTS.md (its `###` sub-entries included)."""

    date: str
    title: str
    line: int  # of its title, 1-based
    text: str


@dataclasses.dataclass(frozen=True)
class Declaration:
    """One row of a `| key | figure |` table: the key, its figure cell and where it stands."""

    key: str
    written: str  # the figure cell as written
    figures: tuple[tuple[str, str], ...]  # (unit, value) of every figure in the cell
    date: str  # the entry's, or its dated sub-entry's
    line: int  # 1-based line of the row in RESULTS.md
    entry: str  # the `##` title


def entries(text: str) -> list[Entry]:
    """RESULTS.md's `## ` entries in file order (a `## ` title without a date is not an entry:
    it ends the one before)."""
    found: list[Entry] = []
    start: tuple[str, str, int] | None = None  # date, title, line of the open entry
    fenced = False
    lines = text.splitlines()
    for number, line in enumerate([*lines, "## end"], 1):
        if _FENCE.match(line):
            fenced = not fenced
        if fenced or not line.startswith("## "):
            continue
        if start is not None:
            date, title, first = start
            found.append(Entry(date, title, first, "\n".join(lines[first - 1 : number - 1])))
        m = _ENTRY.match(line)
        start = (m.group(1), line[3:].strip(), number) if m else None
    return found


def declarations(text: str) -> tuple[list[Declaration], list[str]]:
    """Every key row of RESULTS.md's key tables, and one line per malformed one."""
    found: list[Declaration] = []
    bad: list[str] = []
    entry_date = date = title = None
    in_table = fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
        if fenced:
            continue
        if line.startswith("## "):
            m = _ENTRY.match(line)
            entry_date = date = m.group(1) if m else None
            title = line[3:].strip()
        elif line.startswith("### "):
            m = _SUB_ENTRY.match(line)
            date = m.group(1) if m else entry_date
        if _KEY_HEADER.match(line.strip()):
            in_table = True
            if date is None:
                bad.append(f"benchmarks/RESULTS.md:{number}: a key table outside a dated `## ` entry")
            continue
        if not in_table:
            continue
        if not line.lstrip().startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if all(re.fullmatch(r":?-+:?", c) for c in cells):
            continue  # the separator row
        where = f"benchmarks/RESULTS.md:{number}"
        if len(cells) != 2:
            bad.append(f"{where}: a key row has two cells, `| key | figure |`")
            continue
        key, written = cells
        figures = tuple((unit, value) for unit, value, _ in figures_in(written))
        if not _KEY.fullmatch(key):
            bad.append(f"{where}: key {key!r} is not a lowercase dotted name (area.thing.measure)")
        elif not figures:
            bad.append(f"{where}: key {key} declares {written!r}, which holds no figure")
        elif date is not None:
            found.append(Declaration(key, written, figures, date, number, title))
    seen: dict[tuple[str, str], Declaration] = {}
    for d in found:
        if (d.key, d.entry) in seen:
            bad.append(f"benchmarks/RESULTS.md:{d.line}: key {d.key} is declared twice in '{d.entry}'")
        seen[(d.key, d.entry)] = d
    return found, bad


def load_keys(text: str) -> dict[str, list[Declaration]]:
    """Key -> its declarations, newest first (latest date, then nearer the top of the file)."""
    keys: dict[str, list[Declaration]] = {}
    for d in declarations(text)[0]:
        keys.setdefault(d.key, []).append(d)
    for found in keys.values():
        found.sort(key=lambda d: (d.date, -d.line), reverse=True)
    return keys


# --------------------------------------------------------------------------------------------
# The docs
# --------------------------------------------------------------------------------------------


def _allowed(unit: str, value: str, line: str) -> bool:
    for written, phrase, _ in ALLOWED:
        if phrase in line and any((u, v) == (unit, value) for u, v, _ in figures_in(written)):
            return True
    return False


def cited_keys(line: str) -> list[str]:
    """The keys a raw doc line names in its `<!-- fig: ... -->` comments."""
    return [key for m in _CITE.finditer(line) for key in m.group(1).split()]


def doc_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _name(md: pathlib.Path) -> str:
    return str(md.relative_to(ROOT)) if md.is_relative_to(ROOT) else str(md)


def _show(d: Declaration) -> str:
    return f"{d.key} = {d.written} ({d.date}, '{d.entry}')"


def _check(md: pathlib.Path, keys: dict[str, list[Declaration]], text: str):
    """(line number, (unit, value) or None, problem) for each problem of a doc's text."""
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        for key in cited_keys(line):
            if key not in keys:
                yield (
                    number,
                    None,
                    f"{_name(md)}:{number}: key {key} is declared by no `| key | figure |` table of benchmarks/RESULTS.md",
                )
    for number, unit, value, written in figures_of(text):
        line = lines[number - 1]
        cited = [keys[k] for k in cited_keys(line) if k in keys]
        if any((unit, value) in found[0].figures for found in cited) or _allowed(unit, value, line):
            continue
        where = f"{_name(md)}:{number}: '{written}'"
        older = [(found[0], d) for found in cited for d in found[1:] if (unit, value) in d.figures]
        if older:
            newest, old = older[0]
            problem = (
                f"{where} is {old.key}'s figure of {old.date}, superseded by the entry of "
                f"{newest.date} (value {newest.written}): quote the newer figure"
            )
        elif cited:
            problem = (
                f"{where} is not the newest figure of "
                + "; ".join(_show(found[0]) for found in cited)
                + " (quote that figure, or cite the key this one is)"
            )
        else:
            problem = (
                f"{where} names no key: add `<!-- fig: KEY -->` on its line, KEY a key of "
                "benchmarks/RESULTS.md (`python3 tests/test_doc_figures.py --report` lists candidates)"
            )
        yield number, (unit, value), problem


def problems(md: pathlib.Path, keys: dict[str, list[Declaration]], text: str | None = None) -> list[str]:
    """One line per figure of `md` (or of `text`, given as md's) that is not the newest figure
    of a key its line cites, and per cited key that RESULTS.md does not declare."""
    text = md.read_text(encoding="utf-8") if text is None else text
    return [problem for _, _, problem in _check(md, keys, text)]


def report(results_text: str | None = None, docs: list[pathlib.Path] | None = None) -> str:
    """For each doc line with a failing figure: the line, each figure's problem, and the keys
    that hold its value (newest first), or where no key does, the RESULTS.md entries that state
    it (newest first): what whoever tags the docs needs."""
    results_text = RESULTS.read_text(encoding="utf-8") if results_text is None else results_text
    keys = load_keys(results_text)
    by_age = sorted(entries(results_text), key=lambda e: (e.date, -e.line), reverse=True)
    stated = {e.line: results_figures(e.text) for e in by_age}
    out = []
    for md in doc_files() if docs is None else docs:
        text = md.read_text(encoding="utf-8")
        lines = text.splitlines()
        found = sorted(_check(md, keys, text), key=lambda f: f[0])
        if found:
            out.append(f"## {_name(md)}: {len(found)} problem(s)")
        shown = None
        for number, figure, problem in found:
            if number != shown:
                out.append(f"{_name(md)}:{number}: {lines[number - 1].strip()[:160]}")
                shown = number
            out.append("    " + problem.split(": ", 1)[1].split(" (", 1)[0].split(": add", 1)[0])
            if figure is None:
                continue
            holders = sorted(
                (ds for ds in keys.values() if any(figure in d.figures for d in ds)),
                key=lambda ds: (ds[0].date, -ds[0].line),
                reverse=True,
            )
            for ds in holders:
                if figure in ds[0].figures:
                    out.append(f"        key {ds[0].key} = {ds[0].written} ({ds[0].date})")
                else:
                    old = next(d for d in ds if figure in d.figures)
                    out.append(
                        f"        key {old.key}: {old.written} on {old.date}, superseded by {ds[0].written} ({ds[0].date})"
                    )
            if not holders:
                out += [f"        entry: line {e.line}: {e.title[:100]}" for e in by_age if figure in stated[e.line]]
                if not any(figure in stated[e.line] for e in by_age):
                    out.append("        no entry of RESULTS.md states this figure")
        if found:
            out.append("")
    return "\n".join(out) or "every doc figure names its key"


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keys() -> dict[str, list[Declaration]]:
    return load_keys(RESULTS.read_text(encoding="utf-8"))


@pytest.mark.parametrize("md", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_figure_in_the_docs_is_the_newest_of_its_key(md, keys):
    found = problems(md, keys)
    assert not found, f"{len(found)} figure(s) without their newest RESULTS.md figure:\n" + "\n".join(found)


def test_results_entries_are_dated_newest_first_and_their_key_tables_well_formed():
    text = RESULTS.read_text(encoding="utf-8")
    dates = [e.date for e in entries(text)]
    assert dates, "RESULTS.md has no `## YYYY-MM-DD — ...` entry"
    assert dates == sorted(dates, reverse=True), "RESULTS.md's `## ` entries are not newest first"
    titles = [line for line in text.splitlines() if line.startswith("## ")]
    assert len(titles) == len(dates), "a `## ` title of RESULTS.md has no date"
    found, bad = declarations(text)
    assert found, "RESULTS.md declares no key"
    assert not bad, "\n".join(bad)


def test_every_key_is_a_figure_of_its_entry():
    """A key's figure is one its entry states (the table names it, it does not add it)."""
    text = RESULTS.read_text(encoding="utf-8")
    stated = {}
    for e in entries(text):
        body = re.sub(r"^\|\s*key\s*\|\s*figure\s*\|\s*\n(\|.*\n?)*", "", e.text, flags=re.MULTILINE)
        stated[e.title] = results_figures(body)
    missing = [
        f"benchmarks/RESULTS.md:{d.line}: {d.key} = {d.written}: '{unit} {value}' is not stated in '{d.entry}'"
        for d in declarations(text)[0]
        for unit, value in d.figures
        if (unit, value) not in stated[d.entry]
    ]
    assert not missing, "\n".join(missing)


_SYNTHETIC = """# Results

## 2026-12-05 — Newer

Machine, commit, command.

| key | figure |
|---|---|
| kernels.flash.fwd_bwd_vs_cudnn | 0.61x |
| suite.quick.cold | 11 min 31 s |

## 2026-12-05 — Same day, lower in the file

| key | figure |
|---|---|
| suite.quick.cold | 12 min 14 s |

## 2026-11-30 — Older

| key | figure |
|---|---|
| kernels.flash.fwd_bwd_vs_cudnn | 0.56x |
| gpu.decode.batch1 | 502 tok/s |

### A sub-entry of its own date (2026-12-06)

| key | figure |
|---|---|
| gpu.decode.batch1 | 610 tok/s |
"""


def test_a_superseded_figure_fails_naming_the_newer_entry():
    keys = load_keys(_SYNTHETIC)
    doc = pathlib.Path("docs/example.md")
    old = "runs at 0.56x of cuDNN <!-- fig: kernels.flash.fwd_bwd_vs_cudnn -->\n"
    (found,) = problems(doc, keys, old)
    assert "superseded" in found and "2026-12-05" in found and "0.61x" in found, found
    assert problems(doc, keys, old.replace("0.56x", "0.61x")) == []
    # Same date: the entry nearer the top wins. A dated `###` is newer than its `##`.
    assert problems(doc, keys, "in 11 min 31 s <!-- fig: suite.quick.cold -->") == []
    assert "superseded" in problems(doc, keys, "in 12 min 14 s <!-- fig: suite.quick.cold -->")[0]
    assert problems(doc, keys, "| 1 | 610 tok/s <!-- fig: gpu.decode.batch1 --> |") == []
    assert "superseded" in problems(doc, keys, "decodes 502 tok/s <!-- fig: gpu.decode.batch1 -->")[0]


def test_unknown_keys_untagged_figures_and_other_keys_figures_fail():
    keys = load_keys(_SYNTHETIC)
    doc = pathlib.Path("docs/example.md")
    found = problems(doc, keys, "0.61x <!-- fig: kernels.flash.nothing -->")
    assert "kernels.flash.nothing is declared by no" in found[0] and "names no key" in found[1], found
    (found,) = problems(doc, keys, "runs at 0.61x of cuDNN\n")
    assert "names no key" in found
    (found,) = problems(doc, keys, "runs at 0.61x <!-- fig: suite.quick.cold -->")
    assert "not the newest figure of suite.quick.cold" in found
    # Several keys on one line, in one comment or in two; a table cell takes its header's unit.
    two = "0.61x, 11 min 31 s <!-- fig: kernels.flash.fwd_bwd_vs_cudnn suite.quick.cold -->"
    assert problems(doc, keys, two) == []
    assert problems(doc, keys, two.replace(" suite", " --> <!-- fig: suite")) == []
    table = "| batch | decode tok/s |\n|---|---|\n| 1 | 610 <!-- fig: gpu.decode.batch1 --> |\n"
    assert problems(doc, keys, table) == []


def test_key_tables_are_read_with_their_dates_and_malformed_rows_reported():
    keys = load_keys(_SYNTHETIC)
    assert [d.date for d in keys["gpu.decode.batch1"]] == ["2026-12-06", "2026-11-30"]
    assert keys["suite.quick.cold"][0].figures == (("min", "11"), ("s", "31"))
    _, bad = declarations("## 2026-12-01 — X\n\n| key | figure |\n|---|---|\n| Bad Key | 3% |\n| a.b | none |\n")
    assert len(bad) == 2 and "lowercase" in bad[0] and "no figure" in bad[1]


def test_the_rule_finds_figures_and_ignores_the_rest():
    line = (
        "48.2% MFU, 1.82x faster, x2.3, 0.28-0.56x of cuDNN, 3e-6, 502 tok/s, 3 min, "
        "17,555 tokens/s, a 2x4 mesh, 16 x 128 tokens, stage 2 x data 4, 8 devices, 4 layers, 2 stages"
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
    assert [(u, v) for u, v, _ in figures_in("within 4.17e-06. By x2.3.")] == [("x", "2.3"), ("e", "4.17e-06")]
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


if __name__ == "__main__":
    if sys.argv[1:] != ["--report"]:
        sys.exit("usage: python3 tests/test_doc_figures.py --report")
    print(report())
