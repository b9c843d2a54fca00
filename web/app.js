// gemq dashboard: plain JavaScript, no libraries, no build step.
// Talks to the API of docs/api.md: the run list and run views over fetch, live metrics over
// Server-Sent Events (GET /api/runs/{id}/events), falling back to polling while the stream is down.
"use strict";

(() => {
  const API = "api"; // relative, so the dashboard also works behind a path prefix
  const TOKEN_KEY = "gemq.apiToken";
  const ENDED = new Set(["finished", "stopped", "failed"]);
  // rq job states in which the aggregation may still change the run.
  const JOB_ACTIVE = new Set(["queued", "started", "deferred", "scheduled"]);
  const MAX_ROWS = 50000; // the metrics stream keeps ~20,000; this bounds the page's memory
  const RUNS_POLL_MS = 5000;
  const WATCHDOG_MS = 2000;
  const RATE_WINDOW_MS = 2000;

  const state = {
    runs: [],
    runsSignature: "",
    selected: null, // run id
    gen: 0, // bumped at every selection; late answers for an older selection are dropped
    view: null,
    viewAt: 0, // when the view last came
    rows: [],
    lastId: null,
    es: null,
    esFailures: 0,
    reconnectTimer: null,
    polling: false,
    pollOk: false, // the last fetch of the selected run worked
    stopPending: false,
    knownWorkers: new Map(), // worker id -> time first seen on this page
    clockSkewMs: 0, // server clock minus ours, from the Date header
    tokenPromptDeclined: false,
    dirty: { rows: false, view: false },
    frame: 0,
  };

  // ---------------------------------------------------------------- small helpers

  const $ = (sel) => document.querySelector(sel);

  function esc(value) {
    return String(value).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  }

  function num(value) {
    if (value === null || value === undefined || value === "") return NaN;
    const n = typeof value === "number" ? value : Number(value);
    return Number.isFinite(n) ? n : NaN;
  }

  function fmt(value, digits = 3) {
    const n = num(value);
    if (Number.isNaN(n)) return "—";
    const a = Math.abs(n);
    if (a !== 0 && (a >= 1e6 || a < 1e-3)) return n.toExponential(2);
    if (a >= 1000) return Math.round(n).toLocaleString("en-US");
    return Number(n.toPrecision(digits)).toString();
  }

  function fmtInt(value) {
    const n = num(value);
    return Number.isNaN(n) ? "—" : Math.round(n).toLocaleString("en-US");
  }

  function serverNow() {
    return Date.now() + state.clockSkewMs;
  }

  function duration(ms) {
    const s = Math.max(0, Math.round(ms / 1000));
    if (s < 60) return `${s}s`;
    const m = Math.floor(s / 60);
    if (m < 60) return `${m}m ${s % 60}s`;
    const h = Math.floor(m / 60);
    if (h < 48) return `${h}h ${m % 60}m`;
    return `${Math.floor(h / 24)}d`;
  }

  function ago(ms) {
    const t = num(ms);
    if (Number.isNaN(t) || t <= 0) return "never";
    const d = serverNow() - t;
    return d < 1000 ? "just now" : `${duration(d)} ago`;
  }

  function streamIdKey(id) {
    const [ms, seq] = String(id).split("-");
    return [Number(ms) || 0, Number(seq) || 0];
  }

  function streamIdAfter(a, b) {
    const [am, as] = streamIdKey(a);
    const [bm, bs] = streamIdKey(b);
    return am > bm || (am === bm && as > bs);
  }

  function jobState(job) {
    if (!job) return null;
    return typeof job === "string" ? job : job.state || null;
  }

  // ---------------------------------------------------------------- errors and status line

  function showError(message) {
    $("#error-text").textContent = message;
    $("#error-banner").hidden = false;
  }

  function clearError() {
    $("#error-banner").hidden = true;
    $("#error-text").textContent = "";
  }

  function setConnection(kind, text) {
    const el = $("#connection");
    el.className = `conn conn-${kind}`;
    el.textContent = text || kind;
    el.dataset.state = kind;
  }

  // ---------------------------------------------------------------- API access

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  async function errorDetail(res) {
    let body = null;
    try {
      body = await res.json();
    } catch (_) {
      /* not JSON */
    }
    const d = body && body.detail;
    if (typeof d === "string" && d) return d;
    if (Array.isArray(d) && d.length) {
      // FastAPI's 422: [{loc: ["body", "lr"], msg: "..."}]
      return d.map((e) => {
        const loc = (e.loc || []).filter((p) => p !== "body" && p !== "query" && p !== "path").join(".");
        return loc ? `${loc}: ${e.msg}` : e.msg;
      }).join("; ");
    }
    if (d && typeof d === "object") return d.message || JSON.stringify(d);
    return `${res.status} ${res.statusText || "error"}`;
  }

  function noteServerDate(res) {
    const date = Date.parse(res.headers.get("date") || "");
    if (Number.isNaN(date)) return;
    const skew = date - Date.now();
    // The Date header has a resolution of one second: ignore skews that small.
    state.clockSkewMs = Math.abs(skew) > 2000 ? skew : 0;
  }

  function askForToken(status, detail, interactive) {
    if (!interactive && state.tokenPromptDeclined) return false;
    const why = status === 401 ? "This gemq API needs a token." : `The API refused the token: ${detail}.`;
    const entered = window.prompt(`${why}\nAPI token (kept in this browser's localStorage):`, "");
    if (entered === null || !entered.trim()) {
      state.tokenPromptDeclined = true;
      return false;
    }
    localStorage.setItem(TOKEN_KEY, entered.trim());
    state.tokenPromptDeclined = false;
    updateTokenButton();
    return true;
  }

  async function api(method, path, body, retried = false) {
    const headers = { Accept: "application/json" };
    const token = localStorage.getItem(TOKEN_KEY);
    if (token) headers.Authorization = `Bearer ${token}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    let res;
    try {
      res = await fetch(API + path, {
        method, headers, cache: "no-store",
        body: body === undefined ? undefined : JSON.stringify(body),
      });
    } catch (e) {
      throw new ApiError(0, `Cannot reach the gemq API (${e.message}).`);
    }
    noteServerDate(res);
    if ((res.status === 401 || res.status === 403) && !retried) {
      const detail = await errorDetail(res);
      // Ask for the token when a user action needs it; background reads ask only once.
      if (askForToken(res.status, detail, method !== "GET")) return api(method, path, body, true);
      throw new ApiError(res.status, `${detail} (set the API token with the “API token” button)`);
    }
    if (!res.ok) throw new ApiError(res.status, await errorDetail(res));
    if (res.status === 204) return null;
    const type = res.headers.get("content-type") || "";
    return type.includes("json") ? res.json() : res.text();
  }

  function updateTokenButton() {
    const has = !!localStorage.getItem(TOKEN_KEY);
    const b = $("#token-button");
    b.textContent = has ? "API token ✓" : "API token";
    b.setAttribute("aria-label", has ? "API token is set; change or clear it" : "Set the API token");
  }

  // ---------------------------------------------------------------- run list

  async function loadRuns() {
    try {
      const data = await api("GET", "/runs");
      state.runs = Array.isArray(data) ? data : (data && data.runs) || [];
      renderRunList();
      if (!state.selected) selectInitialRun();
    } catch (e) {
      renderRunList(e.message);
    }
  }

  function summaryOf(run) {
    // The selected run's live view is fresher than the last list poll.
    if (state.view && run.run_id === state.view.run_id) {
      return { ...run, state: state.view.state, job: state.view.job, progress: state.view.progress };
    }
    return run;
  }

  function renderRunList(error) {
    const list = $("#run-list");
    const runs = state.runs.map(summaryOf);
    const signature = JSON.stringify([error || "", state.selected, state.stopPending,
      runs.map((r) => [r.run_id, r.state, jobState(r.job), r.progress && r.progress.fraction])]);
    if (signature === state.runsSignature) return;
    state.runsSignature = signature;
    if (error && !runs.length) {
      list.innerHTML = `<li class="empty error-text">${esc(error)}</li>`;
      return;
    }
    if (!runs.length) {
      list.innerHTML = `<li class="empty">No runs yet. Start one below.</li>`;
      return;
    }
    list.innerHTML = runs.map((r) => {
      const id = r.run_id;
      const st = r.state || "unknown";
      const job = jobState(r.job);
      const frac = r.progress ? num(r.progress.fraction) : NaN;
      const selected = id === state.selected;
      const canStop = !ENDED.has(st);
      const canStart = st === "created" && !job;
      return `<li class="run-item${selected ? " selected" : ""}" data-run-id="${esc(id)}" data-state="${esc(st)}" data-testid="run-item">
        <button type="button" class="run-select" data-action="select" ${selected ? 'aria-current="true"' : ""}>
          <span class="run-id">${esc(id)}</span>
          <span class="run-meta">
            <span class="badge state-${esc(st)}" data-testid="run-item-state">${esc(st)}</span>
            <span class="muted">job ${esc(job || "—")}</span>
            ${Number.isNaN(frac) ? "" : `<span class="muted">${Math.round(frac * 100)}%</span>`}
          </span>
        </button>
        ${canStart ? `<button type="button" class="btn btn-small" data-action="start" aria-label="Start run ${esc(id)}">Start</button>` : ""}
        ${canStop ? `<button type="button" class="btn btn-small btn-danger-ghost" data-action="stop" aria-label="Stop run ${esc(id)}">Stop</button>` : ""}
      </li>`;
    }).join("");
  }

  function selectInitialRun() {
    const fromHash = decodeURIComponent((location.hash.match(/^#run=(.+)$/) || [])[1] || "");
    if (fromHash) return selectRun(fromHash);
    if (!state.runs.length) return;
    const live = state.runs.find((r) => r.state === "running") || state.runs[0];
    selectRun(live.run_id);
  }

  // ---------------------------------------------------------------- selection and live data

  function selectRun(id) {
    if (!id || id === state.selected) return;
    closeStream();
    state.selected = id;
    state.gen += 1;
    state.view = null;
    state.rows = [];
    state.lastId = null;
    state.esFailures = 0;
    state.stopPending = false;
    state.knownWorkers = new Map();
    if (location.hash !== `#run=${encodeURIComponent(id)}`) history.replaceState(null, "", `#run=${encodeURIComponent(id)}`);
    $("#no-run").hidden = true;
    $("#run-panel").hidden = false;
    $("#run-title").textContent = id;
    $("#model-link").href = `${API}/runs/${encodeURIComponent(id)}/model`;
    $("#model-link").setAttribute("download", `${id}.pt`);
    renderRunList();
    state.dirty.rows = state.dirty.view = true;
    scheduleRender();
    const gen = state.gen;
    refreshSelected(gen).then(() => {
      if (gen === state.gen && !runIsOver()) connectStream();
    });
  }

  function runIsOver() {
    const v = state.view;
    if (!v || !ENDED.has(v.state)) return false;
    return !JOB_ACTIVE.has(jobState(v.job));
  }

  // One fetch round: the run view, then every metrics row after the last one we have.
  async function refreshSelected(gen) {
    const id = state.selected;
    try {
      const view = await api("GET", `/runs/${encodeURIComponent(id)}`);
      if (gen !== state.gen) return;
      onView(view);
      await backfill(gen);
      state.pollOk = true;
    } catch (e) {
      if (gen !== state.gen) return;
      state.pollOk = false;
      if (e.status === 404) {
        showError(`Run ${id} not found: ${e.message}`);
        deselect();
      } else {
        setConnection("offline", "API unreachable");
      }
    }
  }

  // Pages of up to PAGE rows; a short page means we have caught up (the stream does the rest).
  async function backfill(gen) {
    const id = state.selected;
    const PAGE = 5000;
    for (let page = 0; page < 20; page += 1) {
      const after = state.lastId ? `after=${encodeURIComponent(state.lastId)}&` : "";
      const data = await api("GET", `/runs/${encodeURIComponent(id)}/metrics?${after}limit=${PAGE}`);
      if (gen !== state.gen) return;
      const rows = Array.isArray(data) ? data : (data && data.rows) || [];
      addRows(rows);
      if (rows.length < PAGE) break;
    }
  }

  function deselect() {
    closeStream();
    state.selected = null;
    state.gen += 1;
    state.view = null;
    state.rows = [];
    $("#run-panel").hidden = true;
    $("#no-run").hidden = false;
    history.replaceState(null, "", location.pathname + location.search);
    setConnection("idle");
    renderRunList();
  }

  function connectStream() {
    closeStream();
    const gen = state.gen;
    // Resume after the newest row we hold (a reconnecting EventSource also sends Last-Event-ID).
    const after = state.lastId ? `?after=${encodeURIComponent(state.lastId)}` : "";
    const es = new EventSource(`${API}/runs/${encodeURIComponent(state.selected)}/events${after}`);
    state.es = es;
    setConnection("connecting", "connecting…");
    es.addEventListener("open", () => {
      if (gen !== state.gen) return;
      state.esFailures = 0;
      setConnection("live", "live");
      // Rows published while we were not connected.
      backfill(gen).catch(() => {});
    });
    es.addEventListener("metrics", (ev) => {
      if (gen !== state.gen) return;
      const data = parseJson(ev.data);
      if (data) addRows(Array.isArray(data) ? data : data.rows || []);
    });
    es.addEventListener("run", (ev) => {
      if (gen !== state.gen) return;
      const view = parseJson(ev.data);
      if (view) onView(view);
    });
    es.addEventListener("error", () => {
      if (gen !== state.gen || state.es !== es) return;
      if (es.readyState === EventSource.CLOSED) {
        // The browser gave up (an HTTP error or a wrong content type): retry ourselves.
        state.es = null;
        scheduleReconnect(gen);
      } else {
        setConnection("reconnecting", "reconnecting…");
      }
    });
  }

  function scheduleReconnect(gen) {
    clearTimeout(state.reconnectTimer);
    if (runIsOver()) return;
    const delay = Math.min(1000 * 2 ** state.esFailures, 15000);
    state.esFailures += 1;
    // While polling works (as when reads need the token, which EventSource cannot send),
    // say so rather than "reconnecting".
    if (state.pollOk) setConnection("polling", "polling");
    else setConnection("reconnecting", `reconnecting in ${Math.round(delay / 1000)}s…`);
    state.reconnectTimer = setTimeout(() => {
      if (gen === state.gen && !runIsOver()) connectStream();
    }, delay);
  }

  function closeStream() {
    clearTimeout(state.reconnectTimer);
    if (state.es) state.es.close();
    state.es = null;
  }

  function parseJson(text) {
    try {
      return JSON.parse(text);
    } catch (_) {
      return null;
    }
  }

  // While the event stream is down (or refused, as when reads need the token), poll.
  async function watchdog() {
    if (!state.selected || state.polling) return;
    if (state.es && state.es.readyState === EventSource.OPEN) return;
    // An ended run has no stream; refresh its view now and then (its workers go quiet).
    if (runIsOver() && Date.now() - state.viewAt < 5000) return;
    state.polling = true;
    try {
      await refreshSelected(state.gen);
      if (state.pollOk && !(state.es && state.es.readyState === EventSource.OPEN) && !runIsOver()) {
        setConnection("polling", "polling");
      }
    } finally {
      state.polling = false;
    }
  }

  function normaliseRow(row) {
    const out = { ...row };
    for (const k of ["t_ms", "updates", "applied", "rejected", "loss", "energy_ratio", "median_pi",
      "staleness_mean", "staleness_max", "active_workers", "updates_per_s"]) {
      if (k in out) out[k] = num(out[k]);
    }
    let pi = out.pi_tensors;
    if (typeof pi === "string") pi = parseJson(pi);
    out.pi_tensors = Array.isArray(pi) ? pi.map(num) : null;
    return out;
  }

  function addRows(rows) {
    let added = 0;
    for (const raw of rows) {
      if (!raw || raw.id === undefined) continue;
      if (state.lastId && !streamIdAfter(raw.id, state.lastId)) continue; // already have it
      state.rows.push(normaliseRow(raw));
      state.lastId = raw.id;
      added += 1;
    }
    if (state.rows.length > MAX_ROWS) state.rows.splice(0, state.rows.length - MAX_ROWS);
    if (added) {
      state.dirty.rows = true;
      scheduleRender();
    }
  }

  function onView(view) {
    if (!view || view.run_id !== state.selected) return;
    const wasOver = runIsOver();
    // Workers already there when the run is opened are not news; later ones are highlighted.
    const first = state.view === null;
    for (const w of view.workers || []) {
      if (!state.knownWorkers.has(w.worker_id)) state.knownWorkers.set(w.worker_id, first ? 0 : Date.now());
    }
    state.view = view;
    state.viewAt = Date.now();
    if (ENDED.has(view.state)) state.stopPending = false;
    const i = state.runs.findIndex((r) => r.run_id === view.run_id);
    if (i < 0) loadRuns();
    state.dirty.view = true;
    scheduleRender();
    renderRunList();
    if (!wasOver && runIsOver()) {
      // Final state: take the last rows, then stop listening.
      closeStream();
      const gen = state.gen;
      backfill(gen).catch(() => {});
      setConnection("ended", `run ${view.state}`);
    } else if (runIsOver()) {
      setConnection("ended", `run ${view.state}`);
    }
  }

  // ---------------------------------------------------------------- actions

  async function stopRun(id) {
    if (!window.confirm(`Stop run ${id}?\n\nThe aggregator finishes its current batch, commits it, and marks the run stopped. This cannot be undone.`)) return;
    clearError();
    if (id === state.selected) {
      state.stopPending = true;
      state.dirty.view = true;
      scheduleRender();
    }
    try {
      await api("POST", `/runs/${encodeURIComponent(id)}/stop`);
      setFormMessage("");
    } catch (e) {
      if (id === state.selected) state.stopPending = false;
      showError(`Could not stop ${id}: ${e.message}`);
    }
    state.dirty.view = true;
    scheduleRender();
    loadRuns();
    if (id === state.selected && !state.es) refreshSelected(state.gen);
  }

  async function startExisting(id) {
    clearError();
    try {
      await api("POST", `/runs/${encodeURIComponent(id)}/start`);
    } catch (e) {
      showError(`Could not start ${id}: ${e.message}`);
    }
    await loadRuns();
    if (id === state.selected) {
      const gen = state.gen;
      await refreshSelected(gen);
      if (gen === state.gen && !state.es && !runIsOver()) connectStream();
    }
  }

  function setFormMessage(text, isError = false) {
    const el = $("#form-message");
    el.textContent = text;
    el.classList.toggle("error-text", isError);
  }

  function readForm() {
    const f = $("#start-form");
    const body = { algo: f.algo.value };
    const numbers = { lr: f.lr, momentum: f.momentum, kappa: f.kappa, batch_size: f.batch_size };
    for (const [name, input] of Object.entries(numbers)) {
      const v = num(input.value);
      if (Number.isNaN(v)) throw new Error(`${input.labels[0].textContent}: enter a number`);
      body[name] = v;
    }
    body.model = f.model.value.trim();
    body.dataset = f.dataset.value.trim();
    if (!body.model) throw new Error("Model: enter a model name");
    if (!body.dataset) throw new Error("Dataset: enter a dataset name");
    const budget = num(f.budget.value);
    if (Number.isNaN(budget)) throw new Error("Budget: enter a number");
    body[f.budget_kind.value] = budget;
    return body;
  }

  async function submitStart(ev) {
    ev.preventDefault();
    clearError();
    let body;
    try {
      body = readForm();
    } catch (e) {
      setFormMessage(e.message, true);
      return;
    }
    const button = $("#start-button");
    button.disabled = true;
    setFormMessage("Starting…");
    try {
      const view = await api("POST", "/runs", body);
      setFormMessage(`Started ${view.run_id}`);
      await loadRuns();
      if (view && view.run_id) selectRun(view.run_id);
    } catch (e) {
      setFormMessage("");
      showError(`Could not start the run: ${e.message}`);
    } finally {
      button.disabled = false;
    }
  }

  // ---------------------------------------------------------------- rendering

  function scheduleRender() {
    if (state.frame) return;
    state.frame = requestAnimationFrame(() => {
      state.frame = 0;
      const { rows, view } = state.dirty;
      state.dirty.rows = state.dirty.view = false;
      if (view) renderRunHead();
      if (view) renderWorkers();
      if (view || rows) renderStats();
      if (rows || view) renderCharts();
    });
  }

  function latest() {
    const v = state.view || {};
    const l = { ...(state.rows[state.rows.length - 1] || {}), ...(v.latest || {}) };
    return l;
  }

  function renderRunHead() {
    const v = state.view;
    const stateEl = $("#run-state");
    const jobEl = $("#job-state");
    const stop = $("#stop-button");
    const start = $("#start-run-button");
    if (!v) {
      stateEl.textContent = "loading…";
      stateEl.className = "badge";
      jobEl.textContent = "—";
      stop.disabled = true;
      start.hidden = true;
      return;
    }
    stateEl.textContent = v.state || "unknown";
    stateEl.className = `badge state-${v.state}`;
    stateEl.dataset.state = v.state || "";
    const job = jobState(v.job);
    jobEl.textContent = job || "none";
    jobEl.className = `badge badge-muted job-${job || "none"}`;
    const jobError = v.job && typeof v.job === "object" ? v.job.error : null;
    const err = v.error || jobError;
    $("#job-error").hidden = !err;
    $("#job-error").textContent = err ? `${v.state === "failed" ? "Run failed" : "Error"}: ${err}` : "";

    const ended = ENDED.has(v.state);
    stop.disabled = ended || state.stopPending;
    stop.textContent = state.stopPending ? "Stopping…" : "Stop run";
    stop.title = ended ? `The run has ${v.state}` : "Stop this run after its current batch";
    start.hidden = !(v.state === "created" && !job);

    const times = [];
    if (v.created_ms) times.push(`created ${new Date(num(v.created_ms)).toLocaleString()}`);
    if (v.started_ms) {
      const end = v.ended_ms ? num(v.ended_ms) : serverNow();
      times.push(`${v.ended_ms ? "ran" : "running"} for ${duration(end - num(v.started_ms))}`);
    }
    $("#run-times").textContent = times.join(" · ");

    const p = v.progress || {};
    const frac = Math.max(0, Math.min(1, num(p.fraction) || 0));
    $("#progress-fill").style.width = `${(frac * 100).toFixed(1)}%`;
    $("#progress-fill").classList.toggle("done", ended);
    $("#progress-text").textContent = p.budget
      ? `${fmtInt(p.updates)} / ${fmtInt(p.budget)} updates (${(frac * 100).toFixed(1)}%)`
      : `${fmtInt(p.updates)} updates`;

    renderKeyValues($("#config-table tbody"), v.config || {});
    renderKeyValues($("#counters-table tbody"), v.counters || {});
  }

  function renderKeyValues(tbody, obj) {
    tbody.innerHTML = Object.keys(obj).sort().map((k) => {
      const val = obj[k];
      const shown = val !== null && typeof val === "object" ? JSON.stringify(val) : String(val);
      return `<tr><th scope="row">${esc(k)}</th><td>${esc(shown)}</td></tr>`;
    }).join("");
  }

  function renderStats() {
    const l = latest();
    const counters = (state.view && state.view.counters) || {};
    let rejected = 0;
    for (const [k, v] of Object.entries(counters)) if (k.startsWith("rejected")) rejected += num(v) || 0;
    const rate = Number.isNaN(num(l.updates_per_s)) ? lastOf(rateSeries()) : num(l.updates_per_s);
    $("#stat-updates").textContent = fmtInt(l.updates);
    $("#stat-loss").textContent = fmt(l.loss, 4);
    $("#stat-energy").textContent = fmt(l.energy_ratio);
    $("#stat-pi").textContent = fmt(l.median_pi);
    $("#stat-staleness").textContent = fmt(l.staleness_mean);
    $("#stat-rate").textContent = fmt(rate);
    // The table's notion of active (heard from within the API's window), else the aggregator's.
    const workers = state.view && Array.isArray(state.view.workers) ? state.view.workers : null;
    $("#stat-workers").textContent = workers && workers.length
      ? `${workers.filter((w) => w.active === true).length} / ${workers.length}`
      : fmtInt(l.active_workers);
    $("#stat-rejected").textContent = fmtInt(rejected);
  }

  function lastOf(points) {
    return points.length ? points[points.length - 1][1] : NaN;
  }

  function seriesOf(key) {
    const out = [];
    for (const r of state.rows) {
      const x = r.updates;
      const y = r[key];
      if (Number.isFinite(x) && Number.isFinite(y)) out.push([x, y]);
    }
    return out;
  }

  // Centred moving average over about 2% of the points: smooth, and without the lag of an EMA.
  function smooth(points) {
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
  function rateSeries() {
    const rows = state.rows.filter((r) => Number.isFinite(r.t_ms) && Number.isFinite(r.updates));
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

  function renderCharts() {
    const rows = state.rows;
    // One x range (updates) for every chart, so that they line up.
    const xs = rows.map((r) => r.updates).filter(Number.isFinite);
    const xDomain = xs.length ? [xs[0], xs[xs.length - 1]] : null;
    const loss = seriesOf("loss");
    lineChart($("#loss-chart"), {
      series: [
        { name: "loss", points: loss, cls: "s-raw" },
        { name: "smoothed", points: smooth(loss), cls: "s-main" },
      ],
      yZero: true, readout: $("#loss-readout"), hover: 0, xDomain, legend: true, robust: true,
    });
    const energy = seriesOf("energy_ratio");
    lineChart($("#energy-chart"), {
      series: [
        { name: "energy ratio", points: energy, cls: "s-energy-raw" },
        { name: "smoothed", points: smooth(energy), cls: "s-energy" },
      ],
      refs: [{ y: 1, label: "1 = compliance" }],
      yZero: true, readout: $("#energy-readout"), hover: 0, xDomain, legend: true, robust: true,
    });
    lineChart($("#rate-chart"), {
      series: [{ name: "updates/s", points: rateSeries(), cls: "s-rate" }],
      yZero: true, readout: $("#rate-readout"), hover: 0, xDomain,
    });
    lineChart($("#staleness-chart"), {
      series: [
        { name: "max", points: seriesOf("staleness_max"), cls: "s-raw-alt" },
        { name: "mean", points: seriesOf("staleness_mean"), cls: "s-stale" },
      ],
      yZero: true, readout: $("#staleness-readout"), hover: 1, xDomain, legend: true,
    });
    const tensors = (state.view && state.view.tensors) || [];
    const piMax = num(state.view && state.view.config && state.view.config.pi_max);
    heatmap($("#pi-heatmap"), tensors, rows, Number.isNaN(piMax) ? 5 : piMax);
  }

  // ---------------------------------------------------------------- workers table

  function renderWorkers() {
    const tbody = $("#workers-table tbody");
    const workers = ((state.view && state.view.workers) || []).slice();
    const now = Date.now();
    const isActive = (w) => w.active !== false && w.active !== "false";
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
    tbody.innerHTML = workers.map((w) => {
      const on = isActive(w);
      const joined = now - (state.knownWorkers.get(w.worker_id) || 0) < 3000;
      const rej = w.rejected && typeof w.rejected === "object" ? w.rejected : {};
      const rejTotal = Object.values(rej).reduce((s, v) => s + (num(v) || 0), 0);
      const rejText = Object.entries(rej).filter(([, v]) => num(v) > 0).map(([k, v]) => `${k} ${v}`).join(", ");
      const seen = num(w.last_seen_ms);
      return `<tr data-worker-id="${esc(w.worker_id)}" data-active="${on}" data-testid="worker-row" class="${on ? "" : "gone"}${joined ? " joined" : ""}">
        <th scope="row" class="mono">${esc(w.worker_id)}</th>
        <td><span class="dot ${on ? "dot-on" : "dot-off"}" aria-hidden="true"></span>${on ? "active" : "gone"}</td>
        <td><time class="ago" data-ts="${Number.isNaN(seen) ? "" : seen}" datetime="${Number.isNaN(seen) ? "" : new Date(seen).toISOString()}" title="${Number.isNaN(seen) ? "" : esc(new Date(seen).toLocaleString())}">${ago(seen)}</time></td>
        <td class="num">${fmtInt(w.steps)}</td>
        <td class="num">${fmtInt(w.applied)}</td>
        <td class="num">${fmtInt(w.last_staleness)}</td>
        <td class="num">${fmt(w.mean_staleness)}</td>
        <td class="num"${rejText ? ` title="${esc(rejText)}"` : ""}>${fmtInt(rejTotal)}${rejText ? ` <span class="muted small">(${esc(rejText)})</span>` : ""}</td>
      </tr>`;
    }).join("");
  }

  function tickClock() {
    for (const t of document.querySelectorAll("time.ago[data-ts]")) {
      if (t.dataset.ts) t.textContent = ago(Number(t.dataset.ts));
    }
    for (const tr of document.querySelectorAll("#workers-table tr.joined")) {
      if (Date.now() - (state.knownWorkers.get(tr.dataset.workerId) || 0) >= 3000) tr.classList.remove("joined");
    }
    if (state.view && state.view.started_ms && !state.view.ended_ms) {
      state.dirty.view = true; // the "running for" clock
      scheduleRender();
    }
  }

  // ---------------------------------------------------------------- charts

  function niceStep(range, count) {
    const raw = range / Math.max(1, count);
    const mag = 10 ** Math.floor(Math.log10(raw));
    const f = raw / mag;
    return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * mag;
  }

  function ticks(lo, hi, count) {
    const step = niceStep(hi - lo, count);
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
    return { values: out, step };
  }

  function tickLabel(v, step) {
    const a = Math.abs(v);
    if (a >= 10000) return `${Number((v / 1000).toPrecision(4))}k`;
    const decimals = Math.max(0, -Math.floor(Math.log10(step)));
    return v.toFixed(Math.min(decimals, 6));
  }

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

  // A line chart in inline SVG: series of [x, y] points over a shared x axis (updates).
  // opts: series [{name, points, cls}], refs [{y, label}] (dashed lines), yZero, readout, hover.
  function lineChart(el, opts) {
    const W = Math.max(260, Math.floor(el.clientWidth || 480));
    const H = 200;
    const m = { l: 46, r: 14, t: opts.legend ? 26 : 12, b: 28 };
    const pw = W - m.l - m.r;
    const ph = H - m.t - m.b;
    const main = opts.series[opts.hover || 0];
    el.dataset.points = String(main.points.length);
    const all = opts.series.flatMap((s) => s.points);
    if (!all.length) {
      el.innerHTML = `<div class="chart-empty">Waiting for data…</div>`;
      if (opts.readout) opts.readout.textContent = "";
      el._chart = null;
      return;
    }
    let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
    for (const [x, y] of all) {
      if (x < x0) x0 = x;
      if (x > x1) x1 = x;
      if (y < y0) y0 = y;
      if (y > y1) y1 = y;
    }
    for (const r of opts.refs || []) {
      y0 = Math.min(y0, r.y);
      y1 = Math.max(y1, r.y);
    }
    // robust: a few outliers (one huge spike) must not flatten the rest; they are clipped.
    let clippedAt = null;
    if (opts.robust && main.points.length >= 50) {
      const ys = main.points.map((p) => p[1]).sort((a, b) => a - b);
      const cap = Math.max(ys[Math.floor(ys.length * 0.99)] * 1.5, ...(opts.refs || []).map((r) => r.y * 1.2));
      if (cap > 0 && y1 > cap) {
        y1 = cap;
        clippedAt = cap;
      }
    }
    if (opts.xDomain) [x0, x1] = opts.xDomain;
    if (opts.yZero && y0 > 0) y0 = 0;
    if (x1 === x0) x1 = x0 + 1;
    if (y1 === y0) y1 = y0 + 1;
    y1 += (y1 - y0) * 0.06;
    const sx = (x) => m.l + ((x - x0) / (x1 - x0)) * pw;
    const sy = (y) => m.t + ph - ((y - y0) / (y1 - y0)) * ph;
    const clipId = `clip-${el.id}`;

    const parts = [];
    const yt = ticks(y0, y1, 4);
    for (const v of yt.values) {
      const y = sy(v).toFixed(1);
      parts.push(`<line class="grid" x1="${m.l}" x2="${m.l + pw}" y1="${y}" y2="${y}"/>`,
        `<text class="tick" x="${m.l - 6}" y="${y}" text-anchor="end" dominant-baseline="middle">${tickLabel(v, yt.step)}</text>`);
    }
    const xt = ticks(x0, x1, Math.max(2, Math.floor(pw / 90)));
    for (const v of xt.values) {
      const x = sx(v).toFixed(1);
      parts.push(`<line class="axis" x1="${x}" x2="${x}" y1="${m.t + ph}" y2="${m.t + ph + 4}"/>`,
        `<text class="tick" x="${x}" y="${m.t + ph + 16}" text-anchor="middle">${tickLabel(v, xt.step)}</text>`);
    }
    parts.push(`<line class="axis" x1="${m.l}" x2="${m.l + pw}" y1="${m.t + ph}" y2="${m.t + ph}"/>`,
      `<text class="axis-label" x="${m.l + pw}" y="${H - 2}" text-anchor="end">updates</text>`);
    parts.push(`<clipPath id="${clipId}"><rect x="${m.l}" y="${m.t - 2}" width="${pw}" height="${ph + 4}"/></clipPath>`,
      `<g clip-path="url(#${clipId})">`);
    for (const s of opts.series) {
      if (!s.points.length) continue;
      const pts = downsample(s.points, Math.max(100, pw * 2));
      const d = pts.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" ");
      parts.push(`<polyline class="line ${s.cls}" points="${d}"><title>${esc(s.name)}</title></polyline>`);
    }
    parts.push("</g>");
    if (clippedAt !== null) {
      parts.push(`<text class="clip-note" x="${m.l + pw}" y="8" text-anchor="end" dominant-baseline="middle">values above ${fmt(clippedAt)} clipped</text>`);
    }
    for (const r of opts.refs || []) {
      const y = sy(r.y).toFixed(1);
      parts.push(`<line class="ref" x1="${m.l}" x2="${m.l + pw}" y1="${y}" y2="${y}"/>`,
        `<text class="ref-label" x="${m.l + pw - 4}" y="${(sy(r.y) - 5).toFixed(1)}" text-anchor="end">${esc(r.label)}</text>`);
    }
    if (opts.legend) {
      let lx = m.l + 8;
      for (const s of opts.series) {
        parts.push(`<line class="line ${s.cls}" x1="${lx}" x2="${lx + 14}" y1="8" y2="8"/>`,
          `<text class="legend" x="${lx + 18}" y="8" dominant-baseline="middle">${esc(s.name)}</text>`);
        lx += 30 + s.name.length * 7;
      }
    }
    parts.push(`<g class="hover" visibility="hidden"><line class="hover-line" y1="${m.t}" y2="${m.t + ph}"/><circle r="3.5"/></g>`,
      `<rect class="overlay" x="${m.l}" y="${m.t}" width="${pw}" height="${ph}"/>`);
    el.innerHTML = `<svg viewBox="0 0 ${W} ${H}" width="${W}" height="${H}" aria-hidden="true">${parts.join("")}</svg>`;

    const fmtPoint = (p) => `${fmt(p[1], 4)} at ${fmtInt(p[0])} updates`;
    el._chart = { sx, sy, top: m.t, points: main.points, name: main.name, fmtPoint, readout: opts.readout };
    if (opts.readout) opts.readout.textContent = main.points.length ? `${main.name} ${fmt(lastOf(main.points), 4)}` : "";
    if (!el.dataset.bound) {
      el.dataset.bound = "1";
      el.addEventListener("mousemove", (ev) => chartHover(el, ev));
      el.addEventListener("mouseleave", () => chartHover(el, null));
    }
  }

  function chartHover(el, ev) {
    const c = el._chart;
    const g = el.querySelector("g.hover");
    if (!c || !g) return;
    if (!ev || !c.points.length) {
      g.setAttribute("visibility", "hidden");
      if (c.readout) c.readout.textContent = c.points.length ? `${c.name} ${fmt(lastOf(c.points), 4)}` : "";
      return;
    }
    const svg = el.querySelector("svg");
    const box = svg.getBoundingClientRect();
    const scale = svg.viewBox.baseVal.width / box.width;
    const px = (ev.clientX - box.left) * scale;
    // Nearest point by x (points are in x order).
    let lo = 0, hi = c.points.length - 1;
    while (hi - lo > 1) {
      const mid = (lo + hi) >> 1;
      if (c.sx(c.points[mid][0]) < px) lo = mid; else hi = mid;
    }
    const p = Math.abs(c.sx(c.points[lo][0]) - px) <= Math.abs(c.sx(c.points[hi][0]) - px) ? c.points[lo] : c.points[hi];
    const x = c.sx(p[0]).toFixed(1);
    const y = Math.max(c.top, c.sy(p[1])).toFixed(1);
    g.setAttribute("visibility", "visible");
    g.querySelector("line").setAttribute("x1", x);
    g.querySelector("line").setAttribute("x2", x);
    g.querySelector("circle").setAttribute("cx", x);
    g.querySelector("circle").setAttribute("cy", y);
    if (c.readout) c.readout.textContent = `${c.name} ${c.fmtPoint(p)}`;
  }

  // ---------------------------------------------------------------- heat map

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

  // Median pi per tensor (rows) over time (columns: metrics rows, bucketed to fit the width).
  function heatmap(el, tensors, rows, piMax) {
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

    el._heat = { m, cw, rowH, nCols, nT, names, grid, colUpdates };
    if (!el.dataset.bound) {
      el.dataset.bound = "1";
      el.addEventListener("mousemove", (ev) => heatHover(el, ev));
      el.addEventListener("mouseleave", () => { $("#pi-readout").textContent = ""; });
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
      $("#pi-readout").textContent = "";
      return;
    }
    $("#pi-readout").textContent = `${h.names[t]} · π ${fmt(h.grid[c][t])} at ${fmtInt(h.colUpdates[c])} updates`;
  }

  // ---------------------------------------------------------------- wiring

  function onRunListClick(ev) {
    const button = ev.target.closest("button[data-action]");
    if (!button) return;
    const id = button.closest("li[data-run-id]").dataset.runId;
    const action = button.dataset.action;
    if (action === "select") selectRun(id);
    else if (action === "stop") stopRun(id);
    else if (action === "start") startExisting(id);
  }

  function init() {
    updateTokenButton();
    $("#run-list").addEventListener("click", onRunListClick);
    $("#refresh-runs").addEventListener("click", () => {
      state.runsSignature = "";
      loadRuns();
    });
    $("#stop-button").addEventListener("click", () => state.selected && stopRun(state.selected));
    $("#start-run-button").addEventListener("click", () => state.selected && startExisting(state.selected));
    $("#start-form").addEventListener("submit", submitStart);
    $("#f-budget-kind").addEventListener("change", (ev) => {
      const budget = $("#f-budget");
      budget.value = ev.target.value === "steps" ? "1000" : "10";
      budget.step = ev.target.value === "steps" ? "1" : "any";
    });
    $("#error-close").addEventListener("click", clearError);
    $("#token-button").addEventListener("click", () => {
      const entered = window.prompt("API token for Start and Stop (empty to clear):", "");
      if (entered === null) return;
      if (entered.trim()) localStorage.setItem(TOKEN_KEY, entered.trim());
      else localStorage.removeItem(TOKEN_KEY);
      state.tokenPromptDeclined = false;
      updateTokenButton();
    });
    window.addEventListener("hashchange", () => {
      const id = decodeURIComponent((location.hash.match(/^#run=(.+)$/) || [])[1] || "");
      if (id) selectRun(id);
    });
    let resizeTimer = 0;
    window.addEventListener("resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(() => {
        state.dirty.rows = true;
        scheduleRender();
      }, 150);
    });
    loadRuns();
    setInterval(loadRuns, RUNS_POLL_MS);
    setInterval(watchdog, WATCHDOG_MS);
    setInterval(tickClock, 1000);
  }

  window.gemqDashboard = { state }; // for a look from the browser's console
  document.addEventListener("DOMContentLoaded", init);
})();
