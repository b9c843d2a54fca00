"""The dashboard's comparison of runs in a real browser (headless Debian chromium driven by
Playwright): two real runs (a finished GEM run and a live DOWNPOUR run) on a real Redis, the
API service, the rq aggregator service and a worker service; the page's lines are checked
against the rows the API serves.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from playwright.sync_api import Page

from tests.helpers import wait_for
from tests.test_dashboard import ARTIFACTS, _api, _browser_page
from tests.test_dashboard import api_url as api_url  # the fixture: the services, with a token

SMALL = {"model": "mlp", "dataset": "digits", "batch_size": 16}
FINISHED = ("cmp-gem", "gem")  # ends before the page opens
LIVE = ("cmp-downpour", "downpour")  # runs while it is compared, then is stopped
#: The comparison's charts and the metric each draws.
CHARTS = {"#compare-loss-chart": "loss", "#compare-accuracy-chart": "accuracy",
          "#compare-energy-chart": "energy_ratio", "#compare-staleness-chart": "staleness_mean"}


def _wait_state(api: httpx.Client, run: str, state: str) -> None:
    def there() -> bool:
        view = api.get(f"/api/runs/{run}").json()
        return bool(view["state"] == state and view["job"]["state"] == "finished")
    wait_for(there, timeout_s=90, what=f"{run} {state}, its job finished")


def _points(api: httpx.Client, run: str, key: str) -> int:
    """The points a line of `key` must have: the API's rows with a number for it."""
    rows: list[dict[str, Any]] = api.get(f"/api/runs/{run}/metrics",
                                         params={"limit": 10_000}).json()["rows"]
    return sum(1 for r in rows if r["updates"] is not None and r[key] is not None)


def _lines(page: Page, chart: str) -> dict[str, int]:
    """The lines a chart draws: run id -> its number of points."""
    found: dict[str, int] = page.eval_on_selector_all(
        f"{chart} polyline[data-series]",
        "els => Object.fromEntries(els.map(e => [e.dataset.series, Number(e.dataset.points)]))")
    return found


def _wait_count(page: Page, runs: int) -> None:
    """The tab's count of compared runs comes to ``runs`` (it is drawn at the next
    animation frame after a box changes, not at once)."""
    page.wait_for_function("n => document.querySelector('#compare-count').textContent === n",
                           arg=str(runs), timeout=5_000)


def _box(run: str) -> str:
    return f'#run-list li[data-run-id="{run}"] input[data-action=compare]'


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dashboard_compares_runs(api_url: str) -> None:
    with _api(api_url) as api:
        for (run, algo), steps in ((FINISHED, 300), (LIVE, 1_000_000)):
            created = api.post("/api/runs", json={"run_id": run, "algo": algo, "steps": steps,
                                                  **SMALL})
            assert created.status_code == 201, created.text
            if run == FINISHED[0]:
                _wait_state(api, run, "finished")
        wait_for(lambda: api.get(f"/api/runs/{LIVE[0]}").json()["progress"]["updates"] >= 20,
                 timeout_s=90, what="the live run's first updates")

        with _browser_page("compare") as (page, errors):
            page.goto(api_url + "/")
            page.wait_for_selector(_box(LIVE[0]), timeout=15_000)
            _compare_both(page, api, api_url)
            _switch_the_x_axis(page, api)
            assert api.post(f"/api/runs/{LIVE[0]}/stop").status_code == 202
            _wait_state(api, LIVE[0], "stopped")
            _lines_end_with_the_api_rows(page, api)
            _deselect(page)
            _back_to_the_run_view(page)
            assert errors == []


def _compare_both(page: Page, api: httpx.Client, api_url: str) -> None:
    assert page.is_hidden("#compare-view")
    page.check(_box(FINISHED[0]))
    assert page.is_visible("#compare-view") and page.is_hidden("#run-view")
    page.check(_box(LIVE[0]))
    _wait_count(page, 2)
    for chart in CHARTS:
        page.wait_for_function("c => document.querySelectorAll(`${c} polyline`).length === 2",
                               arg=chart, timeout=15_000)
    # The legend names each run, id and algorithm, in the order picked, with its CSV link.
    items = page.locator("#compare-legend li[data-run-id]")
    assert items.evaluate_all("els => els.map(e => e.dataset.runId)") == [FINISHED[0], LIVE[0]]
    for i, (run, algo) in enumerate((FINISHED, LIVE)):
        text = items.nth(i).inner_text()
        assert run in text and algo in text
        assert items.nth(i).locator(".shard-note").count() == 0  # runs of one shard
        link = items.nth(i).locator("a[data-testid=csv-link]")
        assert link.get_attribute("href") == f"api/runs/{run}/metrics.csv"
        assert link.evaluate("a => a.href") == f"{api_url}/api/runs/{run}/metrics.csv"
        assert link.inner_text() == "Download CSV"
    # Each run has its own colour, in its line and in its box in the run list.
    colours = items.locator(".swatch-line").evaluate_all(
        "els => els.map(e => getComputedStyle(e).backgroundColor)")
    assert len(set(colours)) == 2
    # The finished run's lines hold exactly the API's rows; the live run's lines grow.
    for chart, key in CHARTS.items():
        assert _lines(page, chart)[FINISHED[0]] == _points(api, FINISHED[0], key), chart
    _accuracy_is_a_share_of_every_row(page, api)
    before = _lines(page, "#compare-loss-chart")[LIVE[0]]
    page.wait_for_function(
        "([run, n]) => Number(document.querySelector("
        "`#compare-loss-chart polyline[data-series='${run}']`).dataset.points) > n",
        arg=[LIVE[0], before], timeout=30_000)
    # Under the pointer, near the start where both runs have rows: a value for each run.
    box = page.locator("#compare-loss-chart svg").bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + 66, box["y"] + box["height"] / 2)
    readout = page.locator("#compare-loss-readout")
    assert readout.locator(".readout-item").count() == 2
    assert readout.inner_text().endswith(" updates")
    page.screenshot(path=str(ARTIFACTS / "dashboard-compare.png"), full_page=True)
    page.mouse.move(0, 0)


def _accuracy_is_a_share_of_every_row(page: Page, api: httpx.Client) -> None:
    """Digits' targets are classes: every row of the finished run has an accuracy in [0, 1]
    (the series route's column), and its line has a point for each; the y axis is 0 to 1."""
    series = api.get(f"/api/runs/{FINISHED[0]}/series",
                     params={"fields": "updates,accuracy"}).json()
    accuracy = series["columns"]["accuracy"]
    assert series["count"] > 0 and all(a is not None and 0 <= a <= 1 for a in accuracy)
    assert _lines(page, "#compare-accuracy-chart")[FINISHED[0]] == series["count"]
    ticks = page.locator("#compare-accuracy-chart text.tick:not(.x-tick)").all_text_contents()
    assert ticks and float(ticks[0]) == 0 and float(ticks[-1]) == 1, ticks


def _axis(page: Page) -> tuple[str, list[str]]:
    label = page.text_content("#compare-loss-chart .axis-label") or ""
    ticks = page.locator("#compare-loss-chart text.x-tick").all_text_contents()
    return label, ticks


def _switch_the_x_axis(page: Page, api: httpx.Client) -> None:
    label, ticks = _axis(page)
    assert label == "updates"
    finished = _lines(page, "#compare-loss-chart")[FINISHED[0]]
    page.click("#compare-axis label:has(input[value=time])")
    page.wait_for_function(
        "document.querySelector('#compare-loss-chart .axis-label').textContent"
        " === 'seconds since start'", timeout=5_000)
    for chart in CHARTS:
        assert page.text_content(f"{chart} .axis-label") == "seconds since start"
    _, time_ticks = _axis(page)
    assert time_ticks != ticks
    # The same rows, drawn over time: the last tick is within the longer run's duration.
    assert _lines(page, "#compare-loss-chart")[FINISHED[0]] == finished
    view = api.get(f"/api/runs/{LIVE[0]}").json()
    rows = api.get(f"/api/runs/{LIVE[0]}/metrics", params={"limit": 10_000}).json()["rows"]
    seconds = (rows[-1]["t_ms"] - view["started_ms"]) / 1000
    assert 0 < float(time_ticks[-1]) <= seconds + 5
    page.screenshot(path=str(ARTIFACTS / "dashboard-compare-time.png"), full_page=True)


def _lines_end_with_the_api_rows(page: Page, api: httpx.Client) -> None:
    """Once the live run has stopped, its lines hold every row the API has: none is left out
    between the first read and the last."""
    for chart, key in CHARTS.items():
        expected = _points(api, LIVE[0], key)
        page.wait_for_function(
            "([c, run, n]) => Number(document.querySelector("
            "`${c} polyline[data-series='${run}']`)?.dataset.points) === n",
            arg=[chart, LIVE[0], expected], timeout=30_000)


def _deselect(page: Page) -> None:
    page.uncheck(_box(FINISHED[0]))
    for chart in CHARTS:
        page.wait_for_function("c => document.querySelectorAll(`${c} polyline`).length === 1",
                               arg=chart, timeout=5_000)
        assert list(_lines(page, chart)) == [LIVE[0]]
    assert page.locator("#compare-legend li[data-run-id]").count() == 1
    _wait_count(page, 1)
    # The legend's remove button unticks the run's box too.
    page.click(f'#compare-legend li[data-run-id="{LIVE[0]}"] button[data-action=uncompare]')
    page.wait_for_selector("#compare-empty:not([hidden])", timeout=5_000)
    assert page.is_hidden("#compare-panel")
    assert not page.is_checked(_box(LIVE[0])) and not page.is_checked(_box(FINISHED[0]))


def _back_to_the_run_view(page: Page) -> None:
    """The single-run view still works: a run picked from the list shows there."""
    page.click(f'#run-list li[data-run-id="{FINISHED[0]}"] button[data-action=select]')
    assert page.is_visible("#run-view") and page.is_hidden("#compare-view")
    page.wait_for_function("run => document.querySelector('#run-title').textContent === run",
                           arg=FINISHED[0], timeout=10_000)
    page.wait_for_function("Number(document.querySelector('#loss-chart').dataset.points) > 0"
                           " && document.querySelector('#loss-chart svg').getAttribute('width')"
                           " > 400", timeout=15_000)
