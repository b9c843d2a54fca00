// The selected run's live data: the run list poll, selection, the backfill of metrics rows,
// the Server-Sent Events stream with its reconnects, and polling while the stream is down.

import { api, apiUrl } from "./api.js";
import { parseJson } from "./format.js";
import { $, setConnection, showError } from "./page.js";
import { invalidate } from "./render.js";
import { renderRunList } from "./runlist.js";
import { normaliseRow, streamIdAfter } from "./series.js";
import { ENDED, runIsOver, state } from "./state.js";

const MAX_ROWS = 50000; // the metrics stream keeps ~20,000; this bounds the page's memory
const PAGE = 5000; // metrics rows per backfill request

export async function loadRuns() {
  try {
    const data = await api("GET", "/runs");
    state.runs = Array.isArray(data) ? data : (data && data.runs) || [];
    // The list is the API's first page: say so when there are more runs than it holds.
    const total = data && Number.isFinite(data.total) ? data.total : state.runs.length;
    const more = $("#runs-more");
    more.hidden = total <= state.runs.length;
    more.textContent = `The newest ${state.runs.length} of ${total} runs (GET api/runs?offset=… lists the others).`;
    renderRunList();
    if (!state.selected) selectInitialRun();
  } catch (e) {
    renderRunList(e.message);
  }
}

// The run id in the URL's #run=<id>, or "".
export function runFromHash() {
  return decodeURIComponent((location.hash.match(/^#run=(.+)$/) || [])[1] || "");
}

// The run named in the URL, else a running one, else the newest.
function selectInitialRun() {
  const fromHash = runFromHash();
  if (fromHash) return selectRun(fromHash);
  if (!state.runs.length) return;
  const live = state.runs.find((r) => r.state === "running") || state.runs[0];
  selectRun(live.run_id);
}

export function selectRun(id) {
  if (!id || id === state.selected) return;
  closeStream();
  state.selected = id;
  state.gen += 1;
  state.view = null;
  state.rows = [];
  state.lastId = null;
  state.esFailures = 0;
  state.stopPending = false;
  state.knownWorkers = new Map();
  state.zoom = null; // another run's range means nothing here
  if (location.hash !== `#run=${encodeURIComponent(id)}`) history.replaceState(null, "", `#run=${encodeURIComponent(id)}`);
  $("#no-run").hidden = true;
  $("#run-panel").hidden = false;
  $("#run-title").textContent = id;
  $("#model-link").href = apiUrl(`/runs/${encodeURIComponent(id)}/model`);
  $("#model-link").setAttribute("download", `${id}.pt`);
  renderRunList();
  invalidate("rows", "view");
  const gen = state.gen;
  refreshSelected(gen).then(() => {
    if (gen === state.gen && !runIsOver()) connectStream();
  });
}

function deselect() {
  closeStream();
  state.selected = null;
  state.gen += 1;
  state.view = null;
  state.rows = [];
  $("#run-panel").hidden = true;
  $("#no-run").hidden = false;
  history.replaceState(null, "", location.pathname + location.search);
  setConnection("idle");
  renderRunList();
}

// One fetch round: the run view, then every metrics row after the last one we have.
export async function refreshSelected(gen) {
  const id = state.selected;
  try {
    const view = await api("GET", `/runs/${encodeURIComponent(id)}`);
    if (gen !== state.gen) return;
    onView(view);
    await backfill(gen);
    state.pollOk = true;
  } catch (e) {
    if (gen !== state.gen) return;
    state.pollOk = false;
    if (e.status === 404) {
      showError(`Run ${id} not found: ${e.message}`);
      deselect();
    } else {
      setConnection("offline", "API unreachable");
    }
  }
}

// Pages of up to PAGE rows; a short page means we have caught up (the stream does the rest).
async function backfill(gen) {
  const id = state.selected;
  for (let page = 0; page < 20; page += 1) {
    const after = state.lastId ? `after=${encodeURIComponent(state.lastId)}&` : "";
    const data = await api("GET", `/runs/${encodeURIComponent(id)}/metrics?${after}limit=${PAGE}`);
    if (gen !== state.gen) return;
    const rows = Array.isArray(data) ? data : (data && data.rows) || [];
    addRows(rows);
    if (rows.length < PAGE) break;
  }
}

export function connectStream() {
  closeStream();
  const gen = state.gen;
  // Resume after the newest row we hold (a reconnecting EventSource also sends Last-Event-ID).
  const after = state.lastId ? `?after=${encodeURIComponent(state.lastId)}` : "";
  const es = new EventSource(apiUrl(`/runs/${encodeURIComponent(state.selected)}/events${after}`));
  state.es = es;
  setConnection("connecting", "connecting…");
  es.addEventListener("open", () => {
    if (gen !== state.gen) return;
    state.esFailures = 0;
    setConnection("live", "live");
    // Rows published while we were not connected.
    backfill(gen).catch(() => {});
  });
  es.addEventListener("metrics", (ev) => {
    if (gen !== state.gen) return;
    const data = parseJson(ev.data);
    if (data) addRows(Array.isArray(data) ? data : data.rows || []);
  });
  es.addEventListener("run", (ev) => {
    if (gen !== state.gen) return;
    const view = parseJson(ev.data);
    if (view) onView(view);
  });
  es.addEventListener("error", () => {
    if (gen !== state.gen || state.es !== es) return;
    if (es.readyState === EventSource.CLOSED) {
      // The browser gave up (an HTTP error or a wrong content type): retry ourselves.
      state.es = null;
      scheduleReconnect(gen);
    } else {
      setConnection("reconnecting", "reconnecting…");
    }
  });
}

function scheduleReconnect(gen) {
  clearTimeout(state.reconnectTimer);
  if (runIsOver()) return;
  const delay = Math.min(1000 * 2 ** state.esFailures, 15000);
  state.esFailures += 1;
  // While polling works (as when reads need the token, which EventSource cannot send),
  // say so rather than "reconnecting".
  if (state.pollOk) setConnection("polling", "polling");
  else setConnection("reconnecting", `reconnecting in ${Math.round(delay / 1000)}s…`);
  state.reconnectTimer = setTimeout(() => {
    if (gen === state.gen && !runIsOver()) connectStream();
  }, delay);
}

function closeStream() {
  clearTimeout(state.reconnectTimer);
  if (state.es) state.es.close();
  state.es = null;
}

// While the event stream is down (or refused, as when reads need the token), poll.
export async function watchdog() {
  if (!state.selected || state.polling) return;
  if (state.es && state.es.readyState === EventSource.OPEN) return;
  // An ended run has no stream; refresh its view now and then (its workers go quiet).
  if (runIsOver() && Date.now() - state.viewAt < 5000) return;
  state.polling = true;
  try {
    await refreshSelected(state.gen);
    if (state.pollOk && !(state.es && state.es.readyState === EventSource.OPEN) && !runIsOver()) {
      setConnection("polling", "polling");
    }
  } finally {
    state.polling = false;
  }
}

function addRows(rows) {
  let added = 0;
  for (const raw of rows) {
    if (!raw || raw.id === undefined) continue;
    if (state.lastId && !streamIdAfter(raw.id, state.lastId)) continue; // already have it
    state.rows.push(normaliseRow(raw));
    state.lastId = raw.id;
    added += 1;
  }
  if (state.rows.length > MAX_ROWS) state.rows.splice(0, state.rows.length - MAX_ROWS);
  if (added) invalidate("rows");
}

function onView(view) {
  if (!view || view.run_id !== state.selected) return;
  const wasOver = runIsOver();
  // Workers already there when the run is opened are not news; later ones are highlighted.
  const first = state.view === null;
  for (const w of view.workers || []) {
    if (!state.knownWorkers.has(w.worker_id)) state.knownWorkers.set(w.worker_id, first ? 0 : Date.now());
  }
  state.view = view;
  state.viewAt = Date.now();
  if (ENDED.has(view.state)) state.stopPending = false;
  if (!state.runs.some((r) => r.run_id === view.run_id)) loadRuns();
  invalidate("view");
  renderRunList();
  if (!wasOver && runIsOver()) {
    // Final state: take the last rows, then stop listening.
    closeStream();
    backfill(state.gen).catch(() => {});
    setConnection("ended", `run ${view.state}`);
  } else if (runIsOver()) {
    setConnection("ended", `run ${view.state}`);
  }
}
