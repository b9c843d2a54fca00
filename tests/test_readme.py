"""The README's examples, run as a reader would run them: its words must stay true."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
pytestmark = pytest.mark.slow


def code_block(starting_with: str) -> str:
    blocks = re.findall(r"```(?:python|bash)\n(.*?)```", README.read_text(), re.S)
    matches = [b for b in blocks if b.startswith(starting_with)]
    assert len(matches) == 1, f"README has {len(matches)} blocks starting {starting_with!r}"
    return matches[0]


def example_env(tmp_path: Path) -> dict[str, str]:
    """A folder holding the README's mymodels.py, and the environment of a reader who
    runs the examples from it: no PYTHONPATH."""
    (tmp_path / "mymodels.py").write_text(code_block("# mymodels.py"))
    gemq_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PATH": gemq_bin + os.pathsep + os.environ["PATH"]}


def test_own_model_and_data_from_the_command_line(tmp_path: Path) -> None:
    env = example_env(tmp_path)
    command = code_block("gemq run --model mymodels").strip()
    out = subprocess.run([*command.split(), "--no-progress", "--json", "s.json"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["updates_applied"] == 500
    assert summary["test_accuracy"] > 0.9  # the label is the sign of feature 0


def test_own_model_and_data_from_python(tmp_path: Path) -> None:
    env = example_env(tmp_path)
    script = code_block("import gemq, mymodels")
    (tmp_path / "example.py").write_text(script.replace(
        "workers=8,", "workers=8, progress=False,"))
    out = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip().splitlines()[-1]) > 0.9
