// A sharded run's shards: the table of each shard's numbers (from the run view's "shards"),
// and the notes on the charts and tiles drawn from shard 0's metrics rows alone. A run of
// one shard shows neither.

import { esc, fmt, fmtInt } from "./format.js";
import { $ } from "./page.js";
import { state } from "./state.js";

// The run view's per-shard table; empty for a run of one shard.
function shardsOf(view) {
  const shards = view && Array.isArray(view.shards) ? view.shards : [];
  return shards.length > 1 ? shards : [];
}

// A shard without a final state of its own is still going (or not started, with its run).
function shardState(shard, runState) {
  if (shard.state) return shard.state;
  return runState === "created" ? "created" : "running";
}

function shardRow(s, runState) {
  const st = shardState(s, runState);
  const leader = s.leader
    ? `<span class="mono" title="${esc(s.leader)}">${esc(s.leader)}</span>`
    : `<span class="muted">none</span>`;
  return `<tr data-shard="${esc(s.shard)}" data-testid="shard-row">
    <th scope="row">${esc(s.shard)}</th>
    <td data-field="state"><span class="badge state-${esc(st)}">${esc(st)}</span></td>
    <td data-field="leader">${leader}</td>
    <td class="num" data-field="updates">${fmtInt(s.updates)}</td>
    <td class="num" data-field="applied">${fmtInt(s.applied)}</td>
    <td class="num" data-field="rejected">${fmtInt(s.rejected)}</td>
    <td class="num" data-field="backlog">${fmtInt(s.backlog)}</td>
    <td class="num" data-field="staleness_mean">${fmt(s.staleness_mean)}</td>
    <td class="num" data-field="energy_ratio">${fmt(s.energy_ratio)}</td>
    <td class="num" data-field="median_pi">${fmt(s.median_pi)}</td>
  </tr>`;
}

// The run-wide row (the run view's "shards_overall"): energies summed over the shards,
// their mean staleness, the range of their median pi.
function renderOverall(view, shards) {
  const overall = view.shards_overall || {};
  const cell = (field) => $(`#shards-table tfoot [data-field=${field}]`);
  cell("backlog").textContent = fmtInt(shards.reduce((sum, s) => sum + (s.backlog || 0), 0));
  cell("staleness_mean").textContent = fmt(overall.staleness_mean);
  cell("energy_ratio").textContent = fmt(overall.energy_ratio);
  const range = overall.median_pi_range;
  cell("median_pi").textContent = range ? `${fmt(range[0])}–${fmt(range[1])}` : fmt(null);
}

// The line charts' x axis: the updates of the rows' shard, named so when the run has
// others (its shards apply at their own pace; the progress bar is the slowest one's).
export function rowsAxis(view) {
  if (!shardsOf(view).length) return {};
  return { xLabel: "updates of shard 0", fmtX: (x) => `${fmtInt(x)} updates of shard 0` };
}

export function renderShards() {
  const view = state.view;
  const shards = shardsOf(view);
  $("#shards-card").hidden = !shards.length;
  // The charts and tiles that come from the metrics rows show shard 0's: say so.
  for (const note of document.querySelectorAll(".shard-note")) {
    note.hidden = !shards.length;
    note.textContent = shards.length ? `shard 0 of ${shards.length}` : "";
  }
  if (!shards.length) return;
  const leading = shards.filter((s) => s.leader).length;
  $("#shards-summary").textContent = `${shards.length} shards, ${leading} led`;
  $("#shards-table tbody").innerHTML = shards.map((s) => shardRow(s, view.state)).join("");
  renderOverall(view, shards);
}
