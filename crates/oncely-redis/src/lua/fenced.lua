-- A lease holder's writes, each fenced on its record, one answer each in
-- the order given: complete, release and renew of one lease, the horizon
-- check's take-back and clear, and Ledger::complete_many (one call per
-- slot, one server: one call), every record answered exactly as a call of
-- its own would be.
--
-- KEYS: the n records. ARGV: 1 n, 2 operation ('complete', 'release',
-- 'renew', 'undo', 'checked'), 3 the writing ledger's waiter mark, 4 its
-- channel (prelude.lua, wake); then three per record: its effect key, its
-- fence, and the outcome bytes / unused / extension (us) / creation time
-- (us) / creation time (us); then, for 'undo' and 'checked' (one record),
-- the record's 'hz'.
--
-- The fence is compared as a number: a lease's fence above 2^53 rounds to
-- a number at or above 2^53, and load() refuses a record whose fence is
-- there, so none can match by rounding.
local function fenced(fence, op, arg, hz, own, channel)
  local rec, err = load(false)
  if err then
    return { 'corrupt', err }
  end
  if not rec or rec.s ~= 'in_progress' or rec.f ~= tonumber(fence) then
    return { 'lost' }
  end
  if op == 'undo' or op == 'checked' then
    -- The record a claim inserted, found beyond the horizon by that claim
    -- ('undo': deleted) or by a later claimant's second check (beyond it:
    -- 'undo'; within: 'checked', the mark cleared): only if it is still
    -- exactly what that claim wrote (in progress, its fence, its creation
    -- time, its mark), never a takeover's record nor one its holder has
    -- written since (a renewal while the second check ran).
    if rec.c ~= tonumber(arg) or rec.hz ~= hz then
      return { 'lost' }
    end
    if op == 'undo' then
      redis.call('DEL', key)
      -- Its waiters find the key absent now.
      wake(rec, own, channel)
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
    local exp = now + tonumber(arg)
    redis.call('HSET', key, 'le', fmt(exp))
    return { 'ok', now, exp }
  end
  local ru = now + rec.r
  -- No TTL: only prune deletes a record, so that every deletion raises the
  -- horizon first (prune.lua).
  if op == 'complete' then
    redis.call('HSET', key, 's', 'completed', 'o', arg, 'u', now_s, 'ru', fmt(ru))
  else
    redis.call('HSET', key, 's', 'released', 'u', now_s, 'ru', fmt(ru))
  end
  wake(rec, own, channel)
  return { 'ok', now, ru }
end

local n, op, own, channel = tonumber(ARGV[1]), ARGV[2], ARGV[3], ARGV[4]
local replies = {}
for i = 1, n do
  key, ek = KEYS[i], ARGV[2 + 3 * i]
  replies[i] = fenced(ARGV[3 + 3 * i], op, ARGV[4 + 3 * i], ARGV[5 + 3 * n], own, channel)
end
return replies
