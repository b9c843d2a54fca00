"""The deployment's services as their containers run them, outside a container.

Redis starts with the StatefulSet's own script and configuration; the aggregator, the
worker and the API start with each image's own command and exactly the environment their
manifests give them, and pass their startup, liveness and readiness probes and the images'
health checks; a stale heartbeat fails the worker's liveness probe.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gemq.running.embedded import find_redis_server, free_port
from tests.deploy_helpers import (
    BIN,
    DOCKERFILES,
    K8S,
    REAL_SECRETS,
    SERVICES,
    Manifests,
    _exec_form,
    _render,
    _sigterm,
    _start,
)
from tests.helpers import wait_for


@pytest.fixture(scope="module")
def base() -> Manifests:
    return _render(K8S)


# ---- Redis as the StatefulSet runs it -----------------------------------------------


@dataclass
class ManifestRedis:
    port: int
    password: str
    env: dict[str, str]

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"


def _redis_command(base: Manifests, tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """The Redis container's argv with its volumes "mounted" under tmp_path."""
    container = base.container("gemq-redis")
    spec = base.pod_specs()["gemq-redis"]
    config_map = next(v["configMap"]["name"] for v in spec["volumes"] if v["name"] == "config")
    mounts = {m["mountPath"]: tmp_path / m["name"] for m in container["volumeMounts"]}
    for directory in mounts.values():
        directory.mkdir()
    argv = container["command"] + container["args"]
    conf = base.by_name("ConfigMap", config_map)["data"]["redis.conf"]
    for mount, directory in mounts.items():
        argv = [a.replace(mount, str(directory)) for a in argv]
        conf = conf.replace(f" {mount}\n", f" {directory}\n")
    (mounts["/etc/gemq-redis"] / "redis.conf").write_text(conf)
    return argv, base.environment(container)


@pytest.fixture
def manifest_redis(base: Manifests, tmp_path: Path) -> Iterator[ManifestRedis]:
    """redis-server started by the StatefulSet's own script, config and probe, on loopback."""
    argv, env = _redis_command(base, tmp_path)
    password = REAL_SECRETS["redis-password"]
    env = {**env, "REDIS_PASSWORD": password, "REDISCLI_AUTH": password}
    server_dir = str(Path(find_redis_server()).parent)
    env["PATH"] = f"{server_dir}{os.pathsep}{os.environ['PATH']}"
    port = free_port()
    process = subprocess.Popen([*argv, "--port", str(port), "--bind", "127.0.0.1"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    server = ManifestRedis(port, password, env)
    try:
        wait_for(lambda: _ping(server.url), timeout_s=20, what="the StatefulSet's Redis")
        yield server
    finally:
        process.terminate()
        process.wait(20)


def _ping(url: str) -> bool:
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=1) as client:
            return bool(client.ping())
    except redis.ConnectionError:
        return False


def test_redis_refuses_the_placeholder_password(base: Manifests, tmp_path: Path) -> None:
    argv, env = _redis_command(base, tmp_path)
    out = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 1 and "gemq-secrets" in out.stderr


def test_redis_runs_with_aof_and_the_password(base: Manifests,
                                             manifest_redis: ManifestRedis) -> None:
    with redis.Redis(port=manifest_redis.port) as anonymous, \
            pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    with redis.Redis.from_url(manifest_redis.url) as client:
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert client.config_get("save") == {"save": ""}
    probe = base.container("gemq-redis")["readinessProbe"]["exec"]["command"]
    probe = [a.replace("redis-cli", f"redis-cli -p {manifest_redis.port}") for a in probe]
    assert subprocess.run(probe, env=manifest_redis.env, timeout=30).returncode == 0


# ---- the services, as their containers would run them -------------------------------


def _service_env(base: Manifests, workload: str, server: ManifestRedis,
                 tmp_path: Path) -> dict[str, str]:
    """The manifest's environment, with the pod network mapped onto this machine."""
    env = base.environment(base.container(workload), REAL_SECRETS)
    for setting in ("GEMQ_REDIS_URL", "GEMQ_QUEUE_URL"):
        if setting in env:
            env[setting] = env[setting].replace("@gemq-redis:6379", f"@127.0.0.1:{server.port}")
    if "GEMQ_HEARTBEAT_FILE" in env:
        env["GEMQ_HEARTBEAT_FILE"] = str(tmp_path / f"{workload}.heartbeat")
    if workload == "gemq-api":
        env.update(GEMQ_HOST="127.0.0.1", GEMQ_PORT=str(free_port()))
    if "GEMQ_METRICS_PORT" in env:  # one port per pod there, two services on one host here
        env["GEMQ_METRICS_PORT"] = str(free_port())
    keep = {k: v for k, v in os.environ.items() if not k.startswith("GEMQ_")}
    return _with_venv({**keep, **env})


def _with_venv(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this interpreter's bin directory first: `python` and `gemq` are ours,
    as they are the image's in a container."""
    return {**env, "PATH": f"{BIN}{os.pathsep}{env.get('PATH', os.defpath)}"}


def _exec_probe(container: dict[str, Any], probe: str,
                env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(container[probe]["exec"]["command"], env=_with_venv(env),
                          cwd=tempfile.gettempdir(), capture_output=True, text=True,
                          timeout=30)


def _http_probe(container: dict[str, Any], probe: str, env: dict[str, str]) -> int:
    url = f"http://127.0.0.1:{env['GEMQ_PORT']}{container[probe]['httpGet']['path']}"
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0


def test_the_services_run_and_pass_their_probes(base: Manifests, manifest_redis: ManifestRedis,
                                                tmp_path: Path) -> None:
    """Each image's command with its manifest's environment: probes pass, SIGTERM ends it."""
    envs = {w: _service_env(base, w, manifest_redis, tmp_path) for w in SERVICES}
    processes = {}
    try:
        for workload, env in envs.items():
            dockerfile = DOCKERFILES[workload]
            argv = _exec_form(dockerfile, "ENTRYPOINT") + _exec_form(dockerfile, "CMD")
            processes[workload] = _start(argv, env, tmp_path / f"{workload}.log")
        for workload in ("gemq-aggregator", "gemq-worker"):
            container = base.container(workload)
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                wait_for(lambda c=container, p=probe, w=workload:
                         _exec_probe(c, p, envs[w]).returncode == 0, timeout_s=90,
                         what=f"{workload} {probe}")
            healthcheck = _exec_form(DOCKERFILES[workload], "HEALTHCHECK")
            assert subprocess.run(healthcheck, env=envs[workload], timeout=30).returncode == 0
            scrape = httpx.get(f"http://127.0.0.1:{envs[workload]['GEMQ_METRICS_PORT']}/metrics",
                               timeout=5)
            assert "gemq_build_info{" in scrape.text, (workload, scrape.text)
        api = base.container("gemq-api")
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            wait_for(lambda p=probe: _http_probe(api, p, envs["gemq-api"]) == 200,
                     timeout_s=90, what=f"gemq-api {probe}")
        healthcheck = _exec_form(DOCKERFILES["gemq-api"], "HEALTHCHECK")
        assert subprocess.run(healthcheck, env=envs["gemq-api"], timeout=30).returncode == 0
        for workload, process in processes.items():
            code, seconds = _sigterm(process)
            log = (tmp_path / f"{workload}.log").read_text()
            # uvicorn shuts down cleanly, then re-raises the signal: its status says SIGTERM.
            assert code in ((0, -signal.SIGTERM) if workload == "gemq-api" else (0,)), log
            # Before the kubelet's SIGKILL: within the manifest's grace period (15 or 30 s).
            grace_s = base.pod_specs()[workload]["terminationGracePeriodSeconds"]
            assert seconds < grace_s, f"{workload} took {seconds:.1f}s of its {grace_s} s"
        assert "Application shutdown complete" in (tmp_path / "gemq-api.log").read_text()
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def test_a_stale_heartbeat_fails_the_liveness_probe(base: Manifests, tmp_path: Path) -> None:
    heartbeat = tmp_path / "heartbeat"
    heartbeat.touch()
    old = time.time() - 120
    os.utime(heartbeat, (old, old))
    env = {**os.environ, "GEMQ_HEARTBEAT_FILE": str(heartbeat)}
    started = time.time()
    stale = _exec_probe(base.container("gemq-worker"), "livenessProbe", env)
    # The probe reads the age when it runs: 120 s plus however long Python took to start it.
    took = int(time.time() - started) + 1
    ages = {f"heartbeat {120 + s}s old" for s in range(took + 1)}
    assert stale.returncode == 1 and any(a in stale.stderr for a in ages), stale.stderr
    heartbeat.touch()
    fresh = _exec_probe(base.container("gemq-worker"), "livenessProbe", env)
    assert fresh.returncode == 0, fresh.stderr
