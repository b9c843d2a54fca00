"""Research mode: n asynchronous workers simulated in one process, no Redis, deterministic.

| module | one job |
|---|---|
| ``command`` | ``gemq simulate``: its flags and what it prints (light: no torch) |
| ``options`` | ``SimOptions``: how a simulation runs, beyond the RunConfig it simulates |
| ``staleness`` | the staleness models: in which order the workers' gradients land |
| ``engine`` | ``simulate()``: the workers' steps (gemq.training.flatmodel) and the
  aggregator's rules (gemq.aggregation.rules), event by event |
| ``results`` | ``SimResult``: the curves and the summary, written as JSON or CSV |

The dependencies point one way: command -> engine -> results -> options -> staleness.
"""
