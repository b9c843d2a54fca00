// The page's shared status lines: the error banner and the connection badge (and `$`).

export const $ = (sel) => document.querySelector(sel);

export function showError(message) {
  $("#error-text").textContent = message;
  $("#error-banner").hidden = false;
}

export function clearError() {
  $("#error-banner").hidden = true;
  $("#error-text").textContent = "";
}

// kind: idle, connecting, live, reconnecting, polling, offline or ended (a CSS class too).
export function setConnection(kind, text) {
  const el = $("#connection");
  el.className = `conn conn-${kind}`;
  el.textContent = text || kind;
  el.dataset.state = kind;
}
