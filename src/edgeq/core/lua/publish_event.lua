-- Append one event to a job's log: its replay stream and its pub/sub channel, in one step
-- (core/events.py EventLog; needs settle.lua). Runs in a BatchedScript (core/batching.py).
--
-- KEYS: the job's replay stream, its terminal key, its stream channel, then for a counted
-- terminal event the queue's outcome tally and the job's reservation (core/keys.py
-- reservation_key). ARGV: the event's JSON before and after its seq, terminal flag, TTL (ms),
-- the seq the writer wants (-1: the next one), then for a counted terminal event its outcome,
-- retention (s) and the job's tenant ('': not known), whose outcomes are counted too, as
-- tenant:<name>:<outcome>; then the settlement's: the prefix of a tenant's limits usage hash
-- (limits_usage_key with no tenant), the completion tokens the job produced and its prompt's
-- tokens (-1 each: what was reserved stands). Then, for a terminal event that goes into the usage
-- ledger (core/ledger.py): KEYS 6 and 7 the tenant's usage hash for the day and the day's
-- tenant index, ARGV 12 their lifetime (s), ARGV 13 on field, increment pairs. Returns
-- {seq, listeners}.
--
-- The ledger is counted and the reservation settled here, in the step that writes the terminal
-- event, so a job is counted and settled exactly once: a retry that finds its event stored
-- returns before this, and a stream with a terminal event takes no second one. An error end
-- keeps what its job reserved (what it streamed before is not known in tokens), unless
-- nothing came before it in the stream (seq 0: a job cancelled or expired in the queue, or
-- refused before its first token): never answered, it is charged nothing.
--
-- A wanted seq makes a retry idempotent: the same event already at that seq (its reply was
-- lost) is reported again, not appended twice; another event there means another run of the
-- job took the stream ({-3, 0}: a worker thought dead was not); a seq past the end (Redis lost
-- events: a restart without persistence, a failover) is answered {-2, length} so the writer
-- resends. A stream that already has its terminal event answers {-1, 0}.
local length = redis.call('XLEN', KEYS[1])
local wanted = tonumber(ARGV[5])
if wanted >= 0 and wanted < length then
  local kept = redis.call('XRANGE', KEYS[1], wanted .. '-1', wanted .. '-1')[1]
  if kept and kept[2][2] == ARGV[1] .. '"seq":' .. wanted .. ',' .. ARGV[2] then
    return {wanted, 0}
  end
  if redis.call('EXISTS', KEYS[2]) == 1 then return {-1, 0} end
  return {-3, 0}
end
if redis.call('EXISTS', KEYS[2]) == 1 then return {-1, 0} end
if wanted > length then return {-2, length} end
local seq = length
local event = ARGV[1] .. '"seq":' .. seq .. ',' .. ARGV[2]
redis.call('XADD', KEYS[1], seq .. '-1', 'event', event)
redis.call('PEXPIRE', KEYS[1], ARGV[4])
if ARGV[3] == '1' then
  redis.call('SET', KEYS[2], seq, 'PX', ARGV[4])
  if #KEYS > 3 then
    redis.call('HINCRBY', KEYS[4], ARGV[6], 1)
    if ARGV[8] ~= '' then
      redis.call('HINCRBY', KEYS[4], 'tenant:' .. ARGV[8] .. ':' .. ARGV[6], 1)
    end
    redis.call('EXPIRE', KEYS[4], ARGV[7])
    local completion, prompt = tonumber(ARGV[10]), tonumber(ARGV[11])
    if completion < 0 and seq == 0 then completion, prompt = 0, 0 end
    settle(KEYS[5], ARGV[9], ARGV[8], completion, prompt)
  end
  if #KEYS > 5 then
    for i = 13, #ARGV, 2 do
      redis.call('HINCRBY', KEYS[6], ARGV[i], ARGV[i + 1])
    end
    redis.call('EXPIRE', KEYS[6], ARGV[12])
    redis.call('SADD', KEYS[7], ARGV[8])
    redis.call('EXPIRE', KEYS[7], ARGV[12])
  end
end
local listeners = redis.call('PUBLISH', KEYS[3], event)
return {seq, listeners}
