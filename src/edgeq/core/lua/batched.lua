-- The end of every batched script (core/batching.py combined): runs the function `call`,
-- which core/batching.py wraps around a script's body just before this file, once per call
-- of the batch, each over its own slice of KEYS and ARGV.
--
-- ARGV begins with the calls' shapes: how many calls, then each one's key count and argument
-- count. A call that raises replies with its error and the next call runs, as separate
-- scripts would; a call that returns nothing replies nil (false), so the replies keep their
-- places.
local calls = tonumber(ARGV[1])
local replies, k, a = {}, 0, 1 + 2 * calls
for i = 1, calls do
  local nk, na = tonumber(ARGV[2 * i]), tonumber(ARGV[2 * i + 1])
  local ok, reply = pcall(call, {unpack(KEYS, k + 1, k + nk)}, {unpack(ARGV, a + 1, a + na)})
  if not ok and type(reply) ~= 'table' then reply = redis.error_reply(tostring(reply)) end
  replies[i] = reply or false
  k, a = k + nk, a + na
end
return replies
