"""The manifests' own pod specs, run by ``podman kube play``.

``kubectl kustomize`` renders an overlay of the shipped manifests (images pointed at the
test's tags, the placeholder secrets replaced: what every user's overlay does); each pod
that the cluster would run goes through ``podman kube play`` with its command, args, env
from the ConfigMaps and the Secret, securityContext (uid, read-only root file system,
dropped capabilities), volumes and grace period as written.

What podman 4.3 (Debian bookworm's) cannot take as it is, and what is done instead
(``DIFFERENCES``), is all that changes; ``UNSUPPORTED`` lists the kinds it cannot run at all.
"""

from __future__ import annotations

import base64
import copy
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.podman import LABEL, ROOT, podman, remember

#: Kinds kube play cannot run, and why; the tests check that nothing else is left out.
UNSUPPORTED = {
    "Namespace": "podman has no namespaces (one podman host is one namespace)",
    "Service": "podman has no Services: each becomes a network alias of the pods its "
               "selector picks (StatefulSet pods also answer to POD.SERVICE)",
    "PodDisruptionBudget": "no voluntary disruptions (drains) to budget",
    "NetworkPolicy": "a podman network has no ingress policy",
    "HorizontalPodAutoscaler": "no metrics-server",
    "Ingress": "no ingress controller",
}
#: Every change made to a rendered pod spec before kube play, and why.
DIFFERENCES = [
    "Secret: each secretKeyRef becomes its value (podman 4.3 stores a played Secret as YAML "
    "and then fails to read it as JSON: containers/podman#17071)",
    "$(VAR) references between env entries are expanded (kube play 4.3 leaves them literal)",
    "StatefulSet: one Pod per ordinal, named as Kubernetes names it (NAME-0, ...), with a "
    "PersistentVolumeClaim per claim template (kube play 4.3 has no StatefulSet)",
    "Deployment: one pod per replica, each with emptyDir volumes of its own (kube play 4.3 "
    "makes an emptyDir a named volume that every pod of the file shares)",
    "Job: its pod template played as a Pod (restartPolicy as written); the test waits for it "
    "to exit 0 where the Job controller would",
    "containerPorts are dropped (kube play 4.3 publishes each on the host's same port, so "
    "replicas collide); the API's gets a free host port, the stand-in for a port-forward",
    "fieldRef env (metadata.name, status.podIP) is filled in here with the pod's name and "
    "the static address it is played with (a StatefulSet pod's address is needed up front)",
]


def render(overlay: str, images: dict[str, str], secrets: dict[str, str],
           work: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize`` of an overlay of ``k8s/<overlay>`` that sets the images and
    replaces the Secret's values, as a user's own overlay does."""
    work.mkdir(parents=True, exist_ok=True)
    base = Path("../" * len(work.resolve().parts[1:])) / ROOT.relative_to("/") / overlay
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [str(base)],
        "images": [{"name": name, "newName": tag.rsplit(":", 1)[0],
                    "newTag": tag.rsplit(":", 1)[1]} for name, tag in images.items()],
        "secretGenerator": [{"name": "gemq-secrets", "behavior": "replace",
                             "literals": [f"{k}={v}" for k, v in secrets.items()]}],
    }
    (work / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    out = subprocess.run(["kubectl", "kustomize", str(work)], capture_output=True, text=True,
                         check=True, timeout=120)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@dataclass
class Pod:
    """One pod as kube play gets it: its file, and the names it answers to."""

    name: str                  # the pod's name as Kubernetes would give it
    kind: str                  # the workload kind it comes from
    workload: str              # the Deployment, StatefulSet or Job it belongs to
    documents: list[dict[str, Any]]
    aliases: list[str] = field(default_factory=list)
    ip: str | None = None
    host_port: tuple[int, int] | None = None  # (host, container)

    @property
    def spec(self) -> dict[str, Any]:
        return self.documents[-1]["spec"]["template"]["spec"] \
            if self.documents[-1]["kind"] == "Deployment" else self.documents[-1]["spec"]

    @property
    def podman_name(self) -> str:
        """The pod's name in podman (kube play names a Deployment's pod NAME-pod-0)."""
        return f"{self.name}-pod-0" if self.documents[-1]["kind"] == "Deployment" \
            else self.name

    def container(self, name: str) -> str:
        """The podman name of one of its containers."""
        return f"{self.podman_name}-{name}"


def pods(documents: list[dict[str, Any]], addresses: Iterator[str]) -> list[Pod]:
    """Every pod the rendered objects would run, ready for kube play; ``addresses``: the
    static addresses handed out in order (StatefulSet pods need theirs up front)."""
    skipped = {d["kind"] for d in documents} - set(UNSUPPORTED) - {
        "ConfigMap", "Secret", "Deployment", "StatefulSet", "Job"}
    assert not skipped, f"kinds this runner does not know: {skipped}"
    configmaps = [d for d in documents if d["kind"] == "ConfigMap"]
    secrets = {d["metadata"]["name"]: {k: base64.b64decode(v).decode()
                                       for k, v in d.get("data", {}).items()}
               for d in documents if d["kind"] == "Secret"}
    services = [d for d in documents if d["kind"] == "Service"]
    out: list[Pod] = []
    for workload in documents:
        kind, name = workload["kind"], workload["metadata"]["name"]
        if kind not in ("Deployment", "StatefulSet", "Job"):
            continue
        template = workload["spec"]["template"]
        count = workload["spec"].get("replicas", 1) if kind != "Job" else 1
        for i in range(count):
            pod_name = f"{name}-{i}"
            spec = copy.deepcopy(template["spec"])
            labels = {**template["metadata"].get("labels", {}),
                      LABEL.split("=")[0]: LABEL.split("=")[1]}
            claims = _claims(workload, i, spec) if kind == "StatefulSet" else []
            ip = next(addresses) if kind == "StatefulSet" else None
            _own_empty_dirs(spec, pod_name)
            for container in spec["containers"]:
                container.pop("ports", None)
                container["env"] = _resolved_env(container.get("env", []), secrets,
                                                 pod_name, ip)
            aliases = [s["metadata"]["name"] for s in services
                       if _selects(s, template["metadata"].get("labels", {}))]
            if kind == "StatefulSet":
                aliases.append(f"{pod_name}.{workload['spec']['serviceName']}")
            document = _as_playable(kind, pod_name, labels, spec)
            out.append(Pod(pod_name, kind, name, [*configmaps, *claims, document],
                           aliases, ip))
    return out


def _as_playable(kind: str, name: str, labels: dict[str, str],
                 spec: dict[str, Any]) -> dict[str, Any]:
    metadata = {"name": name, "labels": labels}
    if kind == "Deployment":
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata,
                "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                         "template": {"metadata": {"labels": labels}, "spec": spec}}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def _claims(workload: dict[str, Any], ordinal: int, spec: dict[str, Any]) -> list[dict]:
    claims = []
    for template in workload["spec"].get("volumeClaimTemplates", []):
        volume = template["metadata"]["name"]
        claim = f"{volume}-{workload['metadata']['name']}-{ordinal}"
        claims.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                       "metadata": {"name": claim, "labels": {
                           LABEL.split("=")[0]: LABEL.split("=")[1]}},
                       "spec": template["spec"]})
        spec.setdefault("volumes", []).append(
            {"name": volume, "persistentVolumeClaim": {"claimName": claim}})
    return claims


def _own_empty_dirs(spec: dict[str, Any], pod_name: str) -> None:
    for volume in spec.get("volumes", []):
        if "emptyDir" not in volume:
            continue
        old, new = volume["name"], f"{volume['name']}-{pod_name}"
        volume["name"] = new
        for container in spec["containers"]:
            for mount in container.get("volumeMounts", []):
                if mount["name"] == old:
                    mount["name"] = new


def _resolved_env(env: list[dict[str, Any]], secrets: dict[str, dict[str, str]],
                  pod_name: str, ip: str | None) -> list[dict[str, Any]]:
    """Values for secretKeyRef and fieldRef, and $(VAR) expanded as Kubernetes does: from
    the entries defined before, an unknown name left as it is."""
    seen: dict[str, str] = {}
    out = []
    for entry in env:
        source = entry.get("valueFrom", {})
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            value = next(v for name, data in secrets.items()
                         if name.startswith(ref["name"]) for k, v in data.items()
                         if k == ref["key"])
        elif "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            value = {"metadata.name": pod_name, "status.podIP": ip}[path] or ""
        elif "value" in entry:
            value = re.sub(r"\$\((\w+)\)", lambda m: seen.get(m.group(1), m.group(0)),
                           str(entry["value"]))
        else:  # resourceFieldRef and the like: left to kube play
            out.append(entry)
            continue
        seen[entry["name"]] = value
        out.append({"name": entry["name"], "value": value})
    return out


def _selects(service: dict[str, Any], labels: dict[str, str]) -> bool:
    selector = service["spec"].get("selector") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def play(pod: Pod, network: str) -> None:
    """``podman kube play`` of one pod on ``network``, answering to its aliases."""
    if pod.host_port is not None:
        host, container = pod.host_port
        for c in pod.spec["containers"]:
            c["ports"] = [{"containerPort": container, "hostPort": host}]
            break
    target = network + (":" + ",".join(f"alias={a}" for a in pod.aliases)
                        if pod.aliases else "")
    address = ["--ip", pod.ip] if pod.ip is not None else []
    # kube play 4.3 puts no label on what it makes: clean_up() removes what is listed here.
    volumes = [v.get("persistentVolumeClaim", {}).get("claimName")
               or v.get("configMap", {}).get("name")
               or (v["name"] if "emptyDir" in v else None) for v in pod.spec.get("volumes", [])]
    remember(pods=[pod.podman_name], volumes=[v for v in volumes if v])
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix=f"{pod.name}-") as f:
        yaml.safe_dump_all(pod.documents, f)
        f.flush()
        podman("kube", "play", "--network", target, *address, f.name, timeout=300)
