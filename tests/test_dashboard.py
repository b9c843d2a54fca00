"""The dashboard in a real browser (headless Debian chromium driven by Playwright), on a live
run: a real Redis, the API service, the rq aggregator service and a worker service.

Run it alone with ``pytest -m browser``. Chromium comes from ``.ci/install-browser``
(``apt-get install chromium``); Playwright only drives it, it never downloads a browser.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import ConsoleMessage, Dialog, Page, sync_playwright

from gemq.embedded import EmbeddedRedis, free_port
from tests.helpers import GemqProcess, wait_for

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-quic"]
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
TOKEN = "dashboard-test-token-0123456789"
RUN = "browser-run"
# Small and fast; a budget far beyond what the test needs, so only the stop ends the run.
TINY = {"model": "logreg", "dataset": "digits", "batch_size": 16, "steps": 1_000_000}


@pytest.fixture
def api_url(redis_server: EmbeddedRedis) -> Iterator[str]:
    """The API service with a token, the aggregator service and a worker service."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: run .ci/install-browser (apt-get install chromium)")
    url = redis_server.url
    port = free_port()
    env = {**os.environ, "GEMQ_API_TOKEN": TOKEN}
    processes = [
        GemqProcess("serve", "--redis-url", url, "--port", str(port), env=env),
        GemqProcess("aggregator", "--serve", "--redis-url", url),
        GemqProcess("worker", "--follow", "--redis-url", url, "--workers", "2"),
    ]
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(base + "/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, timeout_s=60, what=f"the API on port {port}: {processes[0].output()}")
        yield base
    finally:
        for process in processes:
            process.stop()  # the whole process group, rq's work horses included


def _answer_dialogs(page: Page, seen: list[tuple[str, str]]) -> None:
    def answer(dialog: Dialog) -> None:
        seen.append((dialog.type, dialog.message))
        if dialog.type == "prompt":  # the dashboard asks for the API token
            dialog.accept(TOKEN)
        else:  # the stop confirmation
            dialog.accept()
    page.on("dialog", answer)


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_dashboard_watches_and_stops_a_live_run(api_url: str) -> None:
    with httpx.Client(base_url=api_url, timeout=30,
                      headers={"Authorization": f"Bearer {TOKEN}"}) as api:
        created = api.post("/api/runs", json={"run_id": RUN, **TINY})
        assert created.status_code == 201, created.text

        ARTIFACTS.mkdir(exist_ok=True)
        errors: list[str] = []
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1440, "height": 1000})
                page.on("pageerror", lambda e: errors.append(f"page error: {e}"))

                def console(message: ConsoleMessage) -> None:
                    # 401 and 422 answers are expected below; the browser logs each one.
                    if message.type == "error" and "Failed to load resource" not in message.text:
                        errors.append(f"console: {message.text}")
                page.on("console", console)
                try:
                    _watch_and_stop(page, api, api_url, errors)
                except Exception:
                    page.screenshot(path=str(ARTIFACTS / "dashboard-failure.png"), full_page=True)
                    raise
            finally:
                browser.close()

        view = api.get(f"/api/runs/{RUN}").json()
        assert view["state"] == "stopped", view
        assert 0 < view["progress"]["updates"] < TINY["steps"]
        assert errors == []


def _watch_and_stop(page: Page, api: httpx.Client, api_url: str, errors: list[str]) -> None:
    dialogs: list[tuple[str, str]] = []
    _answer_dialogs(page, dialogs)
    page.goto(api_url + "/")
    # The page picks the running run by itself and fills in over SSE.
    page.wait_for_function("run => document.querySelector('#run-title').textContent === run",
                           arg=RUN, timeout=15_000)
    page.evaluate("window.gemqNoReload = true")  # gone if the page reloads
    page.wait_for_function("Number(document.querySelector('#loss-chart').dataset.points) >= 5"
                           " && document.querySelector('#loss-chart polyline') !== null",
                           timeout=45_000)
    page.wait_for_function(
        "document.querySelectorAll("
        "'#workers-table tbody tr[data-worker-id][data-active=true]').length === 2",
        timeout=30_000)
    assert page.locator("#energy-chart polyline").count() >= 1
    assert page.locator("#energy-chart line.ref").count() == 1  # the compliance line at 1
    page.wait_for_function("Number(document.querySelector('#rate-chart').dataset.points) >= 2"
                           " && Number(document.querySelector('#pi-heatmap').dataset.columns)"
                           " >= 2", timeout=15_000)
    assert errors == []
    assert page.locator("#pi-heatmap canvas").count() == 1
    assert page.text_content("#run-state") == "running"
    assert page.locator(f'#run-list li[data-run-id="{RUN}"]').count() == 1
    assert page.get_attribute("#connection", "data-state") == "live"
    ids = {w["worker_id"] for w in api.get(f"/api/runs/{RUN}").json()["workers"]}
    shown = set(page.locator("#workers-table tbody tr[data-worker-id]")
                .evaluate_all("rows => rows.map(r => r.dataset.workerId)"))
    assert shown == ids and len(ids) == 2

    # A bad start: the token is asked for (401), kept, and the 422's detail is shown.
    page.fill("#f-lr", "-1")
    page.click("#start-button")
    page.wait_for_selector("#error-banner:not([hidden])", timeout=10_000)
    assert "lr" in (page.text_content("#error-text") or "")
    assert [kind for kind, _ in dialogs] == ["prompt"]
    assert page.evaluate("localStorage.getItem('gemq.apiToken')") == TOKEN
    page.click("#error-close")
    page.fill("#f-lr", "0.05")

    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)

    # Stop: confirm (the kept token goes with it), then the state follows without a reload.
    page.click("#stop-button")
    page.wait_for_function("document.querySelector('#run-state').textContent === 'stopped'",
                           timeout=30_000)
    assert [kind for kind, _ in dialogs] == ["prompt", "confirm"]
    assert RUN in dialogs[-1][1]
    assert page.is_disabled("#stop-button")
    page.wait_for_function("document.querySelector('#job-state').textContent === 'finished'",
                           timeout=30_000)
    page.wait_for_function(
        "run => document.querySelector(`#run-list li[data-run-id=\"${run}\"]`)"
        "?.dataset.state === 'stopped'", arg=RUN, timeout=10_000)
    assert page.evaluate("window.gemqNoReload") is True
    assert page.is_hidden("#error-banner")
    page.screenshot(path=str(ARTIFACTS / "dashboard-stopped.png"), full_page=True)
