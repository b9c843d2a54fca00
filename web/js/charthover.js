// A line chart's hover readout: a guide line at the pointer, a dot on each followed series
// and their values in the chart's readout (the latest values while the pointer is away).

import { esc, fmt } from "./format.js";

// A series whose points end this many pixels before the pointer (or start after it) has no
// value there: a shorter run is not read at its last point.
const REACH_PX = 8;

// The point of `points` (in x order) nearest to the pixel column px.
function nearest(points, px, sx) {
  let lo = 0, hi = points.length - 1;
  while (hi - lo > 1) {
    const mid = (lo + hi) >> 1;
    if (sx(points[mid][0]) < px) lo = mid; else hi = mid;
  }
  return Math.abs(sx(points[lo][0]) - px) <= Math.abs(sx(points[hi][0]) - px) ? points[lo] : points[hi];
}

function reaches(points, px, sx) {
  return sx(points[0][0]) - REACH_PX <= px && px <= sx(points[points.length - 1][0]) + REACH_PX;
}

// picks: [{series, point}]; x: the x the readout names, or null for the latest values.
function readoutHtml(c, picks, x) {
  if (!picks.length) return "";
  if (c.followed.length === 1) {
    const [{ series, point }] = picks;
    return esc(`${series.name} ${fmt(point[1], 4)}${x === null ? "" : ` at ${c.fmtX(point[0])}`}`);
  }
  const items = picks.map(({ series, point }) => `<span class="readout-item" title="${esc(series.name)}">`
    + `<i class="swatch" style="background:${esc(series.color || "currentColor")}"></i>${esc(fmt(point[1], 4))}</span>`);
  return items.join("") + (x === null ? "" : `<span class="readout-x">at ${esc(c.fmtX(x))}</span>`);
}

function latestPicks(c) {
  return c.followed.filter((s) => s.points.length).map((s) => ({ series: s, point: s.points[s.points.length - 1] }));
}

// Shows the latest values (ev null) or those under the pointer.
function update(el, ev) {
  const c = el._chart;
  const g = el.querySelector("g.hover");
  if (!c || !g) return;
  const dots = g.querySelectorAll("circle");
  if (!ev) {
    g.setAttribute("visibility", "hidden");
    if (c.readout) c.readout.innerHTML = readoutHtml(c, latestPicks(c), null);
    return;
  }
  const svg = el.querySelector("svg");
  const box = svg.getBoundingClientRect();
  const px = (ev.clientX - box.left) * (svg.viewBox.baseVal.width / box.width);
  const picks = [];
  c.followed.forEach((s, i) => {
    const show = s.points.length > 0 && reaches(s.points, px, c.sx);
    dots[i].setAttribute("visibility", show ? "visible" : "hidden");
    if (!show) return;
    const p = nearest(s.points, px, c.sx);
    dots[i].setAttribute("cx", c.sx(p[0]).toFixed(1));
    dots[i].setAttribute("cy", Math.max(c.top, c.sy(p[1])).toFixed(1));
    picks.push({ series: s, point: p });
  });
  // One series: the guide line goes through its point; several: it follows the pointer.
  const lineX = picks.length === 1 && c.followed.length === 1 ? c.sx(picks[0].point[0]) : px;
  g.setAttribute("visibility", picks.length ? "visible" : "hidden");
  g.querySelector("line").setAttribute("x1", lineX.toFixed(1));
  g.querySelector("line").setAttribute("x2", lineX.toFixed(1));
  if (c.readout) c.readout.innerHTML = readoutHtml(c, picks, c.ix(px));
}

// c: {sx, sy, ix (pixel to x), top, followed (series), fmtX, readout}. Binds the pointer
// once per element; each redraw only replaces el._chart.
export function attachHover(el, c) {
  el._chart = c;
  update(el, null);
  if (el.dataset.bound) return;
  el.dataset.bound = "1";
  el.addEventListener("mousemove", (ev) => update(el, ev));
  el.addEventListener("mouseleave", () => update(el, null));
}
