// API access: the one fetch wrapper every call goes through, the bearer token (kept in
// localStorage, asked for when the API wants it) and the server's clock from the Date header.

import { $ } from "./page.js";

const BASE = "api"; // relative, so the dashboard also works behind a path prefix
const TOKEN_KEY = "gemq.apiToken";

let clockSkewMs = 0; // server clock minus ours
let tokenPromptDeclined = false;

// The URL of an API path ("/runs"), for what fetch does not load: EventSource, links.
export function apiUrl(path) {
  return BASE + path;
}

// Now on the server's clock: ages of server timestamps are not skewed by ours.
export function serverNow() {
  return Date.now() + clockSkewMs;
}

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status; // 0: the API could not be reached
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
  clockSkewMs = Math.abs(skew) > 2000 ? skew : 0;
}

function askForToken(status, detail, interactive) {
  if (!interactive && tokenPromptDeclined) return false;
  const why = status === 401 ? "This gemq API needs a token." : `The API refused the token: ${detail}.`;
  const entered = window.prompt(`${why}\nAPI token (kept in this browser's localStorage):`, "");
  if (entered === null || !entered.trim()) {
    tokenPromptDeclined = true;
    return false;
  }
  localStorage.setItem(TOKEN_KEY, entered.trim());
  tokenPromptDeclined = false;
  updateTokenButton();
  return true;
}

// One call: the parsed JSON (or text, or null for a 204), else an ApiError with the API's detail.
export async function api(method, path, body, retried = false) {
  const headers = { Accept: "application/json" };
  const token = localStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let res;
  try {
    res = await fetch(apiUrl(path), {
      method, headers, cache: "no-store",
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (e) {
    throw new ApiError(0, `Cannot reach the gemq API (${e.message}).`);
  }
  noteServerDate(res);
  if ((res.status === 401 || res.status === 403) && !retried) {
    const detail = await errorDetail(res);
    // Calls made together (the run list, the form's settings) are refused together: one
    // prompt is enough, the others take the token it stored.
    const tokenSince = localStorage.getItem(TOKEN_KEY);
    if (tokenSince && tokenSince !== token) return api(method, path, body, true);
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

export function bindTokenButton() {
  updateTokenButton();
  $("#token-button").addEventListener("click", () => {
    const entered = window.prompt("API token for Start and Stop (empty to clear):", "");
    if (entered === null) return;
    if (entered.trim()) localStorage.setItem(TOKEN_KEY, entered.trim());
    else localStorage.removeItem(TOKEN_KEY);
    tokenPromptDeclined = false;
    updateTokenButton();
  });
}
