-- ARGV: 1 effect key, 2 fence, 3 operation ('complete', 'release', 'renew',
-- 'undo', 'checked'), 4 outcome bytes / unused / extension (us) / creation
-- time (us) / creation time (us), 5 ('undo', 'checked') the record's 'hz'.
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
if op == 'undo' or op == 'checked' then
  -- The record a claim inserted, found beyond the horizon by that claim
  -- ('undo': deleted) or by a later claimant's second check (beyond it:
  -- 'undo'; within: 'checked', the mark cleared): only if it is still
  -- exactly what that claim wrote (in progress, its fence, its creation
  -- time, its mark), never a takeover's record nor one its holder has
  -- written since (a renewal while the second check ran).
  if rec.c ~= tonumber(ARGV[4]) or rec.hz ~= ARGV[5] then
    return { 'lost' }
  end
  if op == 'undo' then
    redis.call('DEL', key)
  else
    redis.call('HDEL', key, 'hz')
  end
  return { 'ok' }
end
-- A lease holder writes only after its claim returned, so that claim's
-- horizon check passed: the mark goes with its first write.
if rec.hz then
  redis.call('HDEL', key, 'hz')
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
