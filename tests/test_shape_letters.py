"""docs/architecture.md "Shape letters" is the one table of the letters arrays are named with: every
shape suffix of a name (`x_BLD`, `k_sGK`, `mask_B1LS`) and every letter of an einsum spec
(`"BLD,DHK->BLHK"`) in the package's source is in it. Reads the source with `tokenize`; no jax."""

import ast
import io
import re
import tokenize
from pathlib import Path

from conftest import ROOT

SOURCES = ("models", "sharding", "src/meshwork", "train", "inference")
# A lower-case name, then "_" and a suffix holding at least one capital: x_BLD, t_k_B, kv_Bl2HK.
SUFFIX = re.compile(r"^_*[a-z][a-z0-9_]*_([A-Za-z0-9]*[A-Z][A-Za-z0-9]*)$")
EINSUM = re.compile(r"^[A-Za-z]+(,[A-Za-z]+)+->[A-Za-z]*$")


def table_letters() -> tuple[set[str], set[str]]:
    """(capitals, lower-case letters) the table allows; digits are literal sizes, always allowed."""
    text = (ROOT / "docs/architecture.md").read_text()
    section = text.split("\n## Shape letters\n", 1)[1].split("\n## ", 1)[0]
    tokens = [
        t
        for line in section.splitlines()
        if line.startswith("| `")
        for t in re.findall(r"`([^`]+)`", line.split("|")[1])
    ]
    capitals = {c for t in tokens for c in t if c.isupper()}
    # A lower-case letter is a part of its capital's axis; the table may also list one of its own (r).
    lower = {c.lower() for c in capitals} | {t for t in tokens if len(t) == 1 and t.islower()}
    return capitals, lower


def offenders(source: str, where: str, capitals: set[str], lower: set[str]) -> list[str]:
    def bad(letters: str) -> list[str]:
        return sorted({c for c in letters if (c.isupper() and c not in capitals) or (c.islower() and c not in lower)})

    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and (m := SUFFIX.match(tok.string)) and bad(m[1]):
            found.append(f"{where}:{tok.start[0]} name {tok.string}: {''.join(bad(m[1]))} not in the table")
        elif tok.type == tokenize.STRING:
            try:
                value = ast.literal_eval(tok.string)
            except (ValueError, SyntaxError):  # f-strings and the like
                continue
            if isinstance(value, str) and EINSUM.match(value.replace(" ", "")) and bad(value):
                found.append(f"{where}:{tok.start[0]} einsum {value!r}: {''.join(bad(value))} not in the table")
    return found


def source_files() -> list[Path]:
    seen, files = set(), []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.resolve() not in seen:  # src/meshwork links to the root folders
                seen.add(path.resolve())
                files.append(path)
    return files


def test_the_table_has_the_model_letters():
    capitals, lower = table_letters()
    assert set("BLSDFVHGRKE") <= capitals and {"l", "r"} <= lower


def test_a_letter_outside_the_table_is_found():
    capitals, lower = table_letters()
    found = offenders("y_BLI = jnp.einsum('BLD,DI->BLI', x_BLD, w_DI)\n", "example.py", capitals, lower)
    assert [f.split(": ")[-1] for f in found] == ["I not in the table"] * 3, found


def test_every_shape_letter_in_the_source_is_in_the_table():
    capitals, lower = table_letters()
    files = source_files()
    assert len(files) > 100
    found = [f for path in files for f in offenders(path.read_text(), str(path.relative_to(ROOT)), capitals, lower)]
    assert not found, "shape letters missing from docs/architecture.md#shape-letters:\n" + "\n".join(found)
