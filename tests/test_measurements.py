"""Measured numbers live in docs/performance.md, dated; the code says where, never how much.

A timing or a speed-up in a docstring or a comment goes stale the day the code changes. The
allow-list is empty on purpose: a number a comment needs is a setting (name its constant)
or a measurement (point at docs/performance.md).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: A number with a unit of time or throughput, or a speed-up ("5-13x faster", "3.1x").
MEASURED = re.compile(
    r"(?<![\w.])\d(?:[\d.,]*\d)?(?:\s*(?:-|to)\s*\d(?:[\d.,]*\d)?)?\s*"
    r"(?:ms|µs|us|ns|s|secs?|seconds?|milliseconds?|microseconds?|minutes?"
    r"|[KMG]i?B/s|x|×|times\s+(?:faster|slower|as\s+fast))(?![\w/])",
    re.IGNORECASE)
#: Where one may stand anyway. Keep it empty: move the number to docs/performance.md.
ALLOWED: set[tuple[str, str]] = set()


def _prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python file."""
    found = [(tok.start[0], tok.string) for tok in
             tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for statement in body:  # docstrings, and the strings documenting attributes
            if (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
                    and isinstance(statement.value.value, str)):
                found.append((statement.lineno, statement.value.value))
    return found


def _measured(path: Path, prose: list[tuple[int, str]]) -> list[str]:
    where = str(path.relative_to(ROOT))
    return [f"{where}:{line}: {match.group(0)!r}"
            for line, text in prose for match in MEASURED.finditer(text)
            if (where, match.group(0)) not in ALLOWED]


def test_the_pattern_finds_what_it_is_for() -> None:
    samples = ["took 20 ms", "5-13x faster", "0.3 s each", "26-37 ms", "1.5 GB/s",
               "three times faster", "374ms", "2 times slower"]
    assert [s for s in samples if not MEASURED.search(s)] == ["three times faster"]
    assert not MEASURED.search("an 11 M-parameter model in 2 shards, 64 MB, 16-bit, CRC16s")


def test_no_measured_number_in_the_package_docstrings_or_comments() -> None:
    found = []
    for path in sorted((ROOT / "gemq").rglob("*.py")):
        found += _measured(path, _prose(path.read_text()))
    assert found == [], "move these to docs/performance.md (dated) and point there"


def test_no_measured_number_in_pyproject_comments() -> None:
    path = ROOT / "pyproject.toml"
    comments = [(n, line.partition("#")[2]) for n, line in
                enumerate(path.read_text().splitlines(), 1) if "#" in line]
    assert _measured(path, comments) == []
