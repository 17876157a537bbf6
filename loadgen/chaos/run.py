"""One chaos run: start the topology, run the load and the fault schedule side by side, then let
everything recover and check what is left: requests that hung, sessions lost, workers still
holding a dead request's KV, routers still holding a request, directory entries naming a dead
worker, and the replicas' memory and sockets over the run."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from redis.exceptions import RedisError

from loadgen.chaos.load import ChaosLoad, LoadOptions, LoadResult
from loadgen.chaos.probe import (
    ROUTER_GAUGES,
    SIDECAR_GAUGES,
    WORKER_GAUGES,
    DirectoryProbe,
    Named,
    counters,
    proc_stats,
    scrape,
)
from loadgen.chaos.schedule import (
    FAULT_KINDS,
    ScheduledFault,
    fault_schedule,
    sidecar_mode_for,
    unsupported,
)
from loadgen.chaos.topology import DIRECTORY_PREFIX, Replica, RouterTimeouts, Topology
from loadgen.cluster import DEFAULT_PROFILE, MODEL, ClusterSpec, EmulatedWorker, KVSidecar
from ownerserve.kvstate.heads import head_keys
from workers.mooncake_store import MasterUnavailable
from workers.mooncake_store.master import find_master_binary

ROUTER_COUNTERS = (
    "ownerserve_requests_total",
    "ownerserve_retries_total",
    "ownerserve_stream_errors_total",
    "ownerserve_fallbacks_total",
    "ownerserve_upstream_timeouts_total",
    "ownerserve_directory_lookup_errors_total",
    "ownerserve_directory_commit_errors_total",
    "ownerserve_directory_drop_worker_errors_total",
    "ownerserve_directory_sweep_errors_total",
    "ownerserve_kv_fetches_total",
)
"""The replicas' counters the report carries (what the routers saw of the faults)."""


REDIS_START_S = 120.0
"""How long a restarted Redis may take to answer: it first replays its append-only file,
tens of MB after a few minutes of load, which took past 10 s on a busy 2-core machine."""


@dataclass
class ChaosPlan:
    """What one run does (the CLI's options)."""

    out_dir: Path
    log_dir: Path
    duration_s: float = 600.0
    sessions: int = 6
    seed: int = 0
    prefill: int = 1
    decode: int = 1
    hybrid: int = 4
    profile: str = DEFAULT_PROFILE
    speed: float = 4.0
    lease_s: float = 10.0
    replica_ttl_s: float = 30.0
    """The KV sidecars' `--replica-ttl-s`: what they publish lives this long unless renewed
    (every third of it), the bound on a dead sidecar's or a lost object's replicas."""
    faults: tuple[str, ...] = FAULT_KINDS
    repeats: int = 2
    stop_s: float = 8.0
    """How long a SIGSTOPped worker stays stopped."""
    redis_down_s: float = 2.0
    hang_s: float = 45.0
    recover_s: float = 30.0
    settle_s: float = 60.0
    stream_share: float = 0.5
    time_scale: float = 1.0
    sample_s: float = 2.0
    timeouts: RouterTimeouts = field(default_factory=RouterTimeouts)
    progress: bool = True
    kv_sidecars: str = "auto"
    """`off`, `tcp`, `store` (`loadgen.chaos.topology.KV_SIDECAR_MODES`) or `auto`: the least
    that `faults` run on (`sidecar_mode_for`)."""
    master_down_s: float = 2.0
    """How long a killed Mooncake Store master stays down."""

    def sidecar_mode(self) -> str:
        if self.kv_sidecars != "auto":
            return self.kv_sidecars
        mode = sidecar_mode_for(self.faults)
        if mode == "store":
            try:
                find_master_binary()
            except MasterUnavailable:  # no Mooncake here: store_master_kill is skipped, said
                return sidecar_mode_for([k for k in self.faults if k != "store_master_kill"])
        return mode

    def spec(self) -> ClusterSpec:
        # the emulators' P/D holds expire well inside the settle bound
        extra = ("--kv-lease-duration", "10", "--transfer-timeout-s", "10")
        return ClusterSpec(
            self.prefill, self.decode, self.hybrid, self.profile, self.speed, MODEL, extra
        )

    def check(self) -> None:
        if self.duration_s <= 0 or self.sessions < 1 or self.repeats < 1:
            raise ValueError("--duration and --sessions must be > 0, --repeats >= 1")
        if self.prefill + self.decode + self.hybrid < 2:
            raise ValueError("the topology needs at least two workers (one can die)")
        if self.hang_s <= self.timeouts.request_timeout_s:
            raise ValueError(
                f"--hang-s ({self.hang_s:g}) must exceed the routers' request_timeout_s "
                f"({self.timeouts.request_timeout_s:g}): every answer is due within that"
            )


@dataclass
class Death:
    """A worker killed by a fault, and what the directory did about it."""

    worker: str
    fault: str
    killed_s: float
    owner_gone_s: float | None
    """Seconds from the kill until the directory named it in no live lease and as no
    session's decode owner (None: not within the wait's bound)."""
    named_at_kill: Named
    named_at_restart: Named
    """What the directory still named it in just before its restart: stale entries."""
    restart_epoch: int
    """The epoch counter just before the restart: a live lease of this worker at or below
    it was granted before the restart, for KV the restart lost."""
    restarted_s: float | None = None


@dataclass
class FaultRecord:
    fault: ScheduledFault
    started_s: float
    ended_s: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.fault.kind,
            "target": self.fault.target,
            "planned_s": self.fault.at_s,
            "started_s": round(self.started_s, 2),
            "ended_s": round(self.ended_s, 2),
            **self.detail,
            "problems": self.problems,
        }


class _Run:
    """The state of one run while it goes: the processes, the probes, the records."""

    def __init__(self, plan: ChaosPlan, topo: Topology) -> None:
        self.plan = plan
        self.topo = topo
        self.probe = DirectoryProbe(topo.redis.url, DIRECTORY_PREFIX)
        self.http = httpx.AsyncClient(timeout=5.0)
        self.load: ChaosLoad | None = None
        self.t0 = time.monotonic()
        self.records: list[FaultRecord] = []
        self.deaths: list[Death] = []
        self.samples: list[dict[str, Any]] = []
        self.current = ""
        self.no_more_faults = asyncio.Event()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def log(self, msg: str) -> None:
        if self.plan.progress:
            wall = time.strftime("%H:%M:%S")
            print(f"[chaos {self.now():7.1f}s {wall}] {msg}", file=sys.stderr, flush=True)

    async def close(self) -> None:
        await self.http.aclose()
        with contextlib.suppress(RedisError, OSError):
            await self.probe.close()

    # --- measuring ---------------------------------------------------------------------------

    async def named(self, worker: str, *, cached: bool = False) -> Named | None:
        """What the directory names `worker` in; with KV sidecars, leaving out the replicas its
        sidecar publishes (`cpu`, `ssd`): the sidecar outlives its engine's death and serves
        them, so they are not stale (a dead sidecar's are checked by `sidecar_kill`)."""
        tiers = ("gpu",) if self.topo.sidecars else None
        try:
            return await self.probe.named(worker, cached=cached, replica_tiers=tiers)
        except (RedisError, OSError):
            return None

    async def epoch(self) -> int:
        """The directory's epoch counter; -1 when Redis does not answer (twice: the first
        call after a Redis restart finds its pooled connection closed)."""
        for _ in range(2):
            with contextlib.suppress(RedisError, OSError):
                return await self.probe.epoch()
        return -1

    async def wait_for(
        self, cond: Callable[[], Awaitable[bool]], bound_s: float, poll_s: float = 0.2
    ) -> float | None:
        """Seconds until `cond()` held, or None when it did not within `bound_s`."""
        start = time.monotonic()
        while True:
            if await cond():
                return time.monotonic() - start
            if time.monotonic() - start >= bound_s:
                return None
            await asyncio.sleep(poll_s)

    async def gauges(self) -> dict[str, dict[str, float] | None]:
        out: dict[str, dict[str, float] | None] = {}
        for w in self.topo.workers:
            out[w.worker_id] = await scrape(self.http, w.url, WORKER_GAUGES)
        for r in self.topo.replicas:
            out["router " + r.name] = await scrape(self.http, r.url, ROUTER_GAUGES)
        for sc in self.topo.sidecars:
            out["sidecar " + sc.worker_id] = await scrape(self.http, sc.url, SIDECAR_GAUGES)
        return out

    async def admin_state(self, replica: Replica) -> dict[str, tuple[bool, int]] | None:
        """Worker id -> (healthy, requests in flight), as `replica` sees them (admin API)."""
        try:
            resp = await self.http.get(
                replica.url + "/admin/workers",
                headers={"authorization": f"Bearer {self.topo.admin_token}"},
            )
            return {
                w["id"]: (bool(w["healthy"]), int(w["inflight"])) for w in resp.json()["workers"]
            }
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None

    async def directory_healthy(self, replica: Replica) -> bool:
        try:
            body = (await self.http.get(replica.url + "/health")).json()
            return bool(body["directory"]["healthy"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return False

    async def sample_forever(self) -> None:
        while True:
            t = self.now()
            for r in self.topo.replicas:
                pid = r.pid
                stats = proc_stats(pid) if pid is not None else None
                if stats is not None:
                    self.samples.append(
                        {
                            "t_s": round(t, 2),
                            "replica": r.name,
                            "generation": r.generation,
                            "rss_mb": round(stats.rss_mb, 2),
                            "sockets": stats.sockets,
                            "fds": stats.fds,
                        }
                    )
            load = self.load
            if load is not None and self.plan.progress and int(t) % 15 < self.plan.sample_s:
                ok = sum(1 for a in load.attempts if a.ok)
                self.log(
                    f"requests ok {ok}, failed {len(load.attempts) - ok}, in flight "
                    f"{load.inflight}; sessions done {len(load.sessions)}"
                    + (f"; fault: {self.current}" if self.current else "")
                )
            await asyncio.sleep(self.plan.sample_s)

    # --- faults -----------------------------------------------------------------------------

    async def run_schedule(self, schedule: tuple[ScheduledFault, ...], load_t0: float) -> None:
        """Each fault at its time, one after another (one that runs long delays the next);
        none starts once `no_more_faults` is set."""
        for f in schedule:
            delay = load_t0 + f.at_s - time.monotonic()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, delay)):
                    await self.no_more_faults.wait()
            if self.no_more_faults.is_set():
                return
            rec = FaultRecord(f, self.load_now(), detail={"at": time.strftime("%H:%M:%S")})
            self.records.append(rec)
            self.current = f"{f.kind} {f.target}".strip()
            self.log(f"fault {self.current}")
            try:
                await self.fault(rec)
            except Exception as exc:  # a fault that could not be applied is a finding
                rec.problems.append(f"the fault failed: {exc!r}"[:400])
            finally:
                rec.ended_s = self.load_now()
                self.current = ""
                self.log(f"fault {f.kind} {f.target} done: {rec.detail} {rec.problems}")

    def load_now(self) -> float:
        return self.load.now() if self.load is not None else 0.0

    async def fault(self, rec: FaultRecord) -> None:
        kind, target = rec.fault.kind, rec.fault.target
        if kind in ("worker_kill", "pd_drop"):
            await self.kill_worker(rec, self.topo.worker(target), in_flight=kind == "pd_drop")
        elif kind == "worker_stop":
            await self.stop_worker(rec, self.topo.worker(target))
        elif kind == "redis_restart":
            await self.restart_redis(rec)
        elif kind == "router_restart":
            await self.restart_router(rec, self.topo.replica(target))
        elif kind == "sidecar_kill":
            await self.kill_sidecar(rec, await self.sidecar_holding_replicas(rec))
        elif kind == "store_master_kill":
            await self.restart_master(rec)
        else:
            raise AssertionError(f"no action for {kind}")

    async def kill_worker(self, rec: FaultRecord, w: EmulatedWorker, *, in_flight: bool) -> None:
        """SIGKILL `w` (for `pd_drop`, while a P/D plan has it as its prefill worker), wait
        until every replica holds it dead and the directory names it in nothing, start it
        again (cold) and wait until every replica routes to it."""
        plan = self.plan
        if in_flight:
            await self.catch_in_flight(rec, w)
        at_kill = await self.named(w.worker_id) or Named()
        killed = self.load_now()
        await asyncio.to_thread(w.kill)
        if w.process is not None and w.process.pid is not None:  # it may have been frozen
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.process.pid, signal.SIGCONT)

        async def not_owner() -> bool:
            n = await self.named(w.worker_id)
            return n is not None and n.as_owner == 0

        async def forgotten() -> bool:
            n = await self.named(w.worker_id, cached=True)
            return n is not None and n.total == 0

        # past one lease TTL only a bug keeps it named; wait a second TTL before giving up
        bound = 2 * plan.lease_s + 5.0
        owner_gone = await self.wait_for(not_owner, bound)
        dead = await self.wait_for(lambda: self.all_see(w.worker_id, False), bound)
        dead_s = self.load_now() - killed
        when_dead = await self.named(w.worker_id, cached=True) or Named()
        gone = await self.wait_for(forgotten, bound, poll_s=0.5)
        since = self.load_now() - killed
        rec.detail["owner_gone_s"] = None if owner_gone is None else round(owner_gone, 2)
        rec.detail["held_dead_by_every_replica_by_s"] = None if dead is None else round(dead_s, 2)
        rec.detail["named_when_held_dead"] = when_dead.as_dict()
        rec.detail["forgotten_by_s"] = None if gone is None else round(since, 2)
        rec.detail["named_at_kill"] = at_kill.as_dict()
        if owner_gone is None or owner_gone > plan.lease_s:
            rec.problems.append(
                f"the directory named {w.worker_id} as an owner "
                + ("past the wait's bound" if owner_gone is None else f"for {owner_gone:.1f} s")
                + f" after its death (bound: one lease, {plan.lease_s:g} s)"
            )
        if dead is None:
            rec.problems.append(f"a replica did not hold {w.worker_id} dead within {bound:g} s")
        # what is still there now is stale: the worker is dead and about to come back empty
        at_restart = await self.named(w.worker_id, cached=True) or Named()
        rec.detail["named_at_restart"] = at_restart.as_dict()
        if at_restart.total:
            rec.problems.append(
                f"stale entries naming {w.worker_id} {since:.0f} s after its death: "
                f"{at_restart.as_dict()}"
            )
        epoch = await self.epoch()
        death = Death(w.worker_id, rec.fault.kind, killed, owner_gone, at_kill, at_restart, epoch)
        self.deaths.append(death)
        await asyncio.to_thread(w.start)
        await asyncio.to_thread(w.wait_healthy)
        death.restarted_s = self.load_now()
        back = await self.wait_for(lambda: self.all_see(w.worker_id, True), 30.0)
        rec.detail["down_s"] = round(death.restarted_s - killed, 2)
        rec.detail["routed_again_s"] = None if back is None else round(back, 2)
        if back is None:
            rec.problems.append(f"a replica did not see {w.worker_id} healthy within 30 s")

    async def catch_in_flight(self, rec: FaultRecord, w: EmulatedWorker) -> None:
        """Return once a replica has a plan in flight on `w` (its admin API's `inflight`):
        watched for up to 10 s; an emulated prefill lasts tens of milliseconds, so if none is
        seen, `w` is frozen (SIGSTOP) until one is sent to it (up to 20 s more), and the
        caller kills it frozen. The record says which."""

        async def busy() -> bool:
            for r in self.topo.replicas:
                seen = await self.admin_state(r)
                if seen is not None and seen.get(w.worker_id, (True, 0))[1] > 0:
                    return True
            return False

        if await self.wait_for(busy, 10.0, poll_s=0.02) is not None:
            rec.detail["killed"] = "with a plan in flight on it"
            return
        pid = w.process.pid if w.process is not None else None
        if pid is None:
            return
        os.killpg(pid, signal.SIGSTOP)
        if await self.wait_for(busy, 20.0, poll_s=0.05) is not None:
            rec.detail["killed"] = "frozen, once a plan was in flight on it"
        else:
            rec.detail["killed"] = "frozen, idle: no plan used it within 30 s"
            rec.problems.append(f"no plan used {w.worker_id} within 30 s: killed idle")

    async def all_see(self, worker: str, healthy: bool) -> bool:
        """Whether every replica's admin API shows `worker` as `healthy`."""
        for r in self.topo.replicas:
            seen = await self.admin_state(r)
            if seen is None or worker not in seen or seen[worker][0] is not healthy:
                return False
        return True

    async def stop_worker(self, rec: FaultRecord, w: EmulatedWorker) -> None:
        pid = w.process.pid if w.process is not None else None
        if pid is None:
            rec.problems.append(f"{w.worker_id} is not running")
            return
        stop_s = self.plan.stop_s
        os.killpg(pid, signal.SIGSTOP)
        t = time.monotonic()
        try:
            marked = await self.wait_for(
                lambda: self.all_see(w.worker_id, False), stop_s, poll_s=0.25
            )
            left = stop_s - (time.monotonic() - t)
            if left > 0:
                await asyncio.sleep(left)
        finally:
            os.killpg(pid, signal.SIGCONT)
        rec.detail["stopped_s"] = round(time.monotonic() - t, 2)
        rec.detail["marked_dead_by_every_replica_s"] = None if marked is None else round(marked, 2)
        back = await self.wait_for(lambda: self.all_see(w.worker_id, True), 30.0)
        rec.detail["healthy_again_s"] = None if back is None else round(back, 2)
        if back is None:
            rec.problems.append(f"a replica did not see {w.worker_id} healthy within 30 s")

    async def restart_redis(self, rec: FaultRecord) -> None:
        redis = self.topo.redis
        before = await self.epoch()
        await asyncio.to_thread(redis.kill)
        await asyncio.sleep(self.plan.redis_down_s)
        await asyncio.to_thread(redis.start, REDIS_START_S)

        async def healthy() -> bool:
            return all([await self.directory_healthy(r) for r in self.topo.replicas])

        back = await self.wait_for(healthy, 60.0, poll_s=0.25)
        after = await self.epoch()
        rec.detail["down_s"] = self.plan.redis_down_s
        rec.detail["directory_healthy_again_s"] = None if back is None else round(back, 2)
        rec.detail["epoch_before_after"] = [before, after]
        if back is None:
            rec.problems.append("a replica's directory was not healthy within 60 s of Redis")

    # --- the KV sidecars and their store ----------------------------------------------------

    async def sidecar_health(self, sc: KVSidecar) -> dict[str, Any] | None:
        try:
            body = (await self.http.get(sc.url + "/health", timeout=2.0)).json()
        except (httpx.HTTPError, ValueError):
            return None
        return body if isinstance(body, dict) else None

    async def fetching_from(self, worker: str) -> bool:
        """Whether a peer sidecar has a fetch from `worker`'s sidecar running now (all asked
        at once: a fetch of the emulated blocks lasts milliseconds)."""
        peers = [sc for sc in self.topo.sidecars if sc.worker_id != worker]
        healths = await asyncio.gather(*(self.sidecar_health(sc) for sc in peers))
        return any(
            h is not None and int((h.get("fetching_from") or {}).get(worker, 0)) for h in healths
        )

    async def all_see_kv_api(self, worker: str, up: bool) -> bool:
        """Whether every replica's admin API shows `worker`'s KV API (its sidecar) as `up`."""
        for r in self.topo.replicas:
            try:
                resp = await self.http.get(
                    r.url + "/admin/workers",
                    headers={"authorization": f"Bearer {self.topo.admin_token}"},
                )
                rows = {w["id"]: bool(w["kv_api_ok"]) for w in resp.json()["workers"]}
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                return False
            if rows.get(worker) is not up:
                return False
        return True

    async def fetch_counts(self) -> dict[str, float]:
        """The replicas' `ownerserve_kv_fetches_total` by result and fallbacks, summed."""
        out: dict[str, float] = {}
        for r in self.topo.replicas:
            got = await counters(
                self.http, r.url, ("ownerserve_kv_fetches_total", "ownerserve_fallbacks_total")
            )
            for key, value in (got or {}).items():
                name = key.replace("ownerserve_", "").replace("_total", "")
                out[name] = out.get(name, 0.0) + value
        return out

    async def sidecar_holding_replicas(self, rec: FaultRecord) -> KVSidecar:
        """The sidecar `rec` kills: the scheduled one once the directory names replicas on it
        (a kill of a sidecar that holds nothing checks nothing; after a store master's restart,
        or early in a run, the sidecars hold no replica until the load writes KV again), waited
        on for two replica TTLs and a lease. If it still holds none, the peer sidecar among the
        candidates that holds the most, recorded as a retarget; if none holds any, the
        scheduled one, recorded as a problem."""
        plan, scheduled = self.plan, rec.fault.target
        victims = {w.worker_id for w in self.topo.workers if w.role != "prefill"}
        candidates = [sc.worker_id for sc in self.topo.sidecars if sc.worker_id in victims]

        async def holds() -> bool:
            return bool(await self.probe_sidecar_replicas(scheduled))

        bound = 2 * plan.replica_ttl_s + plan.lease_s
        waited = await self.wait_for(holds, bound, poll_s=0.25)
        if waited is not None:
            rec.detail["waited_for_replicas_s"] = round(waited, 2)
            return self.topo.sidecar(scheduled)
        held = {w: await self.probe_sidecar_replicas(w) or 0 for w in candidates or [scheduled]}
        best = max(held, key=lambda w: held[w])
        if held[best] == 0:
            rec.problems.append(
                f"no sidecar held a replica to kill (waited on {scheduled}'s for "
                f"{bound:g} s): the kill checks nothing"
            )
            return self.topo.sidecar(scheduled)
        rec.fault = dataclasses.replace(rec.fault, target=best)
        rec.detail["retargeted_from"] = scheduled
        return self.topo.sidecar(best)

    async def kill_sidecar(self, rec: FaultRecord, sc: KVSidecar) -> None:
        """SIGKILL `sc` while a peer sidecar's fetch from it runs (watched for one lease; a
        fetch of the emulated blocks lasts milliseconds, so if none is seen `sc` is frozen
        until one is stuck on it or every replica holds its KV API down, when no plan fetches
        from it any more, and killed frozen), wait until the directory names none of its
        replicas, start it again and wait until every replica uses it again. Its replicas'
        time in the directory counts from when it stopped renewing them: the kill, or the
        freeze."""
        plan, worker = self.plan, sc.worker_id
        before = await self.fetch_counts()
        rec.detail["replicas_before"] = await self.probe_sidecar_replicas(worker)
        bound = 2 * plan.replica_ttl_s + 5.0
        watch = plan.lease_s
        gone: asyncio.Task[float | None] | None = None

        async def unnamed() -> bool:
            return await self.probe_sidecar_replicas(worker) == 0

        async def fetch_or_down() -> bool:
            return await self.fetching_from(worker) or await self.all_see_kv_api(worker, False)

        caught = await self.wait_for(lambda: self.fetching_from(worker), watch, poll_s=0.01)
        stopped: float | None = None
        stopped_ms: int | None = None  # Redis time: what the replica lines' expiries are in
        frozen_expiry: asyncio.Task[int | None] | None = None
        if caught is not None:
            rec.detail["killed"] = "with a fetch from it in flight"
        elif sc.process is not None and sc.process.pid is not None:
            os.killpg(sc.process.pid, signal.SIGSTOP)
            stopped = self.load_now()
            stopped_ms = await self.redis_ms()
            gone = asyncio.create_task(self.wait_for(unnamed, bound, poll_s=0.25))
            # read while the latest lines still live (a renewal sent before the freeze may
            # land a moment after it)
            frozen_expiry = asyncio.create_task(self.replica_expiry(worker, after_s=1.0))
            await self.wait_for(fetch_or_down, 15.0, poll_s=0.02)
            if await self.fetching_from(worker):
                rec.detail["killed"] = "frozen, once a fetch from it was in flight"
            else:
                rec.detail["killed"] = (
                    f"frozen, idle: no fetch from it within {watch:g} s, nor frozen until "
                    "the replicas held its KV API down"
                )
                rec.problems.append(f"no fetch from {worker}'s sidecar in flight: killed idle")
        at_kill = await self.probe_sidecar_replicas(worker)
        killed = self.load_now()
        stopped = killed if stopped is None else stopped
        await asyncio.to_thread(sc.kill)
        stopped_ms = await self.redis_ms() if stopped_ms is None else stopped_ms
        if gone is None:
            gone = asyncio.create_task(self.wait_for(unnamed, bound, poll_s=0.25))
        down = await self.wait_for(lambda: self.all_see_kv_api(worker, False), bound)
        # nothing renews them now: the latest expiry is how long past the stop they are named
        # (exact, where the polling above also counts its own reads' time on a busy Redis)
        expiries = [await self.replica_expiry(worker)]
        if frozen_expiry is not None:
            expiries.append(await frozen_expiry)
        expiry = max((e for e in expiries if e is not None), default=None)
        named_for = (
            None
            if stopped_ms is None or expiry is None
            else round(max(0, expiry - stopped_ms) / 1000, 2)
        )
        took = await gone  # watched from the stop: the freeze, or the kill
        gone_s = None if took is None else round(took, 2)
        if expiry is None:
            named_for = gone_s  # all expired before the read: the polled time bounds it
        rec.detail["frozen_s"] = round(killed - stopped, 2)
        rec.detail["replicas_at_kill"] = at_kill
        rec.detail["kv_api_down_by_every_replica_s"] = None if down is None else round(down, 2)
        rec.detail["replicas_gone_s"] = gone_s
        rec.detail["replicas_named_past_stop_s"] = named_for
        # a replica line lives one TTL after its last renewal, which came before the stop
        if gone_s is None or named_for is None or named_for > plan.replica_ttl_s:
            rec.problems.append(
                f"the directory named replicas on {worker}'s dead sidecar "
                + (
                    "past the wait's bound"
                    if gone_s is None or named_for is None
                    else f"until {named_for:.1f} s after it stopped"
                )
                + f" (bound: one replica TTL, {plan.replica_ttl_s:g} s)"
            )
        if down is None:
            rec.problems.append(f"a replica did not hold {worker}'s KV API down within {bound:g} s")
        await asyncio.to_thread(sc.start)
        await asyncio.to_thread(sc.wait_healthy)
        rec.detail["down_s"] = round(self.load_now() - killed, 2)
        back = await self.wait_for(lambda: self.all_see_kv_api(worker, True), 30.0)
        rec.detail["kv_api_up_again_s"] = None if back is None else round(back, 2)
        if back is None:
            rec.problems.append(f"a replica did not use {worker}'s sidecar again within 30 s")
        rec.detail["router_fetches"] = _delta(before, await self.fetch_counts())

    async def redis_ms(self) -> int | None:
        for _ in range(2):  # the first call after a Redis restart finds its socket closed
            with contextlib.suppress(RedisError, OSError):
                return await self.probe.now_ms()
        return None

    async def replica_expiry(self, worker: str, after_s: float = 0.0) -> int | None:
        await asyncio.sleep(after_s)
        for _ in range(2):
            with contextlib.suppress(RedisError, OSError):
                return await self.probe.replica_expiry_ms(worker, tiers=("cpu", "ssd"))
        return None

    async def probe_sidecar_replicas(self, worker: str) -> int | None:
        for _ in range(2):  # a busy Redis times a read out now and then
            with contextlib.suppress(RedisError, OSError):
                return await self.probe.replica_lines(worker, tiers=("cpu", "ssd"))
        return None

    async def sidecar_put(self, sc: KVSidecar, n: int) -> bool:
        """Whether `sc` takes a put now (a probe artifact outside the KV key layout: held,
        never indexed or published)."""
        try:
            resp = await self.http.put(
                f"{sc.url}/ownerserve/kv/artifacts/chaos-probe-{n}", content=b"p" * 64
            )
        except httpx.HTTPError:
            return False
        return resp.status_code == 201

    async def restart_master(self, rec: FaultRecord) -> None:
        """SIGKILL the Mooncake Store master, start it again on the same ports after
        `master_down_s`, then wait until every sidecar takes a put again, and until the
        directory names no block whose artifact the master lost (a block named as a sidecar's
        replica before the kill that its sidecar no longer serves) past one replica TTL."""
        master = self.topo.master
        assert master is not None, "store_master_kill needs --kv-sidecars store"
        plan = self.plan
        before = await self.fetch_counts()
        named = await self.sidecar_replica_blocks()
        t = time.monotonic()
        await asyncio.to_thread(master.kill)
        await asyncio.sleep(plan.master_down_s)
        await asyncio.to_thread(master.start)
        restarted = time.monotonic()
        rec.detail["down_s"] = round(restarted - t, 2)
        probe = [0]

        async def puts_taken() -> bool:
            probe[0] += 1
            return all([await self.sidecar_put(sc, probe[0]) for sc in self.topo.sidecars])

        resumed = await self.wait_for(puts_taken, 60.0, poll_s=0.25)
        rec.detail["puts_resumed_s"] = None if resumed is None else round(resumed, 2)
        if resumed is None:
            rec.problems.append("a sidecar took no put within 60 s of the master's restart")
        # every object the master held is gone; what the directory still names past one TTL
        # (and its sidecar cannot serve) is stale
        left = plan.replica_ttl_s + 1.0 - (time.monotonic() - restarted)
        if left > 0:
            await asyncio.sleep(left)
        stale = await self.lost_blocks_named(named)
        rec.detail["replica_blocks_at_kill"] = {w: len(b) for w, b in named.items()}
        rec.detail["lost_blocks_named_after_ttl"] = stale
        unread = sorted(w for w, n in stale.items() if n is None)
        if unread:
            rec.problems.append(f"the directory could not be read for {unread}'s replicas")
        if any(stale.values()):
            rec.problems.append(
                f"{plan.replica_ttl_s + 1.0:g} s after the master's restart the directory "
                f"still named blocks whose artifacts it lost, as sidecar replicas: {stale}"
            )
        rec.detail["router_fetches"] = _delta(before, await self.fetch_counts())

    async def sidecar_replica_blocks(self, sample: int = 64) -> dict[str, list[int]]:
        """Per worker, up to `sample` blocks the directory names as its sidecar's replicas."""
        out: dict[str, list[int]] = {}
        for sc in self.topo.sidecars:
            out[sc.worker_id] = []
            for _ in range(2):
                with contextlib.suppress(RedisError, OSError):
                    out[sc.worker_id] = await self.probe.replica_blocks(
                        sc.worker_id, tiers=("cpu", "ssd"), limit=sample
                    )
                    break
        return out

    async def lost_blocks_named(self, named: dict[str, list[int]]) -> dict[str, int | None]:
        """Of `named` (blocks per worker), those the directory still names as the worker's
        sidecar replicas whose artifact its sidecar does not serve (None: the directory could
        not be read, twice)."""
        out: dict[str, int | None] = {}
        for worker, blocks in named.items():
            sc = self.topo.sidecar(worker)
            still: set[int] | None = None
            for _ in range(2):  # the first call after a Redis restart finds its socket closed
                with contextlib.suppress(RedisError, OSError):
                    still = set(
                        await self.probe.replica_blocks(worker, tiers=("cpu", "ssd"), limit=None)
                    )
                    break
            if still is None:
                out[worker] = None
                continue
            n = 0
            for block in blocks:
                if block not in still:
                    continue
                key = head_keys(MODEL, block, (0,))[0]
                try:
                    resp = await self.http.get(f"{sc.url}/ownerserve/kv/artifacts/{key}")
                except httpx.HTTPError:
                    continue
                if resp.status_code == 404:
                    n += 1
            out[worker] = n
        return out

    async def restart_router(self, rec: FaultRecord, r: Replica) -> None:
        t = time.monotonic()
        await asyncio.to_thread(r.stop)
        stopped = time.monotonic() - t
        await asyncio.to_thread(r.start)
        rec.detail["stop_s"] = round(stopped, 2)
        rec.detail["down_s"] = round(time.monotonic() - t, 2)

    # --- after the load ----------------------------------------------------------------------

    async def recover(self) -> list[str]:
        """Bring back whatever a fault left down (it should be nothing)."""
        notes = []
        for w in self.topo.workers:
            if not w.alive():
                notes.append(f"worker {w.worker_id} was down at the end: started again")
                await asyncio.to_thread(w.start)
                await asyncio.to_thread(w.wait_healthy)
        for sc in self.topo.sidecars:
            if not sc.alive():
                notes.append(f"sidecar {sc.worker_id} was down at the end: started again")
                await asyncio.to_thread(sc.start)
                await asyncio.to_thread(sc.wait_healthy)
        master = self.topo.master
        if master is not None and not master.running():
            notes.append("the Mooncake Store master was down at the end: started again")
            await asyncio.to_thread(master.start)
        if not self.topo.redis.alive():
            notes.append("redis was down at the end: started again")
            await asyncio.to_thread(self.topo.redis.start, REDIS_START_S)
        for r in self.topo.replicas:
            if r.pid is None:
                notes.append(f"router {r.name} was down at the end: started again")
                await asyncio.to_thread(r.start)
        return notes

    async def settle(
        self, baseline: dict[str, dict[str, float] | None]
    ) -> tuple[float | None, dict[str, dict[str, float] | None]]:
        """Wait until every gauge is back at its value before the load; (seconds it took or
        None, the last values)."""
        last: dict[str, dict[str, float] | None] = {}

        async def idle() -> bool:
            nonlocal last
            last = await self.gauges()
            return all(now is not None and now == baseline.get(name) for name, now in last.items())

        took = await self.wait_for(idle, self.plan.settle_s, poll_s=0.5)
        return took, last

    async def stale_leases(self) -> dict[str, int]:
        """Per worker killed during the run: its live leases granted before its last restart
        (the KV they name died with it)."""
        last_epoch: dict[str, int] = {}
        for d in self.deaths:
            last_epoch[d.worker] = max(last_epoch.get(d.worker, -1), d.restart_epoch)
        leases = await self.probe.live_leases()
        return {
            w: sum(1 for e in leases.get(w, []) if e <= epoch) for w, epoch in last_epoch.items()
        }


async def _run_async(plan: ChaosPlan, topo: Topology, command: str) -> dict[str, Any]:
    from loadgen.chaos.report import build_report

    run = _Run(plan, topo)
    try:
        baseline = await run.gauges()
        start_stats = {r.name: proc_stats(r.pid) if r.pid else None for r in topo.replicas}
        skipped = unsupported(plan.faults, plan.sidecar_mode())
        kinds = tuple(k for k in plan.faults if k not in skipped)
        prefill = [w.worker_id for w in topo.cluster.by_role("prefill")]
        victims = [w.worker_id for w in topo.workers if w.role != "prefill"]
        if "pd_drop" in kinds and not (prefill and topo.cluster.by_role("decode")):
            kinds = tuple(k for k in kinds if k != "pd_drop")
            skipped["pd_drop"] = "the topology has no P/D pair (--prefill and --decode >= 1)"
        warmup = min(10.0, plan.duration_s * 0.1)
        schedule = (
            fault_schedule(
                kinds,
                plan.repeats,
                warmup,
                plan.duration_s * 0.85,
                plan.seed,
                victims=victims,
                prefill=prefill,
                replica=topo.replicas[-1].name,
                sidecars=[sc.worker_id for sc in topo.sidecars if sc.worker_id in victims],
            )
            if kinds
            else ()
        )
        opts = LoadOptions(
            targets=tuple(r.url for r in topo.replicas),
            sessions=plan.sessions,
            duration_s=plan.duration_s,
            seed=plan.seed,
            model=MODEL,
            stream_share=plan.stream_share,
            hang_s=plan.hang_s,
            recover_s=plan.recover_s,
            time_scale=plan.time_scale,
        )
        run.load = ChaosLoad(opts)
        sampler = asyncio.create_task(run.sample_forever())
        load_task = asyncio.create_task(run.load.run())
        await asyncio.sleep(0)  # the load's clock starts in its task
        faults = asyncio.create_task(run.run_schedule(schedule, run.load.t0))
        result: LoadResult = await load_task
        run.log("load ended; waiting for the fault in progress, if any")
        run.no_more_faults.set()
        await faults  # every fault's waits are bounded
        notes = await run.recover()
        run.log("settling: every gauge back to its value before the load")
        settle_s, end_gauges = await run.settle(baseline)
        stale = await run.stale_leases()
        try:
            slow = {
                "slowest_commands": await run.probe.slow_commands(),
                "latency_events": await run.probe.latency_events(),
            }
        except (RedisError, OSError) as exc:
            slow = {"error": repr(exc)}
        end_stats = {r.name: proc_stats(r.pid) if r.pid else None for r in topo.replicas}
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        router_counters = {}
        for r in topo.replicas:
            router_counters[r.name] = await counters(run.http, r.url, ROUTER_COUNTERS)
        return build_report(
            plan=plan,
            command=command,
            schedule=schedule,
            skipped=skipped,
            result=result,
            records=run.records,
            deaths=run.deaths,
            baseline=baseline,
            end_gauges=end_gauges,
            settle_s=settle_s,
            stale_leases=stale,
            samples=run.samples,
            start_stats={k: dataclasses.asdict(v) if v else None for k, v in start_stats.items()},
            end_stats={k: dataclasses.asdict(v) if v else None for k, v in end_stats.items()},
            router_counters=router_counters,
            workers={w.worker_id: w.role for w in topo.workers},
            redis_slow=slow,
            notes=notes,
        )
    finally:
        await run.close()


def run_chaos(plan: ChaosPlan, command: str = "") -> dict[str, Any]:
    """Start the topology, run, stop it; the report (also written to `plan.out_dir`)."""
    from loadgen.chaos.report import write_report

    plan.check()
    topo = Topology(
        plan.spec(),
        plan.log_dir,
        lease_s=plan.lease_s,
        replica_ttl_s=plan.replica_ttl_s,
        timeouts=plan.timeouts,
        kv_sidecars=plan.sidecar_mode(),
    )
    topo.start()
    try:
        report = asyncio.run(_run_async(plan, topo, command))
    finally:
        for w in topo.workers:  # a worker left stopped would ignore SIGTERM
            if w.process is not None and w.alive() and w.process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(w.process.pid, signal.SIGCONT)
        topo.stop()
    write_report(report, plan.out_dir)
    return report


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """`after - before` per key, the keys that changed (a replica restarted meanwhile counts
    from 0 again: its keys then show what it counted since)."""
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items()) if v != before.get(k)}
