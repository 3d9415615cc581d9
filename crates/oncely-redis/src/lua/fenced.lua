-- ARGV: 1 effect key, 2 fence, 3 operation ('complete', 'release', 'renew'),
-- 4 outcome bytes / unused / extension (us), 5 expiry grace (us).
local rec, err = load(false)
if err then
  return { 'corrupt', err }
end
if not rec or rec.s ~= 'in_progress' or rec.f ~= tonumber(ARGV[2]) then
  return { 'lost' }
end
local now, now_s = now_us()
local op = ARGV[3]
if op == 'renew' then
  local exp = now + tonumber(ARGV[4])
  redis.call('HSET', key, 'le', fmt(exp))
  return { 'ok', now, exp }
end
local ru = now + rec.r
if op == 'complete' then
  redis.call('HSET', key, 's', 'completed', 'o', ARGV[4], 'u', now_s, 'ru', fmt(ru))
else
  redis.call('HSET', key, 's', 'released', 'u', now_s, 'ru', fmt(ru))
end
-- Redis deletes the record by itself once retention (plus the grace that
-- leaves prune something to do) has passed.
redis.call('PEXPIRE', key, fmt(math.ceil((rec.r + tonumber(ARGV[5])) / 1000)))
return { 'ok', now, ru }
