"""KV events leave the emulated engine over real ZMQ in vLLM's wire format, in order, and rebuild
the router's hash chain; evictions arrive as BlockRemoved after the stores they undo."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import zmq
import zmq.asyncio

from ownerserve.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from ownerserve.hashing import block_hash_chain, chain_root, hash_block
from ownerserve.ports import free_port
from ownerserve.vllm_events import decode_message
from tests.waiting import until
from tests.workers.emulator.conftest import StartEmulator
from tests.workers.emulator.zmq_subscriber import ZmqSubscriber
from workers.emulator.config import DEFAULT_MODEL as MODEL


class Subscriber(ZmqSubscriber):
    """A real ZMQ SUB socket collecting decoded batches."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint)
        self.batches: list[EventBatch] = []

    async def drain(self, quiet_s: float = 0.3) -> list[EventBatch]:
        async for frames in self.messages(quiet_s):
            self.batches.append(decode_message(frames))
        return self.batches


async def chat(http: httpx.AsyncClient, url: str, content: str, **extra: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}
    resp = await http.post(url + "/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


async def connected(sub: Subscriber, http: httpx.AsyncClient, url: str) -> None:
    """Wait out ZMQ's slow joiner: send probes until one's events arrive, then forget them."""
    probes = 0

    async def heard() -> bool:
        nonlocal probes
        probes += 1
        await chat(http, url, f"probe {probes} " + "p" * 40)
        return bool(await sub.drain(0.05))

    await until(heard, what="a probe's KV events on the SUB socket")
    reset = await http.post(url + "/reset_prefix_cache")
    assert reset.status_code == 200
    batches = await sub.drain(0.3)
    assert isinstance(batches[-1].events[-1], AllBlocksCleared)
    sub.batches.clear()


async def test_stores_and_evictions_arrive_in_order_and_rebuild_the_hash_chain(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    port = free_port()
    server = await start_emulator(num_blocks=12, kv_events_port=port, salt="ev")
    sub = Subscriber(f"tcp://127.0.0.1:{port}")
    try:
        await connected(sub, http, server.url)
        for i in range(3):
            await chat(http, server.url, f"{i} conversation " + "z" * 90)  # 7 full blocks each
        batches = await sub.drain()
    finally:
        sub.close()
    seqs = [b.seq for b in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    events = [e for b in batches for e in b.events]
    resident: dict[int, tuple[int, ...]] = {}
    parents: dict[int, int | None] = {}
    root = chain_root(MODEL, "ev")
    removed = 0
    for e in events:
        if isinstance(e, BlockStored):
            # Rebuild each hash from token ids, as the directory does.
            parent = root if e.parent_engine_hash is None else e.parent_engine_hash
            assert e.parent_engine_hash is None or e.parent_engine_hash in resident
            for k, h in enumerate(e.engine_hashes):
                tokens = e.token_ids[k * e.block_size : (k + 1) * e.block_size]
                assert hash_block(parent, tokens) == h
                resident[h] = tokens
                parents[h] = e.parent_engine_hash if k == 0 else parent
                parent = h
        elif isinstance(e, BlockRemoved):
            for h in e.engine_hashes:
                assert h in resident, "a block was removed before it was stored"
                del resident[h]
                removed += 1
    assert removed > 0
    listing = (await http.get(server.url + "/kv_blocks")).json()
    assert set(resident) == set(listing["block_hashes"])
    last_prompt = "<|user|>2 conversation " + "z" * 90 + "<|end|>\n<|assistant|>"
    last_chain = block_hash_chain(list(last_prompt.encode()), 16, root)
    assert set(last_chain) <= set(resident)


async def test_replay_socket_resends_missed_batches(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    port, replay_port = free_port(), free_port()
    server = await start_emulator(kv_events_port=port, kv_events_replay_port=replay_port)
    for i in range(3):
        await chat(http, server.url, f"{i} replayed " + "r" * 40)
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        await dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        got: list[int] = []
        while True:
            async with asyncio.timeout(5):
                frames = await dealer.recv_multipart()
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == -1:
                break
            got.append(decode_message(frames[1:]).seq)
    finally:
        dealer.close(linger=0)
        ctx.term()
    assert got == [1, 2]


async def test_directory_learns_holdings_and_evictions_from_the_emulator_events(
    start_emulator: StartEmulator, http: httpx.AsyncClient
) -> None:
    """Emulator PUB -> the project's KVEventSubscriber (with replay) -> InMemoryDirectory."""
    from ownerserve.directory.memory import InMemoryDirectory
    from ownerserve.tokenizer import ByteTokenizer, ChatTemplate
    from router.backends.kv_events import KVEventSubscriber

    port, replay_port = free_port(), free_port()
    server = await start_emulator(
        num_blocks=16, kv_events_port=port, kv_events_replay_port=replay_port, worker_id="w1"
    )
    root = chain_root(MODEL)
    directory = InMemoryDirectory()
    await directory.register_worker("w1", root, 16)

    def chain_of(content: str) -> list[int]:
        text = ChatTemplate().render([{"role": "user", "content": content}])
        return block_hash_chain(ByteTokenizer().encode(text), 16, root)

    async def held(content: str) -> bool:
        chain = chain_of(content)
        return (await directory.lookup(chain)).longest("w1") == len(chain)

    async def gone(content: str) -> bool:
        return (await directory.lookup(chain_of(content))).longest("w1") == 0

    # Published before anyone listens: the subscriber catches up from the replay socket.
    first = "0 the first prompt " + "f" * 80
    await chat(http, server.url, first)
    # A batch published before the subscription reached the PUB (ZMQ's slow joiner) is lost
    # there, and fetched from the replay socket after a quiet interval: a short one here.
    sub = KVEventSubscriber(
        "w1", f"tcp://127.0.0.1:{port}", directory,
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}", catch_up_interval_s=0.5,
    )  # fmt: skip
    await sub.start()
    try:
        await until(lambda: held(first), what="the first prompt's blocks, replayed")
        second = "1 another prompt " + "s" * 80
        await chat(http, server.url, second)
        await until(lambda: held(second), what="the second prompt's blocks")
        for prompt in (first, second):
            chain = chain_of(prompt)
            assert (await directory.lookup(chain)).longest("w1") == len(chain) > 0
        assert sub.stats.replayed >= 1  # the batch published before it subscribed
        # Fill the 16-block cache with other prompts: the first one is evicted everywhere.
        for i in range(3):
            await chat(http, server.url, f"{i + 2} filler " + "x" * 120)
        await until(lambda: gone(first), what="the first prompt evicted")
    finally:
        await sub.close()
