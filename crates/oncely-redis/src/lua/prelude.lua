-- Shared by every oncely script. KEYS[1] is the record; ARGV[1] is the
-- displayed effect key the caller expects there ('' = accept any oncely record).
--
-- Every script runs once per operation, so this code is the hot path: each
-- redis.call and each string built here costs server time per claim.
--
-- Numbers are handed to redis.call as Lua numbers: Redis writes them like
-- printf's %.17g, which prints every integer below 10^17 without an exponent.
-- Every stored number is an integer below 2^53 (microseconds since 1970 are
-- about 2^51), so no string.format is needed to store one.
--
-- Record format 2 (field 'v'): 'v' 'k' 's' 'f' 'c' 'le' 'r' always; 'fp' only
-- with a fingerprint, 'amo' only for an at-most-once step ('1'), 'u' only once
-- updated (else it is 'c'), 'ru' only once completed or released (else it is
-- 'c' + 'r'), 'o' only once completed. 'le' means something only in progress.
-- Each field written costs server time on every claim, hence the optional
-- ones. Format 1 (every field always written) reads the same way.
local key = KEYS[1]
local ek = ARGV[1]

local function now_us()
  local t = redis.call('TIME')
  return t[1] * 1000000 + t[2]
end

local function foreign(ty)
  return nil, 'key holds a ' .. ty .. ', not an oncely record; nothing was changed'
end

-- Reads the record's control fields. Returns nil when the key is absent,
-- the record as a table, or nil plus a message when the key holds something
-- oncely did not write (which must never be overwritten).
-- `claim`: a claim usually finds nothing, so it asks TYPE first (one call
-- when absent) and then reads every control field; the other operations
-- expect a record, so they read it at once, only the fields they use (each
-- one costs), and look at the type only when that fails.
local function load(claim)
  local v
  if claim then
    local ty = redis.call('TYPE', key)['ok']
    if ty == 'none' then
      return nil
    end
    if ty ~= 'hash' then
      return foreign(ty)
    end
    v = redis.call('HMGET', key, 'v', 'k', 's', 'f', 'c', 'r', 'amo', 'le', 'fp')
  else
    v = redis.pcall('HMGET', key, 'v', 'k', 's', 'f', 'c', 'r')
    if v['err'] then
      return foreign(redis.call('TYPE', key)['ok'])
    end
    if not v[1] and not v[2] and not v[3] and redis.call('EXISTS', key) == 0 then
      return nil
    end
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
