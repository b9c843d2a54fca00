"""The manifests' own pod specs in real containers: ``kubectl kustomize`` of k8s/ (and of
the cluster overlay) through ``podman kube play`` (tests/kube.py says exactly what differs
from a cluster and why), and a run through them to its end, driven over REST."""

from __future__ import annotations

import ipaddress
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import kube
from tests.podman import (
    REDIS_IMAGE,
    REDIS_PASSWORD,
    TOKEN,
    BuiltImage,
    Network,
    balanced,
    held_out_accuracy,
    logs,
    podman,
    record,
    wait_for,
)

pytestmark = [pytest.mark.containers, pytest.mark.slow]


def _overlay_images(images: dict[str, BuiltImage]) -> dict[str, str]:
    return {"redis": REDIS_IMAGE, **{image.name: image.tag for image in images.values()}}


def _addresses(network: Network) -> Iterator[str]:
    subnet = podman("network", "inspect", network.name, "--format",
                    "{{range .Subnets}}{{.Subnet}}{{end}}").stdout.strip()
    hosts = ipaddress.ip_network(subnet).hosts()
    for _ in range(20):  # leave the first addresses to podman's own allocation
        next(hosts)
    return (str(h) for h in hosts)


class Played:
    """The pods of one rendered overlay, played on a network; pods stop in reverse order."""

    def __init__(self, network: Network, pods: list[kube.Pod]) -> None:
        self.network, self.pods, self.started = network, pods, []

    def play(self, workload: str) -> list[kube.Pod]:
        chosen = [p for p in self.pods if p.workload == workload]
        for pod in chosen:
            kube.play(pod, self.network.name)
            self.started.append(pod)
            self.network.containers += [pod.container(c["name"])
                                        for c in pod.spec["containers"]]
        return chosen

    def stop(self, pod: kube.Pod) -> dict[str, Any]:
        """``podman pod stop`` with the pod's grace period: seconds, and each exit code."""
        grace = int(pod.spec.get("terminationGracePeriodSeconds", 30))
        started = time.monotonic()
        podman("pod", "stop", "--time", str(grace), pod.podman_name, timeout=grace + 60)
        took = time.monotonic() - started
        codes = {c["name"]: int(podman("inspect", pod.container(c["name"]), "--format",
                                       "{{.State.ExitCode}}").stdout)
                 for c in pod.spec["containers"]}
        return {"seconds": round(took, 1), "grace_s": grace, "exit_codes": codes}


@pytest.fixture
def rendered(tmp_path: Path, images: dict[str, BuiltImage]) -> Any:
    def render(overlay: str) -> list[dict[str, Any]]:
        return kube.render(overlay, _overlay_images(images),
                           {"api-token": TOKEN, "redis-password": REDIS_PASSWORD},
                           tmp_path / overlay.replace("/", "-"))
    return render


def _api_pod(pods: list[kube.Pod]) -> tuple[kube.Pod, httpx.Client]:
    from gemq.running.embedded import free_port

    (api,) = [p for p in pods if p.workload == "gemq-api"]
    port = free_port()
    api.host_port = (port, 8000)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30,
                          headers={"Authorization": f"Bearer {TOKEN}"})
    return api, client


def _ready(client: httpx.Client) -> bool:
    try:
        return client.get("/readyz").status_code == 200
    except httpx.HTTPError:
        return False


def _run_to_its_end(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    created = client.post("/api/runs", json=body)
    assert created.status_code == 201, created.text
    run = body["run_id"]

    def view() -> dict[str, Any]:
        return client.get(f"/api/runs/{run}").json()

    wait_for(lambda: view()["state"] != "running" and view()["state"] != "created", 900,
             f"the end of {run}", every_s=2)
    if body.get("shards", 1) == 1:
        # A sharded run's counters combine its shards' (gemq/records/combine.py: published and
        # applied the smallest, unused the largest), so they balance per shard only.
        wait_for(lambda: balanced(view()["counters"]), 30, f"balanced counters: {view()}")
    return view()


def _no_tracebacks(played: Played) -> None:
    for name in played.network.containers:
        text = logs(name)
        assert "Traceback" not in text, (name, text[-4000:])


@pytest.mark.timeout(1200)
def test_the_base_manifests_run_a_run_under_kube_play(network: Network, rendered: Any) -> None:
    documents = rendered("k8s")
    left_out = sorted({d["kind"] for d in documents if d["kind"] in kube.UNSUPPORTED})
    pods = kube.pods(documents, _addresses(network))
    assert sorted(p.workload for p in pods) == [
        "gemq-aggregator", "gemq-aggregator", "gemq-api", "gemq-redis",
        "gemq-worker", "gemq-worker"]
    api, client = _api_pod(pods)
    played = Played(network, pods)
    (redis_pod,) = played.play("gemq-redis")
    played.play("gemq-api")
    aggregators = played.play("gemq-aggregator")
    workers = played.play("gemq-worker")
    wait_for(lambda: _ready(client), 180, "the API pod's /readyz")

    # What the pods got is what the manifests say.
    aggregator = aggregators[0].container("aggregator")
    assert podman("exec", aggregator, "id", "-u").stdout.strip() == "10001"
    assert podman("inspect", aggregator, "--format",
                  "{{.HostConfig.ReadonlyRootfs}}").stdout.strip() == "true"
    env = podman("exec", aggregator, "env").stdout.splitlines()
    assert "GEMQ_LEASE_MS=5000" in env  # from the ConfigMap gemq-aggregator
    assert f"GEMQ_REDIS_URL=redis://:{REDIS_PASSWORD}@gemq-redis:6379/0" in env
    assert podman("exec", redis_pod.container("redis"), "id", "-u").stdout.strip() == "999"
    probe = podman("exec", workers[0].container("worker"), "python", "-m",
                   "gemq.services.probe", "--max-age", "30", "--redis", check=False)
    assert probe.returncode == 0, probe.stdout + probe.stderr  # the readiness probe

    view = _run_to_its_end(client, {"run_id": "kube-play", "model": "cnn",
                                    "dataset": "mnist5k", "epochs": 6})
    assert view["state"] == "finished", view
    assert len(view["workers"]) == 2, view["workers"]
    accuracy = held_out_accuracy(client, "kube-play")
    assert accuracy >= 0.9, accuracy

    stops = {p.name: played.stop(p) for p in reversed(played.started)}
    for name, stopped in stops.items():
        assert set(stopped["exit_codes"].values()) == {0}, (name, stopped)
        assert stopped["seconds"] < stopped["grace_s"], (name, stopped)
    _no_tracebacks(played)
    record("kube_play_base", {"left_out": left_out, "differences": kube.DIFFERENCES,
                              "accuracy": accuracy, "updates": view["progress"]["updates"],
                              "stops": stops})
    client.close()
    print(json.dumps(stops, indent=1))


@pytest.mark.timeout(1500)
def test_the_cluster_overlay_runs_a_sharded_run_under_kube_play(network: Network,
                                                                rendered: Any) -> None:
    """k8s/overlays/cluster: the StatefulSet's node script on three pods (static addresses,
    as a StatefulSet's pods keep their names), the Job that forms the cluster, the base's
    Redis for rq, four aggregators; a 3-shard run to its end."""
    documents = rendered("k8s/overlays/cluster")
    pods = kube.pods(documents, _addresses(network))
    api, client = _api_pod(pods)
    played = Played(network, pods)
    played.play("gemq-redis")
    nodes = played.play("gemq-redis-cluster")
    assert [p.name for p in nodes] == [f"gemq-redis-cluster-{i}" for i in range(3)]
    (job,) = played.play("gemq-redis-cluster-create")
    formed_in = wait_for(
        lambda: podman("inspect", job.container("create"), "--format",
                       "{{.State.Status}}").stdout.strip() == "exited", 300,
        "the cluster-forming Job's pod", every_s=2)
    job_log = logs(job.container("create"))
    assert podman("inspect", job.container("create"), "--format",
                  "{{.State.ExitCode}}").stdout.strip() == "0", job_log
    info = podman("exec", nodes[0].container("redis"), "sh", "-c",
                  f"REDISCLI_AUTH={REDIS_PASSWORD} redis-cli cluster info").stdout
    assert "cluster_state:ok" in info and "cluster_known_nodes:3" in info, info
    played.play("gemq-api")
    played.play("gemq-aggregator")
    played.play("gemq-worker")
    wait_for(lambda: _ready(client), 180, "the API pod's /readyz")

    view = _run_to_its_end(client, {"run_id": "kube-cluster", "model": "cnn",
                                    "dataset": "mnist5k", "epochs": 3, "shards": 3})
    assert view["state"] == "finished", view
    assert [s["updates"] for s in view["shards"]] == [view["progress"]["budget"]] * 3, \
        view["shards"]
    leaders = {s["leader"] for s in view["shards"]}
    accuracy = held_out_accuracy(client, "kube-cluster")

    stops = {p.name: played.stop(p) for p in reversed(played.started) if p is not job}
    for name, stopped in stops.items():
        assert set(stopped["exit_codes"].values()) == {0}, (name, stopped)
        assert stopped["seconds"] < stopped["grace_s"], (name, stopped)
    _no_tracebacks(played)
    record("kube_play_cluster", {"cluster_formed_s": round(formed_in, 1),
                                 "shard_updates": [s["updates"] for s in view["shards"]],
                                 "leaders": len(leaders), "accuracy": accuracy,
                                 "stops": stops})
    client.close()
