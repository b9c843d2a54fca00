// The heat map of median pi per parameter tensor over updates (a canvas), its colour
// legend and its hover readout.

import { fmt, fmtInt } from "./format.js";
import { ticks, tickLabel } from "./ticks.js";

const VIRIDIS = ["#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58", "#b5de2b", "#fde725"]
  .map((h) => [1, 3, 5].map((i) => parseInt(h.slice(i, i + 2), 16)));

const measureCtx = document.createElement("canvas").getContext("2d");

function colour(t) {
  const u = Math.max(0, Math.min(1, t)) * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(u));
  const f = u - i;
  const c = VIRIDIS[i].map((v, k) => Math.round(v + f * (VIRIDIS[i + 1][k] - v)));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

// Median pi per tensor (rows) over time (columns: metrics rows, bucketed to fit the width);
// hovering a cell writes its tensor, pi and updates into `readout`.
export function heatmap(el, tensors, rows, piMax, readout) {
  const cols = rows.filter((r) => Array.isArray(r.pi_tensors) && r.pi_tensors.length);
  el.dataset.columns = String(cols.length);
  if (!cols.length) {
    el.innerHTML = `<div class="chart-empty">Waiting for data…</div>`;
    el._heat = null;
    return;
  }
  const nT = Math.max(tensors.length, cols[cols.length - 1].pi_tensors.length);
  const names = Array.from({ length: nT }, (_, i) => tensors[i] || `tensor ${i}`);
  const W = Math.max(300, Math.floor(el.clientWidth || 600));
  const rowH = Math.max(6, Math.min(22, Math.floor(260 / nT)));
  const labelFont = `${Math.min(12, rowH - 1)}px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace`;
  const shortNames = names.map((n) => (n.length > 28 ? `…${n.slice(-27)}` : n));
  measureCtx.font = labelFont;
  const widest = Math.max(...shortNames.map((n) => measureCtx.measureText(n).width));
  const labelW = Math.min(220, Math.max(60, Math.ceil(widest) + 14));
  const m = { l: labelW, r: 12, t: 6, b: 26 };
  const pw = W - m.l - m.r;
  const ph = rowH * nT;
  const H = m.t + ph + m.b;
  // Columns are equal spans of updates (the x axis of the line charts): each shows the mean
  // of the medians of the metrics rows in its span, or carries the previous one over a gap.
  const u0 = cols[0].updates;
  const u1 = Math.max(cols[cols.length - 1].updates, u0 + 1);
  const nCols = Math.max(1, Math.min(cols.length, Math.floor(pw / 3)));
  const span = (u1 - u0) / nCols;
  const sums = Array.from({ length: nCols }, () => new Float64Array(nT));
  const counts = Array.from({ length: nCols }, () => new Uint32Array(nT));
  for (const r of cols) {
    const c = Math.min(nCols - 1, Math.floor((r.updates - u0) / span));
    for (let t = 0; t < nT; t += 1) {
      if (Number.isFinite(r.pi_tensors[t])) {
        sums[c][t] += r.pi_tensors[t];
        counts[c][t] += 1;
      }
    }
  }
  const grid = [];
  const colUpdates = [];
  let vmax = 0;
  for (let c = 0; c < nCols; c += 1) {
    const prev = grid[c - 1];
    const col = Array.from(sums[c], (s, t) => (counts[c][t] ? s / counts[c][t] : prev ? prev[t] : NaN));
    for (const v of col) if (v > vmax) vmax = v;
    grid.push(col);
    colUpdates.push(Math.round(u0 + (c + 1) * span));
  }
  // Colour domain [0, top]: at least 1 (pi = 1 is a plain SGD step), at most pi_max.
  const top = Math.min(piMax, Math.max(1, vmax));

  const dpr = window.devicePixelRatio || 1;
  el.innerHTML = `<canvas width="${W * dpr}" height="${H * dpr}" style="width:${W}px;height:${H}px"></canvas>
    <div class="legend-row"><span class="legend-note">x: updates applied; one column per span of updates</span>${legendHtml(top, piMax)}</div>`;
  const ctx = el.querySelector("canvas").getContext("2d");
  ctx.scale(dpr, dpr);
  const cw = pw / nCols;
  for (let c = 0; c < nCols; c += 1) {
    for (let t = 0; t < nT; t += 1) {
      const v = grid[c][t];
      ctx.fillStyle = Number.isNaN(v) ? "#eceff3" : colour(v / top);
      ctx.fillRect(m.l + c * cw, m.t + t * rowH, Math.ceil(cw) + 0.5, rowH - (rowH > 8 ? 1 : 0));
    }
  }
  ctx.font = labelFont;
  ctx.fillStyle = "#3b4452";
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  const every = Math.ceil(11 / rowH); // label every row when they fit
  names.forEach((_, t) => {
    if (t % every === 0) ctx.fillText(shortNames[t], m.l - 6, m.t + t * rowH + rowH / 2);
  });
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#6b7280";
  ctx.textAlign = "center";
  ctx.textBaseline = "alphabetic";
  const xt = ticks(u0, u1, Math.max(2, Math.floor(pw / 90)));
  for (const v of xt.values) {
    const x = m.l + ((v - u0) / (u1 - u0)) * pw;
    ctx.fillRect(x - 0.5, m.t + ph, 1, 4);
    ctx.fillText(tickLabel(v, xt.step), x, m.t + ph + 16);
  }

  el._heat = { m, cw, rowH, nCols, nT, names, grid, colUpdates, readout };
  if (!el.dataset.bound) {
    el.dataset.bound = "1";
    el.addEventListener("mousemove", (ev) => heatHover(el, ev));
    el.addEventListener("mouseleave", () => { if (el._heat) el._heat.readout.textContent = ""; });
  }
}

function legendHtml(top, piMax) {
  const stops = VIRIDIS.map((c, i) => `rgb(${c.join(",")}) ${((i / (VIRIDIS.length - 1)) * 100).toFixed(0)}%`).join(", ");
  const one = top > 1 ? `<span class="legend-one" style="left:${((1 / top) * 100).toFixed(1)}%">1</span>` : "";
  return `<span class="legend-title">median π</span>
    <span class="legend-scale" role="img" aria-label="colour scale from 0 to ${fmt(top)}">
      <span class="legend-bar" style="background:linear-gradient(to right, ${stops})"></span>
      <span class="legend-ticks"><span>0</span>${one}<span>${fmt(top)}${top >= piMax ? " (π max)" : ""}</span></span>
    </span>`;
}

function heatHover(el, ev) {
  const h = el._heat;
  const canvas = el.querySelector("canvas");
  if (!h || !canvas) return;
  const box = canvas.getBoundingClientRect();
  const x = ev.clientX - box.left - h.m.l;
  const y = ev.clientY - box.top - h.m.t;
  const c = Math.floor(x / h.cw);
  const t = Math.floor(y / h.rowH);
  if (c < 0 || c >= h.nCols || t < 0 || t >= h.nT) {
    h.readout.textContent = "";
    return;
  }
  h.readout.textContent = `${h.names[t]} · π ${fmt(h.grid[c][t])} at ${fmtInt(h.colUpdates[c])} updates`;
}
