-- Shared functions (core/scripts.py prepends this file) of the scripts that check a tenant's
-- caps on files and batches and take them in the same step (resources/batches/store.py): what the
-- tenant keeps, counted from its indexes. A file that expired, or a batch that ended, is
-- dropped from its index here, so the counts need no cleanup when keys expire.

-- The tenant's files (uploads and batch output) and their bytes. `index`: its sorted set of
-- file ids; `prefix`: what a file's key starts with (core/keys.py file_key).
local function file_usage(index, prefix)
  local count, bytes = 0, 0
  for _, id in ipairs(redis.call('ZRANGE', index, 0, -1)) do
    local file = redis.call('HMGET', prefix .. id, 'tenant', 'bytes')
    if file[1] then
      count = count + 1
      bytes = bytes + tonumber(file[2] or '0')
    else
      redis.call('ZREM', index, id)
    end
  end
  return count, bytes
end

-- A batch whose record is in one of these statuses still holds its slot and its lines.
local ACTIVE = {in_progress = true, cancelling = true, finalizing = true, validating = true}

-- The tenant's batches not finished yet and the bytes of their validated lines. `active`:
-- its set of batch ids; `prefix`: what a batch's key starts with (core/keys.py batch_key).
local function batch_usage(active, prefix)
  local count, bytes = 0, 0
  for _, id in ipairs(redis.call('SMEMBERS', active)) do
    local batch = redis.call('HMGET', prefix .. id, 'status', 'input_bytes')
    if batch[1] and ACTIVE[batch[1]] then
      count = count + 1
      bytes = bytes + tonumber(batch[2] or '0')
    else
      redis.call('SREM', active, id)
    end
  end
  return count, bytes
end
