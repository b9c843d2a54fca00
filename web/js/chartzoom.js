// Zooming a line chart on a range of x: drag across the plot to pick it, double-click to
// see everything again. The range is the caller's to keep (every chart of a run shares it).

// Drags narrower than this many pixels are clicks, not ranges.
const MIN_DRAG_PX = 6;

function pixelX(el, ev) {
  const svg = el.querySelector("svg");
  const box = svg.getBoundingClientRect();
  return (ev.clientX - box.left) * (svg.viewBox.baseVal.width / box.width);
}

// c: {ix (pixel to x), left, right (the plot's pixel bounds), top, height, onZoom ([x0, x1]
// or null)}. Binds the pointer once per element; each redraw only replaces el._zoom.
export function attachZoom(el, c) {
  el._zoom = c;
  if (el.dataset.zoomBound) return;
  el.dataset.zoomBound = "1";
  let start = null;
  const selection = () => el.querySelector("rect.zoom-selection");
  el.addEventListener("mousedown", (ev) => {
    const z = el._zoom;
    if (!z || ev.button !== 0) return;
    const px = pixelX(el, ev);
    if (px < z.left || px > z.right) return;
    start = px;
    ev.preventDefault(); // no text selection while dragging
  });
  el.addEventListener("mousemove", (ev) => {
    const z = el._zoom;
    const rect = selection();
    if (start === null || !z || !rect) return;
    const px = Math.min(z.right, Math.max(z.left, pixelX(el, ev)));
    rect.setAttribute("x", Math.min(start, px).toFixed(1));
    rect.setAttribute("width", Math.abs(px - start).toFixed(1));
    rect.setAttribute("visibility", "visible");
  });
  window.addEventListener("mouseup", (ev) => {
    const z = el._zoom;
    if (start === null || !z) return;
    const px = Math.min(z.right, Math.max(z.left, pixelX(el, ev)));
    const from = start;
    start = null;
    const rect = selection();
    if (rect) rect.setAttribute("visibility", "hidden");
    if (Math.abs(px - from) >= MIN_DRAG_PX) z.onZoom([z.ix(Math.min(from, px)), z.ix(Math.max(from, px))]);
  });
  el.addEventListener("dblclick", () => el._zoom && el._zoom.onZoom(null));
}
