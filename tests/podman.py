"""Real containers for the deployment tests: podman, the shipped Dockerfiles, a network.

Everything here drives the ``podman`` command line, as an operator would. The machine is set
up by ``.ci/install-containers`` (podman, its engine settings, the stand-in base and Redis
images, ../shared/CONTAINERS.md); without it the container tests skip, except under CI,
where they fail.

The stand-ins enter only through build arguments and image names, never by editing the
Dockerfiles or the manifests:

- ``GEMQ_TEST_PYTHON_IMAGE`` (``localhost/python-stand-in:3.11``): the Dockerfiles'
  ``PYTHON_IMAGE``;
- ``GEMQ_TEST_REDIS_IMAGE`` (``localhost/redis-stand-in:7``): the manifests' ``redis``;
- ``GEMQ_TEST_TORCH_INDEX_URL`` (``https://pypi.org/simple``): ``TORCH_INDEX_URL``; the torch
  wheel that constraints.txt pins is taken from pip's find-links folder when this machine
  has one (mounted into the build at the same path).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
PYTHON_IMAGE = os.environ.get("GEMQ_TEST_PYTHON_IMAGE", "localhost/python-stand-in:3.11")
REDIS_IMAGE = os.environ.get("GEMQ_TEST_REDIS_IMAGE", "localhost/redis-stand-in:7")
TORCH_INDEX_URL = os.environ.get("GEMQ_TEST_TORCH_INDEX_URL", "https://pypi.org/simple")
IMAGES = ("aggregator", "worker", "api")
#: Every container, pod, volume and network a test makes carries this label, so that a test
#: run that was killed half-way leaves nothing the next one trips over.
LABEL = "gemq-test=containers"
TOKEN = "container-test-token-0123456789abcdef"
REDIS_PASSWORD = "0c7e1d5a9b3f4e2d8a6c"


def podman(*args: str, check: bool = True, timeout: float = 300,
           capture: bool = True) -> subprocess.CompletedProcess[str]:
    """One podman command; a failure raises with its output."""
    done = subprocess.run(["podman", *args], capture_output=capture, text=True,
                          timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} -> {done.returncode}\n"
                             f"{done.stdout}\n{done.stderr}")
    return done


def require_podman() -> None:
    """Skip (or, under CI, fail) when this machine cannot run the container tests."""
    missing = None
    if shutil.which("podman") is None:
        missing = "podman is not installed"
    elif podman("image", "exists", PYTHON_IMAGE, check=False).returncode != 0:
        missing = f"the base image {PYTHON_IMAGE} is missing"
    elif podman("image", "exists", REDIS_IMAGE, check=False).returncode != 0:
        missing = f"the Redis image {REDIS_IMAGE} is missing"
    if missing is None:
        return
    message = f"{missing}: run .ci/install-containers as root (../shared/CONTAINERS.md)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


#: What a test made that carries no label (kube play's pods and volumes), one per line.
MADE = ARTIFACTS / "podman-made.txt"


def remember(pods: Sequence[str] = (), volumes: Sequence[str] = ()) -> None:
    """Note pods and volumes for clean_up() that cannot carry the test label."""
    ARTIFACTS.mkdir(exist_ok=True)
    with MADE.open("a") as f:
        f.writelines([f"pod {p}\n" for p in pods] + [f"volume {v}\n" for v in volumes])


def clean_up() -> None:
    """Remove every pod, container, volume and network a container test made."""
    podman("pod", "rm", "--force", "--filter", f"label={LABEL}", check=False)
    made = [line.split(" ", 1) for line in MADE.read_text().splitlines()] \
        if MADE.exists() else []
    for kind, name in made:
        if kind == "pod":
            podman("pod", "rm", "--force", "--time", "0", name, check=False)
    for kind, name in made:
        if kind == "volume":
            podman("volume", "rm", "--force", name, check=False)
    MADE.unlink(missing_ok=True)
    ids = podman("ps", "--all", "--quiet", "--filter", f"label={LABEL}", check=False)
    if ids.stdout.split():
        podman("rm", "--force", "--time", "0", *ids.stdout.split(), check=False)
    podman("volume", "prune", "--force", "--filter", f"label={LABEL}", check=False)
    podman("network", "prune", "--force", "--filter", f"label={LABEL}", check=False)


def _find_links() -> str | None:
    """The folder pip takes local wheels from on this machine (torch's CPU build), if any."""
    folder = os.environ.get("PIP_FIND_LINKS")
    if not folder:
        got = subprocess.run(["pip", "config", "get", "global.find-links"],
                             capture_output=True, text=True, check=False)
        folder = got.stdout.strip() if got.returncode == 0 else ""
    return folder if folder and Path(folder).is_dir() else None


@dataclass(frozen=True)
class BuiltImage:
    name: str          # gemq-worker, ...
    tag: str           # localhost/gemq-worker:test
    size_bytes: int
    build_s: float


def build_image(service: str, tag: str) -> BuiltImage:
    """``podman build`` of docker/<service>.Dockerfile from the repository root."""
    volumes: list[str] = []
    if (links := _find_links()) is not None:
        volumes = ["--volume", f"{links}:{links}:ro"]
    started = time.monotonic()
    # --format docker: the OCI image format has no HEALTHCHECK, and podman would drop the
    # Dockerfiles' (docker build makes this format too).
    podman("build", "--format", "docker", "--network", "host", *volumes,
           "--build-arg", f"PYTHON_IMAGE={PYTHON_IMAGE}",
           "--build-arg", f"TORCH_INDEX_URL={TORCH_INDEX_URL}",
           "--file", f"docker/{service}.Dockerfile", "--tag", tag, str(ROOT), timeout=1500)
    took = time.monotonic() - started
    size = int(podman("image", "inspect", tag, "--format", "{{.Size}}").stdout.strip())
    return BuiltImage(f"gemq-{service}", tag, size, took)


def image_size(tag: str) -> int:
    return int(podman("image", "inspect", tag, "--format", "{{.Size}}").stdout.strip())


def inspect(container: str) -> dict:
    return json.loads(podman("inspect", container).stdout)[0]


def logs(container: str) -> str:
    done = podman("logs", container, check=False)
    return done.stdout + done.stderr


@dataclass
class Stopped:
    container: str
    seconds: float
    exit_code: int
    grace_s: int


def stop(container: str, grace_s: int) -> Stopped:
    """``podman stop`` with the manifest's grace period: how long it took, and the exit code."""
    started = time.monotonic()
    podman("stop", "--time", str(grace_s), container, timeout=grace_s + 60)
    took = time.monotonic() - started
    code = int(podman("inspect", container, "--format", "{{.State.ExitCode}}").stdout.strip())
    return Stopped(container, took, code, grace_s)


@dataclass
class Network:
    """A podman network on which containers answer to the names the manifests use."""

    name: str
    containers: list[str] = field(default_factory=list)

    def run(self, name: str, image: str, *args: str, aliases: tuple[str, ...] = (),
            options: tuple[str, ...] = ()) -> str:
        """Start a container (detached) on this network, reachable as each alias."""
        network = self.name + (":" + ",".join(f"alias={a}" for a in aliases)
                               if aliases else "")
        podman("run", "--detach", "--name", name, "--hostname", name, "--label", LABEL,
               "--network", network, *options, image, *args)
        self.containers.append(name)
        return name


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str,
             every_s: float = 0.5) -> float:
    """Poll until true; returns the seconds it took, fails naming what it waited for."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if predicate():
            return time.monotonic() - started
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def record(name: str, values: dict) -> None:
    """Measurements of a container test, kept in test-artifacts/containers.json (the numbers
    docs/deploy.md quotes come from there)."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / "containers.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[name] = values
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


def balanced(counters: dict[str, int]) -> bool:
    """A run's REST counters: every gradient published was applied, rejected (any reason)
    or left unused."""
    rejected = sum(v for k, v in counters.items() if k.startswith("rejected:"))
    return counters["published"] == counters["applied"] + rejected + counters.get("unused", 0)


def held_out_accuracy(client: Any, run: str) -> float:
    """The run's model downloaded over REST (``client``: an httpx client of the API), loaded
    into the paper's CNN, scored on mnist5k's 1,000 held-out samples."""
    import torch

    from gemq.models import PaperCNN
    from gemq.training.data import load_dataset
    from gemq.training.evaluate import evaluate

    got = client.get(f"/api/runs/{run}/model")
    assert got.status_code == 200, got.text
    model = PaperCNN()
    model.load_state_dict(torch.load(io.BytesIO(got.content), weights_only=True))
    _, accuracy = evaluate(model, load_dataset("mnist5k").test)
    assert accuracy is not None
    return accuracy
