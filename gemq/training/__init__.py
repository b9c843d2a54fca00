"""The worker's side: models, data, losses, and the loop that turns them into gradients.

| module | one job |
|---|---|
| ``worker`` | ``Worker``: read parameters when they change, compute a gradient, publish it |
| ``shardset`` | a worker's side of every shard: read their parameters, publish a slice to each |
| ``flatmodel`` | ``FlatModel``: the worker step, state and gradient as flat float32 vectors |
| ``models`` | the built-in models (public as gemq.models) and the state layout of any model |
| ``data`` | the built-in datasets and minibatch streams |
| ``datasplit`` | ``DataSplit``: a dataset's training and held-out parts |
| ``text`` | the ``pysource`` corpus: byte-level text of the standard library, its baseline |
| ``transformer`` | the decoder-only transformer of ``--model transformer`` |
| ``losses`` | the losses a run trains and evaluates with |
| ``heldout`` | the held-out evaluation every eval_every updates, by whichever worker is first |
| ``evaluate`` | evaluating and saving models |
| ``specs`` | resolving ``package.module:factory`` specs for users' own code |

The dependencies point one way: worker -> shardset, flatmodel, heldout -> models,
evaluate, losses, data -> text, transformer, datasplit, specs; and down to the Redis state
(gemq.state), the wire format (gemq.wire) and the base. torch is imported here (and by
running, and records' TensorBoard writer), never by the aggregation, state or wire wings,
which the aggregator's image holds without torch.
"""
