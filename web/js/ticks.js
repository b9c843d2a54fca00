// Axis ticks at round values and their labels, shared by the line charts and the heat map.

function niceStep(range, count) {
  const raw = range / Math.max(1, count);
  const mag = 10 ** Math.floor(Math.log10(raw));
  const f = raw / mag;
  return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * mag;
}

// About `count` ticks at multiples of a 1-2-5 step within [lo, hi].
export function ticks(lo, hi, count) {
  const step = niceStep(hi - lo, count);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
  return { values: out, step };
}

export function tickLabel(v, step) {
  const a = Math.abs(v);
  if (a >= 10000) return `${Number((v / 1000).toPrecision(4))}k`;
  const decimals = Math.max(0, -Math.floor(Math.log10(step)));
  return v.toFixed(Math.min(decimals, 6));
}
