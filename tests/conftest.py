"""Shared fixtures: real redis-server processes on free loopback ports, started here."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from gemq.running.embedded import EmbeddedRedis


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
