-- KEYS[1]: the horizon watermark of one tenant and kind, the decimal
-- microseconds of the newest creation time among the records prune deleted
-- there. ARGV[1]: the newest creation time prune is about to delete.
-- Raises the watermark to it, never lowers it (prunes may run concurrently),
-- and returns the watermark now in force. No TTL: a watermark is kept for the
-- life of the ledger (one small key per tenant and kind).
local w = redis.pcall('GET', KEYS[1])
if type(w) == 'table' then
  return { 'corrupt', 'horizon key holds a ' .. redis.call('TYPE', KEYS[1])['ok'] .. ', not a watermark' }
end
local new = tonumber(ARGV[1])
if w then
  local old = tonumber(w)
  if not old then
    return { 'corrupt', 'horizon key holds ' .. string.format('%q', string.sub(w, 1, 40)) .. ', not a watermark' }
  end
  if old >= new then
    return { 'ok', old }
  end
end
redis.call('SET', KEYS[1], ARGV[1])
return { 'ok', new }
