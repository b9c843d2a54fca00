"""Running gemq on one machine: a private Redis, run creation, the local training command.

| module | one job |
|---|---|
| ``local`` | ``train()``, what ``gemq run`` calls: Redis, an aggregator, n worker processes |
| ``runs`` | creating runs: the initial state and layout, written to Redis |
| ``sizing`` | the settings left at auto, chosen for the model, the workers and the Redis |
| ``resume`` | ``gemq run --resume``: an interrupted run goes on with its whole state |
| ``savedstate`` | a local run's private Redis kept in its folder, and its state file |
| ``modelfile`` | a local run's model file: the newest published state as a state_dict |
| ``dashboard`` | ``gemq run --dashboard``: ``gemq serve`` on the run's own Redis |
| ``localservices`` | ``gemq serve --local``: a private Redis, an aggregator and a worker service |
| ``embedded`` | a private redis-server on a free loopback port |
| ``cluster`` | a private Redis Cluster, for tests and ``gemq run --local-cluster`` |

The dependencies point one way: resume -> local -> runs, modelfile, dashboard,
savedstate, cluster -> embedded; runs -> sizing; localservices -> embedded;
and down to every other wing but the simulator (aggregation, training, records, state,
wire, base).
"""
