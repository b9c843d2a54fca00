// Text for the page: numbers, durations and ages as shown, and HTML escaping. Pure functions.

export function esc(value) {
  return String(value).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

// A finite number, or NaN for anything else (null, "", "abc", Infinity).
export function num(value) {
  if (value === null || value === undefined || value === "") return NaN;
  const n = typeof value === "number" ? value : Number(value);
  return Number.isFinite(n) ? n : NaN;
}

export function fmt(value, digits = 3) {
  const n = num(value);
  if (Number.isNaN(n)) return "—";
  const a = Math.abs(n);
  if (a !== 0 && (a >= 1e6 || a < 1e-3)) return n.toExponential(2);
  if (a >= 1000) return Math.round(n).toLocaleString("en-US");
  return Number(n.toPrecision(digits)).toString();
}

export function fmtInt(value) {
  const n = num(value);
  return Number.isNaN(n) ? "—" : Math.round(n).toLocaleString("en-US");
}

export function duration(ms) {
  const s = Math.max(0, Math.round(ms / 1000));
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m ${s % 60}s`;
  const h = Math.floor(m / 60);
  if (h < 48) return `${h}h ${m % 60}m`;
  return `${Math.floor(h / 24)}d`;
}

// How long before `now` (ms since the epoch, on the server's clock) the time `ms` was.
export function ago(ms, now) {
  const t = num(ms);
  if (Number.isNaN(t) || t <= 0) return "never";
  const d = now - t;
  return d < 1000 ? "just now" : `${duration(d)} ago`;
}

export function parseJson(text) {
  try {
    return JSON.parse(text);
  } catch (_) {
    return null;
  }
}
