-- Claims records, one answer each, in the order given: Ledger::claim is a
-- call with one record, Ledger::claim_many one call per slot (one server:
-- one call), every record answered exactly as a call of its own would be.
-- A key listed twice is claimed twice, one after the other: the second
-- finds the first's lease, as a concurrent duplicate would.
--
-- KEYS: the n records, then the horizon watermarks they name (below).
-- ARGV: 1 n, 2 lease (us), 3 retention (us), 4 fingerprint hex or '', 5
-- at-most-once '1'/'0', 6 sent_at (us since epoch) or '', 7 the waiter's
-- mark or '' (see below), 8 touch '1' or '' (see below); then three per
-- record: its effect key, the index
-- among the watermarks of its horizon key or '' (one server with a sent_at
-- only), and a fence the key had that a new record's fence must exceed or ''
-- (rare: RedisLedger::recheck removed the key's record).
--
-- The horizon watermark of a record's tenant and kind (horizon.lua) is read
-- here atomically with the insert on a single server. In a cluster it lives
-- in another slot, so the worker reads it after the insert instead
-- (RedisLedger::settle_horizon says why that is enough), and the insert
-- carries the sent_at ('hz') until that check is known to have passed
-- (prelude.lua).
--
-- The waiter's mark: a claim that would wait for a record in progress
-- (OnInProgress::Wait) marks it ('w') with the mark of its ledger, or '*'
-- once waiters of two ledgers did, so that its completion or release
-- wakes them (prelude.lua, wake) and a completion nobody waits for costs
-- no message.
--
-- Touch: the ledger waits for replicas after each write
-- (RedisLedgerOptions::wait_replicas) and answers a duplicate with a
-- completed or abandoned record only once they have it. The record may
-- have been written by another connection, whose writes a WAIT on this
-- one need not count (Redis 7.2 and later count a connection's last
-- command that propagated something; 7.0 moved the mark on every command),
-- so the claim rewrites its 'k' to the value it holds: nothing changes,
-- but the write goes into the replication stream after the record's own
-- writes, and a replica that acknowledges this connection's writes has
-- the record.
--
-- The decision restates oncely::backend: is_beyond_horizon for an absent
-- key, answer_existing for a record, next_fence for the grant.
local function claim(hkey, lease, retention, fp, amo, sent, waiter, touch, floor)
  local rec, err = load(true)
  if err then
    return { 'corrupt', err }
  end
  local now, now_s = now_us()
  if not rec then
    if hkey then
      local w = redis.pcall('GET', hkey)
      if type(w) == 'table' then
        return { 'corrupt', 'horizon key holds a ' .. redis.call('TYPE', hkey)['ok'] .. ', not a watermark', 'horizon' }
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
        if tonumber(sent) <= wn then
          return { 'horizon' }
        end
      end
    end
    -- next_fence(None, now) is the clock itself (TIME is far above 1), so the
    -- fence is stored as the digits of now, without formatting a number. A
    -- key whose unchecked record was just removed passes that record's fence
    -- (RedisLedger::recheck), and the new one goes above it.
    local f, f_s = now, now_s
    if floor ~= '' then
      f = next_fence(tonumber(floor), now)
      f_s = fmt(f)
    end
    local exp = now + lease
    local exp_s = fmt(exp)
    if fp == '' and amo == '0' then
      redis.call('HSET', key, 'v', '2', 'k', ek, 's', 'in_progress', 'f', f_s, 'c', now_s, 'le', exp_s, 'r', retention)
    elseif amo == '0' then
      redis.call('HSET', key, 'v', '2', 'k', ek, 's', 'in_progress', 'f', f_s, 'c', now_s, 'le', exp_s, 'r', retention,
        'fp', fp)
    else
      redis.call('HSET', key, 'v', '2', 'k', ek, 's', 'in_progress', 'f', f_s, 'c', now_s, 'le', exp_s, 'r', retention,
        'fp', fp, 'amo', amo)
    end
    if sent ~= '' and not hkey then
      -- A cluster claim with a sent_at: its horizon check follows.
      redis.call('HSET', key, 'hz', sent)
    end
    return { 'acquired', f, exp, now, now, 0 }
  end
  -- answer_existing: fingerprints first, then the state.
  if rec.fp ~= '' and fp ~= '' and rec.fp ~= fp then
    return { 'mismatch' }
  end
  if rec.s == 'completed' then
    if touch ~= '' then
      redis.call('HSET', key, 'k', rec.k)
    end
    return { 'record', now, rec.fields }
  end
  if rec.s == 'in_progress' then
    -- lease_live: expiry is inclusive.
    if rec.le and rec.le > now then
      -- A second waiter of the same ledger writes nothing.
      if waiter ~= '' and rec.w ~= waiter and rec.w ~= '*' then
        redis.call('HSET', key, 'w', rec.w and '*' or waiter)
      end
      return { 'in_progress', rec.f, rec.le, rec.c, now }
    end
    if rec.amo then
      -- An attempted at-most-once step: never taken over, never expires.
      if touch ~= '' then
        redis.call('HSET', key, 'k', rec.k)
      end
      return { 'record', now, rec.fields }
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
    redis.call('HSET', key, 's', 'in_progress', 'f', fmt(f), 'amo', amo, 'u', now_s, 'le', fmt(exp), 'r', retention,
      'fp', fp)
  else
    redis.call('HSET', key, 's', 'in_progress', 'f', fmt(f), 'amo', amo, 'u', now_s, 'le', fmt(exp), 'r', retention)
  end
  -- A released record written by an earlier version of this crate carried a
  -- TTL (records carry none now); a lease must never vanish.
  redis.call('PERSIST', key)
  return { 'acquired', f, exp, rec.c, now, 1 }
end

local n = tonumber(ARGV[1])
local lease, retention, fp, amo, sent, waiter, touch = tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5], ARGV[6],
  ARGV[7], ARGV[8]
local replies = {}
for i = 1, n do
  key, ek = KEYS[i], ARGV[6 + 3 * i]
  local h = ARGV[7 + 3 * i]
  replies[i] = claim(h ~= '' and KEYS[n + tonumber(h)] or nil, lease, retention, fp, amo, sent, waiter, touch,
    ARGV[8 + 3 * i])
end
return replies
