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

# One call for what a process asked in one turn of its event loop. KEYS: the liveness zset,
# then the workers' hashes (process -> requests reserved there). ARGV: process, bound (0:
# none), ttl ms, how many releases, then the releases' and the reservations' key indexes
# (2-based, into KEYS). Releases go first; fields of processes no longer alive are dropped
# as they are met. -> per reservation: taken 0/1, the worker's total after it
_BATCH = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local me = ARGV[1]
local bound = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), me)
local releases = tonumber(ARGV[4])
for i = 5, 4 + releases do
  local key = KEYS[tonumber(ARGV[i])]
  if redis.call('HINCRBY', key, me, -1) <= 0 then redis.call('HDEL', key, me) end
end
local totals = {}
local out = {}
for i = 5 + releases, #ARGV do
  local key = KEYS[tonumber(ARGV[i])]
  local total = totals[key]
  if total == nil then
    total = 0
    local held = redis.call('HGETALL', key)
    for j = 1, #held, 2 do
      local until_ms = redis.call('ZSCORE', KEYS[1], held[j])
      if until_ms and tonumber(until_ms) >= now then
        total = total + tonumber(held[j + 1])
      else
        redis.call('HDEL', key, held[j])
      end
    end
  end
  if bound > 0 and total >= bound then
    out[#out + 1] = 0
  else
    redis.call('HINCRBY', key, me, 1)
    total = total + 1
    out[#out + 1] = 1
  end
  totals[key] = total
  out[#out + 1] = total
end
return out
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
        self._batch = self.client.register_script(_BATCH)
        self._renew = self.client.register_script(_RENEW)
        self._renewer: asyncio.Task[None] | None = None
        self._asked: list[tuple[str, asyncio.Future[Reserved]]] = []
        self._released: list[str] = []
        self._flushing: set[asyncio.Task[None]] = set()
        self._flush_due = False

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
        `bound`. What the requests of one event-loop turn ask goes in one script call
        (releases included); Redis unreachable: taken, counted in-process only."""
        future: asyncio.Future[Reserved] = asyncio.get_running_loop().create_future()
        self._asked.append((worker, future))
        self._schedule()
        return await future

    def release(self, worker: str) -> None:
        """Give back a slot `reserve` took (with the next call: the request has ended)."""
        self.totals[worker] = max(0, self.totals.get(worker, 0) - 1)
        self._released.append(worker)
        self._schedule()

    def _schedule(self) -> None:
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush_soon)

    def _flush_soon(self) -> None:
        self._flush_due = False
        if not self._asked and not self._released:
            return
        asked, self._asked = self._asked, []
        released, self._released = self._released, []
        task = asyncio.get_running_loop().create_task(self._flush(asked, released))
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)

    async def _flush(
        self, asked: list[tuple[str, asyncio.Future[Reserved]]], released: list[str]
    ) -> None:
        keys = [self.alive_key]
        index: dict[str, int] = {}

        def at(worker: str) -> int:
            i = index.get(worker)
            if i is None:
                keys.append(self._key(worker))
                i = index[worker] = len(keys)  # Lua's KEYS are 1-based
            return i

        args: list[str | int] = [self.process, self.bound or 0, self.ttl_ms, len(released)]
        args += [at(w) for w in released]
        args += [at(w) for w, _ in asked]
        try:
            out = await self._batch(keys=keys, args=args)
        except (RedisError, OSError) as exc:  # the TTL frees released slots once gone
            log.warning("in-flight reservations not shared: %s", exc)
            for worker, future in asked:
                if not future.done():
                    future.set_result(Reserved(True, self.totals.get(worker, 0)))
            return
        for k, (worker, future) in enumerate(asked):
            total = int(out[2 * k + 1])
            self.totals[worker] = total
            if not future.done():
                future.set_result(Reserved(bool(int(out[2 * k])), total))
            elif int(out[2 * k]):  # its request went away while it waited: give it back
                self.release(worker)

    async def close(self) -> None:
        """Stop renewing; let pending releases finish; drop this process from the live ones
        (what it still holds stops counting at once); close the client."""
        await cancel_and_wait(self._renewer)
        if self._released or self._asked:
            self._flush_soon()
        if self._flushing:
            await asyncio.wait(list(self._flushing), timeout=2.0)
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
