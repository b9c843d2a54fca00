"""Server-side Lua scripts: the places where atomicity is the point.

Both aggregator scripts start with the fencing check: the run's lease must hold the caller's
token. A leader that was paused past its lease and wakes up to find another token there
fails with FENCED before it touches anything. A lease that merely lapsed (a slow batch) and
that nobody took is taken back: nobody else can have written meanwhile, and the commit's
compare-and-set on the head catches the case where somebody did and left again.
"""

FENCE = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then
  ON_FENCED
  return redis.error_reply('FENCED this aggregator no longer holds the lease')
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
"""

#: KEYS: lease.  ARGV: token, lease_ms.  Renews the lease.
#: The batch itself is read outside the script, in the same pipeline: a script would copy
#: every message into Lua and back. Reading needs no fence: a stale leader's read only moves
#: entries into the group's pending list, which the leader reads before anything new.
RENEW = FENCE.replace("ON_FENCED", "") + """
return 1
"""

#: Every key is the shard's (one slot): the run's status is set apart (CONCLUDE), once the
#: shards have their final states.
#: KEYS: lease, head, versions, gradients, metrics, counters, new params, staged params,
#:       moments index, evaluations, then plan.n_drop snapshot keys to delete, one key per
#:       plan.workers entry, (staged, final) moment keys per plan.checkpoint entry, and one
#:       moment key per plan.forget entry.
#: ARGV: token, lease_ms, msgpack plan.
#: Everything a batch changes lands in this one atomic step: parameters, head, the XACK of
#: the batch, trimming, metrics, counters and worker state. The oldest held-out evaluation
#: workers left (none lost when two come between commits) goes into this one's metrics
#: entry. The trim drops every entry up
#: to the last one applied, that one included: the stream's length, which workers'
#: backpressure compares with max_pending, then counts only entries not applied yet. It
#: never passes an entry still pending outside this window (a deposed leader's read may
#: have moved entries into the pending list while this one read past them): those stay
#: until they are applied.
#: The parameters were SET to the staging key just before, in the same pipeline (not a
#: transaction: this script is the atomic step); they are renamed into place (no copy) or
#: discarded. It is
#: idempotent: it applies only on top of the head it was computed from (plan.prev_id), so a
#: commit re-sent after a lost reply changes nothing and returns 0.
COMMIT = FENCE.replace("ON_FENCED", "redis.call('DEL', KEYS[8])") + """
-- Stream ids compared as 'ms-seq' pairs of 64-bit decimals (Lua's numbers would round).
local function id_less(a, b)
  local am, as = string.match(a, '(%d+)-(%d+)')
  local bm, bs = string.match(b, '(%d+)-(%d+)')
  local function less(x, y)
    if #x ~= #y then return #x < #y end
    return x < y
  end
  if am ~= bm then return less(am, bm) end
  return less(as, bs)
end
local plan = cmsgpack.unpack(ARGV[3])
if redis.call('HGET', KEYS[2], 'last_id') ~= plan.prev_id then
  redis.call('DEL', KEYS[8])
  return 0
end
if plan.publish then
  redis.call('RENAME', KEYS[8], KEYS[7])
  redis.call('PERSIST', KEYS[7])
  redis.call('ZADD', KEYS[3], plan.version, plan.version)
end
local fixed = 10
for i = 1, plan.n_drop do
  redis.call('DEL', KEYS[fixed + i])
  redis.call('ZREM', KEYS[3], plan.drop[i])
end
redis.call('HSET', KEYS[2], 'version', plan.version, 'updates', plan.updates,
           'last_id', plan.last_id)
if #plan.ack > 0 then
  redis.call('XACK', KEYS[4], plan.group, unpack(plan.ack))
  local keep = plan.last_id
  local pending = redis.call('XPENDING', KEYS[4], plan.group)
  if pending[1] > 0 and id_less(pending[2], keep) then keep = pending[2] end
  redis.call('XTRIM', KEYS[4], 'MINID', keep)
  -- MINID keeps its own id. Applied and acknowledged (here or by an earlier commit), the
  -- last entry goes too. (Trimming to the id after it would need a successor of
  -- 18446744073709551615-18446744073709551615, which has none.)
  redis.call('XDEL', KEYS[4], plan.last_id)
end
if #plan.metrics > 0 then
  local evaluation = redis.call('LPOP', KEYS[10])
  if evaluation then
    for _, v in ipairs(cjson.decode(evaluation)) do table.insert(plan.metrics, v) end
  end
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', plan.metrics_maxlen, '*', unpack(plan.metrics))
end
for field, n in pairs(plan.counters) do
  redis.call('HINCRBY', KEYS[6], field, n)
end
for i, w in ipairs(plan.workers) do
  local key = KEYS[fixed + plan.n_drop + i]
  if #w.set > 0 then redis.call('HSET', key, unpack(w.set)) end
  for field, n in pairs(w.incr) do redis.call('HINCRBY', key, field, n) end
end
local next_key = fixed + plan.n_drop + #plan.workers
for i, w in ipairs(plan.checkpoint) do
  redis.call('RENAME', KEYS[next_key + 2 * i - 1], KEYS[next_key + 2 * i])
  redis.call('PERSIST', KEYS[next_key + 2 * i])
  redis.call('HSET', KEYS[9], w, plan.version)
end
next_key = next_key + 2 * #plan.checkpoint
for i, w in ipairs(plan.forget) do
  redis.call('DEL', KEYS[next_key + i])
  redis.call('HDEL', KEYS[9], w)
end
if #plan.final > 0 then
  redis.call('HSET', KEYS[2], unpack(plan.final))
end
return 1
"""

#: A worker's publication is one MULTI: MARK, the XADD of the gradient, then COUNTED. The
#: gradient never passes through Lua (Redis would hash every byte of it); COUNTED sees
#: whether the XADD took by the stream's length, which nothing else can change inside the
#: MULTI, and counts the gradient only then: `published` counts entries that exist.
#: The stream exists as long as the run does: a worker that publishes to a deleted run
#: (frozen past the deletion) must not make its keys again, so MARK writes nothing then and
#: the XADD is NOMKSTREAM.
#: KEYS: gradients, worker hash.
MARK = """
if redis.call('EXISTS', KEYS[1]) == 0 then return end
redis.call('HSET', KEYS[2], 'stream_length', redis.call('XLEN', KEYS[1]))
"""

#: KEYS: gradients, worker hash, counters, workers (zset).  ARGV: worker id, now_ms.
#: Returns 1 if the gradient was added (and counted), else 0. Registers the worker: the
#: aggregator attributes gradients only to registered workers.
COUNTED = """
local before = tonumber(redis.call('HGET', KEYS[2], 'stream_length'))
if not before or redis.call('XLEN', KEYS[1]) ~= before + 1 then return 0 end
redis.call('HINCRBY', KEYS[3], 'published', 1)
redis.call('HINCRBY', KEYS[2], 'steps', 1)
redis.call('HSET', KEYS[2], 'heartbeat_ms', ARGV[2])
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[1])
return 1
"""

#: KEYS: status.  ARGV: job id, job ids.  A created run with no job yet gets these, and is
#: queued from then on (a deletion's claim refuses it, CLAIM_DELETION); returns 'ok', or
#: 'missing' for a run that is gone (deleted meanwhile), or the state of one started or ended
#: already.
CLAIM_START = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 'missing' end
if state ~= 'created' then return state end
if (redis.call('HGET', KEYS[1], 'job_id') or '') ~= '' then return 'queued' end
redis.call('HSET', KEYS[1], 'job_id', ARGV[1], 'job_ids', ARGV[2])
return 'ok'
"""

#: KEYS: evaluation claim, head.  ARGV: index.  A worker claims the held-out evaluation of
#: ``index`` (updates // eval_every); 1 if it is the first to, 0 if that or a later one was
#: claimed already, or the run is gone.
CLAIM_EVALUATION = """
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
local claimed = tonumber(redis.call('GET', KEYS[1]) or '-1')
if tonumber(ARGV[1]) <= claimed then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
return 1
"""

#: KEYS: status.  ARGV: state, now_ms, error.  Gives a run that has not ended its final
#: state (and error, if any); returns 1 if it did (0 for one ended, or gone).
CONCLUDE = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state or state == 'finished' or state == 'stopped' or state == 'failed' then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'ended_ms', ARGV[2])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[3]) end
return 1
"""

#: KEYS: status.  ARGV: error, now_ms.  Fails a run that has not ended (nor is gone);
#: returns 1 if it did.
FAIL = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state or state == 'finished' or state == 'stopped' or state == 'failed' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'failed', 'error', ARGV[1], 'ended_ms', ARGV[2])
return 1
"""

#: KEYS: lease.  ARGV: token.  Deletes the lease only if it is still ours.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

#: KEYS: status, lease, workers (zset), config, deletion marker.  ARGV: force ('1' or '0'),
#: quiet_since_ms, marker_ms.
#: The first, atomic step of deleting a run (gemq/state/retention.py): refuses while anything may
#: still write to the run, else deletes its status and configuration, after which every
#: process sees the run as gone, and sets the deletion marker for marker_ms (the deletion
#: removes it when done). Returns {verdict, detail, keys deleted}, the verdict one of:
#: deleting (another deletion is under way), missing (no status, no config, no deletion
#: under way), led (an aggregator holds the lease: it leads the run
#: or is finishing it), busy (running or queued; detail: the state), workers (a run that has
#: not ended, created or, with force, running or queued: a worker was heard from since
#: quiet_since_ms, and may write to it; detail: its id), claimed (detail: the rq job id, ''
#: if none).
CLAIM_DELETION = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state and redis.call('EXISTS', KEYS[4]) == 0 then
  if redis.call('EXISTS', KEYS[5]) == 1 then return {'deleting', '', 0} end
  return {'missing', '', 0}
end
if redis.call('EXISTS', KEYS[2]) == 1 then return {'led', '', 0} end
local job = redis.call('HGET', KEYS[1], 'job_id') or ''
if state == 'running' or (state == 'created' and job ~= '') then
  if ARGV[1] ~= '1' then return {'busy', state, 0} end
end
if state == 'running' or state == 'created' then
  local heard = redis.call('ZRANGEBYSCORE', KEYS[3], ARGV[2], '+inf', 'LIMIT', 0, 1)
  if #heard > 0 then return {'workers', heard[1], 0} end
end
local deleted = redis.call('DEL', KEYS[1], KEYS[4])
-- pcall: a Redis out of memory refuses the SET, and deleting is how it gets memory back.
redis.pcall('SET', KEYS[5], '1', 'PX', ARGV[3])
return {'claimed', job, deleted}
"""

#: Writes of workers besides their gradients, made only while the run (the shard, by its
#: head) exists: a worker frozen past the run's deletion does not make its keys again.
#: Each returns 1 if it wrote, 0 if the run is gone.
#: KEYS: head, worker hash, workers (zset).  ARGV: worker id, now_ms.
HEARTBEAT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], 'heartbeat_ms', ARGV[2])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
return 1
"""

#: KEYS: head, evaluations (list).  ARGV: the evaluation, a JSON array of field, value...
RECORD_EVALUATION = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[1])
return 1
"""
