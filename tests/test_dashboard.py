"""The dashboard in a real browser (headless Debian chromium driven by Playwright), on a live
run: a real Redis, the API service, the rq aggregator service and a worker service.

Run it alone with ``pytest -m browser``. Chromium comes from ``.ci/install-browser``
(``apt-get install chromium``); Playwright only drives it, it never downloads a browser.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from playwright.sync_api import ConsoleMessage, Dialog, Page, sync_playwright

from gemq.config import RunConfig
from gemq.running.embedded import EmbeddedRedis, free_port
from tests.helpers import GemqProcess, session, small_run, wait_for

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
    assert page.locator("#energy-chart line.ref:not(.legend-ref)").count() == 1  # at 1
    # Its label is in the legend, not on the plot where the ratio's lines run.
    assert page.locator("#energy-chart text.ref-label").count() == 0
    assert "1 = compliance" in page.locator("#energy-chart text.legend").all_text_contents()
    page.wait_for_function("Number(document.querySelector('#rate-chart').dataset.points) >= 2"
                           " && Number(document.querySelector('#pi-heatmap').dataset.columns)"
                           " >= 2", timeout=15_000)
    assert errors == []
    assert page.locator("#pi-heatmap canvas").count() == 1
    assert page.is_hidden("#shards-card")  # a run of one shard has no shard table
    assert page.locator(".shard-note:visible").count() == 0
    assert page.text_content("#run-state") == "running"
    assert page.locator(f'#run-list li[data-run-id="{RUN}"]').count() == 1
    page.wait_for_function("document.querySelector('#connection').dataset.state === 'live'",
                           timeout=15_000)
    ids = {w["worker_id"] for w in api.get(f"/api/runs/{RUN}").json()["workers"]}
    shown = set(page.locator("#workers-table tbody tr[data-worker-id]")
                .evaluate_all("rows => rows.map(r => r.dataset.workerId)"))
    assert shown == ids and len(ids) == 2
    # Every number on the page says what it is: a tooltip on each tile and numeric column.
    unexplained = page.evaluate(
        "[...document.querySelectorAll('#stats dt, #shards-table th.num, #workers-table th.num')]"
        ".filter(e => !e.title.trim()).map(e => e.textContent)")
    assert unexplained == []
    assert "1 when compliant" in (page.get_attribute("#stats dt:has(+ #stat-energy)", "title")
                                  or "")

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
    _check_zoom_and_log_axis(page)  # on a stopped run: its range of updates stays put


def _check_zoom_and_log_axis(page: Page) -> None:
    """The loss axis turns logarithmic and back; a drag across one chart zooms every chart
    of the run on that range of updates; Reset zoom and a double-click undo it."""
    page.click("#loss-log")
    page.wait_for_function("document.querySelector('#loss-chart').dataset.scale === 'log'",
                           timeout=5_000)
    assert page.get_attribute("#loss-log", "aria-pressed") == "true"
    page.click("#loss-log")
    page.wait_for_function("document.querySelector('#loss-chart').dataset.scale === 'linear'",
                           timeout=5_000)

    def x_ranges() -> list[tuple[float, float]]:
        return [(float(page.get_attribute(f"#{chart}", "data-x-from") or "nan"),
                 float(page.get_attribute(f"#{chart}", "data-x-to") or "nan"))
                for chart in ("loss-chart", "energy-chart", "rate-chart", "staleness-chart")]

    # The plot's place on the page, read in one go: the live run redraws the chart (and
    # replaces its elements) many times a second, in the same place.
    box = page.evaluate("(() => { const r = document.querySelector('#loss-chart rect.overlay')"
                        ".getBoundingClientRect(); return {x: r.x, y: r.y, width: r.width, "
                        "height: r.height}; })()")
    full = x_ranges()[0]
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + 0.3 * box["width"], y)
    page.mouse.down()
    page.mouse.move(box["x"] + 0.6 * box["width"], y, steps=5)
    page.mouse.up()
    page.wait_for_selector("#zoom-reset:not([hidden])", timeout=5_000)
    zoomed = x_ranges()
    assert len(set(zoomed)) == 1, zoomed  # every chart on the same range
    low, high = zoomed[0]
    width = full[1] - full[0]
    assert abs(low - (full[0] + 0.3 * width)) < 0.05 * width, (full, zoomed)
    assert abs(high - (full[0] + 0.6 * width)) < 0.05 * width, (full, zoomed)
    assert (page.text_content("#zoom-hint") or "").startswith("updates ")
    page.click("#zoom-reset")
    page.wait_for_selector("#zoom-reset[hidden]", state="attached", timeout=5_000)
    assert page.text_content("#zoom-hint") == "drag across a chart to zoom"
    page.mouse.move(box["x"] + 0.2 * box["width"], y)
    page.mouse.down()
    page.mouse.move(box["x"] + 0.5 * box["width"], y, steps=5)
    page.mouse.up()
    page.wait_for_selector("#zoom-reset:not([hidden])", timeout=5_000)
    page.mouse.dblclick(box["x"] + 0.5 * box["width"], y)
    page.wait_for_selector("#zoom-reset[hidden]", state="attached", timeout=5_000)


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
            # auto: chosen for the model, and a small one keeps the values it always had
            default = (getattr(RunConfig(run_id="r"), setting["name"]) if setting["auto"]
                       else setting["default"])
            assert config[setting["name"]] == changed.get(setting["name"], default)
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
        if setting["auto"] and setting["type"] != "string":  # empty: the service chooses
            assert (value, page.get_attribute(selector, "placeholder")) == ("", "auto")
        else:
            assert (value if setting["type"] == "string" else float(value)) == setting["default"]
        assert (page.get_attribute(selector, "title") or "").startswith(setting["help"])
        if setting["choices"]:
            assert page.locator(f"{selector} option").evaluate_all(
                "options => options.map(o => o.value)") == setting["choices"]
        elif setting["type"] != "string":
            assert _number(page.get_attribute(selector, "min")) == setting["minimum"]
            assert _number(page.get_attribute(selector, "max")) == setting["maximum"]
    lr = by_name["lr"]
    # The learning rate follows the optimizer unless given: an empty box saying "auto".
    assert (lr["default"], lr["minimum"], lr["maximum"], lr["exclusive_minimum"]) == (
        "auto", 0, 10, True)
    assert (page.input_value("#f-lr"), page.get_attribute("#f-lr", "placeholder")) == (
        "", "auto")
    assert page.locator("#f-optimizer option").evaluate_all(
        "options => options.map(o => o.value)") == ["momentum", "adam"]
    assert page.input_value("#f-wire_dtype") == "auto" and by_name["shards"]["default"] == "auto"
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


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gemq_run_dashboard_shows_the_run_and_stays_until_ctrl_c(tmp_path: Path) -> None:
    """One command: `gemq run --dashboard PORT` trains on its private Redis, serves the
    dashboard for the run, keeps it up after the run ends, and goes on Ctrl-C."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: run .ci/install-browser (apt-get install chromium)")
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    process = GemqProcess("run", "--model", "logreg", "--dataset", "digits", "--steps", "3000",
                          "--no-progress", "--dashboard", str(port), "--out",
                          str(tmp_path / "run"))
    try:
        wait_for(lambda: f"dashboard at {url}" in process.output(), timeout_s=120,
                 what=f"the dashboard's address: {process.output()}")
        run_id = re.search(r"run (\S+): dashboard at", process.output()).group(1)  # type: ignore[union-attr]
        with _browser_page("gemq-run-dashboard") as (page, errors):
            page.goto(url)
            page.wait_for_function(  # the page picks the one run by itself
                "run => document.querySelector('#run-title').textContent === run",
                arg=run_id, timeout=30_000)
            page.wait_for_function(
                "Number(document.querySelector('#loss-chart').dataset.points) >= 3",
                timeout=60_000)
            wait_for(lambda: "until Ctrl-C" in process.output(), timeout_s=120,
                     what="the end of the run")
            assert re.search(rf"run {run_id} finished, test accuracy \d+\.\d%; the dashboard "
                             rf"stays at {re.escape(url)} until Ctrl-C", process.output())
            page.wait_for_function("document.querySelector('#run-state').textContent"
                                   " === 'finished'", timeout=30_000)
            assert errors == []
        os.killpg(process.process.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole group
        assert process.wait(30) == 0, process.output()
        assert "test accuracy:" in process.output()  # the summary, printed on the way out
        assert (tmp_path / "run" / "model.pt").is_file()
        wait_for(lambda: session(process.process.pid) == [], timeout_s=20,
                 what="gemq run's processes to end")
    finally:
        process.stop()


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gemq_serve_local_trains_what_the_start_button_starts() -> None:
    """One command, nothing else set up: `gemq serve --local` starts a private Redis, an
    aggregator service and a worker service beside the API; a run started from the form
    trains to its end; Ctrl-C to the terminal's group stops everything."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: run .ci/install-browser (apt-get install chromium)")
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    process = GemqProcess("serve", "--local", "--port", str(port))
    try:
        wait_for(lambda: "worker service" in process.output()
                 and "Uvicorn running" in process.output(), timeout_s=120,
                 what=f"the API and the worker service: {process.output()}")
        with _browser_page("serve-local") as (page, errors):
            dialogs: list[tuple[str, str]] = []
            _answer_dialogs(page, dialogs)
            page.goto(url)
            page.wait_for_selector("#start-form:not([aria-busy]) #f-algo", timeout=15_000)
            page.fill("#f-model", "logreg")
            page.fill("#f-dataset", "digits")
            page.select_option("#f-budget-kind", "steps")
            page.fill("#f-budget", "300")
            page.click("details[data-group=compute] summary")
            page.fill("#f-eval_every", "100")
            page.click("#start-button")
            page.wait_for_function(
                "document.querySelector('#form-message').textContent.startsWith('Started ')",
                timeout=15_000)
            run_id = (page.text_content("#form-message") or "").removeprefix("Started ")
            page.wait_for_function(
                "run => document.querySelector('#run-title').textContent === run",
                arg=run_id, timeout=15_000)
            page.wait_for_function("document.querySelector('#run-state').textContent"
                                   " === 'finished'", timeout=120_000)
            assert page.text_content("#stat-updates") == "300"
            # A service run is evaluated on held-out samples as it trains, every 100 updates
            # here: by the worker service, into the metrics the API serves and the page draws.
            held_out = httpx.get(f"{url}api/runs/{run_id}/series",
                                 params={"fields": "eval_updates,test_accuracy"},
                                 timeout=10).json()["columns"]
            evaluated = [(u, a) for u, a in zip(held_out["eval_updates"],
                                                held_out["test_accuracy"], strict=True)
                         if u is not None]
            assert [u // 100 for u, _ in evaluated] == [1, 2], evaluated
            assert all(0.5 < a <= 1 for _, a in evaluated), evaluated
            line = page.get_attribute('#accuracy-chart polyline[data-series="held-out"]',
                                      "data-points")
            assert line == "2", line
            assert dialogs == []  # loopback without a token: nothing to ask
            assert errors == []
            page.screenshot(path=str(ARTIFACTS / "serve-local.png"), full_page=True)
        os.killpg(process.process.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole group
        assert process.wait(60) == 0, process.output()
        wait_for(lambda: session(process.process.pid) == [], timeout_s=30,
                 what="gemq serve's Redis and services to end")
        assert "exited (code" not in process.output()  # no service died on its own
    finally:
        process.stop()


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_waiting_for_a_missing_service_says_which(redis_server: EmbeddedRedis) -> None:
    """The API alone: a started run's job waits in the queue, and the page says no
    aggregator service takes it; with one, the run waits for workers and the page says
    that; with a worker, the notice goes and the run trains to its end."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: run .ci/install-browser (apt-get install chromium)")
    url, port = redis_server.url, free_port()
    processes = [GemqProcess("serve", "--redis-url", url, "--port", str(port))]
    base = f"http://127.0.0.1:{port}"
    notice = "document.querySelector('#run-waiting')"
    try:
        wait_for(lambda: "Uvicorn running" in processes[0].output(), timeout_s=60,
                 what=f"the API: {processes[0].output()}")
        created = httpx.post(base + "/api/runs", timeout=30, json={
            "run_id": "waits", "model": "logreg", "dataset": "digits", "steps": 200})
        assert created.status_code == 201, created.text
        with _browser_page("run-waiting") as (page, errors):
            page.goto(base + "/")
            page.wait_for_function(f"!{notice}.hidden && {notice}.textContent.startsWith("
                                   "'No aggregator service takes jobs')", timeout=30_000)
            page.screenshot(path=str(ARTIFACTS / "run-waiting.png"), full_page=True)
            processes.append(GemqProcess("aggregator", "--serve", "--redis-url", url))
            page.wait_for_function(  # running, and no worker for the API's active window
                f"!{notice}.hidden && {notice}.textContent === 'No worker is training this "
                "run: start workers (gemq worker --follow, or gemq worker --run waits).'",
                timeout=90_000)
            processes.append(GemqProcess("worker", "--follow", "--redis-url", url))
            page.wait_for_function("document.querySelector('#run-state').textContent"
                                   " === 'finished'", timeout=120_000)
            assert page.is_hidden("#run-waiting")
            assert errors == []
    finally:
        for process in processes:
            process.stop()


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_the_run_list_says_when_it_shows_the_newest_page_only(
        redis_server: EmbeddedRedis) -> None:
    """103 runs: the list holds the API's first page, 100, and says there are 103."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: run .ci/install-browser (apt-get install chromium)")
    client = redis.Redis.from_url(redis_server.url)
    for i in range(103):
        small_run(client, f"many-{i:03d}")
    port = free_port()
    process = GemqProcess("serve", "--redis-url", redis_server.url, "--port", str(port))
    try:
        wait_for(lambda: "Uvicorn running" in process.output(), timeout_s=60,
                 what=f"the API: {process.output()}")
        with _browser_page("runs-more") as (page, errors):
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_selector("#runs-more:not([hidden])", timeout=15_000)
            assert (page.text_content("#runs-more") or "").startswith(
                "The newest 100 of 103 runs")
            assert page.locator("#run-list li").count() == 100
            assert errors == []
    finally:
        process.stop()
