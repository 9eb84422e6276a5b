-- Put a batch's next line in flight if the lines of all batches together leave room for it
-- (resources/batches/runner.py; EDGEQ_GATEWAY_BATCH_QUEUED_MAX). One step, so runners in any
-- number of gateway processes never hold more lines queued or running than the limit.
--
-- KEYS: the queue's batch lines, the batch's in-flight lines, the batch's record. ARGV: the
-- limit, the line's member in the batch lines (`<batch_id>:<line>`), the line number.
-- Returns 1 when the line is in flight (the record's next_line moved past it), 0 at the limit.
if redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('SADD', KEYS[1], ARGV[2])
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('HSET', KEYS[3], 'next_line', tonumber(ARGV[3]) + 1)
return 1
