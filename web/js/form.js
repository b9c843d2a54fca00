// The "Start a run" form. It is built from GET api/settings, the API's one description of
// every run setting (type, default, bounds, choices, help, group), so that no default,
// range or choice is repeated here; it checks the values and posts them to POST api/runs.

import { api } from "./api.js";
import { create, fitNumberInput, InvalidSetting, readValue, settingField } from "./fields.js";
import { $, clearError, showError } from "./page.js";

const BUDGET = "budget"; // epochs and steps: give at most one; neither is the API's default
const OPEN_GROUP = "training"; // shown open; every other group folds into a <details>
const RETRY_MS = 5000;
// Suggestions only: the API takes any spec its help names and refuses unknown ones (422).
const SUGGESTIONS = { model: ["cnn", "mlp", "logreg"], dataset: ["mnist5k", "digits"] };

let controls = []; // [{setting, input}]: every setting outside the budget
let budget = null; // {settings, kind: <select> of the unit, amount: <input>}

export function setFormMessage(text, isError = false) {
  const el = $("#form-message");
  el.textContent = text;
  el.classList.toggle("error-text", isError);
}

// onStarted(view): called with the new run's view once the API created it.
export function initStartForm(onStarted) {
  const form = $("#start-form");
  form.addEventListener("submit", (ev) => submit(ev, onStarted));
  form.addEventListener("input", (ev) => ev.target.removeAttribute("aria-invalid"));
  loadSettings();
}

async function loadSettings() {
  try {
    const data = await api("GET", "/settings");
    build(data.settings);
  } catch (e) {
    setFormMessage(`Cannot load the run settings (${e.message}); retrying…`, true);
    setTimeout(loadSettings, RETRY_MS);
  }
}

// Groups in the API's order, except that folded ones go last, next to the Start button.
function build(settings) {
  const groups = new Map();
  for (const s of settings) groups.set(s.group, [...(groups.get(s.group) || []), s]);
  const open = [...groups].filter(([g]) => g === OPEN_GROUP || g === BUDGET);
  const folded = [...groups].filter(([g]) => g !== OPEN_GROUP && g !== BUDGET);
  controls = [];
  budget = null;
  $("#form-fields").replaceChildren(
    ...open.map(([g, members]) => (g === BUDGET ? budgetFieldset(members) : fieldGrid(members))),
    ...folded.map(([g, members]) => foldedGroup(g, members)));
  $("#start-form").removeAttribute("aria-busy");
  $("#start-button").disabled = false;
  setFormMessage("");
}

function fieldGrid(members) {
  const grid = create("div", { class: "field-grid" });
  for (const setting of members) {
    const { field, input } = settingField(setting, SUGGESTIONS[setting.name]);
    controls.push({ setting, input });
    grid.append(field);
  }
  return grid;
}

function foldedGroup(group, members) {
  const details = create("details", { class: "field-group", "data-group": group });
  details.append(create("summary", {}, group), fieldGrid(members));
  return details;
}

// A unit (one of the budget settings) and an amount; an empty amount posts no budget, so the
// API's default applies (its help says which).
function budgetFieldset(members) {
  const fieldset = create("fieldset", { class: "field budget" });
  const kind = create("select", { id: "f-budget-kind", name: "budget_kind", "aria-label": "Budget unit" });
  for (const s of members) kind.append(new Option(s.name, s.name));
  const amount = create("input", { id: "f-budget", name: "budget", type: "number", placeholder: "default",
    "aria-label": "Budget amount", "aria-describedby": "f-budget-help" });
  const hint = create("p", { id: "f-budget-help", class: "hint" });
  const row = create("div", { class: "budget-row" });
  row.append(kind, amount);
  fieldset.append(create("legend", {}, BUDGET), row, hint);
  budget = { settings: members, kind, amount };
  const fit = () => {
    const s = budgetSetting();
    fitNumberInput(amount, s);
    hint.textContent = s.help;
  };
  kind.addEventListener("change", () => {
    amount.value = ""; // an amount in one unit means nothing in the other
    amount.removeAttribute("aria-invalid");
    fit();
  });
  fit();
  return fieldset;
}

function budgetSetting() {
  return budget.settings.find((s) => s.name === budget.kind.value);
}

// The request posts only the settings changed from the API's defaults (the rest would be
// the same values; leaving them out keeps the API their one home), plus the budget if an
// amount was given.
function requestBody() {
  const body = {};
  for (const { setting, input } of controls) {
    const value = readValue(setting, input);
    if (value !== null && value !== setting.default) body[setting.name] = value;
  }
  if (budget) {
    const s = budgetSetting();
    const value = readValue(s, budget.amount);
    if (value !== null) body[s.name] = value;
  }
  return body;
}

function pointAt(input) {
  input.setAttribute("aria-invalid", "true");
  const folded = input.closest("details");
  if (folded) folded.open = true;
  input.focus();
}

async function submit(ev, onStarted) {
  ev.preventDefault();
  clearError();
  let body;
  try {
    body = requestBody();
  } catch (e) {
    if (!(e instanceof InvalidSetting)) throw e;
    setFormMessage(e.message, true);
    pointAt(e.input);
    return;
  }
  const button = $("#start-button");
  button.disabled = true;
  setFormMessage("Starting…");
  try {
    const view = await api("POST", "/runs", body);
    setFormMessage(`Started ${view.run_id}`);
    await onStarted(view);
  } catch (e) {
    setFormMessage("");
    showError(`Could not start the run: ${e.message}`);
  } finally {
    button.disabled = false;
  }
}
