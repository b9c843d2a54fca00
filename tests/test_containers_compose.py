"""The repository's compose.yaml, run by podman-compose as a user would run it: ``up``, a run
through the REST API on the published port, the model downloaded, ``stop``.

The compose file is used as shipped; only its variables change: the two secrets, the host
port of the API, and the image names (the session's images built from docker/, and the
stand-in Redis image; tests/podman.py). The project has a name of its own and is always taken
down (``down -v``), so it never touches other container tests' labels or networks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.podman import (
    ARTIFACTS,
    REDIS_IMAGE,
    REDIS_PASSWORD,
    ROOT,
    TOKEN,
    BuiltImage,
    balanced,
    held_out_accuracy,
    logs,
    podman,
    record,
    wait_for,
)

pytestmark = [pytest.mark.containers, pytest.mark.slow]

COMPOSE_FILE = ROOT / "compose.yaml"
# stop_grace_period of compose.yaml (the manifests' terminationGracePeriodSeconds).
GRACE_S = {"gemq-redis": 30, "gemq-api": 15, "gemq-aggregator": 15, "gemq-worker": 30}
RUN = "in-compose"
RUN_BODY = {"run_id": RUN, "model": "cnn", "dataset": "mnist5k", "algo": "gem", "epochs": 6}


def _podman_compose() -> str:
    """The podman-compose of this environment (the test extra), else the one on PATH."""
    beside = Path(sys.executable).with_name("podman-compose")
    found = str(beside) if beside.is_file() else shutil.which("podman-compose")
    if found is None:
        message = "podman-compose is missing: pip install -e '.[test]'"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


class Compose:
    """``podman-compose -p PROJECT -f compose.yaml ...`` with the test's variables."""

    def __init__(self, project: str, env: dict[str, str]) -> None:
        self.project = project
        self.command = [_podman_compose(), "-p", project, "-f", str(COMPOSE_FILE)]
        self.env = {**os.environ, **env}

    def __call__(self, *args: str, timeout: float = 300,
                 check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([*self.command, *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout, cwd=ROOT)
        if check and done.returncode != 0:
            raise AssertionError(f"podman-compose {' '.join(args)} -> {done.returncode}\n"
                                 f"{done.stdout[-5000:]}\n{done.stderr[-5000:]}")
        return done

    def containers(self) -> list[dict[str, Any]]:
        """The project's containers (podman ps --format json), by name."""
        done = podman("ps", "--all", "--format", "json", "--filter",
                      f"label=io.podman.compose.project={self.project}")
        return sorted(json.loads(done.stdout or "[]"), key=lambda c: c["Names"][0])


def _service(container: dict[str, Any]) -> str:
    return str(container["Labels"]["io.podman.compose.service"])


@pytest.mark.timeout(900)
def test_compose_runs_a_run(images: dict[str, BuiltImage],
                            request: pytest.FixtureRequest) -> None:
    from gemq.running.embedded import free_port

    port = free_port()
    compose = Compose(f"gemq-test-compose-{os.getpid()}", {
        "GEMQ_REDIS_PASSWORD": REDIS_PASSWORD, "GEMQ_API_TOKEN": TOKEN,
        "GEMQ_API_PUBLISH": f"127.0.0.1:{port}", "GEMQ_REDIS_IMAGE": REDIS_IMAGE,
        **{f"GEMQ_{s.upper()}_IMAGE": image.tag for s, image in images.items()}})
    try:
        started = time.monotonic()
        compose("up", "-d", "--no-build")
        up_s = time.monotonic() - started
        containers = compose.containers()
        services = sorted(_service(c) for c in containers)
        assert services == ["gemq-aggregator", "gemq-api", "gemq-redis",
                            "gemq-worker", "gemq-worker"], services

        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30,
                              headers={"Authorization": f"Bearer {TOKEN}"})
        request.addfinalizer(client.close)

        def ready() -> bool:
            try:
                return client.get("/readyz").status_code == 200
            except httpx.HTTPError:
                return False

        ready_s = wait_for(ready, 240, "the API's /readyz on the published port")
        created = client.post("/api/runs", json=RUN_BODY)
        assert created.status_code == 201, created.text
        run_started = time.monotonic()

        def view() -> dict[str, Any]:
            got = client.get(f"/api/runs/{RUN}")
            assert got.status_code == 200, got.text
            return got.json()

        # created -> running -> finished (or stopped, failed).
        wait_for(lambda: view()["state"] not in ("created", "running"), 600, "the run's end",
                 every_s=2)
        run_s = time.monotonic() - run_started
        ended = view()
        assert ended["state"] == "finished", ended
        # The aggregator's last step counts what is left in the stream as unused, just after
        # the state says finished.
        wait_for(lambda: balanced(view()["counters"]), 30,
                 f"published = applied + rejected + unused: {view()['counters']}")
        counters = view()["counters"]
        # Both worker containers took part: each one's hostname begins its worker's id.
        hosts = {podman("inspect", c["Id"], "--format", "{{.Config.Hostname}}").stdout.strip()
                 for c in containers if _service(c) == "gemq-worker"}
        taking_part = [w["worker_id"] for w in ended["workers"] if w["applied"] > 0]
        assert len(hosts) == 2 and {h for h in hosts
                                    if any(w.startswith(h) for w in taking_part)} == hosts, \
            (hosts, ended["workers"])
        held_out_accuracy(client, RUN)

        stop_at = time.time()
        compose("stop", timeout=120)
        stop_s = time.time() - stop_at
        stopped = compose.containers()
        # Seconds from the stop command to each container's exit (ps's ExitedAt is whole
        # seconds; inspect's FinishedAt is not).
        stops = {c["Names"][0]: round(int(podman(
            "inspect", c["Id"], "--format", "{{.State.FinishedAt.UnixNano}}").stdout) / 1e9
            - stop_at, 1) for c in stopped}
        for c in stopped:
            name = c["Names"][0]
            restarts = podman("inspect", name, "--format", "{{.RestartCount}}").stdout.strip()
            assert c["Exited"] and c["ExitCode"] == 0, (name, c["ExitCode"], logs(name)[-3000:])
            assert restarts == "0", (name, restarts, logs(name)[-3000:])
            assert stops[name] < GRACE_S[_service(c)], (name, stops[name])
            assert "Traceback" not in logs(name), (name, logs(name)[-5000:])
        record("compose", {
            "up_s": round(up_s, 1), "ready_s": round(ready_s, 1), "run_s": round(run_s, 1),
            "updates": ended["progress"]["updates"], "counters": counters,
            "workers": len(taking_part), "stop_s": round(stop_s, 1), "stops_s": stops})
    finally:
        folder = ARTIFACTS / request.node.name
        folder.mkdir(parents=True, exist_ok=True)
        for c in compose.containers():
            (folder / f"{c['Names'][0]}.log").write_text(logs(c["Names"][0]))
        compose("down", "-v", timeout=180, check=False)
        # What down missed (it knows only the file's containers): this project's own.
        if left := [c["Id"] for c in compose.containers()]:
            podman("rm", "--force", "--time", "0", *left, check=False)
        podman("pod", "rm", "--force", f"pod_{compose.project}", check=False)
        podman("volume", "rm", "--force", f"{compose.project}_redis-data", check=False)
        podman("network", "rm", "--force", f"{compose.project}_default", check=False)


