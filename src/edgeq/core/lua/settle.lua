-- Shared functions (core/scripts.py prepends this file) of the terminal step
-- (publish_event.lua, core/events.py): the settlement of a chat's reservation when it ends.
-- What it reserved at admission (its prompt, estimated, and its max_tokens: lua/limits.lua)
-- is replaced by what it used, in the windows it was admitted in that are still the current
-- ones of its tenant (and of its API key, when the key has limits). A window that has turned
-- since keeps what it counted; a count never goes below 0.
--
-- It runs in the same step as the job's one terminal event, whoever writes it (the worker, a
-- client cancelling, a keep-alive declaring a worker lost), and deletes the reservation: a job
-- settles exactly once, however many runs it had. A tenant with no limits has no reservation:
-- its end costs one HMGET here and nothing else.

-- Settle the reservation at `reservation_key`. `usage_prefix` .. each of the reservation's
-- `counted` suffixes is a usage hash it was counted in (core/keys.py limits_usage_key: the
-- tenant's name; key_limits_usage_key: 'key:' and the API key's name; a reservation written
-- before keys had limits has no `counted` and was counted in its tenant's only). Built here so
-- a writer that does not know the job's tenant still settles it, in the queue's slot.
-- `tenant`: the writer's idea of the job's tenant ('': not known); a reservation of another
-- tenant (a request whose tenant differs from the enqueue's) is deleted and nothing given
-- back. `completion`: the tokens the job produced (-1: what it reserved stands); `prompt`: its
-- prompt's exact tokens (-1: the estimate stands). Returns the tokens given back (negative:
-- charged more), 0 when there was nothing to settle.
local function settle(reservation_key, usage_prefix, tenant, completion, prompt)
  local held = redis.call('HMGET', reservation_key, 'prompt', 'completion', 'minute', 'day',
    'month', 'tenant', 'counted')
  if not held[1] then return 0 end
  redis.call('DEL', reservation_key)
  if tenant ~= '' and held[6] ~= tenant then return 0 end
  if prompt < 0 then prompt = tonumber(held[1]) end
  if completion < 0 then completion = tonumber(held[2]) end
  local back = tonumber(held[1]) + tonumber(held[2]) - (prompt + completion)
  if back == 0 then return 0 end
  for suffix in string.gmatch(held[7] or held[6], '%S+') do
    local usage_key = usage_prefix .. suffix
    local now = redis.call('HMGET', usage_key, 'minute', 'day', 'month')
    -- Each count the reservation went into, if its window is still the one counted.
    local function give_back(window_field, window, count_field)
      if now[window_field] == window then
        local count = tonumber(redis.call('HGET', usage_key, count_field) or '0')
        redis.call('HSET', usage_key, count_field, math.max(count - back, 0))
      end
    end
    give_back(1, held[3], 'tokens')
    give_back(2, held[4], 'day_tokens')
    give_back(3, held[5], 'month_tokens')
  end
  return back
end
