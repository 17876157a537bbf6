"""The Redis ownership directory, shared by every router replica: one Lua script per operation.

Every operation is one round trip (`EVALSHA`; `EVALSHA_RO` for the scripts that only read,
lookup and artifact_info, where the server has it (Redis >= 7); or a plain `GET` for the
session owner); a lookup costs one round trip for a chain of any length. Writes whose entries
have no bound (`add_replica`, `drop_worker`, `sweep`, `restore_cached`, a cached view dropped
by `apply_events` or `register_worker`) go in script steps of ~256 entries instead
(`*_STEP_ENTRIES`): Redis serves nothing else while a script runs. Leases use the server's
clock (`redis.call('TIME')`), never the client's.

Key layout (namespace `ns` = `DirectorySettings.key_prefix`; `P` = `{ns}:`, a Redis Cluster
hash tag, so every key of one namespace lives in one slot and every script is single-slot):

    P blk            HASH  block hex -> one record per block: owner artifact id (16 hex
                           digits, or dashes) + cached bytes (byte j: tier bits, gpu 1 cpu 2
                           ssd 4, of the worker with index j, from its KV events) + "\n" +
                           replica lines "worker\ttier\texpires_ms\tread_only\n"
                           (a held line: expires_ms is "h<incarnation>", live while its
                           holder's lease is, at that incarnation)
    P hold           HASH  "worker\ttier" -> "incarnation\texpires_ms": replica holders'
                           liveness leases (`renew_replica_holder`: one HSET a renewal)
    P hx / hxc       ZSET / HASH  holder -> its expiry, or now where a purge of a
                           superseded incarnation is due (a hint for `sweep`); holder -> the
                           cursor of a purge under way (an SSCAN of its worker's :reps)
    P art            HASH  artifact id hex -> "worker\tepoch\texpires_ms\ttier"  (leases)
    P a:<id>         HASH  artifact metadata: worker epoch start n size kv tier created
                           blocks (hex of chain[start:])
    P reuse / last   HASH  artifact id hex -> reuse count / last access ms (batched touches)
    P epoch          STRING  fencing epoch counter (INCR; never reused, even after expiry)
    P workers / widx HASH  worker -> index / index -> worker;  P wnext: index counter
    P w:<worker>     HASH  root, bs (block size), idx, seq (last applied event batch), life
                           (times dropped: fences a drop by a replica that saw an older life)
    P w:<worker>:eh  HASH  engine hash (decimal) -> block hex;  :arts :reps :sess  SETs
                           (its artifacts, replica blocks, sessions: what drop_worker undoes;
                           `transfer` moves ids from one worker's :arts to another's)
    P w:<worker>:drops  SET  lives being dropped; their index sets moved aside as
                           w:<worker>:d<life>:arts/:reps/:sess/:eh (drop_worker's steps)
    P w:<worker>:clears  SET  cached views being dropped (numbered by P clrn), each an :eh
                           moved aside as w:<worker>:clr<n> (clear_step's steps empty them);
                           :clrfresh  SET  blocks stored since the latest (left alone)
    P s:<session>    STRING  decode owner, with a TTL (PX)
    P f:<id>         SET   sessions sharing the artifact copy-on-write (fork refs)
    P kvn            HASH  d: blocks some worker caches on GPU, c: (block, worker) GPU pairs;
                           moved by every script that changes a cached byte's GPU bit
                           (`update_blocks` in common.lua), read by `cached_counts`

Block hashes are 16 hex digits; a chain travels as one string argument (one argument per
block measured no cheaper on the server: Redis builds the same Lua strings either way).
A lookup only reads: the chain's block records with one HMGET, cut into runs of identical
records (one string comparison per block), and the leases of the artifacts the runs name with
one more HMGET. The router turns runs and leases into holdings (`decode_lookup`): routers scale
out, the Redis core they share does not. Reuse counts are batched by the client
(`record_touches`, `touch.lua`).

Trade-off of the one-slot layout: a namespace is served by one Redis master (Cluster then
buys fail-over and lets several namespaces, e.g. one per model or tenant, spread over
masters), in exchange for atomic multi-key scripts without cross-slot moves. Sharding one
namespace by block would make a lookup touch many slots: many round trips.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import time
from collections.abc import Sequence
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlparse, urlunparse

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError

from ownerserve.directory.base import (
    Artifact,
    ArtifactInfo,
    CachedCounts,
    DirectoryHealth,
    EventApplyResult,
    Holding,
    HoldKind,
    Lease,
    Match,
)
from ownerserve.directory.common import (
    TIER_BIT,
    ReplicaEntryPoints,
    ReplicaWrite,
    TransferEntryPoints,
    TransferMove,
    check_artifact,
    check_holder,
    check_ttl,
    check_worker,
    hex_block,
    hex_blocks,
    holder_lapsed,
    holder_not_live,
    sort_holdings,
)
from ownerserve.directory.restorable import GroupHoldings, annotate
from ownerserve.errors import DirectoryUnavailableError, InvalidRequestError, StaleEpochError
from ownerserve.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from ownerserve.hashing import hash_block
from ownerserve.types import TIER_ORDER, Tier

log = logging.getLogger(__name__)

SCRIPT_NAMES = (
    "lookup",
    "claim",
    "renew",
    "release",
    "add_replica",
    "transfer",
    "set_session",
    "fork",
    "register_worker",
    "apply_events",
    "drop_worker",
    "artifact_info",
    "sweep",
    "sweep_due",
    "sweep_index",
    "boot",
    "raise_epoch",
    "restore_cached",
    "touch",
    "clear_step",
    "holder",
    "add_held",
    "drop_replicas",
)
FULL_SWEEP_S = 86_400.0
"""At most this long between sweeps that scan every lease and block record (which also write
the expiry hints the sweeps in between follow: a hint missed for any reason is mended then)."""
STEP_ENTRIES = 256
"""By default (`directory.redis_step_entries`), at most about this many entries per script
call of the writes whose entries have no bound (`RedisDirectory.step_entries`): Redis runs one
script at a time and serves nothing else meanwhile, so a step stays in the milliseconds. In one
call each had held Redis for seconds: `sweep_due` over long expired chains 1.3-5.9 s, a
`drop_worker` of a worker holding 10^5 leases, replica blocks and cached blocks 1.1-4.1 s (the
chaos runs' slow log), an `add_replica` over a long chain 1.44 s (while Redis replayed its
AOF), a gap dropping 10^5 cached blocks 0.2 s (bench/directory/steps.py). An entry: an expiry
hint and the block records it leads to (`sweep_due`), an index entry undone (`drop_worker`),
a block (`add_replica`, `clear_step`), an engine hash (`restore_cached`)."""
ENGINE_MAP_LIMIT = 32_768
"""By default (`directory.engine_map_entries`), per worker, the engine hashes whose block
hashes this router keeps (a cache of Redis's `w:<worker>:eh`, read for a stored event's
parent): a removed block leaves it, and past the limit the oldest quarter goes (a parent not
here costs one HMGET). It was 10^6 entries and kept every block ever stored: ~150 B an entry,
the router's largest growth under the chaos load (bench/router_memory/growth.py)."""
TOUCH_FLUSH_S = 0.5
TOUCH_FLUSH_IDS = 512
"""Reuse counts from lookups are sent in batches: at most this late, or this many artifacts."""
_TRUE = ("1", "true", "yes", "on")
_TIERS = {t.value: t for t in Tier}


def load_script_sources() -> dict[str, str]:
    """Source of every script: the shared prelude (`common.lua`) plus the script itself."""
    pkg = resources.files("ownerserve.directory") / "lua"
    common = (pkg / "common.lua").read_text()
    return {name: common + "\n" + (pkg / f"{name}.lua").read_text() for name in SCRIPT_NAMES}


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def split_cluster_flag(url: str) -> tuple[str, bool]:
    """`redis://h:p/?cluster=1` -> (`redis://h:p/`, True): the flag is ours, not redis-py's."""
    parsed = urlparse(url)
    query = parse_qsl(parsed.query, keep_blank_values=True)
    flags = [v for k, v in query if k == "cluster"]
    rest = [(k, v) for k, v in query if k != "cluster"]
    cluster = bool(flags) and flags[-1].lower() in _TRUE
    return urlunparse(parsed._replace(query=urlencode(rest))), cluster


class RedisDirectory(TransferEntryPoints, ReplicaEntryPoints):
    """`Directory` on one Redis server or a Redis Cluster (redis-py asyncio)."""

    backend_name = "redis"

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        namespace: str = "os",
        *,
        step_entries: int = STEP_ENTRIES,
        engine_map_limit: int = ENGINE_MAP_LIMIT,
    ) -> None:
        if not namespace or any(c in namespace for c in "{}"):
            raise InvalidRequestError(f"invalid directory namespace {namespace!r}")
        if step_entries < 1 or engine_map_limit < 1:
            raise InvalidRequestError("step_entries and engine_map_limit must be >= 1")
        self.step_entries = step_entries
        """Entries per script call of the stepped writes (`STEP_ENTRIES`)."""
        self.engine_map_limit = engine_map_limit
        """Engine hashes kept per worker (`ENGINE_MAP_LIMIT`)."""
        self._client = client
        self.namespace = namespace
        self.prefix = "{" + namespace + "}:"
        self._scripts: dict[str, AsyncScript] = {
            name: client.register_script(src) for name, src in load_script_sources().items()
        }
        # per worker: (root, block size) and engine hash -> block hash, both caches of Redis
        self._registration: dict[str, tuple[int, int]] = {}
        self._engine_map: dict[str, dict[int, int]] = {}
        self._worker_names: dict[int, str] = {}  # cached-byte index -> worker (from `widx`)
        self._touches: dict[str, int] = {}  # artifact id hex -> reuses not yet sent
        self.touches_lost = 0
        """Reuse counts dropped because Redis could not take them at close."""
        self._touch_deadline = 0.0
        self._touch_task: asyncio.Task[None] | None = None
        self.read_only_scripts: bool | None = None
        """Whether the server takes `EVALSHA_RO` (None: no read script has run yet)."""
        self.groups = GroupHoldings()
        """KV cache groups of workers serving hybrid models, from the events this router
        applies (restorable units; kept in process, not in Redis)."""

    @classmethod
    def from_url(
        cls,
        url: str,
        namespace: str = "os",
        *,
        cluster: bool | None = None,
        socket_timeout_s: float = 1.0,
        max_connections: int = 64,
        step_entries: int = STEP_ENTRIES,
        engine_map_limit: int = ENGINE_MAP_LIMIT,
    ) -> RedisDirectory:
        """Connect to `url`; a Redis Cluster if `cluster` is true or the URL has `?cluster=1`."""
        plain, flagged = split_cluster_flag(url)
        kwargs: dict[str, Any] = {
            "decode_responses": True,
            "socket_timeout": socket_timeout_s,
            "socket_connect_timeout": socket_timeout_s,
        }
        client: aioredis.Redis | RedisCluster
        if cluster if cluster is not None else flagged:
            client = RedisCluster.from_url(plain, max_connections=max_connections, **kwargs)
        else:
            client = aioredis.Redis.from_url(plain, max_connections=max_connections, **kwargs)
        return cls(client, namespace, step_entries=step_entries, engine_map_limit=engine_map_limit)

    @property
    def client(self) -> aioredis.Redis | RedisCluster:
        return self._client

    def key(self, name: str) -> str:
        return self.prefix + name

    async def _run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        return await self._scripts[name](keys=list(keys), args=[self.prefix, *args])

    async def _run_read(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """A script that only reads (`args` as sent: the prefix first), as `EVALSHA_RO`
        (Redis >= 7): a read to replicas, read-only routing and ACLs. On an older server
        ("unknown command") this client sends `EVALSHA` from then on, as `_run` does."""
        script = self._scripts[name]
        if self.read_only_scripts is not False:
            flat = [*keys, *args]
            try:
                try:
                    reply = await self._client.evalsha_ro(script.sha, len(keys), *flat)
                except NoScriptError:  # a restarted or flushed server: load it once more
                    await self._client.script_load(script.script)
                    reply = await self._client.evalsha_ro(script.sha, len(keys), *flat)
            except RedisError as exc:
                # the server's answer, or redis-py's cluster client's (it finds the keys by
                # COMMAND, which lists no such command there)
                said = str(exc).lower()
                if "unknown command" not in said and "doesn't exist in redis commands" not in said:
                    raise
                self.read_only_scripts = False
                log.info("directory: Redis has no EVALSHA_RO (before 7.0): reads use EVALSHA")
            else:
                self.read_only_scripts = True
                return reply
        return await script(keys=list(keys), args=list(args))

    # --- lookup ----------------------------------------------------------------------------

    def lookup_call(
        self, chain: Sequence[int], session_id: str | None = None
    ) -> tuple[str, list[str], list[Any]]:
        """(script sha, keys, args) of a lookup: lets a benchmark pipeline many lookups."""
        p = self.prefix
        keys = [p + "blk", p + "art", p + "hold"]
        if session_id is not None:
            keys.append(p + "s:" + session_id)
        return self._scripts["lookup"].sha, keys, [p, hex_blocks(chain)]

    async def lookup(self, chain: Sequence[int], session_id: str | None = None) -> Match:
        _, keys, args = self.lookup_call(chain, session_id)
        reply = await self._run_read("lookup", keys, args)
        try:
            match, touched = self.decode_lookup(len(chain), reply)
        except KeyError:  # a worker registered since we last read the index -> name map
            await self.refresh_worker_names()
            match, touched = self.decode_lookup(len(chain), reply, strict=False)
        self.record_touches(touched)
        return annotate(self.groups, match, chain)

    async def refresh_worker_names(self) -> None:
        names = await self._client.hgetall(self.key("widx"))
        self._worker_names = {int(_s(k)): _s(v) for k, v in names.items()}

    def decode_lookup(
        self, chain_len: int, reply: Sequence[Any], strict: bool = True
    ) -> tuple[Match, list[str]]:
        """The `Match` of a lookup script's reply, and the live artifacts it met (to count
        their reuse). The script only reads (block records run by run, the leases they name);
        the holdings are worked out here, in the router, so the one Redis core every router
        shares does the least. An unknown worker index raises KeyError (`strict`) or drops
        that holding. Same rules as `InMemoryDirectory.lookup`."""
        sess, now, runs, leases, held_by = reply
        now = int(now)
        holders: dict[str, str] = {}  # "worker\ttier" -> incarnation, of the live holders
        for i in range(0, len(held_by), 2):
            inc, _, expires = _s(held_by[i + 1]).partition("\t")
            if int(expires) > now:
                holders[_s(held_by[i])] = inc
        live: dict[str, tuple[str, int, Tier]] = {}
        for i in range(0, len(leases), 2):
            rec = _s(leases[i + 1])
            if rec:
                holder, lease_epoch, lease_expires, lease_tier = rec.split("\t")
                if int(lease_expires) > now:
                    live[_s(leases[i])] = (holder, int(lease_epoch), _TIERS[lease_tier])
        best: dict[tuple[str, Tier, HoldKind], int] = {}
        deep: dict[str, int] = {}
        replicas: dict[tuple[str, Tier], int] = {}
        alive: dict[int, int] = {}
        ended: list[tuple[int, int, int]] = []  # (worker index, tier bits, blocks)
        cached_open, last_cache, start = True, None, 1
        for k in range(0, len(runs), 2):
            end, rec = int(runs[k]), _s(runs[k + 1])
            first, start = start, end + 1
            if not rec:
                if cached_open:
                    ended += [(j, m, first - 1) for j, m in alive.items()]
                    alive, cached_open = {}, False
                continue
            nl = rec.index("\n", 16)
            own = rec[:16]
            if own in live:
                deep[own] = end
            if nl + 1 < len(rec):
                for line in rec[nl + 1 : -1].split("\n"):
                    worker, tier, expires, _ro = line.split("\t")
                    if (
                        holders.get(worker + "\t" + tier) == expires[1:]
                        if expires[0] == "h"
                        else int(expires) > now
                    ):
                        replicas[(worker, _TIERS[tier])] = end
            cache = rec[16:nl]
            if cached_open and cache != last_cache:
                last_cache = cache
                if first == 1:
                    alive = {j + 1: ord(c) for j, c in enumerate(cache) if c != "\0"}
                else:
                    for j, m in list(alive.items()):
                        kept = m & (ord(cache[j - 1]) if j <= len(cache) else 0)
                        if kept != m:
                            ended.append((j, m & ~kept, first - 1))
                            if kept:
                                alive[j] = kept
                            else:
                                del alive[j]
                cached_open = bool(alive)
        ended += [(j, m, chain_len) for j, m in alive.items()]

        owner: tuple[int, str, int, str] | None = None
        for aid, d in deep.items():
            worker, epoch, tier = live[aid]
            key = (worker, tier, HoldKind.OWNER)
            if best.get(key, 0) < d:
                best[key] = d
            if owner is None or d > owner[0]:
                owner = (d, worker, epoch, aid)
        for (worker, tier), d in replicas.items():
            best[(worker, tier, HoldKind.REPLICA)] = d
        names = self._worker_names
        for j, mask, d in ended:
            name = names.get(j)
            if name is None:
                if strict:
                    raise KeyError(j)
                continue
            for tier in TIER_ORDER:
                if mask & TIER_BIT[tier]:
                    best[(name, tier, HoldKind.CACHED)] = d
        holdings = [Holding(w, t, b, kind) for (w, t, kind), b in best.items()]
        match = Match(
            chain_len=chain_len,
            holdings=sort_holdings(holdings),
            owner=owner[1] if owner else None,
            owner_blocks=owner[0] if owner else 0,
            owner_epoch=owner[2] if owner else 0,
            session_owner=_s(sess) if sess is not None else None,
            owner_artifact_id=int(owner[3], 16) if owner else None,
        )
        return match, list(deep)

    def record_touches(self, touched: Sequence[str]) -> None:
        """Count a reuse of every live artifact a lookup met (ids in hex); sent in the
        background in batches (`TOUCH_FLUSH_S`, `TOUCH_FLUSH_IDS`), so a lookup stays one
        round trip and writes nothing."""
        touches = self._touches
        for aid in touched:
            touches[aid] = touches.get(aid, 0) + 1
        if not touches:
            return
        now = time.monotonic()
        if not self._touch_deadline:
            self._touch_deadline = now + TOUCH_FLUSH_S
        due = len(touches) >= TOUCH_FLUSH_IDS or now >= self._touch_deadline
        if due and (self._touch_task is None or self._touch_task.done()):
            self._touch_task = asyncio.create_task(self._flush_touches_quietly())

    async def flush_touches(self) -> int:
        """Send the batched reuse counts now; returns how many artifacts were counted."""
        if not self._touches:
            return 0
        batch, self._touches, self._touch_deadline = self._touches, {}, 0.0
        args: list[Any] = []
        for aid, count in batch.items():
            args += [aid, count]
        p = self.prefix
        try:
            return int(await self._run("touch", [p + "reuse", p + "last", p + "art"], args))
        except BaseException:
            for aid, count in batch.items():  # keep them for the next flush
                self._touches[aid] = self._touches.get(aid, 0) + count
            raise

    async def _flush_touches_quietly(self) -> None:
        try:
            await self.flush_touches()
        except Exception as exc:  # counts are kept; a later flush retries
            log.debug("directory: reuse counts not sent yet: %s", exc)

    # --- leases ----------------------------------------------------------------------------

    async def claim(
        self, artifact: Artifact, worker: str, lease_s: float, fence_epoch: int | None = None
    ) -> Lease:
        check_worker(worker)
        check_artifact(artifact)
        lease_s = check_ttl(lease_s)
        fence_block = ""
        if fence_epoch is not None:
            if artifact.start == 0:
                raise InvalidRequestError("a fenced claim extends a prefix: start must be > 0")
            fence_block = hex_block(artifact.chain[artifact.start - 1])
        p = self.prefix
        reply = await self._run(
            "claim",
            [p + "blk", p + "art", p + "epoch"],
            [
                hex_block(artifact.artifact_id),
                worker,
                _ms(lease_s),
                Tier(artifact.tier).value,
                int(artifact.size_bytes),
                artifact.kv_type,
                artifact.start,
                hex_blocks(artifact.blocks),
                "" if fence_epoch is None else int(fence_epoch),
                fence_block,
            ],
        )
        if reply[0] == "stale":
            raise StaleEpochError(
                f"{worker} no longer owns the prefix at epoch {fence_epoch}"
                f" (current epoch {reply[1]})"
            )
        _, aid, owner, epoch, expires_ms = reply
        return Lease(int(aid, 16), owner, int(epoch), int(expires_ms) / 1000)

    async def renew(self, artifact_id: int, worker: str, epoch: int, lease_s: float) -> Lease:
        lease_s = check_ttl(lease_s)
        reply = await self._run(
            "renew",
            [self.key("art")],
            [hex_block(artifact_id), worker, int(epoch), _ms(lease_s)],
        )
        if reply[0] == "stale":
            raise StaleEpochError(
                f"cannot renew {artifact_id:016x} for {worker} at epoch {epoch}: {reply[2]}"
                f" (current epoch {reply[1]})"
            )
        return Lease(artifact_id, worker, int(epoch), int(reply[1]) / 1000)

    async def release(self, artifact_id: int, worker: str, epoch: int) -> None:
        reply = await self._run(
            "release", [self.key("art")], [hex_block(artifact_id), worker, int(epoch)]
        )
        if reply[0] == "stale":
            raise StaleEpochError(
                f"stale epoch {epoch} for {worker}: artifact is at epoch {reply[1]}"
            )

    async def put_replica(self, write: ReplicaWrite) -> None:
        await self.put_replica_steps(write)

    async def put_replica_steps(self, write: ReplicaWrite, step_entries: int | None = None) -> None:
        """`add_replica` in script calls of `step_entries` blocks each, from the chain's first
        block on, every line with the first call's expiry (the artifact's own blocks are read
        once, before). Between calls a reader sees the copy on a leading part of the blocks,
        listed in the worker's `:reps` set there; a call that fails leaves that part, which
        expires with the copy."""
        if write.blocks:
            hexed = hex_blocks(write.blocks)
        else:
            aid = hex_block(write.artifact_id)
            hexed = _s(await self._client.hget(self.key("a:" + aid), "blocks") or aid)
        head = [write.worker, write.tier.value, _ms(write.ttl_s), 1 if write.read_only else 0]
        expires: int | str = ""
        step = 16 * (step_entries or self.step_entries)
        for first in range(0, len(hexed), step):
            part = hexed[first : first + step]
            expires = int(await self._run("add_replica", [self.key("blk")], [*head, part, expires]))

    # --- replica holders ---------------------------------------------------------------------

    async def renew_replica_holder(
        self, worker: str, tier: Tier, incarnation: int, ttl_s: float
    ) -> bool:
        """One script (`holder.lua`): an HSET of the holder's record and a ZADD of its hint."""
        tier = check_holder(worker, tier, incarnation)
        ttl_s = check_ttl(ttl_s, "ttl_s")
        reply = int(
            await self._run(
                "holder",
                [self.key("hold"), self.key("hx")],
                [worker, tier.value, str(incarnation), _ms(ttl_s)],
            )
        )
        if reply < 0:
            raise holder_lapsed(worker, tier, incarnation)
        return reply == 1

    async def add_held_replicas(
        self, worker: str, tier: Tier, incarnation: int, blocks: Sequence[int]
    ) -> None:
        """In script calls of `step_entries` blocks each (`add_held.lua`), each checking the
        holder: one that fails leaves the lines written before it, which live with the
        holder (a reader sees the copy on a part of `blocks`)."""
        tier = check_holder(worker, tier, incarnation)
        hexed = hex_blocks(blocks)
        step = 16 * self.step_entries
        for first in range(0, len(hexed), step):
            part = hexed[first : first + step]
            ok = await self._run(
                "add_held", [self.key("blk")], [worker, tier.value, str(incarnation), part]
            )
            if int(ok) < 0:
                raise holder_not_live(worker, tier, incarnation)

    async def drop_replicas(self, worker: str, tier: Tier, blocks: Sequence[int]) -> int:
        """In script calls of `step_entries` blocks each (`drop_replicas.lua`)."""
        check_worker(worker)
        tier = Tier(tier)
        hexed = hex_blocks(blocks)
        step = 16 * self.step_entries
        dropped = 0
        for first in range(0, len(hexed), step):
            part = hexed[first : first + step]
            dropped += int(
                await self._run("drop_replicas", [self.key("blk")], [worker, tier.value, part])
            )
        return dropped

    async def move_leases(self, move: TransferMove) -> tuple[int, tuple[Lease, ...]]:
        """One script (`transfer.lua`): the replica lines and the owners are one pass over the
        chain's block records."""
        p = self.prefix
        reply = await self._run(
            "transfer",
            [p + "blk", p + "art", p + "epoch"],
            [
                hex_blocks(move.chain),
                move.from_worker,
                move.to_worker,
                _ms(move.lease_s),
                _ms(move.replica_ttl_s),
                move.tier.value,
            ],
        )
        epoch = int(reply[1])
        leases = tuple(
            Lease(int(_s(reply[k]), 16), move.to_worker, epoch, int(reply[k + 1]) / 1000)
            for k in range(2, len(reply), 2)
        )
        return int(reply[0]), leases

    # --- sessions and forks ------------------------------------------------------------------

    async def set_session_owner(self, session_id: str, worker: str, ttl_s: float) -> None:
        check_worker(worker)
        ttl_s = check_ttl(ttl_s, "ttl_s")
        await self._run(
            "set_session", [self.key("s:" + session_id)], [session_id, worker, _ms(ttl_s)]
        )

    async def get_session_owner(self, session_id: str) -> str | None:
        value = await self._client.get(self.key("s:" + session_id))
        return _s(value) if value is not None else None

    async def add_fork_ref(self, artifact_id: int, session_id: str) -> int:
        key = self.key("f:" + hex_block(artifact_id))
        return int(await self._run("fork", [key], ["add", session_id]))

    async def drop_fork_ref(self, artifact_id: int, session_id: str) -> int:
        key = self.key("f:" + hex_block(artifact_id))
        return int(await self._run("fork", [key], ["drop", session_id]))

    # --- workers and KV events -----------------------------------------------------------------

    async def register_worker(self, worker: str, model_root: int, block_size: int) -> None:
        check_worker(worker)
        if block_size <= 0:
            raise InvalidRequestError("block_size must be positive")
        p = self.prefix
        await self._run(
            "register_worker",
            [p + "workers", p + "widx", p + "w:" + worker, p + "wnext"],
            [worker, hex_block(model_root), int(block_size)],
        )
        await self._clear_steps(worker)  # a new chain root or block size drops the old view
        self._registration[worker] = (model_root, block_size)
        self.groups.register_worker(worker, model_root, block_size)

    async def _fetch_registration(self, worker: str) -> tuple[int, int]:
        root, bs = await self._client.hmget(self.key("w:" + worker), ["root", "bs"])
        if root is None or bs is None:
            raise InvalidRequestError(f"worker {worker!r} is not registered with the directory")
        reg = (int(_s(root), 16), int(bs))
        self._registration[worker] = reg
        self.groups.register_worker(worker, *reg)
        return reg

    async def _known_parents(self, worker: str, batch: EventBatch) -> dict[int, int]:
        """Block hashes of stored events' parents that the local map lacks (one HMGET)."""
        local = self._engine_map.setdefault(worker, {})
        stored_here: set[int] = set()
        missing: list[int] = []
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                parent = ev.parent_engine_hash
                if parent is not None and parent not in local and parent not in stored_here:
                    missing.append(parent)
                stored_here.update(ev.engine_hashes)
        if not missing:
            return {}
        values = await self._client.hmget(
            self.key("w:" + worker + ":eh"), [str(m) for m in missing]
        )
        return {m: int(_s(v), 16) for m, v in zip(missing, values, strict=True) if v is not None}

    def _event_args(
        self,
        worker: str,
        root: int,
        block_size: int,
        batch: EventBatch,
        fetched: dict[int, int],
        life: int | None = None,
    ) -> list[Any]:
        local = self._engine_map.setdefault(worker, {})
        local.update(fetched)
        ops: list[Any] = []
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                n = len(ev.engine_hashes)
                if ev.block_size != block_size or len(ev.token_ids) != n * block_size:
                    ops += ["X", n]
                    continue
                if ev.parent_engine_hash is None:
                    parent: int | None = root
                else:
                    parent = local.get(ev.parent_engine_hash)
                if parent is None:
                    ops += ["Y", n]
                    continue
                parent_hex = "" if ev.parent_engine_hash is None else hex_block(parent)
                blocks: list[int] = []
                for k, engine_hash in enumerate(ev.engine_hashes):
                    parent = hash_block(parent, ev.token_ids[k * block_size : (k + 1) * block_size])
                    blocks.append(parent)
                    local[engine_hash] = parent
                ops += [
                    "S",
                    TIER_BIT[Tier(ev.tier)],
                    "" if ev.parent_engine_hash is None else str(ev.parent_engine_hash),
                    parent_hex,
                    hex_blocks(blocks),
                    ",".join(str(h) for h in ev.engine_hashes),
                ]
            elif isinstance(ev, BlockRemoved):
                for engine_hash in ev.engine_hashes:
                    local.pop(engine_hash, None)
                if ev.engine_hashes:
                    csv = ",".join(str(h) for h in ev.engine_hashes)
                    ops += ["R", TIER_BIT[Tier(ev.tier)], csv]
            elif isinstance(ev, AllBlocksCleared):
                local.clear()
                ops.append("C")
        limit = self.engine_map_limit
        if len(local) > limit:
            for engine_hash in list(itertools.islice(local, len(local) - limit * 3 // 4)):
                del local[engine_hash]
        fence = "" if life is None else int(life)
        return [worker, hex_block(root), block_size, int(batch.seq), fence, *ops]

    async def apply_events(
        self, worker: str, batch: EventBatch, life: int | None = None
    ) -> EventApplyResult:
        check_worker(worker)
        p = self.prefix
        keys = [p + "w:" + worker, p + "w:" + worker + ":eh", p + "blk"]
        batch = self.groups.split(worker, batch)  # the chain index takes the chain group only
        for attempt in range(2):
            reg = self._registration.get(worker)
            if reg is None or attempt:
                reg = await self._fetch_registration(worker)
            fetched = await self._known_parents(worker, batch)
            args = self._event_args(worker, *reg, batch, fetched, life)
            reply = await self._run("apply_events", keys, args)
            status = reply[0]
            if status == "unknown":
                self._registration.pop(worker, None)
                raise InvalidRequestError(f"worker {worker!r} is not registered with the directory")
            if status == "reregistered":
                continue  # another router re-registered it: refetch root/block size, retry
            if status == "dup":
                return EventApplyResult(duplicate=True, expected_seq=int(reply[1]))
            if status == "fenced":
                return EventApplyResult(fenced=int(reply[1]))
            _, stored, removed, gap, expected, skipped, unknown_parent, pending = reply
            if int(pending):
                await self._clear_steps(worker)
            return EventApplyResult(
                stored=int(stored),
                removed=int(removed),
                gap=bool(int(gap)),
                expected_seq=int(expected) if int(gap) else None,
                skipped=int(skipped),
                unknown_parent=int(unknown_parent),
            )
        raise DirectoryUnavailableError(f"worker {worker!r} registration keeps changing")

    async def drop_worker(self, worker: str, life: int | None = None) -> int:
        check_worker(worker)
        return await self.drop_worker_steps(worker, life)

    async def drop_worker_steps(
        self, worker: str, life: int | None = None, step_entries: int | None = None
    ) -> int:
        """`drop_worker` in script calls of about `step_entries` entries each: the first ends
        the life and moves its index sets aside, the rest undo them until none is left (a
        drop another caller left unfinished included)."""
        check_worker(worker)
        keys = [self.key("blk"), self.key("w:" + worker)]
        arg = "" if life is None else life
        step_entries = step_entries or self.step_entries
        dropped, more = await self._run("drop_worker", keys, [worker, arg, step_entries])
        fenced = int(dropped) < 0  # that life was dropped already (by another router replica)
        total = 0 if fenced else int(dropped)
        while int(more):
            n, more = await self._run("drop_worker", keys, [worker, "+", step_entries])
            total += max(0, int(n))
        await self._clear_steps(worker)  # cached views a gap set aside before the death
        if fenced:
            return 0
        self._engine_map.pop(worker, None)
        self.groups.drop_worker(worker)
        return total

    async def _clear_steps(self, worker: str) -> int:
        """Run `clear_step` until none of `worker`'s cached views set aside is left (another
        router's included): the blocks whose cached bits went."""
        cleared, more = 0, 1
        while more:
            n, more = await self._run(
                "clear_step", [self.key("w:" + worker)], [worker, self.step_entries]
            )
            cleared, more = cleared + int(n), int(more)
        return cleared

    async def worker_life(self, worker: str) -> int:
        check_worker(worker)
        return int(await self._client.hget(self.key("w:" + worker), "life") or 0)

    # --- metadata and maintenance -----------------------------------------------------------

    async def artifact_info(self, artifact_id: int) -> ArtifactInfo | None:
        aid = hex_block(artifact_id)
        await self.flush_touches()
        reply = await self._run_read(
            "artifact_info",
            [self.key("art"), self.key("a:" + aid), self.key("f:" + aid), self.key("reuse")],
            [self.prefix, aid],
        )
        if reply is None:
            return None
        w, e, x, t, live, start, n, size, kv, created, last, reuse, refs = reply

        def num(v: Any) -> int:
            return int(v) if v is not None else 0

        return ArtifactInfo(
            artifact_id=artifact_id,
            worker=_s(w),
            epoch=int(e),
            expires_at=int(x) / 1000,
            live=bool(int(live)),
            start=num(start),
            blocks=num(n),
            size_bytes=num(size),
            kv_type=_s(kv) if kv is not None else "dense",
            tier=Tier(_s(t)),
            created_at=num(created) / 1000,
            last_access=num(last) / 1000,
            reuse_count=num(reuse),
            fork_refs=int(refs),
        )

    async def sweep(
        self,
        min_interval_s: float = 0.0,
        batch: int = 500,
        step_entries: int | None = None,
    ) -> int:
        """Expired leases and replica lines (counted), then the index sets that pointed at
        them: each worker's sessions that ended or moved on, fork refs of ended sessions (not
        counted, as sessions are not). One script step per `step_entries` entries touched
        (hints and the block records they lead to; `batch` records a step in the full scan)
        in between which Redis serves the other clients. With
        `min_interval_s`, router replicas take turns: a sweep starts only if it can set the
        namespace's `sweep` key, which expires after that time.

        Everything is found by expiry hints (`lx`, `rx`, `sx`, `fx`: sorted sets by expiry
        time, written with leases, replica lines, sessions and fork refs), so a sweep visits
        what is due, not every record. Once per `FULL_SWEEP_S` (and first on a dataset written
        before the hints existed) it scans every record and index set instead, writing the
        hints anew."""
        if min_interval_s > 0 and not await self._client.set(
            self.key("sweep"), "1", nx=True, px=_ms(min_interval_s)
        ):
            return 0
        await self.flush_touches()
        dropped = 0
        hinted = [self.key(k) for k in ("lx", "rx", "sx", "fx", "hx")]
        if await self._client.exists(self.key("xidx")):
            step_entries = step_entries or self.step_entries
            # each step handles one hint at least, and every hint handled leaves the due
            # range, but a holder's, which stays due while its scan of its worker's replica
            # blocks goes on (a page a step); the bound only guards the loop (hints written
            # meanwhile wait for the next)
            hints = sum([await self._client.zcard(k) for k in hinted])
            for holder in await self._client.zrange(self.key("hx"), 0, -1):
                held_by = _s(holder).rpartition("\t")[0]
                hints += 2 + await self._client.scard(self.key(f"w:{held_by}:reps"))
            for _ in range(hints + 1):
                handled, n, _ = await self._run("sweep_due", hinted, [step_entries])
                dropped += int(n)
                if int(handled) == 0:
                    break
            return dropped
        cursors = ["0", "0"]
        while cursors != ["-", "-"]:
            c1, c2, n = await self._run(
                "sweep", [self.key("art"), self.key("blk")], [*cursors, batch]
            )
            dropped += int(n)
            cursors = [c if c not in ("0", 0) else "-" for c in (_s(c1), _s(c2))]
        for worker in await self._client.smembers(self.key("wsess")):
            await self._sweep_index(self.key(f"w:{_s(worker)}:sess"), "sess", _s(worker), batch)
        await self._list_fork_sets(batch)
        await self._sweep_index(self.key("forks"), "forks", "", batch)
        await self._client.set(self.key("xidx"), "1", px=_ms(FULL_SWEEP_S))
        return dropped

    async def _list_fork_sets(self, batch: int) -> None:
        """List every fork-ref set of the namespace in `forks` (sets written before that
        index existed were not): a SCAN of the keyspace, so only in the daily full sweep."""
        head = self.key("f:")
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", head) + "*"
        ids: list[str] = []
        async for key in self._client.scan_iter(match=pattern, count=1000):
            ids.append(_s(key)[len(head) :])
            if len(ids) >= batch:
                await self._client.sadd(self.key("forks"), *ids)
                ids.clear()
        if ids:
            await self._client.sadd(self.key("forks"), *ids)

    async def _sweep_index(self, key: str, kind: str, worker: str, batch: int) -> None:
        cursor = "0"
        while True:
            cursor, _ = await self._run("sweep_index", [key], [kind, worker, cursor, batch])
            if _s(cursor) == "0":
                return

    # --- recovery after a data loss (used by ResilientDirectory) ------------------------------

    def registration(self, worker: str) -> tuple[int, int] | None:
        """(chain root, block size) of `worker` as this client last saw it registered."""
        return self._registration.get(worker)

    async def boot_token(self, token: str) -> str:
        """Set the dataset's boot token if it has none; return the token it holds."""
        return _s(await self._run("boot", [self.key("boot")], [token]))

    async def raise_epoch(self, floor: int) -> int:
        """Raise the fencing epoch counter to at least `floor`; returns its value."""
        return int(await self._run("raise_epoch", [self.key("epoch")], [int(floor)]))

    async def restore_cached(
        self,
        worker: str,
        entries: Sequence[tuple[int, int, int]],
        step_entries: int | None = None,
    ) -> int:
        """Re-record a registered worker's cached blocks: (engine hash, block hash, tier bits),
        in script calls of `step_entries` entries (a worker's whole cached view may be 10^5);
        the blocks recorded (a block in two calls counts twice), -1 if it is not registered."""
        p = self.prefix
        keys = [p + "w:" + worker, p + "w:" + worker + ":eh", p + "blk"]
        done = 0
        step = step_entries or self.step_entries
        for first in range(0, len(entries), step):
            args: list[Any] = [worker]
            for engine_hash, block, bits in entries[first : first + step]:
                args += [str(engine_hash), hex_block(block), int(bits)]
            n = int(await self._run("restore_cached", keys, args))
            if n < 0:
                return n
            done += n
        return done

    async def cached_counts(self) -> CachedCounts:
        """`kvn`'s counts (one HMGET): kept by the scripts as cached bits change, so they
        count from the first write of this layout on; a dataset written before it existed
        is not in them (a negative count, a removal of a block stored before, reads as 0)."""
        distinct, copies = await self._client.hmget(self.key("kvn"), ["d", "c"])
        return CachedCounts(max(0, int(distinct or 0)), max(0, int(copies or 0)))

    async def ping(self) -> float:
        """Round-trip time of a PING, in seconds (raises if Redis is unreachable)."""
        t0 = time.perf_counter()
        await self._client.ping()
        return time.perf_counter() - t0

    async def health(self) -> DirectoryHealth:
        try:
            rtt = await self.ping()
        except Exception as exc:  # any failure to reach Redis is what health reports
            return DirectoryHealth(self.backend_name, False, f"{type(exc).__name__}: {exc}")
        return DirectoryHealth(
            self.backend_name,
            True,
            f"ping {rtt * 1000:.2f} ms",
            stats={"ping_us": round(rtt * 1e6)},
        )

    async def flush_namespace(self) -> int:
        """Delete every key of this namespace (tests, benchmarks); returns how many went."""
        n = 0
        async for key in self._client.scan_iter(match=self.prefix + "*", count=1000):
            n += int(await self._client.delete(key))
        self._registration.clear()
        self._engine_map.clear()
        self._touches.clear()
        return n

    async def close(self) -> None:
        if self._touch_task is not None:
            # its own failures are caught (and retried by the flush below); only a cancel lands
            with contextlib.suppress(asyncio.CancelledError):
                await self._touch_task
        try:
            await self.flush_touches()
        except Exception as exc:
            # reuse counts only steer eviction: lose them, but say how many and why
            self.touches_lost += sum(self._touches.values())
            log.warning(
                "directory: %d reuse counts not sent at close: %r",
                sum(self._touches.values()),
                exc,
            )
            self._touches.clear()
        await self._client.aclose()
