"""The planner's view of the workers (`router.views.cluster_view`): a worker's `WorkerView` is
reused while nothing it shows changes, and rebuilt with what changed, each input the view
takes from the caller landing in its own field."""

from __future__ import annotations

import time

from ownerserve.config import settings_from_dict
from ownerserve.directory.base import Artifact, HoldKind, Match
from ownerserve.directory.memory import InMemoryDirectory
from ownerserve.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.types import KVTransport, Tier
from router.backends import WorkerLoad
from router.membership import LiveWorkerSink
from router.state import Router
from router.views import cluster_view

MODEL = "tiny"


def _router() -> Router:
    return Router(
        settings_from_dict(
            {
                "models": [{"name": MODEL, "block_size": 4}],
                "workers": [
                    {"id": f"w{i}", "url": f"http://127.0.0.1:{9 + i}", "node": f"n{i}"}
                    for i in range(2)
                ],
                "admission": {"enabled": False},
            }
        )
    )


def test_a_workers_view_is_reused_until_what_it_shows_changes() -> None:
    router = _router()
    for w in router.pool.for_model(MODEL):
        w.load = WorkerLoad(kv_usage=0.25, kv_capacity_tokens=10_000)
    cluster = router.services.cluster
    match = Match(chain_len=0)
    first = cluster_view(cluster, MODEL, match, ()).workers
    again = cluster_view(cluster, MODEL, match, ()).workers
    assert [a is b for a, b in zip(first, again, strict=True)] == [True, True]
    assert [v.kv_usage for v in first] == [0.25, 0.25]

    # a transfer queued on w0's node, a working set on w1, a chunk held by w0: each lands in
    # its own field of its own worker's view (and only there)
    now = time.monotonic()
    router.nics.reserve("n0", 30.0, now)
    router.working_sets.started("s1", "w1", 1234, now)
    w0, w1 = cluster_view(cluster, MODEL, match, (), {"w0": (2,)}).workers
    assert w0.nic_backlog_s > 29.0 and w1.nic_backlog_s == 0.0
    assert (w0.ws_tokens, w1.ws_tokens) == (0, 1234)
    assert (w0.chunks_held, w1.chunks_held) == ((2,), ())
    assert not w0.programs_closed and not w1.programs_closed
    assert w0 is not first[0] and w1 is not first[1]


async def test_a_lease_counts_only_as_far_as_the_workers_kv_events_show_its_blocks() -> None:
    """An owner's lease does not pin the engine's blocks: once w0's events say it evicted the
    tail of the leased prefix, w0's view holds only what is left (what its engine will
    report as cached). w1 publishes no KV events: its lease is all the router knows."""
    settings = settings_from_dict(
        {
            "models": [{"name": MODEL, "block_size": 4}],
            "workers": [
                {"id": "w0", "url": "http://127.0.0.1:9", "node": "n0",
                 "kv_events_endpoint": "tcp://127.0.0.1:9"},
                {"id": "w1", "url": "http://127.0.0.1:10", "node": "n1"},
            ],
            "admission": {"enabled": False},
        }
    )  # fmt: skip
    router = Router(settings)
    d = InMemoryDirectory()
    root = chain_root(MODEL)
    tokens = tuple(range(32))
    chain = tuple(block_hash_chain(tokens, 4, root))
    other = tuple(block_hash_chain(tuple(range(100, 132)), 4, root))
    engine = tuple(range(1000, 1008))  # the engine's own block hashes
    for w in ("w0", "w1"):
        await d.register_worker(w, root, 4)
    stored = BlockStored(engine, None, tokens, 4, Tier.GPU)
    await d.apply_events("w0", EventBatch(0, 0.0, (stored,)))
    await d.claim(Artifact(chain=chain), "w0", 500.0)
    await d.claim(Artifact(chain=other), "w1", 500.0)
    cluster = router.services.cluster

    (w0, _w1) = cluster_view(cluster, MODEL, await d.lookup(chain), ()).workers
    assert w0.cached_blocks == {Tier.GPU: 8}
    evicted = BlockRemoved(engine[4:], Tier.GPU)
    await d.apply_events("w0", EventBatch(1, 0.0, (evicted,)))
    match = await d.lookup(chain)
    assert {(h.worker, h.kind, h.blocks) for h in match.holdings} == {
        ("w0", HoldKind.OWNER, 8),  # the lease still names the evicted blocks
        ("w0", HoldKind.CACHED, 4),
    }
    (w0, _w1) = cluster_view(cluster, MODEL, match, ()).workers
    assert w0.cached_blocks == {Tier.GPU: 4}
    (_w0, w1) = cluster_view(cluster, MODEL, await d.lookup(other), ()).workers
    assert w1.cached_blocks == {Tier.GPU: 8}


async def test_a_hybrid_workers_view_shows_where_its_windows_let_a_hit_resume() -> None:
    """w0's engine tags its KV events per KV cache group: its attention group holds the 8
    blocks of the chain, its sliding-window group (8 tokens: 2 blocks) only blocks 0-2, so
    every group is restorable at boundary 3 at most: the view's `restorable_blocks`, which
    the planner's resume rule reads. w1 names no groups: not known (None)."""
    router = _router()
    d = InMemoryDirectory()
    root = chain_root(MODEL)
    tokens = tuple(range(32))
    chain = tuple(block_hash_chain(tokens, 4, root))
    engine = tuple(range(1000, 1008))
    for w in ("w0", "w1"):
        await d.register_worker(w, root, 4)
    full = BlockStored(engine, None, tokens, 4, Tier.GPU, None, 0, "full_attention")
    window = BlockStored(engine[:3], None, tokens[:12], 4, Tier.GPU, None, 1, "sliding_window", 8)
    await d.apply_events("w0", EventBatch(0, 0.0, (full, window)))
    await d.apply_events("w1", EventBatch(0, 0.0, (BlockStored(engine, None, tokens, 4),)))
    w0, w1 = cluster_view(router.services.cluster, MODEL, await d.lookup(chain), ()).workers
    assert w0.cached_blocks == w1.cached_blocks == {Tier.GPU: 8}
    assert (w0.restorable_blocks, w1.restorable_blocks) == (3, None)
    # the window group's blocks 3-7 stored too: restorable at the sealed boundary
    rest = BlockStored(
        engine[3:], engine[2], tokens[12:], 4, Tier.GPU, None, 1, "sliding_window", 8
    )
    await d.apply_events("w0", EventBatch(1, 0.0, (rest,)))
    w0, _ = cluster_view(router.services.cluster, MODEL, await d.lookup(chain), ()).workers
    assert w0.restorable_blocks == 8


async def test_a_lease_committed_after_the_last_event_counts_until_a_newer_batch() -> None:
    """w0's KV events lag: the router committed w0's 8-block prefix (a served turn) at wall
    time 100, and no batch of w0 published after that has been applied. Its lease is then
    the news and counts whole, whether the batches applied meanwhile were older (ts 50) or
    none; a batch published after the commit (ts 150) shows what the engine holds, and the
    view follows it again (here 4 blocks). A prefix committed elsewhere, or never, is not
    fresh."""
    settings = settings_from_dict(
        {
            "models": [{"name": MODEL, "block_size": 4}],
            "workers": [
                {"id": "w0", "url": "http://127.0.0.1:9", "node": "n0",
                 "kv_events_endpoint": "tcp://127.0.0.1:9"},
            ],
            "admission": {"enabled": False},
        }
    )  # fmt: skip
    router = Router(settings)
    d = InMemoryDirectory()
    root = chain_root(MODEL)
    tokens = tuple(range(32))
    chain = tuple(block_hash_chain(tokens, 4, root))
    engine = tuple(range(1000, 1008))
    await d.register_worker("w0", root, 4)
    await d.claim(Artifact(chain=chain), "w0", 500.0)
    state = router.pool.get("w0")
    assert state is not None
    sink = LiveWorkerSink(d, state)
    cluster = router.services.cluster

    async def gpu_blocks(request_chain: tuple[int, ...]) -> dict[Tier, int]:
        match = await d.lookup(request_chain)
        return cluster_view(cluster, MODEL, match, (), chain=request_chain).workers[0].cached_blocks

    assert await gpu_blocks(chain) == {}  # a lease nobody says is fresh: the events rule
    state.note_commit(chain[-1], 100.0)
    assert await gpu_blocks(chain) == {Tier.GPU: 8}
    longer = (*chain, 12345)  # the next turn's chain extends the committed prefix
    assert await gpu_blocks(longer) == {Tier.GPU: 8}
    other = BlockStored((2000,), None, tuple(range(200, 204)), 4, Tier.GPU)
    await sink.apply_events("w0", EventBatch(0, 50.0, (other,)))
    assert await gpu_blocks(chain) == {Tier.GPU: 8}
    stored = BlockStored(engine[:4], None, tokens[:16], 4, Tier.GPU)
    await sink.apply_events("w0", EventBatch(1, 150.0, (stored,)))
    assert state.events_ts == 150.0
    assert await gpu_blocks(chain) == {Tier.GPU: 4}


async def test_a_workers_view_shows_the_kv_its_events_say_its_hbm_holds() -> None:
    """`WorkerView.cached_tokens` counts the GPU blocks a worker's KV events stored and did not
    remove (the CPU tier's and other KV cache groups' apart), from every batch its subscriber
    passes; a cleared cache, or a dropped worker, counts nothing."""
    router = _router()
    directory = InMemoryDirectory()
    await directory.register_worker("w0", chain_root(MODEL), 4)
    state = router.pool.get("w0")
    assert state is not None
    sink = LiveWorkerSink(directory, state)
    tokens = tuple(range(12))
    stored = BlockStored((1, 2, 3), None, tokens, 4)
    offloaded = BlockStored((1,), None, tokens[:4], 4, tier=Tier.CPU)
    window = BlockStored((7,), None, tokens[:4], 4, group_idx=1)
    await sink.apply_events("w0", EventBatch(0, 1.0, (stored, offloaded, window)))
    cluster = router.services.cluster

    def cached() -> list[int]:
        return [
            v.cached_tokens for v in cluster_view(cluster, MODEL, Match(chain_len=0), ()).workers
        ]

    assert cached() == [12, 0]
    removed = (BlockRemoved((3,)), BlockRemoved((1,), tier=Tier.CPU))
    await sink.apply_events("w0", EventBatch(1, 2.0, removed))
    assert cached() == [8, 0]
    await sink.apply_events("w0", EventBatch(2, 3.0, (AllBlocksCleared(),)))
    assert cached() == [0, 0]
    # a removal of blocks stored before the subscription does not go below nothing
    await sink.apply_events("w0", EventBatch(3, 4.0, (BlockRemoved((9, 10)), stored)))
    assert cached() == [12, 0]
    await sink.drop_worker("w0")
    assert cached() == [0, 0]


def test_a_vllm_workers_view_says_its_engine_never_rebuilds_windows() -> None:
    """vLLM's hybrid KV cache coordinator only cuts a hit back to the windows it holds: its
    view turns the planner's rebuild off; an emulated engine's keeps it (the resume rule)."""
    router = Router(
        settings_from_dict(
            {
                "models": [{"name": MODEL, "block_size": 4}],
                "workers": [
                    {"id": "v", "url": "http://127.0.0.1:9", "kind": "vllm"},
                    {"id": "e", "url": "http://127.0.0.1:10", "kind": "emulator"},
                ],
                "admission": {"enabled": False},
            }
        )
    )
    views = cluster_view(router.services.cluster, MODEL, Match(chain_len=0), ()).workers
    assert {w.worker_id: w.rebuilds_windows for w in views} == {"v": False, "e": True}


def test_a_workers_view_says_which_path_kv_takes_into_it() -> None:
    router = Router(
        settings_from_dict(
            {
                "models": [{"name": MODEL, "block_size": 4}],
                "workers": [
                    {"id": "w0", "url": "http://127.0.0.1:9"},
                    {
                        "id": "w1",
                        "url": "http://127.0.0.1:10",
                        "kv_same_host": False,
                        "kv_transport": "store_tcp",
                    },
                ],
                "admission": {"enabled": False},
            }
        )
    )
    w0, w1 = cluster_view(router.services.cluster, MODEL, Match(chain_len=0), ()).workers
    assert (w0.kv_same_host, w0.kv_transport) == (True, KVTransport.STORE_RDMA)
    assert (w1.kv_same_host, w1.kv_transport) == (False, KVTransport.STORE_TCP)
