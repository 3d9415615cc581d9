-- ARGV: 1 effect key, 2 lease (us), 3 retention (us), 4 fingerprint hex or '',
-- 5 at-most-once '1'/'0', 6 sent_at (us since epoch) or ''.
local rec, err = load(true)
if err then
  return { 'corrupt', err }
end
local now, now_s = now_us()
local lease, ret, fp, amo = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], ARGV[5]
if not rec then
  if ARGV[6] ~= '' and tonumber(ARGV[6]) + ret < now then
    return { 'horizon' }
  end
  local exp = now + lease
  local exp_s = fmt(exp)
  if fp == '' and amo == '0' then
    redis.call('HSET', key, 'v', '2', 'k', ek, 's', 'in_progress', 'f', '1', 'c', now_s, 'le', exp_s, 'r', ARGV[3])
  elseif amo == '0' then
    redis.call('HSET', key, 'v', '2', 'k', ek, 's', 'in_progress', 'f', '1', 'c', now_s, 'le', exp_s, 'r', ARGV[3],
      'fp', fp)
  else
    redis.call('HSET', key, 'v', '2', 'k', ek, 's', 'in_progress', 'f', '1', 'c', now_s, 'le', exp_s, 'r', ARGV[3],
      'fp', fp, 'amo', amo)
  end
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
-- A record never completed nor released has no 'ru': its retention ends at
-- 'c' + 'r' of the first claim, which the new 'r' must not move.
redis.call('HSETNX', key, 'ru', fmt(rec.c + rec.r))
if rec.fp == '' and fp ~= '' then
  redis.call('HSET', key, 's', 'in_progress', 'f', fmt(f), 'amo', amo, 'u', now_s, 'le', fmt(exp), 'r', ARGV[3], 'fp', fp)
else
  redis.call('HSET', key, 's', 'in_progress', 'f', fmt(f), 'amo', amo, 'u', now_s, 'le', fmt(exp), 'r', ARGV[3])
end
-- A released record carried a TTL; a lease must never vanish.
redis.call('PERSIST', key)
return { 'acquired', f, exp, rec.c, now, 1 }
