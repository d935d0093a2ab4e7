"""The user guide's reference tables say what the code does.

docs/guide.rst repeats three things the code defines: the loader's signature,
the keys of ``loader.stats`` (also tabled in ``pingpong/stats.py``'s docstring)
and the exceptions with the built-in each also is. These tests read the tables
out of the files and compare them with the code, so a new argument, counter or
exception cannot be added without its row.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import re
from pathlib import Path

import torch

import pingpong
from pingpong import stats as stats_module

ROOT = Path(__file__).resolve().parent.parent
GUIDE = (ROOT / "docs" / "guide.rst").read_text()


def simple_table_rows(text: str, heading: str) -> list[list[str]]:
    """The rows of the first RST simple table after the line ``heading``.

    Each row is the text of its columns, continuation lines (an empty first
    column) joined to the row above. Column spans come from the border line.
    """
    lines = text[text.index("\n" + heading + "\n") if heading else 0:].splitlines()
    start = next(i for i, line in enumerate(lines) if re.fullmatch(r"=+( +=+)+", line))
    spans = [m.span() for m in re.finditer(r"=+", lines[start])]
    spans[-1] = (spans[-1][0], 10_000)  # the last column may run past its border
    rows: list[list[str]] = []
    borders = 0
    for line in lines[start:]:
        if re.fullmatch(r"=+( +=+)+", line):
            borders += 1
            if borders == 3:
                break
            continue
        if borders < 2 or not line.strip():
            continue
        cells = [line[a:b].strip() for a, b in spans]
        if cells[0]:
            rows.append(cells)
        else:
            rows[-1] = [f"{old} {new}".strip() for old, new in zip(rows[-1], cells, strict=True)]
    return rows


def test_the_guides_signature_is_the_loaders() -> None:
    block = GUIDE[GUIDE.index("pingpong.PingPongLoader(") + len("pingpong.PingPongLoader("):]
    params = block[:block.index(")\n")]
    documented = ast.parse(f"def f({params}): pass").body[0].args  # type: ignore[attr-defined]
    names = [a.arg for a in documented.args + documented.kwonlyargs]
    defaults = [None] * (len(documented.args) - len(documented.defaults)) + [
        ast.literal_eval(d) for d in documented.defaults]
    defaults += [ast.literal_eval(d) for d in documented.kw_defaults]

    actual = inspect.signature(pingpong.PingPongLoader).parameters
    assert names == list(actual)
    for name, default in zip(names, defaults, strict=True):
        want = actual[name].default
        assert default == (None if want is inspect.Parameter.empty else want), name
    keyword_only = {a.arg for a in documented.kwonlyargs}
    assert keyword_only == {n for n, p in actual.items() if p.kind is p.KEYWORD_ONLY}


def test_every_stats_key_has_its_row_in_the_guide_and_in_stats_py() -> None:
    source: list[tuple[torch.Tensor, torch.Tensor, list[object]]] = [
        (torch.arange(5), torch.arange(2), [])]
    with pingpong.PingPongLoader(source, torch.randn(10, 4), labels=torch.arange(10)) as loader:
        for _ in loader:
            pass
        keys = set(loader.stats)
    in_guide = {row[0].strip("`") for row in simple_table_rows(GUIDE, "Statistics")}
    docstring = stats_module.__doc__ or ""
    in_stats_py = {row[0].strip("`") for row in simple_table_rows(docstring, heading="")}
    assert in_guide == keys, (sorted(keys - in_guide), sorted(in_guide - keys))
    assert in_stats_py == keys, (sorted(keys - in_stats_py), sorted(in_stats_py - keys))


def test_the_guides_errors_table_names_every_exception_and_its_builtins() -> None:
    rows = simple_table_rows(GUIDE, "Errors")
    documented: dict[str, list[str]] = {}
    for name_cell, builtins_cell, _when in rows:
        match = re.fullmatch(r":class:`(\w+)`", name_cell)
        assert match is not None, name_cell
        documented[match[1]] = re.findall(r"``(\w+)``", builtins_cell)
    exported = {name for name in pingpong.__all__
                if inspect.isclass(getattr(pingpong, name))
                and issubclass(getattr(pingpong, name), pingpong.PingPongError)
                and name != "PingPongError"}
    assert set(documented) == exported, (sorted(exported - set(documented)),
                                         sorted(set(documented) - exported))
    for name, also in documented.items():
        cls = getattr(pingpong, name)
        assert also, f"{name}: no built-in named"
        for base in also:
            assert issubclass(cls, getattr(builtins, base)), f"{name} is not a {base}"
        # the most derived built-ins it is (IndexError, not also LookupError)
        found = [b for b in inspect.getmro(cls) if b.__module__ == "builtins"]
        nearest = {b.__name__ for b in found
                   if not any(c is not b and issubclass(c, b) for c in found)}
        assert set(also) == nearest, name


def _test_names_defined() -> set[str]:
    """Every test under tests/ by name: ``def test_*`` (functions and methods) and
    ``test_* = Machine.TestCase`` (hypothesis state machines)."""
    names = set()
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {name for name in names if name.startswith("test_")}


def test_every_test_the_docs_name_exists():
    """A test named in README.md or docs/ (as evidence for a claim) is a test that
    exists: ``test_x`` by its full name, ``test_x…`` / ``…x…`` as a part of one,
    ``test_x.py`` as a file.  Two such names went stale when their tests were
    renamed (found by a docs review)."""
    defined = _test_names_defined()
    files = {path.name for path in (ROOT / "tests").rglob("test_*.py")}
    stale = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.*"))]:
        if doc.suffix not in (".md", ".rst"):
            continue
        text = doc.read_text()
        for match in re.finditer(r"(…)?(test_[a-z0-9_]+)(\.py)?(…)?", text):
            before, name, py, after = match.groups()
            if py:
                found = name + ".py" in files
            elif before or after:
                found = any(name in test for test in defined)
            else:
                found = name in defined
            if not found:
                stale.append(f"{doc.name}: {match.group(0)}")
    assert stale == []
