"""The in-memory directory's sweep leaves nothing of what expired: leases and the blocks they
mapped, replicas, sessions, fork refs of ended sessions, and the per-worker index entries that
pointed at them (without it a long-running router's memory grows with every distinct prompt).
It yields to the event loop between slices, and what is renewed meanwhile stays."""

from __future__ import annotations

import asyncio

import pytest

from ownerserve.directory import memory
from ownerserve.directory.base import Artifact
from ownerserve.directory.memory import InMemoryDirectory
from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.types import Tier

ROOT = chain_root("m")


def _chain(seed: int, blocks: int = 8) -> tuple[int, ...]:
    return tuple(block_hash_chain(list(range(seed * 1000, seed * 1000 + blocks * 4)), 4, ROOT))


async def test_a_sweep_after_everything_expired_leaves_an_empty_directory() -> None:
    clock = [1000.0]
    d = InMemoryDirectory(clock=lambda: clock[0])
    for i in range(20):
        chain = _chain(i)
        worker = f"w{i % 3}"
        await d.claim(Artifact(chain), worker, 5.0)
        await d.add_replica(chain[-1], f"w{(i + 1) % 3}", Tier.CPU, 5.0, True, chain)
        await d.set_session_owner(f"s{i}", worker, 5.0)
        await d.add_fork_ref(chain[3], f"s{i}")
    live = _chain(99)
    await d.claim(Artifact(live), "w0", 500.0)
    await d.set_session_owner("kept", "w0", 500.0)
    await d.add_fork_ref(live[3], "kept")
    clock[0] += 10.0

    dropped = await d.sweep()

    assert dropped == 20 + 20 * 8  # leases, replica blocks
    assert list(d._artifacts) == [live[-1]]
    assert set(d._owner_of_block) == set(live)
    assert d._replicas == {} and list(d._sessions) == ["kept"]
    assert d._forks == {live[3]: {"kept"}}
    for worker, rec in d._worker_index.items():
        assert not rec.replica_blocks, worker
        assert rec.sessions == ({"kept"} if worker == "w0" else set()), worker
        assert rec.artifacts == ({live[-1]} if worker == "w0" else set()), worker


async def test_an_expired_session_read_leaves_no_index_entry() -> None:
    clock = [0.0]
    d = InMemoryDirectory(clock=lambda: clock[0])
    await d.set_session_owner("s", "w1", 1.0)
    clock[0] = 2.0
    assert await d.get_session_owner("s") is None
    assert d._worker_index["w1"].sessions == set()


async def test_a_sweep_yields_between_slices_and_keeps_what_was_renewed_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(memory, "SWEEP_SLICE", 4)
    clock = [0.0]
    d = InMemoryDirectory(clock=lambda: clock[0])
    for i in range(12):
        await d.claim(Artifact(_chain(i)), "w1", 5.0)
    clock[0] = 10.0
    turns = 0

    async def other_work() -> None:
        nonlocal turns
        while True:
            turns += 1
            if turns == 2:  # while the sweep is between slices: a new claim of an expired one
                await d.claim(Artifact(_chain(11)), "w2", 50.0)
            await asyncio.sleep(0)

    task = asyncio.create_task(other_work())
    await asyncio.sleep(0)
    dropped = await d.sweep()
    task.cancel()
    assert turns >= 3  # 12 leases in slices of 4, then the other tables
    owner = (await d.lookup(_chain(11))).owner
    assert owner == "w2" and dropped == 11 and len(d._artifacts) == 1


async def test_replicas_pruned_by_a_write_leave_their_workers_index() -> None:
    clock = [0.0]
    d = InMemoryDirectory(clock=lambda: clock[0])
    chain = _chain(1)
    for i in range(8):  # eight holders of the last block: the next write prunes expired ones
        await d.add_replica(chain[-1], f"w{i}", Tier.CPU, 1.0 if i < 4 else 50.0)
    clock[0] = 2.0
    await d.add_replica(chain[-1], "w9", Tier.GPU, 50.0)
    assert {w for w, _ in d._replicas[chain[-1]]} == {"w4", "w5", "w6", "w7", "w9"}
    for i in range(4):
        assert d._worker_index[f"w{i}"].replica_blocks == set()
    assert d._worker_index["w4"].replica_blocks == {chain[-1]}
