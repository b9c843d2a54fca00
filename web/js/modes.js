// What the main area shows: the selected run ("run") or the comparison ("compare"), chosen
// with the tabs above it.

import { invalidateComparison } from "./compareview.js";
import { $ } from "./page.js";
import { invalidate } from "./render.js";
import { state } from "./state.js";

export function showMode(mode) {
  if (mode === state.mode) return;
  state.mode = mode;
  $("#run-view").hidden = mode !== "run";
  $("#compare-view").hidden = mode !== "compare";
  document.body.dataset.mode = mode; // the run list marks the selected run in "run" only
  for (const tab of document.querySelectorAll("[role=tab][data-mode]")) {
    tab.setAttribute("aria-selected", String(tab.dataset.mode === mode));
  }
  // Charts drawn while hidden had no width: draw the shown ones again.
  if (mode === "run") invalidate("rows", "view");
  else invalidateComparison("legend", "charts");
}
