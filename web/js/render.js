// Drawing the selected run: its header (state, job, progress, times, config), the stat
// tiles, the shards table, the charts and the workers table, batched into one animation
// frame.

import { serverNow } from "./api.js";
import { duration, esc, fmt, fmtInt, num } from "./format.js";
import { heatmap } from "./heatmap.js";
import { lineChart } from "./linechart.js";
import { $ } from "./page.js";
import { lastOf, rateSeries, seriesOf, smooth } from "./series.js";
import { renderShards, rowsAxis } from "./shards.js";
import { ENDED, jobState, state } from "./state.js";
import { renderWorkers, tickWorkers } from "./workers.js";

// Marks parts of the page stale ("rows": the charts; "view": everything from the run view)
// and draws them at the next frame, however many updates come before it.
export function invalidate(...parts) {
  for (const part of parts) state.dirty[part] = true;
  if (state.frame) return;
  state.frame = requestAnimationFrame(() => {
    state.frame = 0;
    const { rows, view } = state.dirty;
    state.dirty.rows = state.dirty.view = false;
    if (view) renderRunHead();
    if (view) renderShards();
    if (view) renderWorkers();
    if (view || rows) renderStats();
    if (rows || view) renderCharts();
  });
}

// The newest metrics: the last row, overridden by the view's (it may be newer).
function latest() {
  const v = state.view || {};
  return { ...(state.rows[state.rows.length - 1] || {}), ...(v.latest || {}) };
}

function renderRunHead() {
  const v = state.view;
  const stateEl = $("#run-state");
  const jobEl = $("#job-state");
  const stop = $("#stop-button");
  const start = $("#start-run-button");
  if (!v) {
    stateEl.textContent = "loading…";
    stateEl.className = "badge";
    jobEl.textContent = "—";
    stop.disabled = true;
    start.hidden = true;
    return;
  }
  stateEl.textContent = v.state || "unknown";
  stateEl.className = `badge state-${v.state}`;
  stateEl.dataset.state = v.state || "";
  const job = jobState(v.job);
  jobEl.textContent = job || "none";
  jobEl.className = `badge badge-muted job-${job || "none"}`;
  const jobError = v.job && typeof v.job === "object" ? v.job.error : null;
  const err = v.error || jobError;
  $("#job-error").hidden = !err;
  $("#job-error").textContent = err ? `${v.state === "failed" ? "Run failed" : "Error"}: ${err}` : "";
  // What a run that makes no progress waits for (no aggregator service, no worker).
  $("#run-waiting").hidden = !v.waiting;
  $("#run-waiting").textContent = v.waiting || "";

  const ended = ENDED.has(v.state);
  stop.disabled = ended || state.stopPending;
  stop.textContent = state.stopPending ? "Stopping…" : "Stop run";
  stop.title = ended ? `The run has ${v.state}` : "Stop this run after its current batch";
  start.hidden = !(v.state === "created" && !job);

  $("#run-times").textContent = runTimes(v);
  renderProgress(v.progress || {}, ended);
  renderKeyValues($("#config-table tbody"), v.config || {});
  renderKeyValues($("#counters-table tbody"), v.counters || {});
}

function runTimes(v) {
  const times = [];
  if (v.created_ms) times.push(`created ${new Date(num(v.created_ms)).toLocaleString()}`);
  if (v.started_ms) {
    const end = v.ended_ms ? num(v.ended_ms) : serverNow();
    times.push(`${v.ended_ms ? "ran" : "running"} for ${duration(end - num(v.started_ms))}`);
  }
  return times.join(" · ");
}

function renderProgress(p, ended) {
  const frac = Math.max(0, Math.min(1, num(p.fraction) || 0));
  $("#progress-fill").style.width = `${(frac * 100).toFixed(1)}%`;
  $("#progress-fill").classList.toggle("done", ended);
  $("#progress-text").textContent = p.budget
    ? `${fmtInt(p.updates)} / ${fmtInt(p.budget)} updates (${(frac * 100).toFixed(1)}%)`
    : `${fmtInt(p.updates)} updates`;
}

function renderKeyValues(tbody, obj) {
  tbody.innerHTML = Object.keys(obj).sort().map((k) => {
    const val = obj[k];
    const shown = val !== null && typeof val === "object" ? JSON.stringify(val) : String(val);
    return `<tr><th scope="row">${esc(k)}</th><td>${esc(shown)}</td></tr>`;
  }).join("");
}

function renderStats() {
  const l = latest();
  const counters = (state.view && state.view.counters) || {};
  let rejected = 0;
  for (const [k, v] of Object.entries(counters)) if (k.startsWith("rejected")) rejected += num(v) || 0;
  const rate = Number.isNaN(num(l.updates_per_s)) ? lastOf(rateSeries(state.rows)) : num(l.updates_per_s);
  // The run's updates (its slowest shard's, as the progress bar); the rows are shard 0's.
  const progress = (state.view && state.view.progress) || {};
  $("#stat-updates").textContent = fmtInt(progress.updates ?? l.updates);
  $("#stat-loss").textContent = fmt(l.loss, 4);
  $("#stat-energy").textContent = fmt(l.energy_ratio);
  $("#stat-pi").textContent = fmt(l.median_pi);
  $("#stat-staleness").textContent = fmt(l.staleness_mean);
  $("#stat-rate").textContent = fmt(rate);
  // The table's notion of active (heard from within the API's window), else the aggregator's.
  const workers = state.view && Array.isArray(state.view.workers) ? state.view.workers : null;
  $("#stat-workers").textContent = workers && workers.length
    ? `${workers.filter((w) => w.active === true).length} / ${workers.length}`
    : fmtInt(l.active_workers);
  $("#stat-rejected").textContent = fmtInt(rejected);
}

function renderCharts() {
  const rows = state.rows;
  // One x range (updates) for every chart, so that they line up.
  const xs = rows.map((r) => r.updates).filter(Number.isFinite);
  const xDomain = state.zoom || (xs.length ? [xs[0], xs[xs.length - 1]] : null);
  const axis = { ...rowsAxis(state.view), onZoom: zoomTo };
  $("#zoom-reset").hidden = !state.zoom;
  $("#zoom-hint").textContent = state.zoom
    ? `updates ${fmtInt(state.zoom[0])} to ${fmtInt(state.zoom[1])}`
    : "drag across a chart to zoom";
  const loss = seriesOf(rows, "loss");
  lineChart($("#loss-chart"), {
    series: [
      { name: "loss", points: loss, cls: "s-raw" },
      { name: "smoothed", points: smooth(loss), cls: "s-main" },
      { name: "held-out", points: seriesOf(rows, "test_loss", "eval_updates"), cls: "s-heldout", markers: true },
    ],
    yZero: true, readout: $("#loss-readout"), hover: 0, xDomain, ...axis, legend: true, robust: true,
    logY: state.logLoss,
  });
  const accuracy = seriesOf(rows, "accuracy");
  lineChart($("#accuracy-chart"), {
    series: [
      { name: "accuracy", points: accuracy, cls: "s-raw" },
      { name: "smoothed", points: smooth(accuracy), cls: "s-main" },
      { name: "held-out", points: seriesOf(rows, "test_accuracy", "eval_updates"), cls: "s-heldout", markers: true },
    ],
    yDomain: [0, 1], readout: $("#accuracy-readout"), hover: 0, xDomain, ...axis, legend: true,
  });
  const energy = seriesOf(rows, "energy_ratio");
  lineChart($("#energy-chart"), {
    series: [
      { name: "energy ratio", points: energy, cls: "s-energy-raw" },
      { name: "smoothed", points: smooth(energy), cls: "s-energy" },
    ],
    refs: [{ y: 1, label: "1 = compliance" }],
    yZero: true, readout: $("#energy-readout"), hover: 0, xDomain, ...axis, legend: true, robust: true,
  });
  lineChart($("#rate-chart"), {
    series: [{ name: "updates/s", points: rateSeries(rows), cls: "s-rate" }],
    yZero: true, readout: $("#rate-readout"), hover: 0, xDomain, ...axis,
  });
  lineChart($("#staleness-chart"), {
    series: [
      { name: "max", points: seriesOf(rows, "staleness_max"), cls: "s-raw-alt" },
      { name: "mean", points: seriesOf(rows, "staleness_mean"), cls: "s-stale" },
    ],
    yZero: true, readout: $("#staleness-readout"), hover: 1, xDomain, ...axis, legend: true,
  });
  const tensors = (state.view && state.view.tensors) || [];
  const piMax = num(state.view && state.view.config && state.view.config.pi_max);
  heatmap($("#pi-heatmap"), tensors, rows, Number.isNaN(piMax) ? 5 : piMax, $("#pi-readout"));
}

// Every chart of the run shows the range dragged across one of them (null: everything).
export function zoomTo(range) {
  state.zoom = range;
  invalidate("rows");
}

export function toggleLogLoss() {
  state.logLoss = !state.logLoss;
  $("#loss-log").setAttribute("aria-pressed", String(state.logLoss));
  invalidate("rows");
}

// Once a second: relative times move on without new data.
export function tickClock() {
  tickWorkers();
  if (state.view && state.view.started_ms && !state.view.ended_ms) invalidate("view"); // "running for"
}
