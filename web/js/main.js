// The dashboard's entry point: wires the page's buttons, the start form and the timers.
// Plain ES modules, no libraries, no build step. The API is that of docs/api.md: the run
// list and run views over fetch, live metrics over Server-Sent Events, polling as fallback;
// compared runs' series over fetch.

import { stopRun, startExisting } from "./actions.js";
import { bindTokenButton } from "./api.js";
import { refreshCompared, setCompared } from "./comparison.js";
import { invalidateComparison } from "./compareview.js";
import { initStartForm } from "./form.js";
import { loadRuns, runFromHash, selectRun, watchdog } from "./live.js";
import { showMode } from "./modes.js";
import { $, clearError } from "./page.js";
import { invalidate, tickClock, toggleLogLoss, zoomTo } from "./render.js";
import { state } from "./state.js";

const RUNS_POLL_MS = 5000;
const WATCHDOG_MS = 2000;
const COMPARE_POLL_MS = 3000;

function onRunListClick(ev) {
  const button = ev.target.closest("button[data-action]");
  if (!button) return;
  const id = button.closest("li[data-run-id]").dataset.runId;
  const action = button.dataset.action;
  if (action === "select") {
    showMode("run");
    selectRun(id);
  } else if (action === "stop") stopRun(id);
  else if (action === "start") startExisting(id);
}

// A ticked box adds its run to the comparison and shows it; an unticked one removes it.
function onCompareBox(ev) {
  const box = ev.target.closest("input[data-action=compare]");
  if (!box) return;
  const id = box.closest("li[data-run-id]").dataset.runId;
  if (setCompared(id, box.checked) && box.checked) showMode("compare");
}

function bindComparison() {
  $("#run-list").addEventListener("change", onCompareBox);
  $("#compare-legend").addEventListener("click", (ev) => {
    const button = ev.target.closest("button[data-action=uncompare]");
    if (button) setCompared(button.closest("li[data-run-id]").dataset.runId, false);
  });
  $("#compare-axis").addEventListener("change", (ev) => {
    state.compare.axis = ev.target.value;
    invalidateComparison("charts");
  });
  for (const tab of document.querySelectorAll("[role=tab][data-mode]")) {
    tab.addEventListener("click", () => showMode(tab.dataset.mode));
  }
  setInterval(refreshCompared, COMPARE_POLL_MS);
}

async function onStarted(view) {
  await loadRuns();
  if (!view || !view.run_id) return;
  showMode("run");
  selectRun(view.run_id);
}

function init() {
  bindTokenButton();
  $("#run-list").addEventListener("click", onRunListClick);
  $("#refresh-runs").addEventListener("click", () => {
    state.runsSignature = "";
    loadRuns();
  });
  $("#stop-button").addEventListener("click", () => state.selected && stopRun(state.selected));
  $("#start-run-button").addEventListener("click", () => state.selected && startExisting(state.selected));
  $("#error-close").addEventListener("click", clearError);
  $("#zoom-reset").addEventListener("click", () => zoomTo(null));
  $("#loss-log").addEventListener("click", toggleLogLoss);
  bindComparison();
  initStartForm(onStarted);
  window.addEventListener("hashchange", () => {
    const id = runFromHash();
    if (!id) return;
    showMode("run");
    selectRun(id);
  });
  let resizeTimer = 0;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => {
      invalidate("rows");
      invalidateComparison("charts");
    }, 150);
  });
  loadRuns();
  setInterval(loadRuns, RUNS_POLL_MS);
  setInterval(watchdog, WATCHDOG_MS);
  setInterval(tickClock, 1000);
}

window.gemqDashboard = { state }; // for a look from the browser's console
init(); // a module script runs once the document is parsed, like a deferred one
