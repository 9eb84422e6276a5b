-- Settle a chat's reservation when it ends (core/limits.py settle, called by the worker after
-- the job's terminal write): what it reserved at admission (its prompt, estimated, and its
-- max_tokens) is replaced by what it used, in the windows it was admitted in that are still
-- the tenant's current ones. A window that has turned since keeps what it counted.
--
-- KEYS: the job's reservation (core/keys.py reservation_key), its tenant's usage hash
-- (limits_usage_key); ARGV: the completion tokens the job produced, its prompt's tokens
-- (-1: unknown, the estimate stands), and its tenant (a usage hash of another tenant than the
-- one admitted, from a request whose tenant differs from the enqueue's, is left alone). Returns the tokens given back (negative: charged more),
-- 0 when there was nothing to settle. The reservation is deleted in the same step, so a job
-- settles once, however many runs it had (a continued job's last run settles it).
local held = redis.call('HMGET', KEYS[1], 'prompt', 'completion', 'minute', 'day', 'month',
  'tenant')
if not held[1] then return 0 end
redis.call('DEL', KEYS[1])
if held[6] ~= ARGV[3] then return 0 end
local prompt = tonumber(ARGV[2])
if prompt < 0 then prompt = tonumber(held[1]) end
local back = tonumber(held[1]) + tonumber(held[2]) - (prompt + tonumber(ARGV[1]))
if back == 0 then return 0 end
local now = redis.call('HMGET', KEYS[2], 'minute', 'day', 'month')
-- Each count the reservation went into, if its window is still the one counted (never below 0).
local function give_back(window_field, window, count_field)
  if now[window_field] == window then
    local count = tonumber(redis.call('HGET', KEYS[2], count_field) or '0')
    redis.call('HSET', KEYS[2], count_field, math.max(count - back, 0))
  end
end
give_back(1, held[3], 'tokens')
give_back(2, held[4], 'day_tokens')
give_back(3, held[5], 'month_tokens')
return back
