// Metrics rows (or columns) into chart series: row normalising, stream-id order, smoothing
// and the update rate. Pure functions of the data they are given.

import { num, parseJson } from "./format.js";

const RATE_WINDOW_MS = 2000;
const NUMERIC = ["t_ms", "updates", "applied", "rejected", "loss", "energy_ratio", "median_pi",
  "staleness_mean", "staleness_max", "active_workers", "updates_per_s", "eval_updates",
  "test_loss", "test_accuracy"];

function streamIdKey(id) {
  const [ms, seq] = String(id).split("-");
  return [Number(ms) || 0, Number(seq) || 0];
}

// Redis stream ids ("ms-seq") in stream order.
export function streamIdAfter(a, b) {
  const [am, as] = streamIdKey(a);
  const [bm, bs] = streamIdKey(b);
  return am > bm || (am === bm && as > bs);
}

// A row with numbers as numbers (NaN when missing) and pi_tensors as an array or null.
export function normaliseRow(row) {
  const out = { ...row };
  for (const k of NUMERIC) {
    if (k in out) out[k] = num(out[k]);
  }
  let pi = out.pi_tensors;
  if (typeof pi === "string") pi = parseJson(pi);
  out.pi_tensors = Array.isArray(pi) ? pi.map(num) : null;
  return out;
}

export function lastOf(points) {
  return points.length ? points[points.length - 1][1] : NaN;
}

// [updates, row[key]] for every row where both are numbers; xKey names another x (the held-out
// columns are of the parameters at eval_updates).
export function seriesOf(rows, key, xKey = "updates") {
  const out = [];
  for (const r of rows) {
    const x = r[xKey];
    const y = r[key];
    if (Number.isFinite(x) && Number.isFinite(y)) out.push([x, y]);
  }
  return out;
}

// [xs[i], ys[i]] for every i where both are numbers: one run's columns (as the series route
// gives them) as chart points.
export function pairs(xs, ys) {
  const out = [];
  const n = Math.min(xs.length, ys.length);
  for (let i = 0; i < n; i += 1) {
    if (Number.isFinite(xs[i]) && Number.isFinite(ys[i])) out.push([xs[i], ys[i]]);
  }
  return out;
}

// Centred moving average over about 2% of the points: smooth, and without the lag of an EMA.
export function smooth(points) {
  const half = Math.floor(points.length / 100);
  if (half < 1) return points;
  const prefix = [0];
  for (const [, y] of points) prefix.push(prefix[prefix.length - 1] + y);
  return points.map(([x], i) => {
    const a = Math.max(0, i - half);
    const b = Math.min(points.length, i + half + 1);
    return [x, (prefix[b] - prefix[a]) / (b - a)];
  });
}

// Updates per second over a sliding window of wall time (rows carry t_ms and updates).
export function rateSeries(allRows) {
  const rows = allRows.filter((r) => Number.isFinite(r.t_ms) && Number.isFinite(r.updates));
  if (rows.length && rows.every((r) => Number.isFinite(r.updates_per_s))) {
    return rows.map((r) => [r.updates, r.updates_per_s]);
  }
  const out = [];
  let j = 0;
  for (let i = 1; i < rows.length; i += 1) {
    while (j < i - 1 && rows[i].t_ms - rows[j + 1].t_ms >= RATE_WINDOW_MS) j += 1;
    const dt = rows[i].t_ms - rows[j].t_ms;
    if (dt >= 250) out.push([rows[i].updates, ((rows[i].updates - rows[j].updates) * 1000) / dt]);
  }
  return out;
}
