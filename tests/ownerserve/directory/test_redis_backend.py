"""What only the Redis backend does: batched reuse counts, the worker-name map, script reloads,
the GPU-cached counts rebuilt after a data loss."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from ownerserve.directory import redis as redis_backend
from ownerserve.directory.base import Artifact, CachedCounts, Holding, HoldKind
from ownerserve.directory.common import ReplicaWrite
from ownerserve.directory.memory import InMemoryDirectory
from ownerserve.directory.redis import RedisDirectory
from ownerserve.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.types import Tier
from tests.conftest import RedisServer
from tests.waiting import until

BS = 4
ROOT = chain_root("redis-backend")
TOKENS = list(range(16 * BS))
CHAIN = tuple(block_hash_chain(TOKENS, BS, ROOT))


@pytest.fixture
async def pair(redis_server: RedisServer) -> AsyncIterator[tuple[RedisDirectory, RedisDirectory]]:
    ns = f"rb-{uuid.uuid4().hex[:8]}"
    a = RedisDirectory.from_url(redis_server.url, ns, socket_timeout_s=10)
    b = RedisDirectory.from_url(redis_server.url, ns, socket_timeout_s=10)
    yield a, b
    await a.flush_namespace()
    await a.close()
    await b.close()


async def test_reuse_counts_are_sent_in_the_background(
    pair: tuple[RedisDirectory, RedisDirectory], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _ = pair
    monkeypatch.setattr(redis_backend, "TOUCH_FLUSH_S", 0.05)
    await a.claim(Artifact(CHAIN[:4]), "w1", 60)
    await a.claim(Artifact(CHAIN[:8], start=4), "w1", 60)
    for _ in range(3):
        await a.lookup(CHAIN[:8])
    await asyncio.sleep(0.1)
    await a.lookup(CHAIN[:2])  # past the deadline: this one triggers the send

    async def sent() -> bool:
        return await a.client.hget(a.key("reuse"), format(CHAIN[3], "016x")) == "4"

    await until(sent, what="the batched reuse counts in Redis")
    assert await a.client.hget(a.key("reuse"), format(CHAIN[7], "016x")) == "3"


async def test_workers_registered_by_another_router_appear_by_name(
    pair: tuple[RedisDirectory, RedisDirectory],
) -> None:
    a, b = pair
    await a.lookup(CHAIN[:4])  # a has read the (empty) name map
    await b.register_worker("w-from-b", ROOT, BS)
    stored = BlockStored((1, 2, 3), None, tuple(TOKENS[: 3 * BS]), BS)
    await b.apply_events("w-from-b", EventBatch(1, 0.0, (stored,)))
    m = await a.lookup(CHAIN[:4])
    assert m.holdings == (Holding("w-from-b", Tier.GPU, 3, HoldKind.CACHED),)


async def test_scripts_are_reloaded_after_a_script_flush(
    pair: tuple[RedisDirectory, RedisDirectory],
) -> None:
    a, _ = pair
    lease = await a.claim(Artifact(CHAIN[:4]), "w1", 60)
    await a.client.script_flush()
    assert (await a.lookup(CHAIN[:4])).owner_epoch == lease.epoch


async def test_sweep_empties_the_index_sets_of_what_ended(
    pair: tuple[RedisDirectory, RedisDirectory],
) -> None:
    """Each worker's `:sess` and `:reps` sets (what `drop_worker` undoes) and the fork-ref ids
    lose what expired; without it they grow with every session and replica for good."""
    a, _ = pair
    short, long = 0.2, 60.0
    await a.claim(Artifact(CHAIN[:8]), "w1", long)
    await a.set_session_owner("s-ends", "w1", short)
    await a.set_session_owner("s-moves", "w1", long)
    await a.set_session_owner("s-moves", "w2", long)  # now w2's (and off w1's set)
    await a.add_fork_ref(CHAIN[7], "s-ends")
    await a.add_replica(CHAIN[7], "w2", Tier.CPU, short)
    await a.add_replica(CHAIN[3], "w3", Tier.CPU, long)  # not an artifact id: that block
    await a.add_replica(CHAIN[11], "w4", Tier.CPU, short, blocks=CHAIN[8:12])
    await asyncio.sleep(short + 0.1)
    await a.add_replica(CHAIN[11], "w5", Tier.GPU, long, blocks=CHAIN[8:12])  # prunes w4's
    c = a.client
    assert await c.scard(a.key("w:w1:sess")) == 1 and await c.scard(a.key("w:w2:reps")) == 8
    assert await c.scard(a.key("w:w4:reps")) == 0  # unlisted by w5's write over them

    await a.sweep()

    assert await c.smembers(a.key("w:w1:sess")) == set()
    assert await c.smembers(a.key("w:w2:sess")) == {"s-moves"}
    assert await c.smembers(a.key("wsess")) == {"w2"}
    assert await c.scard(a.key("w:w2:reps")) == 0 and await c.scard(a.key("w:w3:reps")) == 1
    assert await c.scard(a.key("w:w5:reps")) == 4
    assert await c.smembers(a.key("forks")) == set()
    assert not await c.exists(a.key("f:" + format(CHAIN[7], "016x")))


async def test_router_replicas_take_turns_to_sweep(
    pair: tuple[RedisDirectory, RedisDirectory],
) -> None:
    a, b = pair
    await a.claim(Artifact(CHAIN[:4]), "w1", 0.1)
    await asyncio.sleep(0.2)
    assert await a.sweep(min_interval_s=30) == 1
    await a.claim(Artifact(CHAIN[:8], start=4), "w1", 0.1)
    await asyncio.sleep(0.2)
    assert await b.sweep(min_interval_s=30) == 0  # a swept within the interval
    assert await b.sweep() == 1  # without one: always


def _hex(block: int) -> str:
    return format(block, "016x")


async def test_sweeps_follow_expiry_hints_once_a_full_scan_has_written_them(
    pair: tuple[RedisDirectory, RedisDirectory],
) -> None:
    """Between full scans a sweep visits only leases and replica lines whose expiry hint is
    due: what expired goes, a renewed one stays (its hint moves to its real expiry), a hint
    whose record went another way is dropped. A record without a hint waits for the next full
    scan, which finds it and writes the hints anew."""
    a, _ = pair
    c = a.client
    assert await a.sweep() == 0  # an empty namespace: the full scan, hints from now on
    assert await c.exists(a.key("xidx"))
    # short: over before the sweep, yet long enough for the calls until then (`kept` renewed
    # before it ended) on a busy machine too
    short, long = 1.0, 60.0
    await a.claim(Artifact(CHAIN[:4]), "w1", short)  # expires
    kept = await a.claim(Artifact(CHAIN[:8], start=4), "w1", short)
    await a.renew(kept.artifact_id, "w1", kept.epoch, long)  # renewed before it expired
    gone = await a.claim(Artifact(CHAIN[:12], start=8), "w1", long)
    await a.release(gone.artifact_id, "w1", gone.epoch)  # its hint goes with it
    await a.add_replica(CHAIN[3], "w2", Tier.CPU, short)  # expires
    await a.add_replica(CHAIN[3], "w3", Tier.SSD, long)  # w3 keeps this line
    await a.add_replica(CHAIN[3], "w3", Tier.CPU, short)  # and loses this one
    await a.add_replica(CHAIN[15], "w4", Tier.CPU, short, blocks=CHAIN[12:16])
    await a.drop_worker("w4")  # its lines go now; its write's hint is left stale
    assert await c.zscore(a.key("lx"), _hex(gone.artifact_id)) is None
    await c.zadd(a.key("lx"), {_hex(kept.artifact_id): 1000})  # an early hint (an old writer's)
    await asyncio.sleep(short + 0.1)

    assert await a.sweep() == 1 + 4 + 4  # one lease, w2's and w3's short lines on 4 blocks

    assert set(await c.hkeys(a.key("art"))) == {_hex(kept.artifact_id)}
    assert await c.zrange(a.key("lx"), 0, -1) == [_hex(kept.artifact_id)]
    lease = str(await c.hget(a.key("art"), _hex(kept.artifact_id)))
    assert await c.zscore(a.key("lx"), _hex(kept.artifact_id)) == int(lease.split("\t")[2])
    # one hint per replica write: only the long one's is left, with its blocks
    scored: list[Any] = await c.zrange(a.key("rx"), 0, -1, withscores=True)
    assert len(scored) == 1
    now_ms = int((await c.time())[0]) * 1000
    assert float(scored[0][1]) > now_ms + 50_000
    assert await c.hgetall(a.key("rxb")) == {scored[0][0]: "".join(_hex(b) for b in CHAIN[:4])}
    assert await c.scard(a.key("w:w2:reps")) == 0 and await c.scard(a.key("w:w3:reps")) == 4

    # a lease written without a hint (another writer's, or one lost): only a full scan sees it
    await c.hset(a.key("art"), _hex(CHAIN[20 % len(CHAIN)]), "w9\t1\t1000\tgpu")
    assert await a.sweep() == 0
    assert await c.hexists(a.key("art"), _hex(CHAIN[20 % len(CHAIN)]))
    await c.delete(a.key("xidx"))  # as after FULL_SWEEP_S
    assert await a.sweep() == 1
    assert await c.exists(a.key("xidx"))
    assert await c.zrange(a.key("lx"), 0, -1) == [_hex(kept.artifact_id)]


async def test_sweeps_by_hints_prune_the_index_entries_of_ended_sessions(
    pair: tuple[RedisDirectory, RedisDirectory],
) -> None:
    """Between full scans, sessions leave their worker's `:sess` set and fork refs go once
    the session ended, found by their hints (`sx`, `fx`); a fork ref whose session was renewed
    after the ref was taken stays. A fork-ref set written before `forks` listed them is found
    by the next full scan."""
    a, _ = pair
    c = a.client
    await a.sweep()  # the full scan: hints from now on
    short, long = 1.0, 60.0  # short: long enough to renew "s-renewed" in time on a busy machine
    await a.set_session_owner("s-ends", "w1", short)
    await a.set_session_owner("s-moves", "w1", long)
    await a.set_session_owner("s-moves", "w2", long)
    await a.set_session_owner("s-renewed", "w1", short)
    await a.add_fork_ref(CHAIN[3], "s-ends")
    await a.add_fork_ref(CHAIN[3], "s-renewed")  # its hint: the session's end then
    await a.set_session_owner("s-renewed", "w1", long)  # ... which moves on
    await asyncio.sleep(short + 0.1)

    await a.sweep()

    assert await c.smembers(a.key("w:w1:sess")) == {"s-renewed"}
    assert await c.smembers(a.key("w:w2:sess")) == {"s-moves"}
    assert await c.smembers(a.key("f:" + _hex(CHAIN[3]))) == {"s-renewed"}
    assert await c.zrange(a.key("fx"), 0, -1) == [f"{_hex(CHAIN[3])}\ts-renewed"]
    assert sorted(await c.zrange(a.key("sx"), 0, -1)) == ["w1\ts-renewed", "w2\ts-moves"]

    # a fork-ref set from before `forks` existed, its session ended: the full scan finds it
    legacy = a.key("f:" + _hex(CHAIN[5]))
    await c.sadd(legacy, "s-gone")
    await a.sweep()
    assert await c.exists(legacy)  # hints only: not seen
    await c.delete(a.key("xidx"))
    await a.sweep()
    assert not await c.exists(legacy) and await c.smembers(a.key("forks")) == {_hex(CHAIN[3])}


async def test_reuse_counts_redis_cannot_take_at_close_are_counted_and_logged(
    redis_server_factory: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_backend, "TOUCH_FLUSH_S", 3600.0)  # however slow the lookups
    server = redis_server_factory()
    d = RedisDirectory.from_url(server.url, f"rb-{uuid.uuid4().hex[:8]}", socket_timeout_s=2)
    await d.claim(Artifact(CHAIN[:4]), "w1", 60)
    for _ in range(3):
        await d.lookup(CHAIN[:4])  # three reuses of one artifact, batched and not sent yet
    server.stop()
    await d.close()
    assert d.touches_lost == 3
    assert "3 reuse counts not sent at close" in caplog.text


async def test_a_sweep_step_is_bounded_by_the_entries_it_touches_not_by_hints(
    pair: tuple[RedisDirectory, RedisDirectory],
) -> None:
    """One `sweep_due` call stops once its entry budget is spent (a hint plus the block
    records its expired lease maps), after one hint at least; the sweep calls it until nothing
    is due, so small steps drop all the same."""
    a, _ = pair
    c = a.client
    await a.sweep()  # the full scan: hints from now on
    blocks = 50
    for i in range(6):
        chain = tuple(block_hash_chain(list(range(i * 1000, i * 1000 + blocks * BS)), BS, ROOT))
        await a.claim(Artifact(chain), "w1", 0.2)
    hinted = [a.key(k) for k in ("lx", "rx", "sx", "fx")]
    scored: list[Any] = await c.zrange(a.key("lx"), 0, -1, withscores=True)
    expiry = max(int(x) for _, x in scored)

    async def expired() -> bool:
        sec, usec = await c.time()
        return int(sec) * 1000 + int(usec) // 1000 > expiry

    await until(expired, what="the leases' end on the server's clock")
    handled, dropped, spent = await a._run("sweep_due", hinted, [120])
    assert (handled, dropped, spent) == (3, 3, 3 * (1 + blocks))  # the third one crossed 120
    assert await c.zcard(a.key("lx")) == 3 and await c.hlen(a.key("blk")) == 3 * blocks
    assert await a._run("sweep_due", hinted, [1]) == [1, 1, 1 + blocks]  # one hint at least
    assert await a.sweep(step_entries=10) == 2
    assert await c.zcard(a.key("lx")) == 0 and await c.hlen(a.key("blk")) == 0


def _server_major(binary: str) -> int:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"v=(\d+)\.", out)
    return int(found.group(1)) if found else 0


async def test_reads_fall_back_to_evalsha_on_a_server_without_evalsha_ro(
    redis_server: RedisServer,
) -> None:
    d = RedisDirectory.from_url(redis_server.url, f"ro-{uuid.uuid4().hex[:8]}", socket_timeout_s=10)
    try:
        if _server_major(redis_server.binary) >= 7:
            pytest.skip("this redis-server has EVALSHA_RO")
        lease = await d.claim(Artifact(CHAIN[:4]), "w1", 60)
        assert (await d.lookup(CHAIN[:4])).owner_epoch == lease.epoch
        assert d.read_only_scripts is False
        info = await d.artifact_info(lease.artifact_id)
        assert info is not None and info.worker == "w1"
    finally:
        await d.flush_namespace()
        await d.close()


async def test_reads_run_as_evalsha_ro_and_serve_from_a_read_only_replica() -> None:
    """On Redis >= 7 lookups and artifact_info run as EVALSHA_RO: a read-only replica serves
    a lookup (also after its scripts were flushed), and the servers count them as reads."""
    binary = shutil.which("redis-server")
    if binary is None or _server_major(binary) < 7:
        pytest.skip("needs redis-server >= 7 on PATH (apt-get install redis-server)")
    primary = RedisServer(binary).start()
    replica = RedisServer(binary, extra=("--replicaof", "127.0.0.1", str(primary.port))).start()
    ns = f"ro-{uuid.uuid4().hex[:8]}"
    writer = RedisDirectory.from_url(primary.url, ns, socket_timeout_s=10)
    reader = RedisDirectory.from_url(replica.url, ns, socket_timeout_s=10)
    try:
        # cached blocks, no artifact: a lookup of them has no reuse counts to write back
        await writer.register_worker("w1", ROOT, BS)
        stored = BlockStored((1, 2, 3), None, tuple(TOKENS[: 3 * BS]), BS)
        await writer.apply_events("w1", EventBatch(1, 0.0, (stored,)))
        lease = await writer.claim(Artifact(CHAIN[:8], start=4), "w1", 60)
        await writer.client.wait(1, 10_000)  # the replica has them
        want = (Holding("w1", Tier.GPU, 3, HoldKind.CACHED),)
        assert (await reader.lookup(CHAIN[:3])).holdings == want
        assert reader.read_only_scripts is True
        await reader.client.script_flush()
        assert (await reader.lookup(CHAIN[:3])).holdings == want
        info = await writer.artifact_info(lease.artifact_id)
        assert info is not None and info.epoch == lease.epoch
        for d, reads in ((reader, 2), (writer, 1)):
            stats = (await d.client.info("commandstats"))["cmdstat_evalsha_ro"]
            # a call answered NOSCRIPT (the script not loaded there yet) is a failed call
            assert stats["calls"] - stats.get("failed_calls", 0) == reads
        assert "cmdstat_evalsha" not in await reader.client.info("commandstats")
    finally:
        await writer.close()
        await reader.close()
        replica.cleanup()
        primary.cleanup()


async def test_a_late_second_drop_of_a_dead_worker_keeps_what_it_recorded_once_back(
    pair: tuple[RedisDirectory, RedisDirectory],
) -> None:
    """Two router replicas hold the same worker dead; one drops it, the worker comes back and
    records (a lease, a session, cached blocks), and then the other's drop of that same death
    arrives (its health round or Redis was slow): it must not erase the new life's records."""
    a, b = pair
    await a.register_worker("w1", ROOT, BS)
    seen_by_a, seen_by_b = await a.worker_life("w1"), await b.worker_life("w1")
    old = await a.claim(Artifact(CHAIN[:4]), "w1", 60)
    await a.drop_worker("w1", seen_by_a)  # replica A: w1 is dead
    assert (await a.lookup(CHAIN[:4])).owner is None
    # w1 is back: A sees it alive (its life now), and it records
    assert await a.worker_life("w1") == seen_by_a + 1
    new = await a.claim(Artifact(CHAIN[:8], start=4), "w1", 60)
    await a.set_session_owner("s-new", "w1", 60)
    stored = BlockStored((7,), None, tuple(TOKENS[8 * BS : 9 * BS]), BS)
    await a.apply_events("w1", EventBatch(0, 0.0, (stored,)))

    assert await b.drop_worker("w1", seen_by_b) == 0  # replica B's verdict, from before

    m = await b.lookup(CHAIN[:8], "s-new")
    assert m.owner == "w1" and m.owner_epoch == new.epoch and new.epoch > old.epoch
    assert m.session_owner == "w1"
    cached = (await b.lookup(tuple(block_hash_chain(TOKENS[8 * BS : 9 * BS], BS, ROOT)))).holdings
    assert cached == (Holding("w1", Tier.GPU, 1, HoldKind.CACHED),)
    # a drop by one who saw the new life, or by hand, still drops
    assert await b.drop_worker("w1", await b.worker_life("w1")) >= 2
    assert (await b.lookup(CHAIN[:8], "s-new")).owner is None


async def test_a_batch_of_a_dropped_life_is_refused_and_the_next_lifes_batches_count(
    pair: tuple[RedisDirectory, RedisDirectory],
) -> None:
    """Replica B applies a batch of the life it saw after replica A dropped that life (the
    batch was queued in B's subscription, or held back by an outage): refused, the blocks stay
    forgotten; a batch sent with the life the refusal names counts."""
    a, b = pair
    await a.register_worker("w1", ROOT, BS)
    seen_by_b = await b.worker_life("w1")
    await a.drop_worker("w1", await a.worker_life("w1"))
    old = BlockStored((7,), None, tuple(TOKENS[:BS]), BS)
    result = await b.apply_events("w1", EventBatch(5, 0.0, (old,)), seen_by_b)
    assert result.fenced == seen_by_b + 1 and result.stored == 0
    assert (await a.lookup(CHAIN[:1])).holdings == ()
    new = BlockStored((8,), None, tuple(TOKENS[:BS]), BS)
    assert (await b.apply_events("w1", EventBatch(0, 0.0, (new,)), result.fenced)).stored == 1
    assert (await a.lookup(CHAIN[:1])).holdings == (Holding("w1", Tier.GPU, 1, HoldKind.CACHED),)


async def _script_calls(d: RedisDirectory) -> int:
    stats = await d.client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k.startswith("cmdstat_evalsha"))


async def test_a_drop_of_a_worker_holding_many_entries_goes_in_bounded_steps(
    pair: tuple[RedisDirectory, RedisDirectory],
) -> None:
    """Redis serves nothing else while a script runs: a worker with thousands of leases,
    sessions and cached blocks is dropped in many calls of about `step_entries` entries each
    (counted by the server's command stats), and once the drop returns nothing of it is left
    anywhere, while another worker's records stay."""
    a, b = pair
    await a.register_worker("w1", ROOT, BS)
    await a.register_worker("w2", ROOT, BS)
    n = 300
    for i in range(n):
        chain = tuple(block_hash_chain([i, *TOKENS[: 2 * BS - 1]], BS, ROOT))
        await a.claim(Artifact(chain), "w1", 60)
        await a.set_session_owner(f"s{i}", "w1", 60)
    kept = await a.claim(Artifact(CHAIN[:4]), "w2", 60)
    await a.set_session_owner("s-w2", "w2", 60)
    stored = BlockStored(tuple(range(1, n + 1)), None, tuple(1_000 + t for t in range(n * BS)), BS)
    await a.apply_events("w1", EventBatch(0, 0.0, (stored,)))
    cached = tuple(block_hash_chain([1_000 + t for t in range(n * BS)], BS, ROOT))
    assert (await b.lookup(cached[:1])).holdings  # w1 caches them

    step = 50
    before = await _script_calls(a)
    dropped = await a.drop_worker_steps("w1", await a.worker_life("w1"), step_entries=step)
    calls = await _script_calls(a) - before
    # 300 leases of 2 blocks, 300 sessions, 300 cached blocks: >= 1,200 entries; a step
    # ends past its budget by at most one page it took (<= its budget)
    assert calls >= 1_200 // (2 * step)
    assert dropped >= 3 * n

    for i in (0, n // 2, n - 1):
        chain = tuple(block_hash_chain([i, *TOKENS[: 2 * BS - 1]], BS, ROOT))
        m = await b.lookup(chain, f"s{i}")
        assert m.owner is None and m.session_owner is None
    assert not (await b.lookup(cached[:1])).holdings
    left = [k async for k in a.client.scan_iter(match=a.key("w:w1:*"))]
    assert left == []  # the moved index sets and the pending-drop set are all gone
    m = await b.lookup(CHAIN[:4], "s-w2")
    assert m.owner == "w2" and m.owner_epoch == kept.epoch and m.session_owner == "w2"


async def test_the_engine_hash_map_stays_under_its_bound_and_forgets_removed_blocks(
    pair: tuple[RedisDirectory, RedisDirectory],
) -> None:
    """The router's copy of a worker's engine-hash map (read for stored events' parents) is
    bounded by `engine_map_limit` however many sessions' blocks the worker stores, a removed
    block leaves it, and a parent it no longer holds is read from Redis: the child applies."""
    a, _ = pair
    a.engine_map_limit = 64
    await a.register_worker("w1", ROOT, BS)
    seq = 0
    for s in range(100):  # 100 sessions' prefixes of 2 blocks each: 200 engine hashes
        tokens = (10_000 + s, *range(2 * BS - 1))
        stored = BlockStored((2 * s + 1, 2 * s + 2), None, tokens, BS)
        r = await a.apply_events("w1", EventBatch(seq, 0.0, (stored,)))
        assert r.stored == 2
        seq += 1
        assert len(a._engine_map["w1"]) <= 64
    # the first session's blocks are long evicted here; its child still finds its parent
    child = BlockStored((1_000,), 2, tuple(range(BS)), BS)
    assert (await a.apply_events("w1", EventBatch(seq, 0.0, (child,)))).stored == 1
    seq += 1
    kept = list(a._engine_map["w1"])
    await a.apply_events("w1", EventBatch(seq, 0.0, (BlockRemoved(tuple(kept[:10])),)))
    assert not set(kept[:10]) & set(a._engine_map["w1"])


def _replica_lines_normalized(records: list[Any]) -> list[str | None]:
    """Block records with every replica line's expiry blanked (two writes made apart)."""
    return [None if r is None else re.sub(r"\t\d+\t([01])\n", r"\t-\t\1\n", r) for r in records]


async def test_a_long_replica_is_added_in_steps_readers_see_a_prefix_and_it_ends_as_one_call(
    pair: tuple[RedisDirectory, RedisDirectory], redis_server: RedisServer
) -> None:
    """`add_replica` over a 20,000-block artifact runs in many script calls of
    `step_entries` (256) blocks: a reader between them (one MULTI of the chain's records and
    the worker's `:reps` set) sees the copy on a leading part of the chain only, every block
    of it listed in the set, growing; once the call returns the records, the set and a lookup
    are those of the same write made in one script call (another namespace), and so for a
    write naming its blocks."""
    a, b = pair
    n = 20_000
    chain = tuple(block_hash_chain(list(range(n * BS)), BS, ROOT))
    fields = [_hex(h) for h in chain]
    lease = await a.claim(Artifact(chain), "w1", 60)
    one = RedisDirectory.from_url(
        redis_server.url, f"rb1-{uuid.uuid4().hex[:8]}", socket_timeout_s=10
    )
    try:
        assert (await one.claim(Artifact(chain), "w1", 60)).artifact_id == lease.artifact_id
        whole = ReplicaWrite(lease.artifact_id, "w2", Tier.GPU, 60.0, True, None)
        await one.put_replica_steps(whole, step_entries=n + 1)
        named = ReplicaWrite(lease.artifact_id, "w3", Tier.CPU, 60.0, True, chain)
        await one.put_replica_steps(named, step_entries=n + 1)

        seen: list[int] = []
        written = asyncio.Event()

        async def read() -> None:
            while not written.is_set() or not seen or seen[-1] < n:
                async with b.client.pipeline(transaction=True) as tx:
                    tx.hmget(b.key("blk"), fields)
                    tx.smembers(b.key("w:w2:reps"))
                    records, listed = await tx.execute()
                has = [r is not None and "\nw2\t" in r for r in records]
                k = has.index(False) if False in has else n
                assert not any(has[k:]), "a replica line past the copy's leading part"
                assert set(fields[:k]) <= set(listed), "a replica block not in w2's :reps"
                assert not seen or k >= seen[-1]
                seen.append(k)
                assert (await b.lookup(chain)).longest("w2", Tier.GPU) >= k

        reader = asyncio.create_task(read())
        await until(lambda: bool(seen), what="the reader's first read")
        before = await _script_calls(a)
        await a.add_replica(lease.artifact_id, "w2", Tier.GPU, 60.0)
        calls = await _script_calls(a) - before
        written.set()
        async with asyncio.timeout(60.0):
            await reader
        await a.add_replica(lease.artifact_id, "w3", Tier.CPU, 60.0, blocks=chain)

        assert calls >= n // a.step_entries
        assert any(0 < k < n for k in seen), seen  # other clients were served between steps
        got = await a.client.hmget(a.key("blk"), fields)
        want = await one.client.hmget(one.key("blk"), fields)
        assert _replica_lines_normalized(got) == _replica_lines_normalized(want)
        for w in ("w2", "w3"):
            reps = await a.client.smembers(a.key(f"w:{w}:reps"))
            assert reps == await one.client.smembers(one.key(f"w:{w}:reps")) == set(fields)
        # every line of the stepped copy expires at once, and its hints cover every block
        assert len({re.findall(r"w2\t\w+\t(\d+)", str(r))[0] for r in got}) == 1
        hinted = "".join(str(v) for v in (await a.client.hgetall(a.key("rxb"))).values())
        assert set(re.findall(".{16}", hinted)) == set(fields)
        assert (await a.lookup(chain)).holdings == (await one.lookup(chain)).holdings
    finally:
        await one.flush_namespace()
        await one.close()


async def test_a_restored_cached_view_is_written_in_bounded_steps(
    pair: tuple[RedisDirectory, RedisDirectory],
) -> None:
    """`restore_cached` (after Redis lost its data) writes a worker's whole cached view in
    script calls of `step_entries` entries: every block is recorded, the engine hashes map
    onto them (a later removal applies), and an unregistered worker gives -1."""
    a, b = pair
    await a.register_worker("w1", ROOT, BS)
    n = 1_000
    chain = tuple(block_hash_chain(list(range(n * BS)), BS, ROOT))
    entries = [(10_000 + k, h, 1) for k, h in enumerate(chain)]
    before = await _script_calls(a)
    assert await a.restore_cached("w1", entries, step_entries=100) == n
    assert await _script_calls(a) - before >= 10  # (a first call may load the script)
    assert (await b.lookup(chain)).longest("w1", Tier.GPU) == n
    removed = BlockRemoved((10_000 + n // 2,))
    assert (await a.apply_events("w1", EventBatch(0, 0.0, (removed,)))).removed == 1
    assert (await b.lookup(chain)).longest("w1", Tier.GPU) == n // 2
    assert await a.restore_cached("w9", entries[:1]) == -1


async def test_cached_counts_lost_with_the_data_come_back_with_restore_cached(
    pair: tuple[RedisDirectory, RedisDirectory],
) -> None:
    """The GPU-cached counts live in the namespace (`kvn`): lost with its data, rebuilt as
    `restore_cached` re-records the workers' views (in steps, a block in several of them
    counted once), to what the in-memory directory fed the same events counts."""
    a, b = pair
    local = InMemoryDirectory()
    n = 40
    tokens = tuple(range(n * BS))
    batches = {
        "w1": (BlockStored(tuple(range(1, n + 1)), None, tokens, BS),),
        "w2": (
            BlockStored(tuple(range(101, 121)), None, tokens[: 20 * BS], BS),
            BlockStored(tuple(range(201, 231)), None, tokens[: 30 * BS], BS, Tier.CPU),
            BlockRemoved((105,)),
        ),
    }
    for d in (a, local):
        for worker, events in batches.items():
            await d.register_worker(worker, ROOT, BS)
            await d.apply_events(worker, EventBatch(0, 0.0, events))
    counts = await local.cached_counts()
    assert counts == CachedCounts(n, n + 19) and await b.cached_counts() == counts
    await a.flush_namespace()  # Redis lost its data
    assert await b.cached_counts() == CachedCounts(0, 0)
    snapshot = local.export_state()
    for worker, (root, block_size) in snapshot.registrations.items():
        await a.register_worker(worker, root, block_size)
    for worker, entries in snapshot.cached.items():
        assert await a.restore_cached(worker, entries, step_entries=7) > 0
        assert await a.restore_cached(worker, entries[:9]) > 0  # again: the same bits
    assert await b.cached_counts() == counts


def _cached_on(record: str | None, j: int) -> int:
    """The tier bits of the worker with byte index `j` in a block record."""
    if record is None:
        return 0
    cache = record[16 : record.index("\n", 16)]
    return ord(cache[j - 1]) if len(cache) >= j else 0


async def test_a_dropped_cached_view_is_cleared_in_steps_and_the_new_view_is_whole_meanwhile(
    pair: tuple[RedisDirectory, RedisDirectory],
) -> None:
    """A gap in a worker's events drops its cached view: 6,000 blocks set aside at once and
    their bits cleared in many `clear_step` calls. A reader between them sees what the batch
    stored (the new view) whole, and the old view's bits only going (a stale positive, never
    a block of the new view missing); a block of the old view stored again, under a new
    engine hash as after an engine restart, keeps its new bits. Once the call returns, no
    key of the clear is left. A clear left pending (its router died after the script) is
    finished by the next batch, which another router applies."""
    a, b = pair
    await a.register_worker("w1", ROOT, BS)
    n = 6_000
    old_tokens = tuple(10_000 + t for t in range(n * BS))
    old = tuple(block_hash_chain(list(old_tokens), BS, ROOT))
    new_tokens = tuple(90_000_000 + t for t in range(20 * BS))
    new = tuple(block_hash_chain(list(new_tokens), BS, ROOT))
    await a.apply_events(
        "w1", EventBatch(0, 0.0, (BlockStored(tuple(range(1, n + 1)), None, old_tokens, BS),))
    )
    j = int(str(await a.client.hget(a.key("w:w1"), "idx")))
    fields = [_hex(h) for h in (*new, *old[10:])]
    again = BlockStored(tuple(range(100_001, 100_011)), None, old_tokens[: 10 * BS], BS)
    fresh = BlockStored(tuple(range(200_001, 200_021)), None, new_tokens, BS, Tier.CPU)

    stale_seen: list[int] = []
    applied = asyncio.Event()

    async def read() -> None:
        while not applied.is_set():
            async with b.client.pipeline(transaction=True) as tx:
                tx.hget(b.key("w:w1"), "seq")
                tx.hmget(b.key("blk"), fields)
                seq, records = await tx.execute()
            if seq is None or int(seq) != 5:
                continue  # the gap's batch not applied yet (or applied, seq not yet read)
            assert all(_cached_on(r, j) == 2 for r in records[:20]), "the new view is partial"
            stale = sum(_cached_on(r, j) != 0 for r in records[20:])
            assert not stale_seen or stale <= stale_seen[-1], "an old block cached again"
            stale_seen.append(stale)

    reader = asyncio.create_task(read())
    before = await _script_calls(a)
    gap = await a.apply_events("w1", EventBatch(5, 0.0, (again, fresh)))
    calls = await _script_calls(a) - before
    applied.set()
    async with asyncio.timeout(60.0):
        await reader

    assert gap.gap and gap.stored == 30
    assert calls >= n // a.step_entries
    assert any(0 < k < n - 10 for k in stale_seen), stale_seen  # served between steps
    m = await b.lookup(old)
    assert (m.longest("w1", Tier.GPU), (await b.lookup(new)).longest("w1", Tier.CPU)) == (10, 20)
    assert await a.client.hmget(a.key("blk"), [_hex(h) for h in old[10:]]) == [None] * (n - 10)
    clear_keys = [k async for k in a.client.scan_iter(match=a.key("w:w1:clr*"))]
    assert clear_keys == [] and not await a.client.exists(a.key("w:w1:clears"))

    # AllBlocksCleared applied by a router that died before its steps: the clear is pending
    keys = [a.key("w:w1"), a.key("w:w1:eh"), a.key("blk")]
    cleared = EventBatch(6, 0.0, (AllBlocksCleared(),))
    reply = await a._run("apply_events", keys, a._event_args("w1", ROOT, BS, cleared, {}))
    assert int(reply[-1]) == 1
    assert (await b.lookup(old)).longest("w1") == 10  # not cleared yet: a stale positive
    restored = BlockStored(tuple(range(300_001, 300_006)), None, new_tokens[: 5 * BS], BS)
    await b.apply_events("w1", EventBatch(7, 0.0, (restored,)))
    assert (await b.lookup(old)).longest("w1") == 0
    assert (await b.lookup(new)).longest("w1", Tier.GPU) == 5
    assert (await b.lookup(new)).longest("w1", Tier.CPU) == 0
    assert [k async for k in a.client.scan_iter(match=a.key("w:w1:clr*"))] == []
