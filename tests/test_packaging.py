"""The shape of the package: one importable name, no import cycle, imports pointing down,
wing by wing (gemq/__init__.py draws the house)."""

from __future__ import annotations

import ast
import contextlib
import fcntl
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Source folders and the package each installs as (pyproject.toml's package-dir).
SOURCES = {"gemq": ROOT / "gemq", "gemq.services": ROOT / "services"}
#: The top of the house: may import anything; nothing in the library imports them.
TOP = ("gemq.cli", "gemq.__main__")
#: The package's public faces: they hand on names of the wings (gemq.train, gemq.models).
FACES = ("gemq", "gemq.models")
#: The wings of gemq/, floor by floor from the ground: a module imports its own wing and the
#: floors below it, never a wing beside it or above it. "base" is gemq/'s own modules.
FLOORS = (("base",), ("wire",), ("state",), ("aggregation", "training", "records"),
          ("running", "sim"), ("services",), ("top",))
WINGS = {wing for floor in FLOORS for wing in floor} - {"base", "services", "top"}
#: What the aggregator's image runs (docker/aggregator.Dockerfile installs no torch).
AGGREGATOR_IMAGE = ("gemq.services.aggregator", "gemq.services.jobs", "gemq.services.telemetry")


def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every gemq module ``name`` imports, anywhere in the file (lazy imports included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in known}
    return found - {name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _wing(module: str) -> str:
    if module in TOP or module in FACES:
        return "top"
    parts = module.split(".")
    if parts[1] == "services":
        return "services"
    return parts[1] if parts[1] in WINGS else "base"


def _floor(wing: str) -> int:
    return next(n for n, floor in enumerate(FLOORS) if wing in floor)


def _imports_torch(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                 else [])
        if any(name.split(".")[0] == "torch" for name in names):
            return True
    return False


def test_the_walk_sees_the_whole_package() -> None:
    graph = _graph()
    assert {"gemq.cli", "gemq.state.store", "gemq.sim.engine", "gemq.services.api.app",
            "gemq.services.api.routes.runs"} <= set(graph)
    assert "gemq.services.settings" in graph["gemq.services.api.deps"]  # relative imports
    assert "gemq.services.api.app" in graph["gemq.cli"]  # lazy imports


def test_no_import_cycle() -> None:
    graph = _graph()
    cycles = []
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_imports_point_down() -> None:
    """The library never imports the services or the CLI; the services never the CLI."""
    for module, targets in _graph().items():
        if module in TOP:
            continue
        upward = {t for t in targets if t in TOP}
        if not module.startswith("gemq.services"):
            upward |= {t for t in targets if t.startswith("gemq.services")}
        assert not upward, f"{module} imports {sorted(upward)}"


def test_the_wings_import_only_the_floors_below_them() -> None:
    """gemq/__init__.py's order: base < wire < state < aggregation, training, records <
    running, sim < services < the command line. The package's own __init__ (gemq) is left
    out as a target: anyone may read its __version__, and its lazy names (train,
    RunSummary, RunConfig) load only when someone names them."""
    wrong = []
    for module, targets in _graph().items():
        wing = _wing(module)
        for target in sorted(targets - {"gemq"}):
            if _wing(target) != wing and _floor(_wing(target)) >= _floor(wing):
                wrong.append(f"{module} ({wing}) imports {target} ({_wing(target)})")
    assert wrong == []


def test_every_wing_is_one_of_the_floors() -> None:
    folders = {p.parent.name for p in (ROOT / "gemq").glob("*/__init__.py")}
    assert folders == WINGS


@pytest.mark.parametrize("package", ["gemq", *sorted(f"gemq.{w}" for w in WINGS)])
def test_every_wing_maps_every_one_of_its_modules(package: str) -> None:
    """A wing's __init__ docstring has a line for each of its modules (``name``): the one
    list of modules there is (docs/design.md points to these)."""
    folder = ROOT.joinpath(*package.split("."))
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    modules = {p.stem for p in folder.glob("*.py") if p.name != "__init__.py"}
    assert {m for m in modules if f"``{m}``" not in doc} == set()
    if package == "gemq":
        assert {w for w in WINGS if f"``gemq.{w}``" not in doc} == set()


def test_nothing_the_aggregator_image_imports_reaches_torch() -> None:
    """Every module the aggregator's services import, lazily or not, and everything those
    import: none imports torch (the image has none). The walk does not go through the
    package's own __init__, whose lazy names the services never look up."""
    graph, modules = _graph(), _modules()
    reached: set[str] = set()
    todo = list(AGGREGATOR_IMAGE)
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += [] if module == "gemq" else sorted(graph[module])
    assert {"gemq.aggregation.aggregator", "gemq.state.store", "gemq.wire.codec"} <= reached
    assert sorted(m for m in reached if _imports_torch(modules[m])) == []


def test_the_aggregator_image_runs_without_loading_torch() -> None:
    code = ("import sys\n" + "".join(f"import {m}\n" for m in AGGREGATOR_IMAGE)
            + "assert 'torch' not in sys.modules, 'torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=ROOT)


def test_the_public_names_stay_where_users_import_them() -> None:
    """What the README and docs/api.md show: gemq.train, gemq.RunSummary, gemq.RunConfig,
    and the built-in models under gemq.models, the same objects as the wings'."""
    import gemq
    import gemq.models as public
    from gemq.config import RunConfig
    from gemq.models import PaperCNN, build_model
    from gemq.records.summary import RunSummary
    from gemq.running.local import train
    from gemq.training import models

    assert (gemq.train, gemq.RunSummary, gemq.RunConfig) == (train, RunSummary, RunConfig)
    assert (PaperCNN, build_model) == (models.PaperCNN, models.build_model)
    defined = {name for name, value in vars(models).items() if not name.startswith("_")
               and getattr(value, "__module__", None) == models.__name__}
    assert defined | {"IMAGE_MODELS"} == set(public.__all__)
    assert all(getattr(public, name) is getattr(models, name) for name in public.__all__)


def test_the_simulation_wing_is_light_to_import() -> None:
    """`gemq simulate`'s flags load with every command: no torch until it runs."""
    code = ("import sys, gemq.cli, gemq.sim.command, gemq.config\n"
            "assert 'torch' not in sys.modules, 'torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=ROOT)


@contextlib.contextmanager
def building_from_the_source_tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Held while pip builds from the source tree, where setuptools writes build/ and
    gemq.egg-info/: two builds at once (one per pytest-xdist process) race there, and one
    fails. The lock file lives in the session's temporary folder, which the processes of
    one run share."""
    lock = tmp_path_factory.getbasetemp().parent / "source-tree-build.lock"
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    with building_from_the_source_tree(tmp_path_factory):
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                        "--no-build-isolation", "--quiet", "--wheel-dir", str(out), str(ROOT)],
                       check=True, timeout=300, capture_output=True)
    (built,) = out.glob("gemq-*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_installs_one_top_level_name(wheel: zipfile.ZipFile) -> None:
    tops = {name.split("/")[0] for name in wheel.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"gemq"}


def test_the_wheel_carries_every_folder_of_python_files(wheel: zipfile.ZipFile) -> None:
    """pyproject.toml lists the packages one by one: a new wing must be listed too."""
    names = set(wheel.namelist())
    shipped = {f"{package.replace('.', '/')}/{path.relative_to(folder)}"
               for package, folder in SOURCES.items() for path in folder.rglob("*.py")}
    assert sorted(shipped - names) == []


def test_the_wheel_carries_the_services_and_the_dashboard(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    assert {"gemq/services/api/app.py", "gemq/services/probe.py", "gemq/web/index.html",
            "gemq/web/style.css"} <= names
    scripts = [n for n in names if n.startswith("gemq/web/") and n.endswith(".js")]
    assert scripts, "the dashboard's JavaScript"


@pytest.mark.slow
def test_a_plain_install_brings_no_dataset_packages(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """pip resolves `pip install gemq` (no extra) from the registry and this machine's
    torch: the bundled datasets' packages and what they pull in stay out."""
    report = tmp_path / "report.json"
    with building_from_the_source_tree(tmp_path_factory):
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run",
                        "--ignore-installed", "--quiet", "--report", str(report), "-c",
                        "constraints.txt", "."],
                       cwd=ROOT, check=True, capture_output=True, timeout=600)
    names = {item["metadata"]["name"].lower().replace("_", "-")
             for item in json.loads(report.read_text())["install"]}
    assert {"gemq", "torch", "redis", "msgpack", "fastapi", "rq"} <= names
    assert not names & {"mlxtend", "scikit-learn", "pandas", "matplotlib", "scipy"}


def test_without_the_datasets_extra_a_bundled_dataset_is_one_clear_error(
        tmp_path: Path) -> None:
    hidden = tmp_path / "hide"
    (hidden / "sklearn").mkdir(parents=True)
    (hidden / "sklearn" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'sklearn'\", name='sklearn')\n")
    out = subprocess.run([sys.executable, "-m", "gemq", "run", "--model", "mlp", "--dataset",
                          "digits", "--steps", "5", "--no-progress"], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(hidden)}, capture_output=True,
                         text=True, timeout=120)
    assert (out.returncode, out.stdout) == (1, "")  # as for an unknown dataset
    assert out.stderr == ("gemq: error: dataset digits needs the scikit-learn package: pip "
                          "install 'gemq[datasets]' (or bring your own data: mnist-idx:DIR or "
                          "package.module:factory)\n")
