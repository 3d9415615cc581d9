-- ARGV: 1 effect key, 2 lease (us), 3 retention (us), 4 fingerprint hex or '',
-- 5 at-most-once '1'/'0', 6 sent_at (us since epoch) or '', 7 (optional,
-- rare) a fence the key had that a new record's fence must exceed.
-- KEYS[2], on a single server and only with a sent_at: the horizon watermark
-- of the key's tenant and kind (horizon.lua), read here atomically with the
-- insert. In a cluster it lives in another slot, so the worker reads it after
-- the insert instead (RedisLedger::settle_horizon says why that is enough),
-- and the insert carries the sent_at ('hz') until that check is known to
-- have passed (prelude.lua).
--
-- The decision restates oncely::backend: is_beyond_horizon for an absent
-- key, answer_existing for a record, next_fence for the grant.
local rec, err = load(true)
if err then
  return { 'corrupt', err }
end
local now, now_s = now_us()
local lease, fp, amo = tonumber(ARGV[2]), ARGV[4], ARGV[5]
if not rec then
  if KEYS[2] then
    local w = redis.pcall('GET', KEYS[2])
    if type(w) == 'table' then
      return { 'corrupt', 'horizon key holds a ' .. redis.call('TYPE', KEYS[2])['ok'] .. ', not a watermark', 'horizon' }
    end
    if w then
      local wn = tonumber(w)
      if not wn then
        return { 'corrupt', 'horizon key holds ' .. string.format('%q', string.sub(w, 1, 40)) .. ', not a watermark',
          'horizon' }
      end
      -- is_beyond_horizon: sent_at at or before the watermark. A sent_at
      -- above 2^53 rounds to a number still above every watermark, so the
      -- comparison stays exact.
      if tonumber(ARGV[6]) <= wn then
        return { 'horizon' }
      end
    end
  end
  -- next_fence(None, now) is the clock itself (TIME is far above 1), so the
  -- fence is stored as the digits of now, without formatting a number. A
  -- key whose unchecked record was just removed passes that record's fence
  -- (RedisLedger::recheck), and the new one goes above it.
  local f, f_s = now, now_s
  if ARGV[7] then
    f = next_fence(tonumber(ARGV[7]), now)
    f_s = fmt(f)
  end
  local exp = now + lease
  local exp_s = fmt(exp)
  if fp == '' and amo == '0' then
    redis.call('HSET', key, 'v', '2', 'k', ek, 's', 'in_progress', 'f', f_s, 'c', now_s, 'le', exp_s, 'r', ARGV[3])
  elseif amo == '0' then
    redis.call('HSET', key, 'v', '2', 'k', ek, 's', 'in_progress', 'f', f_s, 'c', now_s, 'le', exp_s, 'r', ARGV[3],
      'fp', fp)
  else
    redis.call('HSET', key, 'v', '2', 'k', ek, 's', 'in_progress', 'f', f_s, 'c', now_s, 'le', exp_s, 'r', ARGV[3],
      'fp', fp, 'amo', amo)
  end
  if ARGV[6] ~= '' and not KEYS[2] then
    -- A cluster claim with a sent_at: its horizon check follows.
    redis.call('HSET', key, 'hz', ARGV[6])
  end
  return { 'acquired', f, exp, now, now, 0 }
end
-- answer_existing: fingerprints first, then the state.
if rec.fp ~= '' and fp ~= '' and rec.fp ~= fp then
  return { 'mismatch' }
end
if rec.s == 'completed' then
  return { 'record', now, redis.call('HGETALL', key) }
end
if rec.s == 'in_progress' then
  -- lease_live: expiry is inclusive.
  if rec.le and rec.le > now then
    return { 'in_progress', rec.f, rec.le, rec.c, now }
  end
  if rec.amo then
    -- An attempted at-most-once step: never taken over, never expires.
    return { 'record', now, redis.call('HGETALL', key) }
  end
  if rec.hz then
    -- An expired lease whose claim may never have finished its horizon
    -- check: not taken over here. The worker checks again, then removes
    -- the record or clears its mark, each fenced on what this returns.
    return { 'unchecked', rec.f, rec.c, rec.hz }
  end
end
-- Released, or an expired lease: take it over.
local f, exp = next_fence(rec.f, now), now + lease
-- A record never completed nor released has no 'ru': its retention ends at
-- 'c' + 'r' of the first claim, which the new 'r' must not move.
redis.call('HSETNX', key, 'ru', fmt(rec.c + rec.r))
if rec.fp == '' and fp ~= '' then
  redis.call('HSET', key, 's', 'in_progress', 'f', fmt(f), 'amo', amo, 'u', now_s, 'le', fmt(exp), 'r', ARGV[3], 'fp', fp)
else
  redis.call('HSET', key, 's', 'in_progress', 'f', fmt(f), 'amo', amo, 'u', now_s, 'le', fmt(exp), 'r', ARGV[3])
end
-- A released record written by an earlier version of this crate carried a
-- TTL (records carry none now); a lease must never vanish.
redis.call('PERSIST', key)
return { 'acquired', f, exp, rec.c, now, 1 }
