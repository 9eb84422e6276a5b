-- Shared functions (core/scripts.py prepends this file, after clock.lua) of the enqueue, which
-- admits a chat against its tenant's and its API key's rate limits and token budgets and
-- reserves its tokens in the same step, and of the settlement (settle.lua, core/limits.py).
--
-- Windows are fixed, on Redis's clock: the UTC minute, the UTC day and the UTC calendar month
-- (not sliding: a tenant may spend a minute's limit at 12:00:59 and again at 12:01:00). A
-- scope's usage hash (core/keys.py limits_usage_key, key_limits_usage_key) holds the window
-- it last counted in beside each count; a count of a window that is over is read as 0, so
-- nothing needs resetting when a window turns. The tenancy hash's `limits_clock_ms`, when
-- set, is read instead of Redis's clock: tests drive the windows with it (docs/limits.md).

local MINUTE_MS, DAY_MS = 60000, 86400000

-- Days since 1970-01-01 -> the year and month (1-12) that day is in (H. Hinnant's
-- civil_from_days; Lua 5.1 has no os.date inside Redis).
local function civil_month(days)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local month = mp < 10 and mp + 3 or mp - 9
  local year = yoe + era * 400
  if month <= 2 then year = year + 1 end
  return year, month
end

-- The first day of a month, in days since 1970-01-01 (days_from_civil).
local function month_start(year, month)
  if month <= 2 then year = year - 1 end
  local era = math.floor(year / 400)
  local yoe = year - era * 400
  local doy = math.floor((153 * ((month + 9) % 12) + 2) / 5)
  return era * 146097 + yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy - 719468
end

-- The windows `now_ms` is in, and when each ends (Unix ms).
local function windows_at(now_ms)
  local minute, day = math.floor(now_ms / MINUTE_MS), math.floor(now_ms / DAY_MS)
  local year, month = civil_month(day)
  local next_year, next_month = year, month + 1
  if next_month > 12 then next_year, next_month = year + 1, 1 end
  return {
    minute = minute, day = day, month = year * 12 + month - 1,
    minute_end = (minute + 1) * MINUTE_MS, day_end = (day + 1) * DAY_MS,
    month_end = month_start(next_year, next_month) * DAY_MS,
  }
end

-- What a scope (a tenant, an API key) has used in the windows `w` (a count of a window that
-- is over reads 0).
local function usage_in(used_key, w)
  local u = redis.call('HMGET', used_key, 'minute', 'requests', 'tokens', 'day', 'day_tokens',
    'month', 'month_tokens')
  local function count(window, at, value)
    if tonumber(u[at] or '-1') == window then return tonumber(u[value] or '0') end
    return 0
  end
  return {
    requests = count(w.minute, 1, 2), tokens = count(w.minute, 1, 3),
    day = count(w.day, 4, 5), month = count(w.month, 6, 7),
  }
end

-- Whether any of the limits {rpm, tpm, tokens per day, tokens per month} is set (above 0).
local function limited(limits)
  for i = 1, 4 do
    if tonumber(limits[i] or '0') > 0 then return true end
  end
  return false
end

-- Admit a chat costing `prompt` + `completion` tokens against the limits of each of its
-- scopes: its tenant's and, when it came with a named API key that has limits, the key's.
-- `scopes`: {{used = the scope's usage hash, limits = {rpm, tpm, tokens per day, tokens per
-- month} (tenancy fields, false when unset; 0 or unset: no limit), who = 'tenant' or 'key',
-- counted = its usage hash's suffix after the queue's prefix}}; `clock`: the tenancy hash's
-- frozen clock (false: Redis's). A chat fits only if it fits every scope's limits. Admitted:
-- counts it in every limited scope and writes its reservation (kept `reservation_ttl_ms`),
-- returns nil. Refused: returns {-4, which limit, its value, what is left of it, ms until it
-- resets, rpm, requests left, tpm, tokens left, ms until the minute resets (all of the
-- refusing scope), whose limit it is ('tenant' or 'key')}; nothing is counted anywhere.
local function admit(scopes, reservation_key, tenant, prompt, completion, reservation_ttl_ms,
                     clock)
  local counted = {}
  for _, scope in ipairs(scopes) do
    if limited(scope.limits) then counted[#counted + 1] = scope end
  end
  if #counted == 0 then return nil end
  local now = tonumber(clock or '') or redis_now_ms()
  local w = windows_at(now)
  local cost, minute_left = prompt + completion, w.minute_end - now
  for _, scope in ipairs(counted) do
    local limits = scope.limits
    local rpm, tpm = tonumber(limits[1] or '0'), tonumber(limits[2] or '0')
    local per_day, per_month = tonumber(limits[3] or '0'), tonumber(limits[4] or '0')
    local u = usage_in(scope.used, w)
    scope.u = u
    local function refused(which, limit, used, reset_ms)
      return {-4, which, limit, math.max(limit - used, 0), reset_ms, rpm,
        math.max(rpm - u.requests, 0), tpm, math.max(tpm - u.tokens, 0), minute_left, scope.who}
    end
    if rpm > 0 and u.requests + 1 > rpm then
      return refused('requests', rpm, u.requests, minute_left)
    end
    if tpm > 0 and u.tokens + cost > tpm then
      return refused('tokens', tpm, u.tokens, minute_left)
    end
    if per_day > 0 and u.day + cost > per_day then
      return refused('tokens_per_day', per_day, u.day, w.day_end - now)
    end
    if per_month > 0 and u.month + cost > per_month then
      return refused('tokens_per_month', per_month, u.month, w.month_end - now)
    end
  end
  local suffixes = {}
  for _, scope in ipairs(counted) do
    local u = scope.u
    redis.call('HSET', scope.used, 'minute', w.minute, 'requests', u.requests + 1,
      'tokens', u.tokens + cost, 'day', w.day, 'day_tokens', u.day + cost,
      'month', w.month, 'month_tokens', u.month + cost)
    -- Kept until its month is over (a day more: the settlement of the month's last chats).
    redis.call('PEXPIRE', scope.used, w.month_end - now + DAY_MS)
    suffixes[#suffixes + 1] = scope.counted
  end
  -- `counted`: the usage hashes the settlement gives back to (lua/settle.lua).
  redis.call('HSET', reservation_key, 'tenant', tenant, 'prompt', prompt,
    'completion', completion, 'minute', w.minute, 'day', w.day, 'month', w.month,
    'counted', table.concat(suffixes, ' '))
  redis.call('PEXPIRE', reservation_key, reservation_ttl_ms)
  return nil
end
