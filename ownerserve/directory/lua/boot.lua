-- boot token: set once per Redis dataset; a different or missing token after a reconnect means
-- the server lost its data (restart without persistence). KEYS: boot. ARGV: P, token
redis.call('SET', KEYS[1], ARGV[2], 'NX')
return redis.call('GET', KEYS[1])
