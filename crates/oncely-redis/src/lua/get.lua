-- ARGV: 1 effect key ('' when listing: the caller checks the stored key).
local rec, err = load(false)
if err then
  return { 'corrupt', err }
end
if not rec then
  return { 'none' }
end
return { 'record', now_us(), redis.call('HGETALL', key) }
