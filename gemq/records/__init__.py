"""What a run leaves to read: its curves, its summary and its progress, from its metrics.

| module | one job |
|---|---|
| ``curves`` | a run's curves as rows, one format for every writer |
| ``recording`` | a local run's curves written while it runs (CSV, TensorBoard) |
| ``runfolder`` | the folder of a local run's results, and where they go when the disk refuses it |
| ``curvefile`` | ``metrics.csv``, written so that no row is lost or repeated wherever it goes |
| ``tensorboard_curves`` | the curves as TensorBoard scalars (the optional extra) |
| ``export`` | a run's curves read back from Redis (``gemq export``, the API's CSV) |
| ``summary`` | ``RunSummary``: the end-of-run summary, written as JSON |
| ``verdict`` | whether a finished run's result is poor (most gradients rejected, chance accuracy) |
| ``progress`` | the live progress bar of a run on the terminal |
| ``combine`` | a sharded run's numbers from its shards' |

The dependencies point one way: recording -> curvefile -> runfolder; recording ->
tensorboard_curves -> curves; export -> curves;
summary, progress -> combine, curves; all read Redis through gemq.state.store and import
nothing of aggregation or training.
"""
