// The run list in the sidebar: one row per run with its compare box, state, job, progress
// and the Start and Stop buttons (their clicks are wired in main.js).

import { esc, num } from "./format.js";
import { $ } from "./page.js";
import { ENDED, jobState, state } from "./state.js";

function summaryOf(run) {
  // The selected run's live view is fresher than the last list poll.
  if (state.view && run.run_id === state.view.run_id) {
    return { ...run, state: state.view.state, job: state.view.job, progress: state.view.progress };
  }
  return run;
}

function runItem(r) {
  const id = r.run_id;
  const st = r.state || "unknown";
  const job = jobState(r.job);
  const frac = r.progress ? num(r.progress.fraction) : NaN;
  const selected = id === state.selected;
  const canStop = !ENDED.has(st);
  const canStart = st === "created" && !job;
  return `<li class="run-item${selected ? " selected" : ""}" data-run-id="${esc(id)}" data-state="${esc(st)}" data-testid="run-item">
    <input type="checkbox" class="run-compare" data-action="compare" aria-label="Compare run ${esc(id)}" title="Compare this run with others">
    <button type="button" class="run-select" data-action="select" ${selected ? 'aria-current="true"' : ""}>
      <span class="run-id">${esc(id)}</span>
      <span class="run-meta">
        <span class="badge state-${esc(st)}" data-testid="run-item-state">${esc(st)}</span>
        <span class="muted">job ${esc(job || "—")}</span>
        ${Number.isNaN(frac) ? "" : `<span class="muted">${Math.round(frac * 100)}%</span>`}
      </span>
    </button>
    ${canStart ? `<button type="button" class="btn btn-small" data-action="start" aria-label="Start run ${esc(id)}">Start</button>` : ""}
    ${canStop ? `<button type="button" class="btn btn-small btn-danger-ghost" data-action="stop" aria-label="Stop run ${esc(id)}">Stop</button>` : ""}
  </li>`;
}

// Redraws the list only when what it shows changed (keeps focus and hover between polls).
export function renderRunList(error) {
  const list = $("#run-list");
  const runs = state.runs.map(summaryOf);
  const signature = JSON.stringify([error || "", state.selected, state.stopPending,
    runs.map((r) => [r.run_id, r.state, jobState(r.job), r.progress && r.progress.fraction])]);
  if (signature === state.runsSignature) return;
  state.runsSignature = signature;
  if (error && !runs.length) {
    list.innerHTML = `<li class="empty error-text">${esc(error)}</li>`;
    return;
  }
  if (!runs.length) {
    list.innerHTML = `<li class="empty">No runs yet. Start one below.</li>`;
    return;
  }
  list.innerHTML = runs.map(runItem).join("");
  syncCompareBoxes();
}

// Ticks the boxes of the compared runs, in their lines' colours. Sets them in place: the
// list is not redrawn, so the box just clicked keeps the focus.
export function syncCompareBoxes() {
  for (const box of document.querySelectorAll("#run-list input[data-action=compare]")) {
    const id = box.closest("li[data-run-id]").dataset.runId;
    const entry = state.compare.runs.find((r) => r.id === id);
    box.checked = !!entry;
    box.style.accentColor = entry ? entry.colour : "";
  }
}
