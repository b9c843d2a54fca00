// The runs picked for comparison and their metrics as columns: a run's whole series comes
// in one call (GET api/runs/{id}/series); while the run can still change, later calls ask
// only for the rows after the last one held.

import { api } from "./api.js";
import { invalidateComparison } from "./compareview.js";
import { num } from "./format.js";
import { showError } from "./page.js";
import { syncCompareBoxes } from "./runlist.js";
import { isOver, runSummary, state } from "./state.js";

export const MAX_COMPARED = 8;
// The x columns (updates, t_ms) and those the comparison's charts draw.
const FIELDS = ["updates", "t_ms", "loss", "accuracy", "energy_ratio", "staleness_mean"];
// Okabe and Ito's colours (told apart with the common colour-vision deficiencies), yellow
// swapped for grey, which reads better on white.
const PALETTE = ["#0072b2", "#e69f00", "#009e73", "#cc79a7", "#d55e00", "#56b4e9", "#000000", "#8a8a8a"];

export function isCompared(id) {
  return state.compare.runs.some((r) => r.id === id);
}

// The first colour no compared run has: a run keeps its colour while others come and go.
function freeColour() {
  const used = new Set(state.compare.runs.map((r) => r.colour));
  return PALETTE.find((c) => !used.has(c)) || PALETTE[0];
}

function newEntry(id) {
  return {
    id, colour: freeColour(), columns: Object.fromEntries(FIELDS.map((f) => [f, []])),
    count: 0, lastId: "0-0", final: false, busy: false, error: null,
  };
}

// Adds (on) or removes a run; false when it cannot be added (the comparison is full).
export function setCompared(id, on) {
  const runs = state.compare.runs;
  const at = runs.findIndex((r) => r.id === id);
  let done = true;
  if (!on && at >= 0) runs.splice(at, 1);
  else if (on && at < 0 && runs.length >= MAX_COMPARED) {
    showError(`At most ${MAX_COMPARED} runs can be compared at a time: untick one first.`);
    done = false;
  } else if (on && at < 0) {
    const entry = newEntry(id);
    runs.push(entry);
    fetchMore(entry);
  }
  syncCompareBoxes();
  invalidateComparison("legend", "charts");
  return done;
}

// The rows of one run after the last one held. A run already over when the call starts is
// then complete: it is not asked again.
async function fetchMore(entry) {
  if (entry.busy) return;
  entry.busy = true;
  const over = isOver(runSummary(entry.id));
  const query = `after=${encodeURIComponent(entry.lastId)}&fields=${FIELDS.join(",")}`;
  try {
    const data = await api("GET", `/runs/${encodeURIComponent(entry.id)}/series?${query}`);
    if (!state.compare.runs.includes(entry)) return; // removed meanwhile
    for (const f of FIELDS) entry.columns[f] = entry.columns[f].concat((data.columns[f] || []).map(num));
    entry.count += data.count;
    entry.lastId = data.last_id;
    entry.final = over;
    entry.error = null;
    invalidateComparison("legend", ...(data.count ? ["charts"] : []));
  } catch (e) {
    entry.error = e.message;
    if (e.status === 404) entry.final = true; // deleted: nothing more will come
    invalidateComparison("legend");
  } finally {
    entry.busy = false;
  }
}

// Every few seconds: new rows of the compared runs that can still change, and the legend
// (run states come with the run list's poll).
export function refreshCompared() {
  for (const entry of state.compare.runs) if (!entry.final) fetchMore(entry);
  if (state.compare.runs.length) invalidateComparison("legend");
}
