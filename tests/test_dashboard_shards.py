"""The dashboard's view of a sharded run in a real browser (headless Debian chromium driven
by Playwright): a live 3-shard run on a real Redis, led by the aggregator service (shard 0
through its rq job, the other shards by its standby), fed by a worker service. The page's
shard table is checked against the API's per-shard view; a run of one shard has none.
"""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page

from tests.helpers import wait_for
from tests.test_dashboard import ARTIFACTS, _api, _browser_page
from tests.test_dashboard import api_url as api_url  # the fixture: the services, with a token

SHARDED = "sharded-run"
SINGLE = "single-shard-run"
SHARDS = 3
TINY = {"model": "logreg", "dataset": "digits", "batch_size": 16}
#: The table's number columns: the API's field each one shows.
INTEGERS = ("updates", "applied", "rejected", "backlog")
DECIMALS = ("staleness_mean", "energy_ratio", "median_pi")
#: The dashboard shows decimals to 3 significant digits.
SHOWN_DIGITS = 3


def _table(page: Page) -> list[dict[str, str]]:
    """The shard table as shown: one dict per row, the shard and each cell's text."""
    rows: list[dict[str, str]] = page.eval_on_selector_all(
        "#shards-table tbody tr[data-shard]",
        "rows => rows.map(r => Object.fromEntries([['shard', r.dataset.shard],"
        " ...[...r.querySelectorAll('td[data-field]')]"
        ".map(td => [td.dataset.field, td.textContent.trim()])]))")
    return rows


def _shown_number(text: str) -> float | None:
    return None if text == "—" else float(text.replace(",", ""))


def _same(shown: dict[str, str], shard: dict[str, Any]) -> bool:
    """A row of the page shows this shard of the API's view: the same state, leader and
    counts, and its decimals rounded as the page rounds them."""
    if shown["state"] != (shard["state"] or "running"):
        return False
    if shown["leader"] != (shard["leader"] or "none"):
        return False
    if any(_shown_number(shown[f]) != shard[f] for f in INTEGERS):
        return False
    for field in DECIMALS:
        value, text = shard[field], shown[field]
        if value is None:
            if text != "—":
                return False
        elif _shown_number(text) != float(f"{value:.{SHOWN_DIGITS}g}"):
            return False
    return True


def _rounded(value: float | None) -> float | None:
    """A decimal rounded as the page rounds it (3 significant digits)."""
    return None if value is None else float(f"{value:.{SHOWN_DIGITS}g}")


def _overall_row(page: Page) -> dict[str, str]:
    cells: dict[str, str] = page.eval_on_selector_all(
        "#shards-table tfoot td[data-field]",
        "cells => Object.fromEntries(cells.map(td => [td.dataset.field,"
        " td.textContent.trim()]))")
    return cells


def _overall_matches(page: Page, view: dict[str, Any]) -> bool:
    """The table's last row shows the run-wide numbers of the API's view: the backlog of
    every shard, the shards' energies summed into one ratio, their mean staleness and the
    range of their median pi."""
    overall, shown = view["shards_overall"], _overall_row(page)
    if set(shown) != {"backlog", "staleness_mean", "energy_ratio", "median_pi"}:
        return False
    pis = overall["median_pi_range"]
    shown_pis = (None if shown["median_pi"] == "—"
                 else [_shown_number(p) for p in shown["median_pi"].split("–")])
    return (_shown_number(shown["backlog"]) == sum(s["backlog"] for s in view["shards"])
            and _shown_number(shown["staleness_mean"]) == _rounded(overall["staleness_mean"])
            and _shown_number(shown["energy_ratio"]) == _rounded(overall["energy_ratio"])
            and shown_pis == (None if pis is None else [_rounded(p) for p in pis]))


def _matches_api(page: Page, api: httpx.Client) -> bool:
    view = api.get(f"/api/runs/{SHARDED}").json()
    shards = view["shards"]
    shown = _table(page)
    return (len(shown) == len(shards)
            and all(row["shard"] == str(s["shard"]) and _same(row, s)
                    for row, s in zip(shown, shards, strict=True))
            and _overall_matches(page, view))


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dashboard_shows_each_shard_of_a_sharded_run(api_url: str) -> None:
    with _api(api_url) as api:
        created = api.post("/api/runs", json={"run_id": SHARDED, "shards": SHARDS,
                                              "steps": 1_000_000, **TINY})
        assert created.status_code == 201, created.text
        with _browser_page("shards") as (page, errors):
            page.goto(f"{api_url}/#run={SHARDED}")
            _watch_the_shards_live(page)
            page.screenshot(path=str(ARTIFACTS / "dashboard-shards.png"), full_page=True)

            assert api.post(f"/api/runs/{SHARDED}/stop").status_code == 202
            wait_for(lambda: all(s["state"] == "stopped" and s["backlog"] == 0
                                 for s in api.get(f"/api/runs/{SHARDED}").json()["shards"]),
                     timeout_s=60, what="every shard stopped, its stream released")
            # Once the run has ended its numbers stay: the page must come to show them.
            wait_for(lambda: _matches_api(page, api), timeout_s=30,
                     what=f"the page's shard table equal to the API's: {_table(page)}")

            _compared_it_says_its_series_are_shard_0s(page)
            _a_run_of_one_shard_has_no_table(page, api)
            assert errors == []


def _watch_the_shards_live(page: Page) -> None:
    """One row per shard, each led by an aggregator and moving without a reload; the charts
    and tiles drawn from shard 0's rows say so."""
    page.wait_for_function(
        "n => { const rows = document.querySelectorAll('#shards-table tbody tr[data-shard]');"
        " return rows.length === n && [...rows].every(r =>"
        " r.querySelector('[data-field=leader]').textContent !== 'none'"
        " && Number(r.querySelector('[data-field=updates]').textContent.replace(/,/g, '')) > 0);"
        " }", arg=SHARDS, timeout=90_000)
    page.evaluate("window.gemqNoReload = true")  # gone if the page reloads
    assert page.is_visible("#shards-card")
    assert [row["shard"] for row in _table(page)] == ["0", "1", "2"]
    for row in _table(page):
        assert row["state"] == "running"
        assert re.fullmatch(r".+:\d+:[0-9a-f]{8}", row["leader"]), row  # host:pid:nonce
    before = [int(row["updates"].replace(",", "")) for row in _table(page)]
    page.wait_for_function(
        "before => [...document.querySelectorAll('#shards-table [data-field=updates]')]"
        ".every((td, i) => Number(td.textContent.replace(/,/g, '')) > before[i])",
        arg=before, timeout=30_000)
    assert page.evaluate("window.gemqNoReload") is True
    assert page.text_content("#energy-heading .shard-note") == f"shard 0 of {SHARDS}"
    assert page.is_visible("#energy-heading .shard-note")
    assert page.is_visible("#pi-heading .shard-note")
    assert page.locator("#stats .shard-note:visible").count() == 4  # energy, pi, staleness, rate
    # Every line chart's x axis is shard 0's updates (loss and accuracy are the run's: each
    # slice carries its step's), and the Updates tile is the run's, as the progress bar: its
    # slowest shard's, read with the table's.
    for chart in ("loss", "accuracy", "energy", "rate", "staleness"):
        assert page.locator(f"#{chart}-chart text.axis-label",
                            has_text="updates of shard 0").count() == 1, chart
    page.wait_for_function(
        "() => { const view = gemqDashboard.state.view;"
        " const slowest = Math.min(...view.shards.map(s => s.updates));"
        " return view.progress.updates === slowest && document.querySelector('#stat-updates')"
        ".textContent === slowest.toLocaleString('en-US'); }", timeout=5_000)


def _compared_it_says_its_series_are_shard_0s(page: Page) -> None:
    page.check(f'#run-list li[data-run-id="{SHARDED}"] input[data-action=compare]')
    note = f'#compare-legend li[data-run-id="{SHARDED}"] .shard-note'
    page.wait_for_selector(note, timeout=10_000)
    assert page.text_content(note) == f"shard 0 of {SHARDS}"
    page.click("#tab-run")


def _a_run_of_one_shard_has_no_table(page: Page, api: httpx.Client) -> None:
    created = api.post("/api/runs", json={"run_id": SINGLE, "start": False, **TINY})
    assert created.status_code == 201, created.text
    assert len(api.get(f"/api/runs/{SINGLE}").json()["shards"]) == 1
    page.click("#refresh-runs")
    page.click(f'#run-list li[data-run-id="{SINGLE}"] button[data-action=select]')
    page.wait_for_function(
        "run => document.querySelector('#run-title').textContent === run"
        " && document.querySelector('#run-state').textContent === 'created'",
        arg=SINGLE, timeout=15_000)
    assert page.is_hidden("#shards-card")
    assert page.locator(".shard-note:visible").count() == 0
