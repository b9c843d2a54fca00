"""Shared fixtures: real redis-server processes on free loopback ports, started here; for
the container tests, gemq's images (built once a session) and a podman network."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
import redis

from gemq.running.embedded import EmbeddedRedis
from tests import podman


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``pytest -n 2 --dist loadgroup``; ``make test`` runs the rest of
    the suite so and the container tests after it, alone): the container tests share
    podman's container names, network label and image tags, so one process runs them all,
    one after another. They go first: the longest block, started while the other process
    takes everything else."""
    if not getattr(config.option, "numprocesses", None):
        return
    for item in items:
        if item.get_closest_marker("containers"):
            item.add_marker(pytest.mark.xdist_group("podman"))
    items.sort(key=lambda item: item.get_closest_marker("containers") is None)


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A test that runs a command in-process (``cli.main``) sets up logging to the stderr
    pytest captured for that test, which pytest closes afterwards: the root logger's
    handlers and level go back to what they were, so a later test's records are not sent to
    a closed stream. Warnings stop going to logging too: ``logging.captureWarnings(True)``
    does nothing while it believes it is already on, and pytest puts its own
    ``warnings.showwarning`` back after each test, so a later test's ``configure`` would
    otherwise leave warnings uncaptured."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)


@pytest.fixture
def redis_server() -> Iterator[EmbeddedRedis]:
    """A private redis-server for one test."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def redis_client(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def network(request: pytest.FixtureRequest) -> Iterator[podman.Network]:
    """A fresh labelled network; every container on it is removed afterwards, its logs kept
    in test-artifacts/<test>/ for a failure's reading."""
    podman.require_podman()
    podman.clean_up()
    name = f"gemq-test-{os.getpid()}"
    podman.podman("network", "create", "--label", podman.LABEL, name)
    net = podman.Network(name)
    try:
        yield net
    finally:
        folder = podman.ARTIFACTS / request.node.name
        folder.mkdir(parents=True, exist_ok=True)
        for container in net.containers:
            (folder / f"{container}.log").write_text(podman.logs(container))
        podman.clean_up()


@pytest.fixture(scope="session")
def images() -> dict[str, podman.BuiltImage]:
    """The three images, built from the shipped Dockerfiles once a session (podman's layer
    cache makes a rebuild of unchanged layers quick)."""
    podman.require_podman()
    return {service: podman.build_image(service, f"localhost/gemq-{service}:test")
            for service in podman.IMAGES}

