// What the Start and Stop buttons of a run do (in the run list and in the run's header).

import { api } from "./api.js";
import { setFormMessage } from "./form.js";
import { connectStream, loadRuns, refreshSelected } from "./live.js";
import { clearError, showError } from "./page.js";
import { invalidate } from "./render.js";
import { runIsOver, state } from "./state.js";

export async function stopRun(id) {
  if (!window.confirm(`Stop run ${id}?\n\nThe aggregator finishes its current batch, commits it, and marks the run stopped. This cannot be undone.`)) return;
  clearError();
  if (id === state.selected) {
    state.stopPending = true;
    invalidate("view");
  }
  try {
    await api("POST", `/runs/${encodeURIComponent(id)}/stop`);
    setFormMessage("");
  } catch (e) {
    if (id === state.selected) state.stopPending = false;
    showError(`Could not stop ${id}: ${e.message}`);
  }
  invalidate("view");
  loadRuns();
  if (id === state.selected && !state.es) refreshSelected(state.gen);
}

// Enqueues the aggregation of a run created with "start": false.
export async function startExisting(id) {
  clearError();
  try {
    await api("POST", `/runs/${encodeURIComponent(id)}/start`);
  } catch (e) {
    showError(`Could not start ${id}: ${e.message}`);
  }
  await loadRuns();
  if (id === state.selected) {
    const gen = state.gen;
    await refreshSelected(gen);
    if (gen === state.gen && !state.es && !runIsOver()) connectStream();
  }
}
