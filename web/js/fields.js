// One run setting as a form control, built from its description in GET api/settings (type,
// default, bounds, choices, help), and the control's value read back and checked against
// that same description, so that the form refuses before posting what the API would refuse.

export class InvalidSetting extends Error {
  constructor(input, message) {
    super(message);
    this.input = input; // the control to point the user at
  }
}

export function create(tag, attrs = {}, text = "") {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value !== null && value !== undefined) el.setAttribute(name, String(value));
  }
  if (text) el.textContent = text;
  return el;
}

// "(0, 10]", as the API's messages write a range ( and ) exclusive; "" when unbounded.
function rangeText(s) {
  if (s.minimum === null && s.maximum === null) return "";
  const lo = s.minimum === null ? "-∞" : s.minimum;
  const hi = s.maximum === null ? "∞" : s.maximum;
  return `${s.exclusive_minimum ? "(" : "["}${lo}, ${hi}${s.exclusive_maximum ? ")" : "]"}`;
}

// The help, and the range a number must lie in: a control's title (its description).
export function describe(s) {
  const range = rangeText(s);
  return range ? `${s.help}; range ${range}` : s.help;
}

// step, min and max of a number input. min and max are inclusive, so they only keep the
// spinner in range; readValue checks exclusive bounds.
export function fitNumberInput(input, s) {
  input.step = s.type === "integer" ? "1" : "any";
  for (const [attr, bound] of [["min", s.minimum], ["max", s.maximum]]) {
    if (bound === null) input.removeAttribute(attr);
    else input.setAttribute(attr, String(bound));
  }
  input.title = describe(s);
}

function inputFor(s, id) {
  if (s.choices) {
    const select = create("select", { id, name: s.name });
    for (const choice of s.choices) select.append(new Option(choice, choice));
    return select;
  }
  if (s.type === "string") {
    return create("input", { id, name: s.name, type: "text", maxlength: s.max_length,
      autocomplete: "off", spellcheck: "false" });
  }
  const input = create("input", { id, name: s.name, type: "number" });
  fitNumberInput(input, s);
  return input;
}

// A labelled control (id f-<name>) holding the setting's default; `suggestions` become a
// datalist of a text input.
export function settingField(s, suggestions = null) {
  const id = `f-${s.name}`;
  const input = inputFor(s, id);
  if (s.auto && input.type === "number") input.placeholder = "auto"; // empty: gemq chooses
  else if (s.default !== null) input.value = String(s.default);
  input.title = describe(s);
  const field = create("div", { class: "field" });
  field.append(create("label", { for: id }, s.name), input);
  if (suggestions && input.type === "text") {
    const list = create("datalist", { id: `${id}-suggestions` });
    for (const value of suggestions) list.append(new Option(value));
    input.setAttribute("list", list.id);
    field.append(list);
  }
  return { field, input };
}

function inRange(s, v) {
  if (s.minimum !== null && (s.exclusive_minimum ? v <= s.minimum : v < s.minimum)) return false;
  if (s.maximum !== null && (s.exclusive_maximum ? v >= s.maximum : v > s.maximum)) return false;
  return true;
}

// The control's value as the API takes it, or null when it is empty and the setting has no
// default (it may be left out). Throws InvalidSetting worded like the API's 422 messages.
export function readValue(s, input) {
  const text = input.value.trim();
  const invalid = (why) => new InvalidSetting(input, `${s.name}: ${why}`);
  if (!text) {
    if (s.default === null || s.auto) return null; // null: the API's default applies
    throw invalid(s.type === "string" ? "must not be empty" : "enter a number");
  }
  if (s.type === "string") {
    if (s.choices && !s.choices.includes(text)) throw invalid(`must be one of ${s.choices.join(", ")}`);
    if (s.max_length !== null && text.length > s.max_length) throw invalid(`at most ${s.max_length} characters`);
    return text;
  }
  const value = Number(text);
  if (!Number.isFinite(value)) throw invalid("enter a number");
  if (s.type === "integer" && !Number.isInteger(value)) throw invalid(`must be an integer, got ${text}`);
  if (!inRange(s, value)) throw invalid(`must be in ${rangeText(s)}, got ${text}`);
  return value;
}
