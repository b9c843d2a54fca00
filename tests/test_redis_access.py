"""Every component reaches Redis through its URL: password, ACL user, TLS."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from gemq.config import RunConfig
from gemq.running.embedded import EmbeddedRedis
from gemq.running.runs import create_run
from tests.helpers import GemqProcess

pytestmark = pytest.mark.slow


def train_small_run(url: str, run_id: str) -> None:
    """Create a run, then aggregate and train it with real processes over ``url``."""
    client = redis.Redis.from_url(url)
    store = create_run(client, RunConfig(run_id=run_id, model="logreg", dataset="digits",
                                         batch_size=16, budget_updates=100))
    processes = [GemqProcess("aggregator", "--run", run_id, "--redis-url", url),
                 GemqProcess("worker", "--run", run_id, "--redis-url", url)]
    try:
        for process in processes:
            assert process.wait(120) == 0, process.output()
    finally:
        for process in processes:
            process.stop()
    assert store.state() == "finished"
    assert store.counters()["applied"] == 100
    client.close()


def test_password() -> None:
    with EmbeddedRedis(password="s3cret-password") as server:
        train_small_run(server.url, "pw")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port).ping()


def test_acl_user() -> None:
    with EmbeddedRedis(password="admin-password") as server:
        admin = redis.Redis.from_url(server.url)
        admin.acl_setuser("trainer", enabled=True, passwords=["+trainer-pw"],
                          keys=["gemq:*"], commands=["+@all", "-@dangerous", "+info"],
                          channels=["*"])
        admin.close()
        train_small_run(f"redis://trainer:trainer-pw@127.0.0.1:{server.port}/0", "acl")


@pytest.fixture
def certificate(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True,
                   capture_output=True)
    yield cert, key


def test_tls(certificate: tuple[Path, Path]) -> None:
    with EmbeddedRedis(password="tls-password", tls=certificate) as server:
        assert server.url.startswith("rediss://")
        train_small_run(server.url, "tls")
