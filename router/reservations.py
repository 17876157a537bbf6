"""In-flight reservations shared by the router processes of a host (or by replicas): each
request's decode worker is reserved in Redis when its plan is chosen, in one round trip that
checks the worker's bound over every live process and takes the slot atomically, and released
when the request ends. A process that dies stops renewing its liveness, and its reservations
stop counting after `ttl_s`. Used when `server.processes` > 1 or `admission.max_inflight_per_
worker` is set; one process without a bound keeps only its in-process counts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from ownerserve.config import Settings
from ownerserve.directory.redis import split_cluster_flag
from ownerserve.tasks import cancel_and_wait

log = logging.getLogger("ownerserve.reservations")

INFLIGHT_TTL_S = 10.0
"""A process's reservations count this long after its last renewal (it renews every third of
it): a process that died frees its slots within this."""

# KEYS: the worker's hash (process -> requests reserved there), the liveness zset (process ->
# until when it counts, ms by the server's clock). ARGV: process, bound (0: none), ttl ms.
# Fields of processes no longer alive are dropped as they are met. -> {taken 0/1, total}
_RESERVE = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local me = ARGV[1]
local bound = tonumber(ARGV[2])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), me)
local held = redis.call('HGETALL', KEYS[1])
local total = 0
for i = 1, #held, 2 do
  local proc = held[i]
  local until_ms = redis.call('ZSCORE', KEYS[2], proc)
  if until_ms and tonumber(until_ms) >= now then
    total = total + tonumber(held[i + 1])
  else
    redis.call('HDEL', KEYS[1], proc)
  end
end
if bound > 0 and total >= bound then
  return {0, total}
end
redis.call('HINCRBY', KEYS[1], me, 1)
return {1, total + 1}
"""

# KEYS: the worker's hash. ARGV: process. -> requests still reserved there by this process
_RELEASE = """
local n = redis.call('HINCRBY', KEYS[1], ARGV[1], -1)
if n <= 0 then redis.call('HDEL', KEYS[1], ARGV[1]) end
return n
"""

# KEYS: the liveness zset. ARGV: process, ttl ms. Forgets processes dead for an hour.
_RENEW = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 3600000)
return 1
"""


@dataclass(frozen=True, slots=True)
class Reserved:
    """A reservation's answer: whether the slot was taken, and the requests reserved on the
    worker over every live process (this one included) after it."""

    taken: bool
    total: int


def process_id() -> str:
    """This process among the router processes sharing a Redis: host and pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


class InflightReservations:
    """Requests in flight per worker, counted in Redis over every router process; `bound`
    (None: none) caps them per worker. `totals` is the last count seen per worker, which the
    plan stage's load view reads (`router.views`)."""

    def __init__(
        self,
        redis_url: str,
        key_prefix: str,
        *,
        bound: int | None = None,
        ttl_s: float = 10.0,
        process: str | None = None,
    ) -> None:
        plain, cluster = split_cluster_flag(redis_url)
        self.client: aioredis.Redis | RedisCluster = (
            RedisCluster.from_url(plain) if cluster else aioredis.Redis.from_url(plain)
        )
        # one hash tag: a script's keys are in one slot of a Redis Cluster
        self.prefix = f"{{{key_prefix}:inflight}}"
        self.alive_key = f"{self.prefix}:alive"
        self.bound = bound
        self.ttl_ms = int(ttl_s * 1000)
        self.process = process or process_id()
        self.totals: dict[str, int] = {}
        self._reserve = self.client.register_script(_RESERVE)
        self._release = self.client.register_script(_RELEASE)
        self._renew = self.client.register_script(_RENEW)
        self._renewer: asyncio.Task[None] | None = None
        self._releases: set[asyncio.Task[None]] = set()

    def _key(self, worker: str) -> str:
        return f"{self.prefix}:w:{worker}"

    async def start(self) -> None:
        """Renew this process's liveness every third of `ttl_s` until `close`."""
        self._renewer = asyncio.create_task(self._renew_loop(), name="inflight-renew")

    async def _renew_loop(self) -> None:
        while True:
            with contextlib.suppress(RedisError, OSError):
                await self._renew(keys=[self.alive_key], args=[self.process, self.ttl_ms])
            await asyncio.sleep(self.ttl_ms / 3000)

    async def reserve(self, worker: str) -> Reserved:
        """Take one in-flight slot on `worker` when its count over every live process is under
        `bound` (one script call); Redis unreachable: taken, counted in-process only."""
        try:
            taken, total = await self._reserve(
                keys=[self._key(worker), self.alive_key],
                args=[self.process, self.bound or 0, self.ttl_ms],
            )
        except (RedisError, OSError) as exc:
            log.warning("in-flight reservation on %s not shared: %s", worker, exc)
            return Reserved(True, self.totals.get(worker, 0))
        self.totals[worker] = int(total)
        return Reserved(bool(taken), int(total))

    def release(self, worker: str) -> None:
        """Give back a slot `reserve` took (in the background: the request has ended)."""
        self.totals[worker] = max(0, self.totals.get(worker, 0) - 1)
        task = asyncio.get_running_loop().create_task(self._give_back(worker))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _give_back(self, worker: str) -> None:
        try:
            await self._release(keys=[self._key(worker)], args=[self.process])
        except (RedisError, OSError) as exc:  # the TTL frees it once this process is gone
            log.warning("in-flight release on %s failed: %s", worker, exc)

    async def close(self) -> None:
        """Stop renewing; let pending releases finish; drop this process from the live ones
        (what it still holds stops counting at once); close the client."""
        await cancel_and_wait(self._renewer)
        if self._releases:
            await asyncio.wait(list(self._releases), timeout=2.0)
        with contextlib.suppress(RedisError, OSError):
            await self.client.zrem(self.alive_key, self.process)
        await self.client.aclose()


def shared_reservations(settings: Settings) -> InflightReservations | None:
    """The router's shared reservations: with the Redis directory, when several processes
    serve (`server.processes`) or a per-worker bound is set; else None (one process counts in
    flight in-process only, at no cost per request)."""
    d = settings.directory
    bound = settings.admission.max_inflight_per_worker
    if d.backend != "redis" or d.redis_url is None:
        return None
    if settings.server.processes <= 1 and bound is None:
        return None
    return InflightReservations(d.redis_url, d.key_prefix, bound=bound, ttl_s=INFLIGHT_TTL_S)
