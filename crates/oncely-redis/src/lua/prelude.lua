-- Shared by every oncely script. KEYS[1] is the record; ARGV[1] is the
-- displayed effect key the caller expects there ('' = accept any oncely record).
--
-- Every script runs once per operation, so this code is the hot path: each
-- redis.call and each string built here costs server time per claim.
--
-- Stored numbers are formatted here with '%d' (exact: every one is an
-- integer below 2^53, microseconds since 1970 being about 2^51). Handing Lua
-- numbers to redis.call would also work (Redis prints them like %.17g), but
-- that conversion costs about twice as much per argument.
--
-- Record format 2 (field 'v'): 'v' 'k' 's' 'f' 'c' 'le' 'r' always; 'fp' only
-- with a fingerprint, 'amo' only for an at-most-once step ('1'), 'u' only once
-- updated (else it is 'c'), 'ru' only once completed, released or taken over (else it is
-- 'c' + 'r'), 'o' only once completed. 'le' means something only in progress.
-- Each field written costs server time on every claim, hence the optional
-- ones. Format 1 (every field always written) reads the same way.
local key = KEYS[1]
local ek = ARGV[1]

-- The server's clock in microseconds, as a number and as the digits to
-- store (built from TIME's two strings, without formatting a number).
local function now_us()
  local t = redis.call('TIME')
  return t[1] * 1000000 + t[2], t[1] .. string.sub('00000' .. t[2], -6)
end

local function fmt(n)
  return string.format('%d', n)
end

local function foreign(ty)
  return nil, 'key holds a ' .. ty .. ', not an oncely record; nothing was changed'
end

-- Reads the record's control fields. Returns nil when the key is absent,
-- the record as a table, or nil plus a message when the key holds something
-- oncely did not write (which must never be overwritten).
-- `claim`: a claim usually finds nothing, so it asks EXISTS first (one call
-- when absent) and then reads every control field; the other operations
-- expect a record, so they read it at once, only the fields they use (each
-- one costs), and ask EXISTS only when none is there. A read that fails is a
-- key of another type: TYPE then names it.
local function load(claim)
  if claim and redis.call('EXISTS', key) == 0 then
    return nil
  end
  local v
  if claim then
    v = redis.pcall('HMGET', key, 'v', 'k', 's', 'f', 'c', 'r', 'amo', 'le', 'fp')
  else
    v = redis.pcall('HMGET', key, 'v', 'k', 's', 'f', 'c', 'r')
  end
  if v['err'] then
    return foreign(redis.call('TYPE', key)['ok'])
  end
  if not claim and not v[1] and not v[2] and not v[3] and redis.call('EXISTS', key) == 0 then
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
  if not claim then
    return { s = s, f = f, c = c, r = r }
  end
  -- 'le' is '' in a format 1 record no longer in progress: tonumber gives nil.
  return { s = s, f = f, c = c, r = r, amo = (v[7] == '1'), le = tonumber(v[8]), fp = v[9] or '' }
end
