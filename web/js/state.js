// The page's one mutable state (the selected run, its rows and view, the live stream, the
// runs being compared) and what run and job states mean; every other module reads and
// writes it here.

export const ENDED = new Set(["finished", "stopped", "failed"]);
// rq job states in which the aggregation may still change the run.
const JOB_ACTIVE = new Set(["queued", "started", "deferred", "scheduled"]);

export const state = {
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
  dirty: { rows: false, view: false },
  frame: 0,
  zoom: null, // the x range (updates) the run's charts show, or null: all of it
  logLoss: false, // the loss chart's y axis is logarithmic
  mode: "run", // what the main area shows: "run" (the selected run) or "compare"
  compare: {
    runs: [], // in the order picked: {id, colour, columns, lastId, final, busy, error}
    axis: "updates", // the x axis: "updates" or "time" (since each run's start)
    dirty: { legend: false, charts: false },
    frame: 0,
  },
};

// The rq job's state, whether the view gives the job as a string or as {state, ...}.
export function jobState(job) {
  if (!job) return null;
  return typeof job === "string" ? job : job.state || null;
}

// A run (its view or its summary in the run list) has ended and no job can change it any
// more: nothing left to fetch after one last read.
export function isOver(run) {
  if (!run || !ENDED.has(run.state)) return false;
  return !JOB_ACTIVE.has(jobState(run.job));
}

// What the page knows of a run: the selected run's view (the freshest), else its entry in
// the run list, else null.
export function runSummary(id) {
  if (state.view && state.view.run_id === id) return state.view;
  return state.runs.find((r) => r.run_id === id) || null;
}

// The selected run is over: nothing left to stream.
export function runIsOver() {
  return isOver(state.view);
}
