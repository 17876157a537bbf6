"""What the chaos bench reads while it runs: the ownership directory straight from Redis (what
it names each worker: leases, session decode owners, replicas, cached blocks), a process's
memory and open sockets from /proc, and the counters of a server's `/metrics`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loadgen.metrics import metric_sum, parse_prometheus
from ownerserve.config import DirectorySettings
from ownerserve.directory import open_directory
from ownerserve.directory.redis import RedisDirectory

READ_STEP = 2000
"""Block records per Redis read of a worker's replicas."""


@dataclass(frozen=True, slots=True)
class Named:
    """What the directory names one worker in, now: the epochs of its live leases, the
    sessions whose decode owner it is, its live replica lines and the blocks its cached
    view holds."""

    lease_epochs: tuple[int, ...] = ()
    sessions: int = 0
    replicas: int = 0
    cached_blocks: int = 0

    @property
    def as_owner(self) -> int:
        """Live leases plus sessions it owns: what must go when it dies."""
        return len(self.lease_epochs) + self.sessions

    @property
    def total(self) -> int:
        return self.as_owner + self.replicas + self.cached_blocks

    def as_dict(self) -> dict[str, int]:
        return {
            "leases": len(self.lease_epochs),
            "sessions": self.sessions,
            "replicas": self.replicas,
            "cached_blocks": self.cached_blocks,
        }


class DirectoryProbe:
    """Reads the Redis directory the routers share, key by key (`ownerserve/directory/README.md`,
    *Redis key layout*), without going through the routers."""

    def __init__(self, redis_url: str, namespace: str = "os") -> None:
        settings = DirectorySettings(backend="redis", redis_url=redis_url, key_prefix=namespace)
        directory = open_directory(settings, resilient=False)
        assert isinstance(directory, RedisDirectory)
        self.directory = directory
        self.r = directory.client
        self.p = directory.prefix

    async def close(self) -> None:
        await self.directory.close()

    async def now_ms(self) -> int:
        sec, usec = await self.r.time()
        return int(sec) * 1000 + int(usec) // 1000

    async def epoch(self) -> int:
        """The fencing epoch counter: every lease granted from now on has a higher epoch."""
        return int(await self.r.get(self.p + "epoch") or 0)

    async def live_leases(self) -> dict[str, list[int]]:
        """Worker -> the epochs of its live leases."""
        now = await self.now_ms()
        out: dict[str, list[int]] = {}
        for rec in (await self.r.hgetall(self.p + "art")).values():
            worker, epoch, expires, _tier = str(rec).split("\t")
            if int(expires) > now:
                out.setdefault(worker, []).append(int(epoch))
        return out

    async def holders(self) -> dict[str, tuple[str, int]]:
        """Replica holders' leases: "worker \t tier" -> (incarnation, expiry ms). A held
        replica line ("h<incarnation>" in its expiry field) lives while its holder's lease
        does at that incarnation, and until then expires as that lease does."""
        out: dict[str, tuple[str, int]] = {}
        for key, rec in (await self.r.hgetall(self.p + "hold")).items():
            inc, _, expires = str(rec).partition("\t")
            out[str(key)] = (inc, int(expires))
        return out

    async def slow_commands(self, n: int = 10) -> list[dict[str, Any]]:
        """Redis's slow log (commands past `slowlog-log-slower-than`, 10 ms by default): the
        slowest first, each with its duration and its command cut short."""
        entries = await self.r.slowlog_get(128)
        out: list[dict[str, Any]] = [
            {
                "us": int(e["duration"]),
                "at": int(e["start_time"]),
                "command": str(e["command"])[:160],
            }
            for e in entries
        ]
        out.sort(key=lambda e: -int(e["us"]))
        return out[:n]

    async def latency_events(self) -> dict[str, Any]:
        """Redis's latency monitor, once `latency-monitor-threshold` is set: what stalled the
        server (commands, forks and AOF writes alike) since its last restart: per event its
        latest and worst ms, and each stall of a command with its time (unix s)."""
        latest = await self.r.execute_command("LATENCY", "LATEST")
        history = await self.r.execute_command("LATENCY", "HISTORY", "command")
        return {
            "latest": [[str(x[0]), int(x[1]), int(x[2]), int(x[3])] for x in latest],
            "command_stalls": [[int(t), int(ms)] for t, ms in history],
        }

    async def named(
        self, worker: str, *, cached: bool = False, replica_tiers: Sequence[str] | None = None
    ) -> Named:
        """What the directory names `worker` in (`cached`: also scan every block record for
        its cached view, which costs a pass over the block table; `replica_tiers`: count only
        the replica lines in these tiers, None: all)."""
        p, r = self.p, self.r
        now = await self.now_ms()
        leases = (await self.live_leases()).get(worker, [])
        sids = [str(x) for x in await r.smembers(f"{p}w:{worker}:sess")]
        owners = await r.mget([p + "s:" + sid for sid in sids]) if sids else []
        sessions = sum(1 for o in owners if o == worker)
        blocks = list(await r.smembers(f"{p}w:{worker}:reps"))
        holders = await self.holders()
        replicas = 0
        for i in range(0, len(blocks), READ_STEP):
            for rec in await r.hmget(p + "blk", blocks[i : i + READ_STEP]):
                replicas += _live_replica_lines(rec, worker, now, holders, replica_tiers)
        cached_blocks = await self._cached_blocks(worker) if cached else 0
        return Named(tuple(sorted(leases)), sessions, replicas, cached_blocks)

    async def replica_blocks(
        self, worker: str, *, tiers: Sequence[str], limit: int | None
    ) -> list[int]:
        """Blocks (at most `limit`, None: all) the directory names as `worker`'s live replicas
        in one of `tiers` (a sidecar publishes its own as `cpu` and `ssd`)."""
        p, r = self.p, self.r
        now = await self.now_ms()
        blocks = sorted(str(b) for b in await r.smembers(f"{p}w:{worker}:reps"))
        holders = await self.holders()
        out: list[int] = []
        for i in range(0, len(blocks), READ_STEP):  # no single call holds Redis long
            part = blocks[i : i + READ_STEP]
            for block, rec in zip(part, await r.hmget(p + "blk", part), strict=True):
                if _live_replica_lines(rec, worker, now, holders, tiers):
                    out.append(int(block, 16))
                    if limit is not None and len(out) >= limit:
                        return out
        return out

    async def replica_expiry_ms(self, worker: str, *, tiers: Sequence[str]) -> int | None:
        """The latest expiry (Redis time, ms) of `worker`'s live replica lines in `tiers`:
        until when the directory names them if nothing renews them; None when none lives."""
        p, r = self.p, self.r
        now = await self.now_ms()
        blocks = list(await r.smembers(f"{p}w:{worker}:reps"))
        holders = await self.holders()
        latest: int | None = None
        for i in range(0, len(blocks), READ_STEP):
            for rec in await r.hmget(p + "blk", blocks[i : i + READ_STEP]):
                for expires in _replica_expiries(rec, worker, holders, tiers):
                    if expires > now and (latest is None or expires > latest):
                        latest = expires
        return latest

    async def replica_lines(self, worker: str, *, tiers: Sequence[str]) -> int:
        """How many live replica lines in `tiers` name `worker`."""
        p, r = self.p, self.r
        now = await self.now_ms()
        blocks = list(await r.smembers(f"{p}w:{worker}:reps"))
        holders = await self.holders()
        n = 0
        for i in range(0, len(blocks), READ_STEP):
            recs = await r.hmget(p + "blk", blocks[i : i + READ_STEP])
            n += sum(_live_replica_lines(rec, worker, now, holders, tiers) for rec in recs)
        return n

    async def _cached_blocks(self, worker: str) -> int:
        idx = await self.r.hget(f"{self.p}w:{worker}", "idx")
        if idx is None:
            return 0
        j = int(idx)
        n = 0
        async for _block, rec in self.r.hscan_iter(self.p + "blk", count=2_000):
            rec = str(rec)
            nl = rec.find("\n", 16)
            cache = rec[16:nl] if nl >= 0 else rec[16:]
            if j <= len(cache) and cache[j - 1] != "\0":
                n += 1
        return n


def _replica_expiries(
    rec: object, worker: str, holders: dict[str, tuple[str, int]], tiers: Sequence[str]
) -> list[int]:
    """The expiries (ms) of `worker`'s replica lines in `tiers` in one block record (a held
    line's: its holder's lease's while at its incarnation, else 0)."""
    if not rec:
        return []
    text = str(rec)
    nl = text.find("\n", 16)
    if nl < 0:
        return []
    out = []
    for line in text[nl + 1 :].split("\n"):
        if line:
            who, tier, expires, _ro = line.split("\t")
            if who == worker and tier in tiers:
                out.append(_line_expiry(who, tier, expires, holders))
    return out


def _line_expiry(who: str, tier: str, expires: str, holders: dict[str, tuple[str, int]]) -> int:
    """When a replica line stops counting (ms): its own expiry, or, held ("h<incarnation>"),
    its holder's lease's while the holder is at that incarnation (else 0: superseded)."""
    if not expires.startswith("h"):
        return int(expires)
    inc, until = holders.get(who + "\t" + tier, ("", 0))
    return until if inc == expires[1:] else 0


def _live_replica_lines(
    rec: object,
    worker: str,
    now_ms: int,
    holders: dict[str, tuple[str, int]],
    tiers: Sequence[str] | None = None,
) -> int:
    """Live replica lines of `worker` in one block record (in one of `tiers`; None: any)."""
    if not rec:
        return 0
    text = str(rec)
    nl = text.find("\n", 16)
    if nl < 0:
        return 0
    n = 0
    for line in text[nl + 1 :].split("\n"):
        if not line:
            continue
        who, tier, expires, _ro = line.split("\t")
        if (
            who == worker
            and (tiers is None or tier in tiers)
            and _line_expiry(who, tier, expires, holders) > now_ms
        ):
            n += 1
    return n


@dataclass(frozen=True, slots=True)
class ProcStats:
    """A process's resident memory and open descriptors, from /proc."""

    rss_mb: float
    sockets: int
    fds: int


def proc_stats(pid: int) -> ProcStats | None:
    """`pid`'s `VmRSS` and its open descriptors (sockets among them); None once it is gone."""
    base = Path("/proc") / str(pid)
    try:
        rss_kb = 0
        for line in (base / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss_kb = int(line.split()[1])
                break
        sockets = fds = 0
        for fd in os.listdir(base / "fd"):
            fds += 1
            try:
                if os.readlink(base / "fd" / fd).startswith("socket:"):
                    sockets += 1
            except OSError:  # closed while listed
                continue
    except (OSError, ValueError):
        return None
    return ProcStats(rss_kb / 1024, sockets, fds)


WORKER_GAUGES: dict[str, str] = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "kv_blocks_in_use": "ownerserve_emulator_kv_blocks_in_use",
    "kv_transfers_held": "ownerserve_emulator_kv_transfers_held",
}
"""An emulated worker's gauges that a request holds while it lives (0 on an idle worker)."""

SIDECAR_GAUGES: dict[str, str] = {
    "fetches_in_flight": "ownerserve_sidecar_fetches_in_flight",
}
"""A KV sidecar's gauges that a fetch holds while it runs (0 on an idle sidecar)."""

ROUTER_GAUGES: dict[str, str] = {
    "inflight": "ownerserve_worker_inflight",
    "admission_queued": "ownerserve_admission_queued",
    "leases_open": "ownerserve_request_leases_open",
}
"""A router's gauges that a request holds while it lives (0 on an idle router)."""


async def scrape(
    client: httpx.AsyncClient, url: str, gauges: dict[str, str]
) -> dict[str, float] | None:
    """`gauges` (report name -> metric, summed over labels) from `url`/metrics; None when it
    does not answer."""
    try:
        resp = await client.get(url + "/metrics", timeout=5.0)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    samples = parse_prometheus(resp.text)
    return {k: metric_sum(samples, name) or 0.0 for k, name in gauges.items()}


async def counters(
    client: httpx.AsyncClient, url: str, names: Sequence[str]
) -> dict[str, float] | None:
    """Every sample of the metrics in `names` from `url`/metrics, keyed `name{labels}`."""
    try:
        resp = await client.get(url + "/metrics", timeout=5.0)
    except httpx.HTTPError:
        return None
    out: dict[str, float] = {}
    for name, labels, value in parse_prometheus(resp.text):
        if name in names and value:
            key = name + ("{" + ",".join(f"{k}={v}" for k, v in labels) + "}" if labels else "")
            out[key] = value
    return out
