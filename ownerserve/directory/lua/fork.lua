-- fork refs: the sessions sharing an artifact copy-on-write. KEYS: f:<id>. ARGV: P, 'add'|'drop', sid
if ARGV[2] == 'add' then
  redis.call('SADD', KEYS[1], ARGV[3])
else
  redis.call('SREM', KEYS[1], ARGV[3])
end
return redis.call('SCARD', KEYS[1])
