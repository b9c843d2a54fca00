// The comparison's x axis: updates, or time since each run's start (runs started at
// different moments then line up), in seconds, or in minutes for long runs.

import { fmt, fmtInt } from "./format.js";

const MINUTES_AFTER_S = 1200; // past 20 minutes, minutes read better than seconds

const UPDATES = { label: "updates", div: 1, fmtX: (x) => `${fmtInt(x)} updates` };
const SECONDS = { label: "seconds since start", div: 1, fmtX: (x) => `${fmt(x)} s` };
const MINUTES = { label: "minutes since start", div: 60, fmtX: (x) => `${fmt(x)} min` };

function secondsSince(tMs, startMs) {
  const t0 = Number.isFinite(startMs) ? startMs : tMs.find(Number.isFinite);
  return tMs.map((t) => (t - t0) / 1000);
}

function largest(values) {
  let out = 0;
  for (const v of values) if (v > out) out = v;
  return out;
}

// axis: "updates" or "time"; runs: [{columns: {updates, t_ms}, startMs}] (startMs NaN when
// unknown: the first row's time stands in). Returns {label, fmtX, xs: one array per run}.
export function xAxisOf(axis, runs) {
  if (axis !== "time") return { ...UPDATES, xs: runs.map((r) => r.columns.updates) };
  const seconds = runs.map((r) => secondsSince(r.columns.t_ms, r.startMs));
  const unit = largest(seconds.map(largest)) > MINUTES_AFTER_S ? MINUTES : SECONDS;
  const xs = unit.div === 1 ? seconds : seconds.map((s) => s.map((x) => x / unit.div));
  return { ...unit, xs };
}
