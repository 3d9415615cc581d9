-- ARGV: 1 '' (any oncely record). Deletes a completed or released record
-- whose retention has passed; never a lease or an abandoned step.
local rec, err = load(false)
if err or not rec or rec.s == 'in_progress' then
  return 0
end
local ru = tonumber(redis.call('HGET', key, 'ru'))
if ru and ru <= now_us() then
  redis.call('DEL', key)
  return 1
end
return 0
