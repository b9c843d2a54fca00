"""Server-side Lua scripts: the places where atomicity is the point.

Both aggregator scripts start with the fencing check: the caller's token must still be the
value of the run's lease. A leader that was paused past its lease and wakes up finds another
token there, and its read or commit fails with FENCED before it touches anything.
"""

FENCE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED this aggregator no longer holds the lease')
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""

#: KEYS: lease, gradients, status.  ARGV: token, lease_ms, group, consumer, count.
#: Returns {stop_requested or nil, XREADGROUP reply or nil}. Entries delivered earlier but
#: never acknowledged come first (a previous leader's batch, or one whose reply was lost on
#: the way back to us); only when there are none does it read new entries.
FENCED_READ = FENCE + """
local stop = redis.call('HGET', KEYS[3], 'stop_requested')
local function read(start)
  return redis.call('XREADGROUP', 'GROUP', ARGV[3], ARGV[4], 'COUNT', ARGV[5],
                    'STREAMS', KEYS[2], start)
end
local reply = read('0')
if not reply or #reply[1][2] == 0 then reply = read('>') end
return {stop, reply}
"""

#: KEYS: lease, head, versions, gradients, metrics, counters, workers, status, new params,
#:       then plan.n_drop snapshot keys to delete, then one key per plan.workers entry.
#: ARGV: token, lease_ms, parameter bytes (ignored unless plan.publish), msgpack plan.
#: Everything a batch changes lands in this one atomic step: parameters, head, the XACK of
#: the batch, trimming, metrics, counters and worker state. It is idempotent: it applies
#: only on top of the head it was computed from (plan.prev_id), so a commit re-sent after
#: a lost reply changes nothing and returns 0.
COMMIT = FENCE + """
local plan = cmsgpack.unpack(ARGV[4])
if redis.call('HGET', KEYS[2], 'last_id') ~= plan.prev_id then return 0 end
if plan.publish then
  redis.call('SET', KEYS[9], ARGV[3])
  redis.call('ZADD', KEYS[3], plan.version, plan.version)
end
for i = 1, plan.n_drop do
  redis.call('DEL', KEYS[9 + i])
  redis.call('ZREM', KEYS[3], plan.drop[i])
end
redis.call('HSET', KEYS[2], 'version', plan.version, 'updates', plan.updates,
           'last_id', plan.last_id)
if #plan.ack > 0 then
  redis.call('XACK', KEYS[4], plan.group, unpack(plan.ack))
  redis.call('XTRIM', KEYS[4], 'MINID', plan.last_id)
end
if #plan.metrics > 0 then
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', plan.metrics_maxlen, '*', unpack(plan.metrics))
end
for field, n in pairs(plan.counters) do
  redis.call('HINCRBY', KEYS[6], field, n)
end
for i, w in ipairs(plan.workers) do
  local key = KEYS[9 + plan.n_drop + i]
  redis.call('SADD', KEYS[7], w.id)
  if #w.set > 0 then redis.call('HSET', key, unpack(w.set)) end
  for field, n in pairs(w.incr) do redis.call('HINCRBY', key, field, n) end
end
if #plan.status > 0 then
  redis.call('HSET', KEYS[8], unpack(plan.status))
end
return 1
"""

#: KEYS: lease.  ARGV: token.  Deletes the lease only if it is still ours.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
