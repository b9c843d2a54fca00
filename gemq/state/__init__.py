"""A run's state in Redis: connections, keys, the one façade, scripts and retention.

| module | one job |
|---|---|
| ``connection`` | opening Redis connections: bounded, logged retries; the zero-copy packer |
| ``deadline`` | a reply that trickles in is cut off like one that never comes |
| ``serverfit`` | whether a Redis a user brings suits a run (eviction, value size, memory) |
| ``bulkreads`` | large replies read straight into their own buffer |
| ``redispy`` | whether redis-py has the internals the fast paths use; if not, its own ways |
| ``keys`` | every key and stream name, and the fields of a gradient stream entry |
| ``placement`` | which hash tags spread a new run's shards over a Redis Cluster's masters |
| ``scripts`` | the server-side Lua scripts: where atomicity is the point |
| ``store`` | ``RunStore``: the Redis side of one shard of a run (the façade) |
| ``retention`` | what an ended run keeps, deleting runs, how many are kept |

The dependencies point one way: retention -> store -> placement, scripts, keys; serverfit ->
connection -> deadline, redispy -> bulkreads; and down to the wire format (gemq.wire.codec)
and the base (config, layout, shards, ids, errors). Nothing here imports torch or the
aggregation rules.
"""
