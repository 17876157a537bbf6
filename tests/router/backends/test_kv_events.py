"""The router's KV event subscriber against real ZMQ sockets speaking vLLM's PUB + ROUTER replay
protocol: gaps, catch-up, restarts, binding, and what the backends subscribe to."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, suppress
from typing import Any

import msgpack
import pytest
import zmq

from ownerserve.directory.base import Artifact, EventApplyResult
from ownerserve.directory.memory import InMemoryDirectory
from ownerserve.directory.redis import RedisDirectory
from ownerserve.events import AllBlocksCleared, BlockStored, EventBatch
from ownerserve.hashing import chain_root, hash_block
from ownerserve.ports import free_port
from ownerserve.types import Tier
from ownerserve.vllm_events import encode_message, encode_payload
from router.backends.kv_events import KVEventSink, KVEventSubscriber
from tests.router.waiting import until


class RecordingSink:
    """Collects what the subscriber applies, like the directory would."""

    def __init__(self) -> None:
        self.applied: list[EventBatch] = []
        self.dropped = 0

    async def apply_events(self, worker: str, batch: EventBatch) -> EventApplyResult:
        self.applied.append(batch)
        return EventApplyResult(stored=len(batch.events))

    async def drop_worker(self, worker: str) -> int:
        self.dropped += 1
        return 0


class VllmLikePublisher:
    """vLLM's ZmqEventPublisher protocol: PUB of [topic, seq, payload] plus a ROUTER that replays
    buffered batches from a requested seq and ends with seq -1. `skip` seqs are buffered but
    never published (a lost message).

    Its PUB is an XPUB (the same on the wire), so a test can wait until the subscriber's
    subscription has arrived (`subscribed`): before that, PUB drops what it publishes."""

    def __init__(self, pub_port: int, replay_port: int, topic: bytes = b"kv") -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.bind(f"tcp://127.0.0.1:{pub_port}")
        self.topic = topic
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_port = replay_port
        self.replays = 0
        """Replay requests answered (each to its end marker)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def _serve_replay(self) -> None:
        router = self.ctx.socket(zmq.ROUTER)
        router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        while not self._stop.is_set():
            if not router.poll(50):
                continue
            client, _, start = router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:
                    router.send_multipart(
                        [client, b"", self.topic, seq.to_bytes(8, "big"), payload]
                    )
            router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
            self.replays += 1
        router.close(linger=0)

    def publish(self, seq: int, tokens: range, *, send: bool = True, keep: bool = True) -> None:
        ev = BlockStored((seq,), None, tuple(tokens), 4)
        payload = encode_payload([ev], ts=time.time())
        if keep:
            self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    async def subscribed(self) -> None:
        """Once a subscriber's subscription to the topic reached the PUB socket."""
        await subscription_reached(self.pub, self.topic)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.pub.close(linger=0)
        self.ctx.term()


async def subscription_reached(xpub: zmq.Socket, topic: bytes) -> None:
    """Until the XPUB socket `xpub` has received a subscription to `topic` (ZMQ's slow joiner:
    what is published before it arrives is dropped)."""
    got: list[bytes] = []

    def arrived() -> bool:
        while xpub.poll(0):
            got.append(xpub.recv())
        return b"\x01" + topic in got

    await until(arrived, what=f"a subscription to {topic!r}")


@pytest.fixture
def sink() -> RecordingSink:
    return RecordingSink()


@pytest.fixture
def publisher() -> Iterator[VllmLikePublisher]:
    pub = VllmLikePublisher(free_port(), free_port())
    yield pub
    pub.close()


@asynccontextmanager
async def _subscribed(
    pub: VllmLikePublisher,
    sink: KVEventSink,
    catch_up_interval_s: float | None = None,
    replay: bool = True,
) -> AsyncIterator[KVEventSubscriber]:
    """A subscriber to `pub` feeding `sink`, closed on exit."""
    sub = KVEventSubscriber(
        "w1",
        pub.pub.getsockopt_string(zmq.LAST_ENDPOINT),
        sink,
        replay_endpoint=f"tcp://127.0.0.1:{pub.replay_port}" if replay else None,
        topic=b"kv",
        catch_up_interval_s=catch_up_interval_s,
    )
    await sub.start()
    try:
        await pub.subscribed()
        if replay:  # and its catch-up on start answered: what is published next is news to it
            await until(lambda: pub.replays >= 1, what="the subscriber's catch-up answered")
        yield sub
    finally:
        await sub.close()


async def test_subscriber_fills_a_gap_from_the_replay_socket(
    publisher: VllmLikePublisher, sink: RecordingSink
) -> None:
    async with _subscribed(publisher, sink) as sub:
        publisher.publish(0, range(4))
        publisher.publish(1, range(4, 8), send=False)  # lost on the PUB socket
        publisher.publish(2, range(8, 12))
        await until(lambda: len(sink.applied) == 3)
        assert [b.seq for b in sink.applied] == [0, 1, 2]
        assert sub.stats.gaps == 1 and sub.stats.replayed == 1 and sink.dropped == 0


async def test_subscriber_joining_late_catches_up_before_any_new_batch(
    publisher: VllmLikePublisher, sink: RecordingSink
) -> None:
    publisher.publish(0, range(4))  # before anyone subscribed: only in the replay buffer
    publisher.publish(1, range(4, 8))
    async with _subscribed(publisher, sink):
        await until(lambda: len(sink.applied) == 2)
        publisher.publish(2, range(8, 12))
        await until(lambda: len(sink.applied) == 3)
        assert [b.seq for b in sink.applied] == [0, 1, 2]
        assert sink.dropped == 0


async def test_a_lost_last_batch_is_fetched_after_a_quiet_interval(
    publisher: VllmLikePublisher, sink: RecordingSink
) -> None:
    async with _subscribed(publisher, sink, catch_up_interval_s=0.2):
        publisher.publish(0, range(4))
        publisher.publish(1, range(4, 8), send=False)  # lost, and nothing comes after it
        await until(lambda: len(sink.applied) == 2)
        assert [b.seq for b in sink.applied] == [0, 1]


async def test_unfillable_gap_forgets_the_cached_blocks_then_continues(
    publisher: VllmLikePublisher, sink: RecordingSink
) -> None:
    async with _subscribed(publisher, sink) as sub:
        publisher.publish(0, range(4))
        publisher.publish(1, range(4, 8), send=False, keep=False)  # gone from the buffer too
        publisher.publish(2, range(8, 12))
        await until(lambda: len(sink.applied) == 3)
        # in place of the lost batch 1: "whatever the worker caches is unknown now"
        assert [b.seq for b in sink.applied] == [0, 1, 2]
        assert sink.applied[1].events == (AllBlocksCleared(),)
        assert sink.dropped == 0  # the worker is alive: its sessions and leases stay
        assert sub.stats.gaps == 1 and sub.stats.resyncs == 1


async def test_first_batch_without_replay_is_the_start_not_a_gap(
    publisher: VllmLikePublisher, sink: RecordingSink
) -> None:
    """A router that subscribes to a running engine (no replay socket) sees seq N first."""
    async with _subscribed(publisher, sink, replay=False) as sub:
        publisher.publish(7, range(4))
        publisher.publish(8, range(4, 8))
        await until(lambda: len(sink.applied) == 2)
        assert [b.seq for b in sink.applied] == [7, 8]
        assert sub.stats.gaps == 0 and sub.stats.resyncs == 0 and sink.dropped == 0


async def test_lost_events_keep_the_workers_sessions_and_leases(
    publisher: VllmLikePublisher,
) -> None:
    """With the real in-memory directory: after an unfillable gap the worker's cached blocks
    are forgotten, but the router's commits (artifact lease, session owner) survive."""
    directory = InMemoryDirectory()
    root = chain_root("m")
    await directory.register_worker("w1", root, 4)
    async with _subscribed(publisher, directory) as sub:
        publisher.publish(0, range(4))  # the engine caches block [0..4)
        await until(lambda: sub.stats.batches == 1)
        cached = (hash_block(root, list(range(4))),)
        assert (await directory.lookup(cached)).longest("w1", Tier.GPU) == 1
        owned = (hash_block(root, [9, 9, 9, 9]),)
        lease = await directory.claim(Artifact(owned), "w1", 60.0)
        assert lease.worker == "w1"
        await directory.set_session_owner("s1", "w1", 60.0)
        publisher.publish(1, range(4, 8), send=False, keep=False)  # lost for good
        publisher.publish(2, range(100, 104))
        await until(lambda: sub.stats.batches == 2)
        assert (await directory.lookup(cached)).longest("w1", Tier.GPU) == 0
        assert (await directory.lookup(owned, "s1")).owner == "w1"
        assert await directory.get_session_owner("s1") == "w1"
        info = await directory.artifact_info(owned[0])
        assert info is not None and info.worker == "w1"


async def test_seq_restart_means_engine_restart_and_drops_the_worker(
    publisher: VllmLikePublisher, sink: RecordingSink
) -> None:
    async with _subscribed(publisher, sink):
        publisher.publish(0, range(4))
        publisher.publish(1, range(4, 8))
        await until(lambda: len(sink.applied) == 2)
        publisher.buffer.clear()
        publisher.publish(0, range(4))  # a restarted engine counts from 0 again
        await until(lambda: len(sink.applied) == 3)
        assert sink.dropped == 1


async def test_subscriber_can_bind_for_a_connecting_publisher(sink: RecordingSink) -> None:
    """vLLM connects (not binds) when its endpoint names a host, e.g. tcp://127.0.0.1:PORT."""
    port = free_port()
    sub = KVEventSubscriber("w2", f"tcp://127.0.0.1:{port}", sink, bind=True)
    await sub.start()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)  # a PUB that hears the subscription
    pub.connect(f"tcp://127.0.0.1:{port}")
    try:
        await subscription_reached(pub, b"")
        pub.send_multipart(encode_message(EventBatch(0, 1.0, (AllBlocksCleared(),))))
        await until(lambda: len(sink.applied) == 1)
        assert sink.applied[0].events == (AllBlocksCleared(),)
    finally:
        pub.close(linger=0)
        ctx.term()
        await sub.close()


async def test_block_size_mismatch_is_counted_and_named_once(
    publisher: VllmLikePublisher, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine publishes 4-token blocks, the router was configured for 8: nothing maps, and
    the log says which setting to fix (the directory is the real in-memory one)."""
    directory = InMemoryDirectory()
    await directory.register_worker("w1", chain_root("m"), 8)
    async with _subscribed(publisher, directory) as sub:
        publisher.publish(0, range(4))
        publisher.publish(1, range(4, 8))
        await until(lambda: sub.stats.batches == 2)
        assert sub.stats.skipped_blocks == 2
        warnings = [r.getMessage() for r in caplog.records if "not mapped" in r.getMessage()]
        assert len(warnings) == 1 and "[4]" in warnings[0] and "block_size" in warnings[0]


@pytest.fixture(params=["memory", "redis"])
async def directory(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    if request.param == "memory":
        yield InMemoryDirectory()
        return
    server = request.getfixturevalue("redis_server")
    d = RedisDirectory.from_url(server.url, f"kve-{uuid.uuid4().hex[:8]}", socket_timeout_s=10)
    yield d
    await d.flush_namespace()
    await d.close()


async def test_a_returning_workers_blocks_on_forgotten_chains_are_no_block_size_warning(
    publisher: VllmLikePublisher, directory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker held dead is dropped (the directory forgets its cached blocks) while its engine
    keeps them; back, it stores blocks whose parents only it remembers. They are not mapped,
    and the log says so once, quietly, without blaming the block size."""
    caplog.set_level(logging.INFO, logger="router.backends.kv_events")
    root = chain_root("m")
    await directory.register_worker("w1", root, 4)

    def stored(seq: int, engine_hash: int, parent: int | None, tokens: range) -> None:
        ev = BlockStored((engine_hash,), parent, tuple(tokens), 4)
        payload = encode_payload([ev], ts=time.time())
        publisher.buffer.append((seq, payload))
        publisher.pub.send_multipart([publisher.topic, seq.to_bytes(8, "big"), payload])

    async with _subscribed(publisher, directory) as sub:
        stored(0, 100, None, range(4))
        await until(lambda: sub.stats.batches == 1)
        first = hash_block(root, list(range(4)))
        assert (await directory.lookup((first,))).longest("w1", Tier.GPU) == 1
        await directory.drop_worker("w1")  # held dead: its cached blocks forgotten
        stored(1, 101, 100, range(4, 8))  # back: its next block extends block 100
        stored(2, 102, None, range(8, 12))  # and a chain of its own start
        await until(lambda: sub.stats.batches == 3)
        assert sub.stats.skipped_blocks == sub.stats.unknown_parent_blocks == 1
        assert (await directory.lookup((hash_block(root, list(range(8, 12))),))).longest(
            "w1", Tier.GPU
        ) == 1
    said = [r for r in caplog.records if r.name == "router.backends.kv_events"]
    assert not [r for r in said if "not mapped" in r.getMessage()]
    forgotten = [r for r in said if "chains the directory forgot" in r.getMessage()]
    assert len(forgotten) == 1 and forgotten[0].levelno == logging.INFO


async def test_cpu_medium_events_fill_and_empty_only_the_directorys_cpu_tier(
    publisher: VllmLikePublisher,
) -> None:
    """vLLM's KV offloading publishes each block it writes to CPU memory as a BlockStored with
    medium "CPU" (self-describing: its own parent and tokens) and each eviction from there as a
    BlockRemoved with medium "CPU": they land in, and leave, the CPU tier only."""
    directory = InMemoryDirectory()
    root = chain_root("m")
    await directory.register_worker("w1", root, 4)
    b0 = hash_block(root, [0, 1, 2, 3])
    b1 = hash_block(b0, [4, 5, 6, 7])

    def send(seq: int, *events: dict[str, object]) -> None:
        payload = msgpack.packb([time.time(), list(events), 0], use_bin_type=True)
        publisher.buffer.append((seq, payload))
        publisher.pub.send_multipart([publisher.topic, seq.to_bytes(8, "big"), payload])

    def stored(h: int, parent: int | None, tokens: range, medium: str) -> dict[str, object]:
        return {
            "type": "BlockStored",
            "block_hashes": [h],
            "parent_block_hash": parent,
            "token_ids": list(tokens),
            "block_size": 4,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }

    async with _subscribed(publisher, directory) as sub:
        send(0, stored(b0, None, range(4), "GPU"), stored(b1, b0, range(4, 8), "GPU"))
        send(1, stored(b0, None, range(4), "CPU"), stored(b1, b0, range(4, 8), "CPU"))
        send(2, {"type": "BlockRemoved", "block_hashes": [b0, b1], "medium": "GPU"})
        await until(lambda: sub.stats.batches == 3)
        match = await directory.lookup((b0, b1))
        assert match.longest("w1", Tier.GPU) == 0 and match.longest("w1", Tier.CPU) == 2
        send(3, {"type": "BlockRemoved", "block_hashes": [b1], "medium": "CPU", "group_idx": 0})
        await until(lambda: sub.stats.batches == 4)
        assert (await directory.lookup((b0, b1))).longest("w1", Tier.CPU) == 1
        assert sub.stats.skipped_blocks == 0


class _CancelSwallowingSink(RecordingSink):
    """A sink whose apply swallows the cancel that lands on it, as asyncio.timeout on Python
    3.11 can when the cancel coincides with its own expiry (that race cannot be produced on
    demand: this stands in for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()

    async def apply_events(self, worker: str, batch: EventBatch) -> EventApplyResult:
        self.entered.set()
        with suppress(asyncio.CancelledError):
            await asyncio.Event().wait()
        return await super().apply_events(worker, batch)


async def test_closing_ends_the_subscription_even_if_a_step_swallowed_the_cancel(
    publisher: VllmLikePublisher, caplog: pytest.LogCaptureFixture
) -> None:
    sink = _CancelSwallowingSink()
    sub = KVEventSubscriber(
        "w1", publisher.pub.getsockopt_string(zmq.LAST_ENDPOINT), sink, topic=b"kv"
    )
    await sub.start()
    task = sub._task
    assert task is not None
    await publisher.subscribed()
    publisher.publish(0, range(4))
    await until(sink.entered.is_set, what="the batch in the sink")
    with caplog.at_level(logging.WARNING):
        await sub.close()
    # it ended at its next turn, not left running past `close`'s wait for it
    assert task.done() and not task.cancelled() and task.exception() is None
    assert not [r for r in caplog.records if "did not stop" in r.getMessage()]
