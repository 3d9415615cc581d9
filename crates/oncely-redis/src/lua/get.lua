-- KEYS[1] the record; ARGV[1]: the effect key expected there ('' when
-- listing: the caller checks the stored key).
key, ek = KEYS[1], ARGV[1]
local rec, err = load(true)
if err then
  return { 'corrupt', err }
end
if not rec then
  return { 'none' }
end
return { 'record', now_us(), rec.fields }
