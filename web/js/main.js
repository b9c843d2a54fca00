// The dashboard's entry point: wires the page's buttons, the start form and the timers.
// Plain ES modules, no libraries, no build step. The API is that of docs/api.md: the run
// list and run views over fetch, live metrics over Server-Sent Events, polling as fallback.

import { stopRun, startExisting } from "./actions.js";
import { bindTokenButton } from "./api.js";
import { initStartForm } from "./form.js";
import { loadRuns, runFromHash, selectRun, watchdog } from "./live.js";
import { $, clearError } from "./page.js";
import { invalidate, tickClock } from "./render.js";
import { state } from "./state.js";

const RUNS_POLL_MS = 5000;
const WATCHDOG_MS = 2000;

function onRunListClick(ev) {
  const button = ev.target.closest("button[data-action]");
  if (!button) return;
  const id = button.closest("li[data-run-id]").dataset.runId;
  const action = button.dataset.action;
  if (action === "select") selectRun(id);
  else if (action === "stop") stopRun(id);
  else if (action === "start") startExisting(id);
}

async function onStarted(view) {
  await loadRuns();
  if (view && view.run_id) selectRun(view.run_id);
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
  initStartForm(onStarted);
  window.addEventListener("hashchange", () => {
    const id = runFromHash();
    if (id) selectRun(id);
  });
  let resizeTimer = 0;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => invalidate("rows"), 150);
  });
  loadRuns();
  setInterval(loadRuns, RUNS_POLL_MS);
  setInterval(watchdog, WATCHDOG_MS);
  setInterval(tickClock, 1000);
}

window.gemqDashboard = { state }; // for a look from the browser's console
init(); // a module script runs once the document is parsed, like a deferred one
