-- Start a validated batch if its tenant's caps allow it, in one step with the check
-- (resources/batches/store.py create_batch; needs tenant_usage.lua). Its lines are already in its
-- input list (pushed before: a refused batch's list is deleted by the caller).
--
-- KEYS: the tenant's file index, its active batches, the batch's key, the queue's active
-- batches, the tenant's batch index. ARGV: the file-key and batch-key prefixes, the batch id,
-- created (ms), the most active batches, the most files, the most bytes, the bytes of its
-- lines, then the record's field/value pairs. Returns {1} when started, {-3, active batches}
-- at the batch cap, {-1, files kept} when the tenant keeps more files than its cap (a batch
-- writes up to two more), {-2, bytes kept} when its lines would pass the byte cap.
local max_batches, max_files, max_bytes = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local active, batch_bytes = batch_usage(KEYS[2], ARGV[2])
if active >= max_batches then return {-3, active} end
local files, file_bytes = file_usage(KEYS[1], ARGV[1])
if files > max_files then return {-1, files} end
local kept = file_bytes + batch_bytes
if kept + tonumber(ARGV[8]) > max_bytes then return {-2, kept} end
redis.call('HSET', KEYS[3], unpack(ARGV, 9))
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('SADD', KEYS[4], ARGV[3])
redis.call('ZADD', KEYS[5], ARGV[4], ARGV[3])
return {1}
