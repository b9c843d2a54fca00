"""Shared by the deployment tests (tests/test_deploy_*.py): paths, the rendered manifests,
the Dockerfiles' instructions, and starting and stopping service processes.

There is no cluster and no Docker engine here. The manifests are rendered with
`kubectl kustomize`; what the containers would run is read from the Dockerfiles and the
manifests, so the tests can check it against the code and run it for real, outside a
container.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from gemq.services.settings import (
    AggregatorServiceSettings,
    ApiSettings,
    WorkerServiceSettings,
)

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
DOCKER = ROOT / "docker"
BIN = Path(sys.executable).parent

#: Deployment -> the settings class of the service its container runs, and its image.
SERVICES: dict[str, type[Any]] = {"gemq-aggregator": AggregatorServiceSettings,
                                  "gemq-worker": WorkerServiceSettings,
                                  "gemq-api": ApiSettings}
DOCKERFILES = {"gemq-aggregator": DOCKER / "aggregator.Dockerfile",
               "gemq-worker": DOCKER / "worker.Dockerfile",
               "gemq-api": DOCKER / "api.Dockerfile"}
#: Kinds of the long-running workloads (a Job runs to completion: no probes).
SERVERS = ("Deployment", "StatefulSet")
#: The pod fields a container's environment may read (fieldRef).
POD_FIELDS = {"metadata.name", "status.podIP"}
#: What an overlay would put into the Secret instead of the placeholders.
REAL_SECRETS = {"api-token": "0123456789abcdef0123456789abcdef",
                "redis-password": "5f3c9a0d1e7b24c8"}


# ---- the rendered manifests ---------------------------------------------------------


@dataclass
class Manifests:
    objects: list[dict[str, Any]]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        """The object of this kind whose name is ``name`` (or ``name-<kustomize hash>``)."""
        found = [o for o in self.objects if o["kind"] == kind
                 and re.fullmatch(rf"{re.escape(name)}(-[a-z0-9]{{10}})?", o["metadata"]["name"])]
        assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
        return found[0]

    def by_name(self, kind: str, full_name: str) -> dict[str, Any]:
        found = [o for o in self.objects
                 if o["kind"] == kind and o["metadata"]["name"] == full_name]
        assert found, f"{kind}/{full_name} is referenced but not rendered"
        return found[0]

    def pod_specs(self, kinds: tuple[str, ...] = (*SERVERS, "Job")) -> dict[str, dict[str, Any]]:
        """Pod templates by workload name: of servers and Jobs, or of ``kinds``."""
        return {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in self.objects
                if o["kind"] in kinds}

    def container(self, workload: str) -> dict[str, Any]:
        (container,) = self.pod_specs()[workload]["containers"]
        return container

    def secret(self, name: str, key: str) -> str:
        data = self.by_name("Secret", name)["data"]
        assert key in data, f"Secret {name} has no key {key}"
        return base64.b64decode(data[key]).decode()

    def env_names(self, container: dict[str, Any]) -> list[str]:
        """Every variable the container receives: env entries and envFrom sources."""
        names = [e["name"] for e in container.get("env", [])]
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                names += self.by_name("ConfigMap", source["configMapRef"]["name"])["data"]
            else:
                names += self.by_name("Secret", source["secretRef"]["name"])["data"]
        return names

    def environment(self, container: dict[str, Any], secrets: dict[str, str] | None = None,
                    pod: dict[str, str] | None = None) -> dict[str, str]:
        """The environment Kubernetes would build; ``secrets`` overrides Secret values,
        ``pod`` gives the pod's fields (fieldRef: status.podIP, metadata.name, ...)."""
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            env.update(self.by_name("ConfigMap", source["configMapRef"]["name"])["data"])
        for entry in container.get("env", []):
            env[entry["name"]] = self._value(entry, env, container, secrets or {}, pod or {})
        return env

    def _value(self, entry: dict[str, Any], earlier: dict[str, str],
               container: dict[str, Any], secrets: dict[str, str],
               pod: dict[str, str]) -> str:
        if "value" in entry:
            return _expand(entry["value"], earlier, entry["name"])
        source = entry["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            value = self.secret(ref["name"], ref["key"])
            return secrets.get(ref["key"], value)
        if "resourceFieldRef" in source:
            limit = source["resourceFieldRef"]["resource"].removeprefix("limits.")
            return str(container["resources"]["limits"][limit])
        if "fieldRef" in source:
            field = source["fieldRef"]["fieldPath"]
            assert field in POD_FIELDS, f"{entry['name']}: unknown field {field}"
            return pod.get(field, f"<{field}>")
        raise AssertionError(f"unhandled valueFrom in {entry}")

    def service(self, host: str) -> dict[str, Any]:
        """The Service a pod reaches as ``host`` (its name, in the pod's namespace)."""
        return self.by_name("Service", host)

    def redis_behind(self, url: str) -> dict[str, Any]:
        """The StatefulSet whose pods serve a redis:// URL of a gemq container."""
        selector = self.service(redis.connection.parse_url(url)["host"])["spec"]["selector"]
        (found,) = [o for o in self.objects if o["kind"] == "StatefulSet" and selector.items()
                    <= o["spec"]["template"]["metadata"]["labels"].items()]
        return found

    def config_files(self, workload: str) -> dict[str, str]:
        """The files the workload's ConfigMap volumes mount, by path in the container."""
        spec = self.pod_specs()[workload]
        maps = {v["name"]: v["configMap"]["name"] for v in spec.get("volumes", [])
                if "configMap" in v}
        files = {}
        for mount in self.container(workload).get("volumeMounts", []):
            if mount["name"] in maps:
                data = self.by_name("ConfigMap", maps[mount["name"]])["data"]
                files.update({f"{mount['mountPath']}/{name}": text
                              for name, text in data.items()})
        return files

    def is_cluster(self, redis_set: dict[str, Any]) -> bool:
        """Whether a Redis StatefulSet runs its servers in cluster mode."""
        files = self.config_files(redis_set["metadata"]["name"])
        return any(re.search(r"^cluster-enabled yes$", text, re.MULTILINE)
                   for text in files.values())


def _expand(value: str, earlier: dict[str, str], name: str) -> str:
    """Kubernetes' $(VAR) expansion: only variables defined earlier in the list expand;
    any other reference would stay in the value literally, so it fails the test here."""
    def one(match: re.Match[str]) -> str:
        assert match[1] in earlier, f"{name} refers to $({match[1]}), not defined before it"
        return earlier[match[1]]
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, value)


def _render(directory: Path) -> Manifests:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not on PATH: install it to check the Kubernetes manifests")
    out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return Manifests([o for o in yaml.safe_load_all(out.stdout) if o])


# ---- Dockerfiles --------------------------------------------------------------------


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs of the file, continuation lines joined."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            pairs.append((word.upper(), rest.strip()))
    return pairs


def _final_stage(dockerfile: Path) -> list[tuple[str, str]]:
    steps = _instructions(dockerfile)
    last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last_from:]


def _exec_form(dockerfile: Path, instruction: str) -> list[str]:
    (value,) = [rest for word, rest in _final_stage(dockerfile) if word == instruction][-1:]
    if instruction == "HEALTHCHECK":
        value = value[value.index("CMD") + 3:].strip()
    argv = json.loads(value)
    assert isinstance(argv, list), f"{dockerfile.name}: {instruction} is not in exec form"
    return argv


# ---- service processes --------------------------------------------------------------


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)


def _sigterm(process: subprocess.Popen[bytes]) -> tuple[int, float]:
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    code = process.wait(30)
    return code, time.monotonic() - started
