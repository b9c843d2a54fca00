"""The disk under a run's folder cannot cost the training: a full disk, a folder turned
read-only and a folder removed while `gemq run` trains. Real filesystems: a small tmpfs
in a mount namespace of the run's own (``unshare``), filled or made read-only from outside
with ``nsenter``; the removed folder is an ordinary one."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gemq.records.curvefile import CurveFile
from gemq.records.curves import csv_text
from gemq.records.runfolder import RunFolder
from tests.helpers import GemqProcess, wait_for

pytestmark = pytest.mark.slow

#: A run of some 15 s on an idle machine, the fault comes at its first rows.
STEPS = 20_000
RUN = ("run", "--model", "mlp", "--dataset", "digits", "--workers", "2", "--steps",
       str(STEPS), "--no-progress", "--run", "disk")


def _can_mount() -> bool:
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "mount", "-t",
                            "tmpfs", "tmpfs", "/mnt"], capture_output=True)
    return probe.returncode == 0


needs_mounts = pytest.mark.skipif(not _can_mount(),
                                  reason="needs unshare and nsenter with the right to mount")


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _assert_whole_curves(path: Path) -> None:
    """Every row once, in order, from the run's first updates to its last."""
    rows = _rows(path)
    updates = [int(row["updates"]) for row in rows]
    assert updates == sorted(set(updates)), "a row lost, repeated or out of order"
    assert updates[0] < 200 and updates[-1] == STEPS


def _results(output: str) -> dict[str, Path]:
    """The paths the run's last lines name."""
    named = dict(line.split(":", 1) for line in output.splitlines()[-3:])
    return {name: Path(path.strip()) for name, path in named.items()}


def _assert_results_complete(output: str, folder: Path) -> None:
    results = _results(output)
    assert {path.parent for path in results.values()} == {folder}, output
    summary = json.loads(results["summary"].read_text())
    assert summary["state"] == "finished" and summary["updates_applied"] == STEPS
    assert summary["model_path"] == str(folder / "model.pt")
    assert torch.load(folder / "model.pt", weights_only=True)  # a whole state_dict
    _assert_whole_curves(results["curves"])
    assert (folder / "config.toml").exists()


@pytest.fixture
def on_tmpfs(tmp_path: Path) -> Iterator[tuple[GemqProcess, Path]]:
    """`gemq run` writing to a 16 MB tmpfs mounted at tmp_path/mnt for it alone."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    launcher = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                'mount -t tmpfs -o size=16m tmpfs "$0" && exec "$@"', str(mount)]
    run = GemqProcess(*RUN, "--out", str(mount / "run"), launcher=launcher, cwd=tmp_path)
    try:
        yield run, mount
    finally:
        run.stop()


def _in_its_namespace(run: GemqProcess, script: str) -> None:
    subprocess.run(["nsenter", "-t", str(run.process.pid), "-m", "sh", "-c", script],
                   check=True, capture_output=True, timeout=30)


def _wait_for_first_rows(curves: Path, run: GemqProcess) -> None:
    def rows_written() -> bool:
        assert run.process.poll() is None, run.output()
        return curves.exists() and curves.read_text().count("\n") >= 3

    wait_for(rows_written, timeout_s=120, what="the run's first rows")


def _fallback(output: str) -> Path:
    (line,) = [line for line in output.splitlines() if "results go to" in line]
    return Path(line.split("results go to ", 1)[1].split(" instead")[0])


def _fault_mid_run(run: GemqProcess, mount: Path, fault: str, error: str) -> None:
    """Run ``fault`` (a shell script) in the run's namespace once its first rows are
    written; the run must finish, say ``error`` without a traceback, and leave every
    result in the folder its warning names."""
    # Its files, seen from outside its namespace.
    inside = Path(f"/proc/{run.process.pid}/root") / mount.relative_to("/") / "run"
    _wait_for_first_rows(inside / "metrics.csv", run)
    _in_its_namespace(run, fault)
    assert run.wait(300) == 0, run.output()
    output = run.output()
    fallback = _fallback(output)
    try:
        assert error in output and "Traceback" not in output
        _assert_results_complete(output, fallback)
    finally:
        shutil.rmtree(fallback, ignore_errors=True)


@needs_mounts
def test_a_disk_that_fills_up_costs_neither_the_run_nor_its_results(
        on_tmpfs: tuple[GemqProcess, Path]) -> None:
    run, mount = on_tmpfs
    _fault_mid_run(run, mount, f'cat /dev/zero > "{mount}/filler"; true',
                   "No space left on device")


@needs_mounts
def test_a_folder_turned_read_only_costs_neither_the_run_nor_its_model(
        on_tmpfs: tuple[GemqProcess, Path]) -> None:
    run, mount = on_tmpfs
    folder = mount / "run"
    _fault_mid_run(run, mount, f'mount --bind "{folder}" "{folder}" && '
                               f'mount -o remount,bind,ro "{folder}"', "Read-only file system")


def test_a_folder_removed_mid_run_is_made_again_with_all_its_results(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = GemqProcess(*RUN, "--out", str(out), cwd=tmp_path)
    try:
        _wait_for_first_rows(out / "metrics.csv", run)
        shutil.rmtree(out)
        assert run.wait(300) == 0, run.output()
        output = run.output()
    finally:
        run.stop()
    assert "metrics.csv was removed while the run trained" in output
    _assert_results_complete(output, out)


def test_the_curve_file_writes_each_row_once_wherever_the_folder_goes(
        tmp_path: Path) -> None:
    """The same, one flush at a time: removed, removed again, then moved elsewhere."""
    folder = RunFolder(tmp_path / "a", "r", ("metrics.csv",))
    header = ["stream_id", "updates"]
    curves = CurveFile(folder, header, [{"stream_id": "1-0", "updates": 1}])
    curves.flush()
    for n in (2, 3):
        shutil.rmtree(tmp_path / "a")
        curves.write([{"stream_id": f"{n}-0", "updates": n}])
        curves.flush()
    folder.path = tmp_path / "b"  # as RunFolder.leave moves it
    curves.write([{"stream_id": "4-0", "updates": 4}])
    curves.close()
    expected = csv_text(header, [{"stream_id": f"{n}-0", "updates": n} for n in (1, 2, 3, 4)],
                        with_header=True)
    assert (tmp_path / "b" / "metrics.csv").read_text() == expected
    assert (tmp_path / "a" / "metrics.csv").read_text() == csv_text(
        header, [{"stream_id": f"{n}-0", "updates": n} for n in (1, 2, 3)], with_header=True)
