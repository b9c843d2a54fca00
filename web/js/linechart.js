// Line charts in inline SVG over a shared x axis (updates unless told otherwise); the hover
// readout is charthover.js's.

import { attachHover } from "./charthover.js";
import { attachZoom } from "./chartzoom.js";
import { esc, fmt, fmtInt } from "./format.js";
import { ticks, tickLabel } from "./ticks.js";

const updatesText = (x) => `${fmtInt(x)} updates`;

// Keeps the shape of a long series: the min and max of each bucket, in order.
function downsample(points, maxPoints) {
  if (points.length <= maxPoints) return points;
  const buckets = Math.floor(maxPoints / 2);
  const size = points.length / buckets;
  const out = [];
  for (let b = 0; b < buckets; b += 1) {
    const start = Math.floor(b * size);
    const end = Math.min(points.length, Math.floor((b + 1) * size));
    let lo = start;
    let hi = start;
    for (let i = start; i < end; i += 1) {
      if (points[i][1] < points[lo][1]) lo = i;
      if (points[i][1] > points[hi][1]) hi = i;
    }
    if (lo <= hi) out.push(points[lo], points[hi]);
    else out.push(points[hi], points[lo]);
  }
  return out;
}

// A line chart in inline SVG: series of [x, y] points (in x order) over a shared x axis.
// opts: series [{name, points, cls, color, id}] (color: a stroke for a series without a
// class; id: its line's data-series, else the name), refs [{y, label}] (dashed lines),
// xZero and yZero (the axis starts at 0 at most), readout, hover (the index of the series
// the readout follows, or "all"), xDomain, yDomain (a fixed y range: a share's 0 to 1),
// xLabel (default "updates"), fmtX (an x as the
// readout says it), legend, robust (clip outliers of the followed series), logY (a log
// axis: positive values only), onZoom (called with the x range dragged across, or null on
// a double-click: chartzoom.js).
export function lineChart(el, opts) {
  const W = Math.max(260, Math.floor(el.clientWidth || 480));
  const H = 200;
  const m = { l: 46, r: 14, t: opts.legend ? 26 : 12, b: 28 };
  const pw = W - m.l - m.r;
  const ph = H - m.t - m.b;
  const followed = opts.hover === "all" ? opts.series : [opts.series[opts.hover || 0]];
  el.dataset.points = String(followed.length ? followed[0].points.length : 0);
  // A log axis draws only positive values.
  const logY = Boolean(opts.logY);
  const shown = (points) => (logY ? points.filter((p) => p[1] > 0) : points);
  const all = opts.series.flatMap((s) => shown(s.points));
  if (!all.length) {
    el.innerHTML = `<div class="chart-empty">Waiting for data…</div>`;
    if (opts.readout) opts.readout.textContent = "";
    el._chart = null;
    return;
  }
  let x0 = Infinity, x1 = -Infinity;
  for (const [x] of all) {
    if (x < x0) x0 = x;
    if (x > x1) x1 = x;
  }
  if (opts.xDomain) [x0, x1] = opts.xDomain;
  if (opts.xZero && x0 > 0) x0 = 0;
  if (x1 === x0) x1 = x0 + 1;
  // The y range is that of the points in view: a zoomed range gets its own scale.
  const inView = all.filter(([x]) => x >= x0 && x <= x1);
  let y0 = Infinity, y1 = -Infinity;
  for (const [, y] of inView.length ? inView : all) {
    if (y < y0) y0 = y;
    if (y > y1) y1 = y;
  }
  for (const r of opts.refs || []) {
    y0 = Math.min(y0, r.y);
    y1 = Math.max(y1, r.y);
  }
  // robust: a few outliers (one huge spike) must not flatten the rest; they are clipped.
  let clippedAt = null;
  const followedYs = followed.flatMap((s) => shown(s.points).filter(([x]) => x >= x0 && x <= x1).map((p) => p[1]));
  if (opts.robust && followedYs.length >= 50) {
    const ys = followedYs.sort((a, b) => a - b);
    const cap = Math.max(ys[Math.floor(ys.length * 0.99)] * 1.5, ...(opts.refs || []).map((r) => r.y * 1.2));
    if (cap > 0 && y1 > cap) {
      y1 = cap;
      clippedAt = cap;
    }
  }
  if (opts.yDomain) [y0, y1] = opts.yDomain;
  if (opts.yZero && y0 > 0 && !logY) y0 = 0;
  // Scales in axis units: log10 of the value on a log axis.
  const ty = logY ? Math.log10 : (y) => y;
  let t0 = ty(y0), t1 = ty(y1);
  if (t1 === t0) t1 = t0 + 1;
  t1 += (t1 - t0) * 0.06;
  const sx = (x) => m.l + ((x - x0) / (x1 - x0)) * pw;
  const sy = (y) => m.t + ph - ((ty(y) - t0) / (t1 - t0)) * ph;
  const ix = (px) => x0 + ((px - m.l) / pw) * (x1 - x0);
  const clipId = `clip-${el.id}`;

  const parts = [];
  const yt = logY ? logTicks(10 ** t0, 10 ** t1) : ticks(t0, t1, 4);
  for (const v of yt.values) {
    const y = sy(v).toFixed(1);
    const label = logY ? fmt(v, 3) : tickLabel(v, yt.step);
    parts.push(`<line class="grid" x1="${m.l}" x2="${m.l + pw}" y1="${y}" y2="${y}"/>`,
      `<text class="tick" x="${m.l - 6}" y="${y}" text-anchor="end" dominant-baseline="middle">${label}</text>`);
  }
  const xt = ticks(x0, x1, Math.max(2, Math.floor(pw / 90)));
  for (const v of xt.values) {
    const x = sx(v).toFixed(1);
    parts.push(`<line class="axis" x1="${x}" x2="${x}" y1="${m.t + ph}" y2="${m.t + ph + 4}"/>`,
      `<text class="tick x-tick" x="${x}" y="${m.t + ph + 16}" text-anchor="middle">${tickLabel(v, xt.step)}</text>`);
  }
  parts.push(`<line class="axis" x1="${m.l}" x2="${m.l + pw}" y1="${m.t + ph}" y2="${m.t + ph}"/>`,
    `<text class="axis-label" x="${m.l + pw}" y="${H - 2}" text-anchor="end">${esc(opts.xLabel || "updates")}</text>`);
  parts.push(`<clipPath id="${clipId}"><rect x="${m.l}" y="${m.t - 2}" width="${pw}" height="${ph + 4}"/></clipPath>`,
    `<g clip-path="url(#${clipId})">`);
  for (const s of opts.series) {
    if (!s.points.length) continue;
    const pts = downsample(inRange(shown(s.points), x0, x1), Math.max(100, pw * 2));
    if (!pts.length) continue;
    const d = pts.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" ");
    parts.push(`<polyline class="line ${s.cls || ""}"${strokeOf(s)} data-series="${esc(s.id || s.name)}" data-points="${s.points.length}" points="${d}"><title>${esc(s.name)}</title></polyline>`);
    // A sparse series (a point every few hundred updates) also marks its points.
    if (s.markers) {
      for (const [x, y] of pts) {
        parts.push(`<circle class="marker ${s.cls || ""}" cx="${sx(x).toFixed(1)}" cy="${sy(y).toFixed(1)}" r="3"/>`);
      }
    }
  }
  parts.push("</g>");
  if (clippedAt !== null) {
    parts.push(`<text class="clip-note" x="${m.l + pw}" y="8" text-anchor="end" dominant-baseline="middle">values above ${fmt(clippedAt)} clipped</text>`);
  }
  for (const r of opts.refs || []) {
    const y = sy(r.y).toFixed(1);
    parts.push(`<line class="ref" x1="${m.l}" x2="${m.l + pw}" y1="${y}" y2="${y}"/>`);
    // With a legend, the label goes there: on the plot it would sit on the lines near it.
    if (!opts.legend) {
      parts.push(`<text class="ref-label" x="${m.l + pw - 4}" y="${(sy(r.y) - 5).toFixed(1)}" text-anchor="end">${esc(r.label)}</text>`);
    }
  }
  if (opts.legend) {
    let lx = m.l + 8;
    const entry = (line, name) => {
      parts.push(line(lx), `<text class="legend" x="${lx + 18}" y="8" dominant-baseline="middle">${esc(name)}</text>`);
      lx += 30 + name.length * 7;
    };
    for (const s of opts.series) {
      entry((x) => `<line class="line ${s.cls || ""}"${strokeOf(s)} x1="${x}" x2="${x + 14}" y1="8" y2="8"/>`, s.name);
    }
    for (const r of opts.refs || []) {
      entry((x) => `<line class="ref legend-ref" x1="${x}" x2="${x + 14}" y1="8" y2="8"/>`, r.label);
    }
  }
  const dots = followed.map((s) => `<circle r="3.5"${strokeOf(s)}/>`).join("");
  parts.push(`<g class="hover" visibility="hidden"><line class="hover-line" y1="${m.t}" y2="${m.t + ph}"/>${dots}</g>`,
    `<rect class="zoom-selection" x="${m.l}" y="${m.t}" width="0" height="${ph}" visibility="hidden"/>`,
    `<rect class="overlay" x="${m.l}" y="${m.t}" width="${pw}" height="${ph}"/>`);
  el.innerHTML = `<svg viewBox="0 0 ${W} ${H}" width="${W}" height="${H}" aria-hidden="true">${parts.join("")}</svg>`;
  el.dataset.scale = logY ? "log" : "linear";
  el.dataset.xFrom = String(x0);
  el.dataset.xTo = String(x1);
  const visible = followed.map((s) => ({ ...s, points: shown(s.points) }));
  attachHover(el, { sx, sy, ix, top: m.t, followed: visible, fmtX: opts.fmtX || updatesText, readout: opts.readout });
  if (opts.onZoom) attachZoom(el, { ix, left: m.l, right: m.l + pw, onZoom: opts.onZoom });
}

// The points within [x0, x1] and one on either side, so that lines run to the edges.
function inRange(points, x0, x1) {
  let a = 0;
  while (a < points.length && points[a][0] < x0) a += 1;
  let b = points.length;
  while (b > a && points[b - 1][0] > x1) b -= 1;
  return points.slice(Math.max(0, a - 1), Math.min(points.length, b + 1));
}

// Ticks of a log axis: the powers of ten in [lo, hi], with 2 and 5 times them where fewer
// than three decades are in view, and the ends' own values where no power of ten is.
function logTicks(lo, hi) {
  const values = [];
  const decades = Math.log10(hi) - Math.log10(lo);
  const steps = decades < 3 ? [1, 2, 5] : [1];
  for (let e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e += 1) {
    for (const k of steps) {
      const v = k * 10 ** e;
      if (v >= lo && v <= hi) values.push(v);
    }
  }
  return { values: values.length ? values : [lo, hi] };
}

function strokeOf(series) {
  return series.color ? ` style="stroke:${esc(series.color)}"` : "";
}
