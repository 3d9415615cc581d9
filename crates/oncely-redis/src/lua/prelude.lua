-- Shared by every oncely record script. `key` is the record's Redis key and
-- `ek` the displayed effect key the caller expects there ('' = accept any
-- oncely record): the script's driver (its last lines) sets both before each
-- record it handles, KEYS[1] and ARGV[1] for the scripts on one record, one
-- after the other for claim.lua and fenced.lua, which take several records
-- of one slot in one call (Ledger::claim_many, Ledger::complete_many).
--
-- Every script runs once per operation, so this code is the hot path: each
-- redis.call and each string built here costs server time per claim.
--
-- The clock is the server's TIME, read inside the script: Redis runs a script
-- atomically, with no lock wait between reading the clock and writing, so a
-- lease is measured from the moment its grant is written (the rule of the
-- `Ledger` contract; `oncely::backend::needs_refresh` can never apply here).
--
-- Stored numbers are formatted here with '%d' (exact: every one is an
-- integer below 2^53, microseconds since 1970 being about 2^51, and so is
-- every fence, see next_fence). Handing Lua numbers to redis.call would also
-- work (Redis prints them like %.17g), but that conversion costs about twice
-- as much per argument.
--
-- Record format 2 (field 'v'): 'v' 'k' 's' 'f' 'c' 'le' 'r' always; 'fp' only
-- with a fingerprint, 'amo' only for an at-most-once step ('1'), 'u' only once
-- updated (else it is 'c'), 'ru' only once completed, released or taken over (else it is
-- 'c' + 'r'), 'o' only once completed. 'le' means something only in progress.
-- 'hz' (the decimal microseconds of the claim's sent_at) only on a record
-- that a cluster claim with a sent_at inserted and whose lease holder has
-- not written since: that claim's horizon check runs after the insert and
-- may never have finished, so whoever would take the record over checks
-- again first (claim.lua, RedisLedger::recheck). Complete, release and renew
-- delete it. A missing 'hz' reads as none (every other record, format 1
-- included), so the format is still 2.
-- 'w' (a waiter's mark, see claim.lua) only once a claim that would wait
-- found the record in progress: who to wake when it completes or is
-- released. Like 'hz', a record without it reads as it always did, and
-- earlier versions of this crate ignore it, so the format is still 2.
-- Each field written costs server time on every claim, hence the optional
-- ones. Format 1 (every field always written) reads the same way. Fences of
-- records written before fences followed the clock are small integers; the
-- next grant is still above them (next_fence).
local key, ek

-- The server's clock in microseconds, as a number and as the digits to
-- store (built from TIME's two strings, without formatting a number).
local function now_us()
  local t = redis.call('TIME')
  return t[1] * 1000000 + t[2], t[1] .. string.sub('00000' .. t[2], -6)
end

local function fmt(n)
  return string.format('%d', n)
end

-- Restates oncely::backend::next_fence for a takeover: the clock's
-- microseconds at this write, or the previous fence + 1 if that is higher.
-- The clock carries the order across prunes (a pruned record's fences were
-- granted at least its retention ago), previous + 1 across a clock that
-- stands still. A claim of an absent key uses the clock alone (see claim.lua).
-- Both stay below 2^53, so Lua's numbers hold them exactly.
local function next_fence(previous, now)
  if previous + 1 > now then
    return previous + 1
  end
  return now
end

local function foreign(ty)
  return nil, 'key holds a ' .. ty .. ', not an oncely record; nothing was changed'
end

-- Reads the record. Returns nil when the key is absent, the record as a
-- table, or nil plus a message when the key holds something oncely did not
-- write (which must never be overwritten).
-- `full` (claim, get): every field, in the order of FIELDS in reply.rs,
-- whose unit test holds this line to it: the HMGET reply itself is the
-- record the worker decodes (rec.fields), so a duplicate costs no HGETALL
-- and no second conversion of the record. A claim usually finds nothing,
-- so it asks EXISTS first (one call when absent). The lease holder's writes
-- and prune expect a record, so they read at once only the fields they use
-- (each one costs), and ask EXISTS only when none is there. A read that
-- fails is a key of another type: TYPE then names it.
local function load(full)
  if full and redis.call('EXISTS', key) == 0 then
    return nil
  end
  local v
  if full then
    v = redis.pcall('HMGET', key, 'v', 'k', 's', 'f', 'c', 'r', 'hz', 'w', 'amo', 'le', 'fp', 'o', 'u', 'ru')
  else
    v = redis.pcall('HMGET', key, 'v', 'k', 's', 'f', 'c', 'r', 'hz', 'w')
  end
  if v['err'] then
    return foreign(redis.call('TYPE', key)['ok'])
  end
  if not full and not v[1] and not v[2] and not v[3] and redis.call('EXISTS', key) == 0 then
    return nil
  end
  if (v[1] ~= '2' and v[1] ~= '1') or not v[2] or (ek ~= '' and v[2] ~= ek) then
    return nil, 'hash without oncely record fields at this key; nothing was changed'
  end
  local s = v[3]
  if s ~= 'in_progress' and s ~= 'completed' and s ~= 'released' then
    return nil, 'record has an unknown state; nothing was changed'
  end
  local f, c, r = tonumber(v[4]), tonumber(v[5]), tonumber(v[6])
  if not f or not c or not r then
    return nil, 'record lacks its fence, creation time or retention; nothing was changed'
  end
  -- Fences follow the clock in microseconds and reach 2^53 in the year
  -- 2255; above it Lua's numbers are no longer exact (f + 1 == f), so a
  -- fence up there was not written by oncely and is never used.
  if f >= 9007199254740992 then
    return nil, 'record fence is beyond 2^53; nothing was changed'
  end
  -- 'hz' is kept as stored (its digits are compared, never rounded).
  local hz = v[7]
  if hz and not tonumber(hz) then
    return nil, 'record has a malformed horizon mark; nothing was changed'
  end
  local rec = { s = s, f = f, c = c, r = r, k = v[2], hz = hz, w = v[8] or nil }
  if full then
    -- 'le' is '' in a format 1 record no longer in progress: tonumber gives nil.
    rec.amo, rec.le, rec.fp, rec.fields = (v[9] == '1'), tonumber(v[10]), v[11] or '', v
  end
  return rec
end

-- Wakes the waiters of the record (Ledger::watch) after a write that ends
-- or hands over its lease, if a claim that would wait marked it ('w') and
-- not only waiters of the ledger writing now (`own`: its mark), which that
-- ledger wakes in its own process. The message goes to the channel of the
-- ledger's prefix and database (`channel`), with the effect key. pcall: a
-- user who may not publish (an ACL without the channel) still writes; its
-- waiters elsewhere then wait for their fallback, never for a wrong answer.
local function wake(rec, own, channel)
  if rec.w and rec.w ~= own then
    redis.pcall('PUBLISH', channel, rec.k)
  end
end
