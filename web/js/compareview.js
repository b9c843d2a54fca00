// Drawing the comparison: the legend (per run: its colour, id and algorithm, state, rows,
// CSV link and a remove button) and one chart per metric with a line per run, over the
// x axis chosen; batched into one animation frame.

import { apiUrl } from "./api.js";
import { esc, fmtInt, num } from "./format.js";
import { lineChart } from "./linechart.js";
import { $ } from "./page.js";
import { pairs, smooth } from "./series.js";
import { runSummary, state } from "./state.js";
import { xAxisOf } from "./xaxis.js";

// Each metric is noisy from batch to batch: the lines are smoothed (the same points, each
// averaged with its neighbours), so that several runs stay apart.
const CHARTS = [
  { key: "loss", el: "#compare-loss-chart", readout: "#compare-loss-readout", robust: true },
  // Runs whose targets are not classes have none: no line, as for a run with no rows.
  { key: "accuracy", el: "#compare-accuracy-chart", readout: "#compare-accuracy-readout",
    yDomain: [0, 1] },
  { key: "energy_ratio", el: "#compare-energy-chart", readout: "#compare-energy-readout",
    robust: true, refs: [{ y: 1, label: "1 = compliance" }] },
  { key: "staleness_mean", el: "#compare-staleness-chart", readout: "#compare-staleness-readout" },
];

// "<id> (<algorithm>)": how the legend and the lines' tooltips name a run.
function runLabel(id) {
  const run = runSummary(id);
  return run && run.algo ? `${id} (${run.algo})` : id;
}

// Marks parts of the comparison stale ("legend", "charts") and draws them at the next frame.
export function invalidateComparison(...parts) {
  const c = state.compare;
  for (const part of parts) c.dirty[part] = true;
  if (c.frame) return;
  c.frame = requestAnimationFrame(() => {
    c.frame = 0;
    $("#compare-count").textContent = String(c.runs.length);
    if (state.mode !== "compare") return; // stays dirty: hidden charts have no width
    const { legend, charts } = c.dirty;
    c.dirty.legend = c.dirty.charts = false;
    $("#compare-empty").hidden = c.runs.length > 0;
    $("#compare-panel").hidden = c.runs.length === 0;
    if (legend) renderLegend(c.runs);
    if (charts) renderCharts(c.runs);
  });
}

function legendItem(entry) {
  const run = runSummary(entry.id) || {};
  const id = esc(entry.id);
  const csv = esc(apiUrl(`/runs/${encodeURIComponent(entry.id)}/metrics.csv`));
  return `<li class="compare-item" data-run-id="${id}" data-testid="compare-item">
    <span class="swatch-line" style="background:${esc(entry.colour)}" aria-hidden="true"></span>
    <span class="compare-name"><span class="run-id">${id}</span>${run.algo ? ` <span class="algo">${esc(run.algo)}</span>` : ""}</span>
    ${run.shard_count > 1 ? `<span class="shard-note" title="A sharded run's series are its shard 0's metrics rows">shard 0 of ${esc(run.shard_count)}</span>` : ""}
    <span class="badge state-${esc(run.state || "unknown")}">${esc(run.state || "unknown")}</span>
    <span class="muted compare-rows" data-rows>${fmtInt(entry.count)} rows</span>
    ${entry.error ? `<span class="error-text compare-error">${esc(entry.error)}</span>` : ""}
    <span class="compare-actions">
      <a class="btn btn-small btn-ghost" href="${csv}" download="${id}-metrics.csv" data-testid="csv-link">Download CSV</a>
      <button type="button" class="btn btn-small btn-ghost" data-action="uncompare" aria-label="Remove ${id} from the comparison" title="Remove from the comparison">×</button>
    </span>
  </li>`;
}

// Rebuilt only when what it names changed (keeps focus on its links between polls); the
// row counts are updated in place.
function renderLegend(runs) {
  const list = $("#compare-legend");
  const signature = JSON.stringify(runs.map((r) => {
    const run = runSummary(r.id) || {};
    return [r.id, r.colour, run.algo, run.shard_count, run.state, r.error];
  }));
  if (signature !== list.dataset.signature) {
    list.dataset.signature = signature;
    list.innerHTML = runs.map(legendItem).join("");
  }
  for (const r of runs) {
    const rows = list.querySelector(`li[data-run-id="${CSS.escape(r.id)}"] [data-rows]`);
    if (rows) rows.textContent = `${fmtInt(r.count)} rows`;
  }
  $("#compare-title").textContent = `Comparing ${runs.length} run${runs.length === 1 ? "" : "s"}`;
}

function renderCharts(runs) {
  const axis = xAxisOf(state.compare.axis, runs.map((r) => ({
    columns: r.columns, startMs: num((runSummary(r.id) || {}).started_ms),
  })));
  for (const chart of CHARTS) {
    const series = runs.map((r, i) => {
      const points = smooth(pairs(axis.xs[i], r.columns[chart.key]));
      return { id: r.id, name: runLabel(r.id), color: r.colour, points };
    });
    lineChart($(chart.el), {
      series, refs: chart.refs, xZero: true, yZero: true, robust: chart.robust, hover: "all",
      yDomain: chart.yDomain,
      xLabel: axis.label, fmtX: axis.fmtX, readout: $(chart.readout),
    });
  }
}
