-- ARGV: 1 effect key, 2 lease (us), 3 retention (us), 4 fingerprint hex or '',
-- 5 at-most-once '1'/'0', 6 sent_at (us since epoch) or ''.
local rec, err = load(true)
if err then
  return { 'corrupt', err }
end
local now = now_us()
local lease, ret, fp, amo = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], ARGV[5]
if not rec then
  if ARGV[6] ~= '' and tonumber(ARGV[6]) + ret < now then
    return { 'horizon' }
  end
  local exp = now + lease
  redis.call('HSET', key, 'v', '1', 'k', ek, 's', 'in_progress', 'f', '1', 'fp', fp, 'amo', amo,
    'c', fmt(now), 'u', fmt(now), 'le', fmt(exp), 'ru', fmt(now + ret), 'r', fmt(ret))
  return { 'acquired', 1, exp, now, now, 0 }
end
if rec.fp ~= '' and fp ~= '' and rec.fp ~= fp then
  return { 'mismatch' }
end
if rec.s == 'completed' then
  return { 'record', now, redis.call('HGETALL', key) }
end
if rec.s == 'in_progress' then
  if rec.le and rec.le > now then
    return { 'in_progress', rec.f, rec.le, rec.c, now }
  end
  if rec.amo then
    -- An attempted at-most-once step: never taken over, never expires.
    return { 'record', now, redis.call('HGETALL', key) }
  end
end
local f, exp = rec.f + 1, now + lease
redis.call('HSET', key, 's', 'in_progress', 'f', fmt(f), 'amo', amo, 'u', fmt(now), 'le', fmt(exp), 'r', fmt(ret))
if rec.fp == '' and fp ~= '' then
  redis.call('HSET', key, 'fp', fp)
end
-- A released record carried a TTL; a lease must never vanish.
redis.call('PERSIST', key)
return { 'acquired', f, exp, rec.c, now, 1 }
