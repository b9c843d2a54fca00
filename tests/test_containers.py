"""The three images, built from the shipped Dockerfiles, and a whole run that lives in
containers, driven from the host only through what a user has: the REST API on a published
port, a browser, and podman (scale, kill, stop).

Real podman, real images, one podman network on which each container answers to the name of
its Kubernetes Service (``gemq-redis``, ``gemq-api``). tests/podman.py says how the machine
is set up and how the stand-in base images enter.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.podman import (
    LABEL,
    REDIS_IMAGE,
    REDIS_PASSWORD,
    ROOT,
    TOKEN,
    BuiltImage,
    Network,
    Stopped,
    balanced,
    held_out_accuracy,
    image_size,
    logs,
    podman,
    record,
    stop,
    wait_for,
)

pytestmark = [pytest.mark.containers, pytest.mark.slow]

CONFIG = ROOT / "k8s" / "base" / "config"
# terminationGracePeriodSeconds of k8s/base: podman stop gets the same time.
GRACE_S = {"redis": 30, "api": 15, "aggregator": 15, "worker": 30}
REDIS_URL = f"redis://:{REDIS_PASSWORD}@gemq-redis:6379/0"
RUN = "in-containers"
# The paper's CNN on mnist5k, GEM, with a budget no machine spends before the test has
# scaled the workers and killed the leader (12,500 updates); the test stops it after
# TRAINED_UPDATES (12 epochs of data over all workers), whatever the machine's speed.
RUN_BODY = {"run_id": RUN, "model": "cnn", "dataset": "mnist5k", "algo": "gem", "epochs": 200}
TRAINED_UPDATES = 750


def _service(net: Network, name: str, service: str, images: dict[str, BuiltImage],
             *extra: str, aliases: tuple[str, ...] = ()) -> str:
    """A gemq service container as k8s/base runs it: its image's entry point, its
    ConfigMap's variables (the .env file itself), the Redis URL with the password, uid
    10001, a read-only root file system with a writable /tmp."""
    options = ("--env-file", str(CONFIG / f"{service}.env"),
               "--env", f"GEMQ_REDIS_URL={REDIS_URL}",
               "--read-only", "--tmpfs", "/tmp:rw,size=256m",
               "--stop-timeout", str(GRACE_S[service]), *extra)
    return net.run(name, images[service].tag, options=options, aliases=aliases)


def _redis(net: Network) -> str:
    """Redis as k8s/base/redis.yaml runs it: the base's redis.conf, the password, AOF on a
    volume, uid 999."""
    podman("volume", "create", "--label", LABEL, "gemq-test-redis-data")
    return net.run(
        "gemq-test-redis", REDIS_IMAGE,
        "redis-server", "/etc/gemq-redis/redis.conf", "--requirepass", REDIS_PASSWORD,
        aliases=("gemq-redis",),
        options=("--volume", "gemq-test-redis-data:/data",
                 "--volume", f"{CONFIG / 'redis.conf'}:/etc/gemq-redis/redis.conf:ro",
                 "--user", "999:999", "--read-only",
                 "--stop-timeout", str(GRACE_S["redis"])))


@pytest.mark.timeout(1800)  # the session's images are built in this test's setup
def test_the_three_images_build(images: dict[str, BuiltImage]) -> None:
    """Built from the shipped Dockerfiles (the module's fixture); each runs as uid 10001 with
    gemq as its entry point, and the aggregator's has no torch."""
    from tests.podman import PYTHON_IMAGE

    base = image_size(PYTHON_IMAGE)
    for service, image in images.items():
        config = podman("image", "inspect", image.tag, "--format",
                        "{{.Config.User}} {{json .Config.Entrypoint}}").stdout.split(None, 1)
        assert config == ["10001:10001", '["gemq"]\n'], (service, config)
    helps = podman("run", "--rm", images["aggregator"].tag, "--help", check=False)
    assert helps.returncode == 0 and "aggregator" in helps.stdout, helps.stderr
    found = podman("run", "--rm", "--entrypoint", "python", images["aggregator"].tag, "-c",
                   "import importlib.util as u; print(u.find_spec('torch'))").stdout.strip()
    assert found == "None"
    record("images", {"base": {"image": PYTHON_IMAGE, "size_mb": round(base / 1e6)},
                      **{i.name: {"size_mb": round(i.size_bytes / 1e6),
                                  "build_s": round(i.build_s, 1)} for i in images.values()}})


@pytest.fixture
def api(network: Network, images: dict[str, BuiltImage]) -> Iterator[httpx.Client]:
    from gemq.running.embedded import free_port

    _redis(network)
    port = free_port()
    _service(network, "gemq-test-api", "api", images,
             "--env", f"GEMQ_QUEUE_URL={REDIS_URL}", "--env", f"GEMQ_API_TOKEN={TOKEN}",
             "--publish", f"127.0.0.1:{port}:8000", aliases=("gemq-api",))
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30,
                          headers={"Authorization": f"Bearer {TOKEN}"})

    def ready() -> bool:
        try:
            return client.get("/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(ready, 120, "the API container's /readyz")
    yield client
    client.close()


def _view(api: httpx.Client) -> dict[str, Any]:
    got = api.get(f"/api/runs/{RUN}")
    assert got.status_code == 200, got.text
    return got.json()


def _active_workers(api: httpx.Client) -> int:
    return sum(1 for w in _view(api)["workers"] if w["active"])


def _updates(api: httpx.Client) -> int:
    return int(_view(api)["progress"]["updates"])


@pytest.mark.browser
@pytest.mark.timeout(900)
def test_a_run_lives_in_containers(network: Network, images: dict[str, BuiltImage],
                                   api: httpx.Client) -> None:
    queue = ("--env", f"GEMQ_QUEUE_URL={REDIS_URL}")
    for name in ("gemq-test-aggregator-a", "gemq-test-aggregator-b"):
        _service(network, name, "aggregator", images, *queue)
    workers = [_service(network, "gemq-test-worker-1", "worker", images)]

    created = api.post("/api/runs", json=RUN_BODY)
    assert created.status_code == 201, created.text
    wait_for(lambda: _updates(api) >= 20, 180, "the first updates")
    _watch_in_the_browser(str(api.base_url))

    # Scale 1 -> 3 -> 1 while it trains.
    workers += [_service(network, f"gemq-test-worker-{i}", "worker", images) for i in (2, 3)]
    wait_for(lambda: _active_workers(api) == 3, 120, "three active workers")
    scaled_down = [stop(name, GRACE_S["worker"]) for name in workers[1:]]
    wait_for(lambda: _active_workers(api) == 1, 60, "one active worker again")

    # Kill the leading aggregator's container: the standby takes the run over. (No leader
    # for a moment is a lease that lapsed on a loaded machine, and the next term's leader
    # is the one to kill.)
    wait_for(lambda: _view(api)["shards"][0]["leader"] is not None, 60, "a leader")
    view = _view(api)
    assert view["state"] == "running", {k: v for k, v in view.items() if k != "config"}
    leader = view["shards"][0]["leader"]
    killed = next(n for n in ("gemq-test-aggregator-a", "gemq-test-aggregator-b")
                  if leader.startswith(n))
    before = _updates(api)
    podman("kill", killed)
    killed_at = time.monotonic()
    wait_for(lambda: _updates(api) > before + 5, 120, "updates after the leader's kill")
    takeover_s = time.monotonic() - killed_at
    new_leader = _view(api)["shards"][0]["leader"]
    assert not new_leader.startswith(killed), new_leader

    wait_for(lambda: _updates(api) >= TRAINED_UPDATES, 600, f"{TRAINED_UPDATES} updates")
    assert api.post(f"/api/runs/{RUN}/stop").status_code == 202
    wait_for(lambda: _view(api)["state"] != "running", 120, "the run's end")
    view = _view(api)
    assert view["state"] == "stopped", view
    # The aggregator's last step counts what is left in the stream as unused, just after
    # the run's state says it has ended.
    wait_for(lambda: balanced(_view(api)["counters"]), 30,
             f"published = applied + rejected + unused: {_view(api)['counters']}")
    counters = _view(api)["counters"]
    assert counters["applied"] == view["progress"]["updates"]
    accuracy = held_out_accuracy(api, RUN)
    assert accuracy >= 0.95, accuracy

    # In the reverse order of their start, as `compose down` does: Redis last.
    stopped = [stop(name, GRACE_S[_kind(name)]) for name in reversed(network.containers)
               if name != killed and name not in workers[1:]]
    _assert_clean_stops(scaled_down + stopped, network.containers)
    record("run_in_containers", {
        "accuracy": accuracy, "counters": counters, "takeover_s": round(takeover_s, 1),
        "stops_s": {s.container: round(s.seconds, 1) for s in scaled_down + stopped}})


def _kind(container: str) -> str:
    return next(k for k in GRACE_S if k in container)


def _assert_clean_stops(stops: list[Stopped], containers: list[str]) -> None:
    for s in stops:
        assert s.exit_code == 0, (s, logs(s.container)[-3000:])
        assert s.seconds < s.grace_s, s
    for name in containers:
        assert "Traceback" not in logs(name), (name, logs(name)[-5000:])


def _watch_in_the_browser(url: str) -> None:
    """The dashboard, through the published port, in headless chromium: it finds the run
    and draws its loss live."""
    from playwright.sync_api import sync_playwright

    from tests.test_dashboard import CHROMIUM, CHROMIUM_ARGS

    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: run .ci/install-browser")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url + "/")
            page.wait_for_function(
                "run => document.querySelector('#run-title').textContent === run",
                arg=RUN, timeout=30_000)
            page.wait_for_function(
                "Number(document.querySelector('#loss-chart').dataset.points) >= 3",
                timeout=60_000)
            assert page.text_content("#run-state") == "running"
            # The first points can come from the page's backfill before the event stream
            # opens; the badge must turn live once it does.
            page.wait_for_function(
                "document.querySelector('#connection').dataset.state === 'live'",
                timeout=30_000)
            Path(ROOT / "test-artifacts").mkdir(exist_ok=True)
            page.screenshot(path=str(ROOT / "test-artifacts" / "dashboard-in-containers.png"),
                            full_page=True)
            assert errors == []
        finally:
            browser.close()


def _healthy(container: str) -> bool:
    return podman("healthcheck", "run", container, check=False).returncode == 0


@pytest.mark.timeout(600)
def test_the_healthchecks_pass_while_healthy_and_fail_while_frozen(
        network: Network, images: dict[str, BuiltImage], api: httpx.Client) -> None:
    """Each image's own HEALTHCHECK, run by podman: healthy while the service works,
    unhealthy while its process is frozen (SIGSTOP; the heartbeat probes see the heartbeat
    go stale past 30 s, the API's sees /healthz time out), healthy again once it goes on."""
    queue = ("--env", f"GEMQ_QUEUE_URL={REDIS_URL}")
    services = ["gemq-test-api",
                _service(network, "gemq-test-aggregator-a", "aggregator", images, *queue),
                _service(network, "gemq-test-worker-1", "worker", images)]
    for name in services:
        wait_for(lambda n=name: _healthy(n), 120, f"{name} healthy")
    frozen_at = time.monotonic()
    for name in services:
        podman("kill", "--signal", "STOP", name)
    unhealthy_after = {}
    for name in services:
        wait_for(lambda n=name: not _healthy(n), 90, f"{name} unhealthy while frozen",
                 every_s=2)
        unhealthy_after[name] = round(time.monotonic() - frozen_at, 1)
    for name in services:
        podman("kill", "--signal", "CONT", name)
    for name in services:
        wait_for(lambda n=name: _healthy(n), 60, f"{name} healthy again")
    record("healthchecks", {"unhealthy_after_freeze_s": unhealthy_after})
