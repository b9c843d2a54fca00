"""The aggregator: read gradients as the lease holder, apply a rule, commit each window once.

| module | one job |
|---|---|
| ``aggregator`` | ``Aggregator`` and ``Leader``: the loop from a fenced read to a commit |
| ``leadership`` | the lease holder's side of a shard in Redis: lease, fenced reads, commits |
| ``window`` | ``CommitWindow`` and the ``CommitPlan`` it becomes: one atomic step |
| ``rejections`` | the reasons a gradient is refused; logging them, failing a run that refuses all |
| ``checkpoints`` | when the GEM moments are checkpointed for the next leader |
| ``snapshots`` | the parameter versions kept to compute theta - s exactly |
| ``rules`` | the aggregation rules (GEM, Downpour, ...): numpy and one kernel, no Redis |
| ``kernel`` | the element-wise update every rule makes, one compiled loop |
| ``tally`` | running sums over applied updates: what a metrics row reports |

The dependencies point one way: aggregator -> leadership, window, rejections, checkpoints,
snapshots -> rules, tally -> kernel; and down to the Redis state (gemq.state), the wire
format (gemq.wire) and the base. rules, tally and kernel import no Redis (the simulator,
gemq.sim, uses them too). Nothing here imports torch: the aggregator image has none.
"""
