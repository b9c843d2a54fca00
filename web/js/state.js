// The page's one mutable state (the selected run, its rows and view, the live stream) and
// what run and job states mean; every other module reads and writes it here.

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
};

// The rq job's state, whether the view gives the job as a string or as {state, ...}.
export function jobState(job) {
  if (!job) return null;
  return typeof job === "string" ? job : job.state || null;
}

// The selected run has ended and no job can change it any more: nothing left to stream.
export function runIsOver() {
  const v = state.view;
  if (!v || !ENDED.has(v.state)) return false;
  return !JOB_ACTIVE.has(jobState(v.job));
}
