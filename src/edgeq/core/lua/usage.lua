-- What one tenant keeps against its caps (edgeq batch usage; needs tenant_usage.lua).
-- KEYS: the tenant's file index, its active batches; ARGV: the file-key and batch-key
-- prefixes. Returns {files, their bytes, active batches, their lines' bytes}.
local files, file_bytes = file_usage(KEYS[1], ARGV[1])
local batches, batch_bytes = batch_usage(KEYS[2], ARGV[2])
return {files, file_bytes, batches, batch_bytes}
