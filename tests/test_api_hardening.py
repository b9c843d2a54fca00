"""The API service under hostile or broken conditions: stored import specs, oversized, slow and
unauthenticated bodies, a frozen Redis, cross-site requests and foreign Host names, secrets in
Redis URLs. Each test talks to a real ``gemq serve`` process over real sockets."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import numpy as np
import pytest
import redis
import torch

from gemq.config import RunConfig
from gemq.running.embedded import EmbeddedRedis, free_port
from gemq.state.connection import redact
from gemq.state.store import RunStore
from tests.helpers import SMALL_LAYOUT, small_run, wait_for
from tests.test_api import TOKEN, Service, start_api

#: The body-timeout the token service runs with (GEMQ_BODY_TIMEOUT_S): short to keep tests
#: quick, long enough that an answer which must not wait for it comes well before it, also
#: on a loaded machine.
BODY_TIMEOUT_S = 3.0
#: GEMQ_MAX_BODY_BYTES's default.
MAX_BODY = 1 << 20
EXTRA_HOST = "gemq.internal"


@pytest.fixture(scope="module")
def module_redis() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="module")
def token_api(module_redis: EmbeddedRedis) -> Iterator[Service]:
    service = start_api(module_redis.url, GEMQ_API_TOKEN=TOKEN,
                        GEMQ_BODY_TIMEOUT_S=str(BODY_TIMEOUT_S))
    yield service
    _stop_without_traceback(service)


@pytest.fixture(scope="module")
def loopback_api(module_redis: EmbeddedRedis) -> Iterator[Service]:
    """No token: the loopback-only mode, with one extra allowed host name."""
    service = start_api(module_redis.url, GEMQ_ALLOWED_HOSTS=EXTRA_HOST)
    yield service
    _stop_without_traceback(service)


def _stop_without_traceback(service: Service) -> None:
    """Every refusal above is an answer, never an error logged by the service."""
    output = service.process.output()
    service.process.stop()
    assert "Traceback" not in output, output[-4000:]


@pytest.fixture(scope="module")
def module_client(module_redis: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(module_redis.url)
    yield client
    client.close()


# --- raw HTTP over a socket: what a hostile or broken client sends -------------------------


def _port(service: Service) -> int:
    return int(service.url.rsplit(":", 1)[1])


def _head(service: Service, path: str, *headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{_port(service)}",
             "Content-Type: application/json", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    """Status and body of one response (status 0: the connection closed without one)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(fields.get("content-length", 0)):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), body


def _send_quietly(sock: socket.socket, parts: Iterator[bytes], sent: list[int]) -> None:
    """Send until done or until the server closes the connection; ``sent[0]`` counts the
    bytes the socket took."""
    try:
        for part in parts:
            sock.sendall(part)
            sent[0] += len(part)
    except OSError:
        pass


class Answer(NamedTuple):
    status: int
    body: bytes
    seconds: float  # after the head was sent
    body_bytes_sent: int  # when the answer came


def _json_string_body(size: int) -> Iterator[bytes]:
    """A valid JSON document of exactly ``size`` bytes: one long string field."""
    prefix, suffix = b'{"run_id": "', b'"}'
    left = size - len(prefix) - len(suffix)
    yield prefix
    while left > 0:
        yield b"a" * min(left, 1 << 20)
        left -= 1 << 20
    yield suffix


def _chunked(parts: Iterator[bytes]) -> Iterator[bytes]:
    for part in parts:
        yield f"{len(part):x}\r\n".encode() + part + b"\r\n"
    yield b"0\r\n\r\n"


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def _post_in_background(service: Service, head: bytes, body: Iterator[bytes],
                        timeout_s: float = 20) -> Answer:
    """Send ``head`` and stream ``body`` from a thread; return the response as soon as it
    comes."""
    sent = [0]
    with socket.create_connection(("127.0.0.1", _port(service)), timeout=timeout_s) as sock:
        sock.sendall(head)
        started = time.monotonic()
        sender = threading.Thread(target=_send_quietly, args=(sock, body, sent), daemon=True)
        sender.start()
        try:
            status, answer = _read_response(sock)
        except TimeoutError:
            status, answer = 0, b"(no response)"
        answered = Answer(status, answer, time.monotonic() - started, sent[0])
        with contextlib.suppress(OSError):  # the server may have closed it already
            sock.shutdown(socket.SHUT_RDWR)
        sender.join(timeout_s)
    return answered


# --- 8. the model download imports nothing --------------------------------------------------


def test_model_download_never_imports_the_stored_spec(token_api: Service,
                                                      module_client: redis.Redis) -> None:
    """A run whose stored model and dataset are ``os:abort`` (written straight into Redis,
    past the API's guard) downloads from its layout; the API does not call os.abort."""
    config = RunConfig.from_dict({"run_id": "abort", "model": "os:abort",
                                  "dataset": "os:abort"})
    params = np.arange(SMALL_LAYOUT.size, dtype=np.float32)
    RunStore(module_client, "abort").create(config, SMALL_LAYOUT, params)
    with token_api.client(None) as anonymous:
        try:
            response = anonymous.get("/api/runs/abort/model")
        except httpx.HTTPError as e:
            raise AssertionError(f"the API died: {token_api.process.output()[-2000:]}") from e
        assert response.status_code == 200, response.text
        assert anonymous.get("/healthz").status_code == 200
    state = torch.load(io.BytesIO(response.content), weights_only=True)
    assert list(state) == ["w", "b"]
    assert state["w"].shape == (8, 4) and state["b"].shape == (4,)
    assert torch.equal(state["w"].flatten(), torch.arange(32, dtype=torch.float32))
    assert torch.equal(state["b"], torch.arange(32, 36, dtype=torch.float32))


# --- 9. authentication before the body; body size and time limits ---------------------------


def test_a_big_body_without_token_is_refused_before_it_is_read(token_api: Service) -> None:
    size = 128 << 20
    pid = token_api.process.process.pid
    before = _rss_kib(pid)
    answer = _post_in_background(
        token_api, _head(token_api, "/api/runs", f"Content-Length: {size}"),
        _json_string_body(size))
    grown_mib = (_rss_kib(pid) - before) / 1024
    assert answer.status == 401, answer
    # Unread, the body stops at what the sockets' buffers hold (a few MiB): the answer came
    # while most of it was still unsent.
    assert answer.body_bytes_sent < size // 4, answer
    assert grown_mib < 32, f"the API's memory grew by {grown_mib:.0f} MiB"


def test_invalid_json_without_token_is_401(token_api: Service) -> None:
    with token_api.client(None) as anonymous:
        response = anonymous.post("/api/runs", content=b"{not json",
                                  headers={"Content-Type": "application/json"})
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"


def test_a_declared_body_over_the_cap_is_413_before_it_is_sent(token_api: Service) -> None:
    head = _head(token_api, "/api/runs", f"Authorization: Bearer {TOKEN}",
                 f"Content-Length: {2 * MAX_BODY}")
    answer = _post_in_background(token_api, head, iter([b"{"]), timeout_s=10)
    # One byte of the body comes: an API that waited for the rest would answer only when
    # the body timeout ran out (and then 408).
    assert answer.status == 413 and answer.seconds < BODY_TIMEOUT_S, answer
    assert b"GEMQ_MAX_BODY_BYTES" in answer.body and str(MAX_BODY).encode() in answer.body


def test_a_chunked_body_over_the_cap_is_413(token_api: Service) -> None:
    head = _head(token_api, "/api/runs", f"Authorization: Bearer {TOKEN}",
                 "Transfer-Encoding: chunked")
    answer = _post_in_background(token_api, head, _chunked(_json_string_body(4 * MAX_BODY)))
    assert answer.status == 413, answer
    assert b"GEMQ_MAX_BODY_BYTES" in answer.body


def test_a_stalled_body_is_408_and_the_connection_closed(token_api: Service) -> None:
    head = _head(token_api, "/api/runs", f"Authorization: Bearer {TOKEN}",
                 "Content-Length: 100")
    with socket.create_connection(("127.0.0.1", _port(token_api)),
                                  timeout=3 * BODY_TIMEOUT_S) as sock:
        sock.sendall(head + b'{"run_id": ')  # and then nothing
        started = time.monotonic()
        try:
            status, body = _read_response(sock)
            closed = sock.recv(1) == b""
        except TimeoutError:
            status, body, closed = 0, b"(no response)", False
        elapsed = time.monotonic() - started
    # It waited for the body as long as it was told to, and no longer than the socket's
    # own timeout (three times that).
    assert status == 408 and elapsed >= BODY_TIMEOUT_S - 0.05, (status, body, elapsed)
    assert closed


def test_a_small_valid_body_with_the_token_still_works(token_api: Service) -> None:
    with token_api.client() as c:
        response = c.post("/api/runs", json={"run_id": "fine", "start": False,
                                             "model": "logreg", "dataset": "digits"})
    assert response.status_code == 201, response.text


@pytest.mark.parametrize("field", ["lr", "kappa", "momentum", "epochs", "stall_timeout_s"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e309"])
def test_a_number_that_is_not_finite_is_a_422_naming_its_field(
        token_api: Service, field: str, value: str) -> None:
    body = f'{{"run_id": "nan", "start": false, "{field}": {value}}}'  # JSON as a client sends
    with token_api.client() as c:
        response = c.post("/api/runs", content=body,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 422, response.text
    # Every error names the field; one that also takes "auto" (lr) is a union, whose
    # member's tag follows the field in the location.
    assert {tuple(p["loc"][:2]) for p in response.json()["detail"]} == {("body", field)}


@pytest.mark.parametrize(("field", "value"), [("steps", True), ("steps", "64"),
                                              ("batch_size", "64"), ("lr", "0.1"),
                                              ("seed", 1.5)])
def test_a_number_of_another_type_is_refused_as_the_cli_refuses_it(
        token_api: Service, field: str, value: object) -> None:
    with token_api.client() as c:
        response = c.post("/api/runs", json={"start": False, field: value})
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"][:2] == ["body", field]  # as above: "auto"


def test_a_dataset_path_the_system_cannot_open_is_a_422(token_api: Service) -> None:
    with token_api.client() as c:
        response = c.post("/api/runs", json={"start": False, "model": "logreg",
                                             "dataset": "mnist-idx:/" + "d" * 489})
    assert response.status_code == 422, response.text
    assert "File name too long" in response.text


def test_a_large_bad_body_gets_a_short_answer(token_api: Service) -> None:
    """The 422 names the problems without repeating the values: a 0.6 MB body of bad
    fields once came back as a 5 MB reply."""
    body = {"start": False, "model": "x" * 300_000, "k" * 300_000: 1}
    with token_api.client() as c:
        response = c.post("/api/runs", json=body)
    assert response.status_code == 422, response.text[:500]
    assert len(response.content) < 4000, len(response.content)
    assert {p["loc"][1][:10] for p in response.json()["detail"]} == {"model", "k" * 10}


@pytest.mark.parametrize("stored", [b"x" * 12, b"x" * 13], ids=["12-bytes", "13-bytes"])
def test_a_damaged_parameter_value_is_a_409_not_a_500(
        token_api: Service, module_redis: EmbeddedRedis, stored: bytes) -> None:
    client = redis.Redis.from_url(module_redis.url)
    store = small_run(client, f"damaged-{len(stored)}")
    client.set(store.keys.params(0), stored)
    with token_api.client() as c:
        response = c.get(f"/api/runs/{store.run_id}/model")
    assert response.status_code == 409, response.text
    assert "damaged or was written by another program" in response.json()["detail"]


# --- 10. a frozen Redis -------------------------------------------------------------------


def _timed(call: Callable[[], httpx.Response]) -> tuple[int, float]:
    started = time.monotonic()
    try:
        status = call().status_code
    except httpx.TimeoutException:
        status = 0
    return status, time.monotonic() - started


def test_a_frozen_redis_is_reported_within_seconds(redis_server: EmbeddedRedis) -> None:
    service = start_api(redis_server.url, GEMQ_API_TOKEN=TOKEN)
    assert redis_server.process is not None
    try:
        with httpx.Client(base_url=service.url, timeout=15) as c:
            assert c.get("/readyz").status_code == 200
            assert c.get("/api/runs").status_code == 200  # a pooled connection, now idle
            redis_server.process.send_signal(signal.SIGSTOP)
            try:
                ready = _timed(lambda: c.get("/readyz"))
                runs = _timed(lambda: c.get("/api/runs"))
                ready_again = _timed(lambda: c.get("/readyz"))
            finally:
                redis_server.process.send_signal(signal.SIGCONT)
            assert ready[0] == 503 and ready[1] < 2, ready
            assert ready_again[0] == 503 and ready_again[1] < 2, ready_again
            assert runs[0] == 503 and runs[1] < 8, runs
            wait_for(lambda: c.get("/readyz").status_code == 200, what="ready again")
            assert c.get("/api/runs").status_code == 200
    finally:
        service.process.stop()


# --- 11. cross-site requests and foreign Host names --------------------------------------


def test_loopback_mode_refuses_cross_site_mutations(loopback_api: Service,
                                                    module_client: redis.Redis) -> None:
    small_run(module_client, "xsite")
    port = _port(loopback_api)
    own = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=loopback_api.url, timeout=30) as c:
        for origin in ("http://evil.example", "null", f"http://127.0.0.1:{port + 1}"):
            refused = c.post("/api/runs/xsite/stop", headers={"Origin": origin})
            assert refused.status_code == 403, (origin, refused.text)
            assert "origin" in refused.json()["detail"].lower()
        assert RunStore(module_client, "xsite").state() == "created"
        # The dashboard's own POSTs carry the page's origin; scripts and curl send none.
        assert c.post("/api/runs/xsite/stop", headers={"Origin": own}).status_code == 202
        assert c.post("/api/runs/xsite/stop").status_code == 202


def test_loopback_mode_refuses_unknown_host_names(loopback_api: Service) -> None:
    port = _port(loopback_api)
    with httpx.Client(base_url=loopback_api.url, timeout=30) as c:
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io"):
            refused = c.get("/api/runs", headers={"Host": host})
            assert refused.status_code == 400, (host, refused.text)
            assert "GEMQ_ALLOWED_HOSTS" in refused.json()["detail"]
        for host in (f"localhost:{port}", f"[::1]:{port}", f"127.0.0.1:{port}",
                     f"{EXTRA_HOST}:{port}", EXTRA_HOST.upper()):
            assert c.get("/api/runs", headers={"Host": host}).status_code == 200, host
        assert c.get("/", headers={"Host": "evil.example"}).status_code == 400


def test_with_a_token_any_host_may_read_but_origins_still_count(token_api: Service,
                                                                module_client: redis.Redis
                                                                ) -> None:
    small_run(module_client, "tokenxsite")
    with token_api.client() as c:
        assert c.get("/api/runs", headers={"Host": "gemq.example.com"}).status_code == 200
        refused = c.post("/api/runs/tokenxsite/stop", headers={"Origin": "http://evil.example"})
        assert refused.status_code == 403
        same = c.post("/api/runs/tokenxsite/stop",
                      headers={"Host": "gemq.example.com", "Origin": "https://gemq.example.com"})
        assert same.status_code == 202, same.text


# --- 12. secrets and tracebacks in messages -------------------------------------------------


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://h:6379/0?password=hunter2", "redis://h:6379/0?password=***"),
    ("redis://h/0?db=1&PASSWORD=hunter2&ssl_password=x",
     "redis://h/0?db=1&PASSWORD=***&ssl_password=***"),
    ("unix:///tmp/redis.sock?db=0&password=hunter2", "unix:///tmp/redis.sock?db=0&password=***"),
    ("rediss://u:hunter2@h/0?password=hunter2", "rediss://u:***@h/0?password=***"),
    ("redis://:hunter2@h:99999/0", "redis://:***@h:99999/0"),
    ("redis://:hun@ter2@h/0", "redis://:***@h/0"),
    ("redis://[::1/0", "redis://[::1/0"),
    ("redis://[::1]:6379/0", "redis://[::1]:6379/0"),
    ("redis://user@h/0", "redis://user@h/0"),
    ("not a url", "not a url"),
])
def test_redact_hides_every_password_and_never_raises(url: str, shown: str) -> None:
    assert redact(url) == shown


def _gemq(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMQ_")}
    return subprocess.run([sys.executable, "-m", "gemq", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, check=False)


@pytest.mark.parametrize("url", ["redis://h:99999/0", "redis://:hunter2@h:99999/0",
                                 "redis://[::1/0?password=hunter2"])
@pytest.mark.parametrize("command", [("status", "--run", "x"), ("serve",)])
def test_a_malformed_url_is_one_clear_line(url: str, command: tuple[str, ...]) -> None:
    result = _gemq(*command, "--redis-url", url)
    lines = result.stderr.splitlines()
    assert "Traceback" not in result.stderr + result.stdout
    assert result.returncode in (1, 2), result.stderr
    assert len(lines) == 1 and lines[0].startswith("gemq: error: invalid Redis URL"), lines
    assert "hunter2" not in result.stderr


@pytest.mark.parametrize("command", [("status", "--run", "x"), ("serve",)])
def test_a_url_option_redis_py_refuses_is_one_clear_line(command: tuple[str, ...]) -> None:
    port = free_port()
    url = f"rediss://:hunter2@127.0.0.1:{port}/0?ssl_cert_reqs=bogus"
    result = _gemq(*command, "--redis-url", url)
    assert "Traceback" not in result.stderr + result.stdout
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"gemq: error: cannot use Redis at rediss://:***@127.0.0.1:{port}/0?ssl_cert_reqs="
        "bogus: Invalid SSL Certificate Requirements Flag: bogus")
    assert "hunter2" not in result.stderr


def test_a_wrong_password_in_the_query_is_not_printed() -> None:
    with EmbeddedRedis(password="the-right-one") as server:
        result = _gemq("status", "--run", "x", "--redis-url",
                       f"redis://127.0.0.1:{server.port}/0?password=hunter2")
    assert result.returncode == 1, result.stderr
    assert "refused the credentials" in result.stderr
    assert "hunter2" not in result.stderr + result.stdout


def test_the_docs_load_the_model_with_weights_only() -> None:
    text = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    assert "weights_only=True" in text
