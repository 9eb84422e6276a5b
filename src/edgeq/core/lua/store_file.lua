-- Store a file of a tenant if its caps allow it, in one step with the check, so concurrent
-- uploads (from any number of gateway processes) never keep more than the caps
-- (resources/batches/store.py create_file; needs tenant_usage.lua).
--
-- KEYS: the tenant's file index, its active batches, the file's key. ARGV: the file-key and
-- batch-key prefixes, the file id, created (s), the record (JSON), the tenant, the content,
-- the retention (ms), the most files (0: not checked, a batch's output), the most bytes (0: not
-- checked). Returns {1} when stored, {-1, files kept} at the file cap, {-2, bytes kept} when
-- the content would pass the byte cap (the tenant's files and its running batches' lines).
local max_files, max_bytes = tonumber(ARGV[9]), tonumber(ARGV[10])
local size = string.len(ARGV[7])
if max_files > 0 or max_bytes > 0 then
  local files, file_bytes = file_usage(KEYS[1], ARGV[1])
  if max_files > 0 and files >= max_files then return {-1, files} end
  local _, batch_bytes = batch_usage(KEYS[2], ARGV[2])
  local kept = file_bytes + batch_bytes
  if max_bytes > 0 and kept + size > max_bytes then return {-2, kept} end
end
redis.call('HSET', KEYS[3], 'record', ARGV[5], 'tenant', ARGV[6], 'content', ARGV[7],
  'bytes', size)
redis.call('PEXPIRE', KEYS[3], ARGV[8])
redis.call('ZADD', KEYS[1], ARGV[4], ARGV[3])
return {1}
