// The workers table of the selected run: active ones first, gone ones greyed, new ones
// highlighted for a few seconds.

import { serverNow } from "./api.js";
import { ago, esc, fmt, fmtInt, num } from "./format.js";
import { $ } from "./page.js";
import { state } from "./state.js";

const JOINED_MS = 3000; // how long a newly seen worker stays highlighted

const isActive = (w) => w.active !== false && w.active !== "false";

function workerRow(w, now) {
  const on = isActive(w);
  const joined = now - (state.knownWorkers.get(w.worker_id) || 0) < JOINED_MS;
  const rej = w.rejected && typeof w.rejected === "object" ? w.rejected : {};
  const rejTotal = Object.values(rej).reduce((s, v) => s + (num(v) || 0), 0);
  const rejText = Object.entries(rej).filter(([, v]) => num(v) > 0).map(([k, v]) => `${k} ${v}`).join(", ");
  const seen = num(w.last_seen_ms);
  return `<tr data-worker-id="${esc(w.worker_id)}" data-active="${on}" data-testid="worker-row" class="${on ? "" : "gone"}${joined ? " joined" : ""}">
    <th scope="row" class="mono">${esc(w.worker_id)}</th>
    <td><span class="dot ${on ? "dot-on" : "dot-off"}" aria-hidden="true"></span>${on ? "active" : "gone"}</td>
    <td><time class="ago" data-ts="${Number.isNaN(seen) ? "" : seen}" datetime="${Number.isNaN(seen) ? "" : new Date(seen).toISOString()}" title="${Number.isNaN(seen) ? "" : esc(new Date(seen).toLocaleString())}">${ago(seen, serverNow())}</time></td>
    <td class="num">${fmtInt(w.steps)}</td>
    <td class="num">${fmtInt(w.applied)}</td>
    <td class="num">${fmtInt(w.last_staleness)}</td>
    <td class="num">${fmt(w.mean_staleness)}</td>
    <td class="num"${rejText ? ` title="${esc(rejText)}"` : ""}>${fmtInt(rejTotal)}${rejText ? ` <span class="muted small">(${esc(rejText)})</span>` : ""}</td>
  </tr>`;
}

export function renderWorkers() {
  const tbody = $("#workers-table tbody");
  const workers = ((state.view && state.view.workers) || []).slice();
  workers.sort((a, b) => (isActive(b) - isActive(a)) ||
    String(a.worker_id).localeCompare(String(b.worker_id), "en", { numeric: true }));
  const active = workers.filter(isActive).length;
  $("#workers-summary").textContent = workers.length
    ? `${active} active, ${workers.length - active} gone`
    : "";
  if (!workers.length) {
    tbody.innerHTML = `<tr class="empty"><td colspan="8">No workers yet: they join when the run starts.</td></tr>`;
    return;
  }
  const now = Date.now();
  tbody.innerHTML = workers.map((w) => workerRow(w, now)).join("");
}

// Once a second: the "last seen" ages, and the end of the highlight of new workers.
export function tickWorkers() {
  for (const t of document.querySelectorAll("#workers-table time.ago[data-ts]")) {
    if (t.dataset.ts) t.textContent = ago(Number(t.dataset.ts), serverNow());
  }
  for (const tr of document.querySelectorAll("#workers-table tr.joined")) {
    if (Date.now() - (state.knownWorkers.get(tr.dataset.workerId) || 0) >= JOINED_MS) tr.classList.remove("joined");
  }
}
