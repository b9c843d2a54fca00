"""The dashboard in a real browser (headless Debian chromium driven by Playwright), on a live
run: a real Redis, the API service, the rq aggregator service and a worker service.

Run it alone with ``pytest -m browser``. Chromium comes from ``.ci/install-browser``
(``apt-get install chromium``); Playwright only drives it, it never downloads a browser.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import ConsoleMessage, Dialog, Page, sync_playwright

from gemq.running.embedded import EmbeddedRedis, free_port
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


@contextmanager
def _browser_page(name: str) -> Iterator[tuple[Page, list[str]]]:
    """A page in headless chromium and the errors it logs (page errors, console errors);
    on a failure inside the block, a screenshot test-artifacts/<name>-failure.png."""
    ARTIFACTS.mkdir(exist_ok=True)
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))

            def console(message: ConsoleMessage) -> None:
                # 401 and 422 answers are expected in these tests; the browser logs each one.
                if message.type == "error" and "Failed to load resource" not in message.text:
                    errors.append(f"console: {message.text}")
            page.on("console", console)
            try:
                yield page, errors
            except Exception:
                page.screenshot(path=str(ARTIFACTS / f"{name}-failure.png"), full_page=True)
                raise
        finally:
            browser.close()


def _api(api_url: str) -> httpx.Client:
    """The API as the test itself calls it, with the token."""
    return httpx.Client(base_url=api_url, timeout=30,
                        headers={"Authorization": f"Bearer {TOKEN}"})


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_dashboard_watches_and_stops_a_live_run(api_url: str) -> None:
    with _api(api_url) as api:
        created = api.post("/api/runs", json={"run_id": RUN, **TINY})
        assert created.status_code == 201, created.text

        with _browser_page("dashboard") as (page, errors):
            _watch_and_stop(page, api, api_url, errors)

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
    assert page.is_hidden("#shards-card")  # a run of one shard has no shard table
    assert page.locator(".shard-note:visible").count() == 0
    assert page.text_content("#run-state") == "running"
    assert page.locator(f'#run-list li[data-run-id="{RUN}"]').count() == 1
    assert page.get_attribute("#connection", "data-state") == "live"
    ids = {w["worker_id"] for w in api.get(f"/api/runs/{RUN}").json()["workers"]}
    shown = set(page.locator("#workers-table tbody tr[data-worker-id]")
                .evaluate_all("rows => rows.map(r => r.dataset.workerId)"))
    assert shown == ids and len(ids) == 2

    # A start only the API can refuse (the form cannot know the datasets): the token is
    # asked for (401), kept, and the 422's detail is shown.
    page.fill("#f-dataset", "no-such-dataset")
    page.click("#start-button")
    page.wait_for_selector("#error-banner:not([hidden])", timeout=10_000)
    assert "dataset" in (page.text_content("#error-text") or "")
    assert [kind for kind, _ in dialogs] == ["prompt"]
    assert page.evaluate("localStorage.getItem('gemq.apiToken')") == TOKEN
    page.click("#error-close")

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


def _number(text: str | None) -> float | None:
    return None if text is None else float(text)


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_start_form_is_built_from_the_api_settings(api_url: str) -> None:
    with _api(api_url) as api:
        settings: list[dict[str, Any]] = api.get("/api/settings").json()["settings"]
        with _browser_page("start-form") as (page, errors):
            dialogs: list[tuple[str, str]] = []
            _answer_dialogs(page, dialogs)
            page.goto(api_url + "/")
            page.wait_for_selector("#start-form:not([aria-busy]) #f-algo", timeout=15_000)
            _check_form_offers(page, settings)
            run_id = _start_from_form(page, api, dialogs)
            assert errors == []

        config = api.get(f"/api/runs/{run_id}").json()["config"]
    changed = {"algo": "dcasgd", "lr": 0.02, "model": "logreg", "dataset": "digits"}
    for setting in settings:
        if setting["group"] != "budget":  # the rest are the API's defaults: none was posted
            assert config[setting["name"]] == changed.get(setting["name"], setting["default"])
    assert config["budget_updates"] == 20


def _check_form_offers(page: Page, settings: list[dict[str, Any]]) -> None:
    """One control per setting, with the API's default, bounds, choices and help."""
    by_name = {s["name"]: s for s in settings}
    names = page.locator("#start-form [name]").evaluate_all("els => els.map(e => e.name)")
    budget = [s["name"] for s in settings if s["group"] == "budget"]
    assert sorted(names) == sorted([*(by_name.keys() - set(budget)), "budget_kind", "budget"])
    assert page.locator("#f-budget-kind option").evaluate_all(
        "options => options.map(o => o.value)") == budget == ["epochs", "steps"]
    algorithms = page.locator("#f-algo option").evaluate_all("options => options.map(o => o.value)")
    assert algorithms == by_name["algo"]["choices"] and "dcasgd" in algorithms
    for setting in settings:
        if setting["group"] == "budget":
            continue
        selector = f"#f-{setting['name']}"
        value = page.input_value(selector)
        assert (value if setting["type"] == "string" else float(value)) == setting["default"]
        assert (page.get_attribute(selector, "title") or "").startswith(setting["help"])
        if setting["choices"]:
            assert page.locator(f"{selector} option").evaluate_all(
                "options => options.map(o => o.value)") == setting["choices"]
        elif setting["type"] != "string":
            assert _number(page.get_attribute(selector, "min")) == setting["minimum"]
            assert _number(page.get_attribute(selector, "max")) == setting["maximum"]
    lr = by_name["lr"]
    assert (lr["default"], lr["minimum"], lr["maximum"], lr["exclusive_minimum"]) == (
        0.05, 0, 10, True)
    assert page.input_value("#f-lr") == "0.05"
    assert [page.get_attribute("#f-lr", a) for a in ("min", "max", "step")] == ["0", "10", "any"]
    # Transport settings fold away; the form stays compact.
    assert page.is_hidden("#f-max_pending")
    page.click("details[data-group=transport] summary")
    assert page.is_visible("#f-max_pending")
    page.locator("#start-card").screenshot(path=str(ARTIFACTS / "start-form.png"))


def _start_from_form(page: Page, api: httpx.Client, dialogs: list[tuple[str, str]]) -> str:
    """Starts a run from the form and returns its id, once the page has selected it."""
    # lr's lower bound is exclusive: min="0" lets 0 through, the form does not.
    page.fill("#f-lr", "0")
    page.click("#start-button")
    page.wait_for_function(
        "document.querySelector('#form-message').textContent.includes('lr: must be in (0, 10]')",
        timeout=5_000)
    assert page.get_attribute("#f-lr", "aria-invalid") == "true"
    assert dialogs == [] and api.get("/api/runs").json()["runs"] == []  # nothing was posted

    page.select_option("#f-algo", "dcasgd")
    page.fill("#f-lr", "0.02")
    page.fill("#f-model", "logreg")
    page.fill("#f-dataset", "digits")
    page.select_option("#f-budget-kind", "steps")
    assert page.get_attribute("#f-budget", "step") == "1"
    page.fill("#f-budget", "20")
    page.click("#start-button")
    page.wait_for_function(
        "document.querySelector('#form-message').textContent.startsWith('Started ')",
        timeout=15_000)
    assert [kind for kind, _ in dialogs] == ["prompt"]  # the token, for the POST
    run_id = (page.text_content("#form-message") or "").removeprefix("Started ")
    page.wait_for_function("run => document.querySelector('#run-title').textContent === run",
                           arg=run_id, timeout=15_000)
    page.screenshot(path=str(ARTIFACTS / "dashboard-started.png"), full_page=True)
    return run_id
