-- ARGV: 1 effect key, 2 fence, 3 operation ('complete', 'release', 'renew',
-- 'undo'), 4 outcome bytes / unused / extension (us) / creation time (us).
--
-- The fence is compared as a number: a lease's fence above 2^53 rounds to
-- a number at or above 2^53, and load() refuses a record whose fence is
-- there, so none can match by rounding.
local rec, err = load(false)
if err then
  return { 'corrupt', err }
end
if not rec or rec.s ~= 'in_progress' or rec.f ~= tonumber(ARGV[2]) then
  return { 'lost' }
end
local op = ARGV[3]
if op == 'undo' then
  -- A claim that inserted this record and then found it beyond the horizon
  -- takes it back: only if it is still exactly what that claim wrote (in
  -- progress, its fence, its creation time), never a takeover's record.
  if rec.c ~= tonumber(ARGV[4]) then
    return { 'lost' }
  end
  redis.call('DEL', key)
  return { 'ok' }
end
local now, now_s = now_us()
if op == 'renew' then
  local exp = now + tonumber(ARGV[4])
  redis.call('HSET', key, 'le', fmt(exp))
  return { 'ok', now, exp }
end
local ru = now + rec.r
-- No TTL: only prune deletes a record, so that every deletion raises the
-- horizon first (prune.lua).
if op == 'complete' then
  redis.call('HSET', key, 's', 'completed', 'o', ARGV[4], 'u', now_s, 'ru', fmt(ru))
else
  redis.call('HSET', key, 's', 'released', 'u', now_s, 'ru', fmt(ru))
end
return { 'ok', now, ru }
