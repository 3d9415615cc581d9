-- KEYS[1] the record. ARGV: 1 the effect key expected there ('' in 'check'
-- mode: any oncely record), 2 'check' or 'delete', 3 ('delete') the
-- watermark that prune has raised the record's tenant and kind to.
--
-- Prune is the only path that deletes a record, in two steps around the
-- raise of the horizon (horizon.lua): 'check' reports a record that is due,
-- with its key and creation time; 'delete' deletes it if it is still due
-- and was created at or before the raised watermark. Due restates the rule
-- of oncely::Ledger::prune: completed or released, and past its retention;
-- never a lease, never an abandoned step.
key, ek = KEYS[1], ARGV[1]
local rec, err = load(false)
if err or not rec or rec.s == 'in_progress' then
  return { 'keep' }
end
local check = ARGV[2] == 'check'
if check then
  -- Records written by earlier versions of this crate carry a TTL, which
  -- would delete them without raising the horizon: the first prune that
  -- sees one makes it permanent, like every record written now.
  redis.call('PERSIST', key)
end
local ru = tonumber(redis.call('HGET', key, 'ru'))
if not ru or ru > now_us() then
  return { 'keep' }
end
if check then
  return { 'due', rec.k, rec.c }
end
if rec.c > tonumber(ARGV[3]) then
  return { 'keep' }
end
redis.call('DEL', key)
return { 'deleted' }
