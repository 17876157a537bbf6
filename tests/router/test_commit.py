"""Directory commits after a response, against the real in-memory directory; the ledger of
the leases they hold per worker (`CommittedLeases`)."""

from __future__ import annotations

from dataclasses import dataclass

from ownerserve.directory.base import HoldKind, Lease, Match
from ownerserve.directory.memory import InMemoryDirectory
from ownerserve.types import Tier
from planner.types import Action, Candidate, CostBreakdown, Plan, RequestClass
from router.commit import CommittedLeases, Lifetimes, commit_plan

CHAIN = tuple(range(1000, 1010))


def _plan(action: Action, p: str, d: str) -> Plan:
    return Plan(
        policy="test",
        request_class=RequestClass.NEW_LONG_PREFIX,
        chosen=Candidate(action, p, d, CostBreakdown()),
    )


@dataclass(frozen=True)
class _Served:
    plan: Plan
    chain: tuple[int, ...]
    session_id: str | None
    match: Match
    kv_bytes_per_block: int = 100
    fork_from_blocks: int = 0
    refresh: bool = True


async def _commit(directory, plan, chain, session, match, fork=0):
    served = _Served(plan, chain, session, match, fork_from_blocks=fork)
    return await commit_plan(directory, served, Lifetimes(60, 60, 5))


async def test_remote_prefill_commit_makes_decode_owner_and_prefill_a_replica():
    directory = InMemoryDirectory()
    match = await directory.lookup(CHAIN[:6], "s1")
    lease = await _commit(
        directory, _plan(Action.REMOTE_PREFILL, "p0", "d0"), CHAIN[:6], "s1", match
    )
    assert lease is not None and lease.worker == "d0"
    after = await directory.lookup(CHAIN[:6], "s1")
    assert (after.owner, after.owner_blocks, after.session_owner) == ("d0", 6, "d0")
    kinds = {(h.worker, h.kind) for h in after.holdings}
    assert ("p0", HoldKind.REPLICA) in kinds


async def test_next_turn_commits_a_delta_fenced_by_the_owner_epoch():
    directory = InMemoryDirectory()
    colocated = _plan(Action.COLOCATED_PREFILL, "h0", "h0")
    await _commit(directory, colocated, CHAIN[:4], "s1", await directory.lookup(CHAIN[:4], "s1"))
    match = await directory.lookup(CHAIN, "s1")
    assert match.owner == "h0" and match.owner_blocks == 4
    cont = _plan(Action.DECODE_CONTINUATION, "h0", "h0")
    await _commit(directory, cont, CHAIN, "s1", match)
    after = await directory.lookup(CHAIN, "s1")
    assert (after.owner, after.owner_blocks) == ("h0", 10)


async def test_another_workers_prefix_becomes_a_replica_not_a_takeover():
    directory = InMemoryDirectory()
    await _commit(
        directory,
        _plan(Action.COLOCATED_PREFILL, "a", "a"),
        CHAIN[:4],
        None,
        await directory.lookup(CHAIN[:4]),
    )
    match = await directory.lookup(CHAIN)
    await _commit(directory, _plan(Action.ARTIFACT_FETCH, "b", "b"), CHAIN, "s2", match)
    after = await directory.lookup(CHAIN[:4])
    assert after.owner == "a"
    assert after.longest("b", Tier.GPU) == 4
    full = await directory.lookup(CHAIN, "s2")
    assert full.session_owner == "b"


async def test_fork_takes_a_copy_on_write_reference_on_the_shared_prefix():
    directory = InMemoryDirectory()
    plan = _plan(Action.COLOCATED_PREFILL, "h0", "h0")
    await _commit(directory, plan, CHAIN[:5], "s1", await directory.lookup(CHAIN[:5], "s1"))
    branch = (*CHAIN[:3], 7, 8, 9)
    await _commit(directory, plan, branch, "s1", await directory.lookup(branch, "s1"), fork=3)
    info = await directory.artifact_info(CHAIN[4])
    assert info is not None
    refs = await directory.add_fork_ref(CHAIN[2], "other")
    assert refs == 2


async def test_without_refresh_unchanged_records_are_not_rewritten():
    directory = InMemoryDirectory()
    plan = _plan(Action.COLOCATED_PREFILL, "h0", "h0")
    await _commit(directory, plan, CHAIN[:4], "s1", await directory.lookup(CHAIN[:4], "s1"))
    match = await directory.lookup(CHAIN[:4], "s1")
    calls: list[str] = []
    for name in ("set_session_owner", "renew", "add_replica", "claim"):
        original = getattr(directory, name)

        async def spy(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return await _original(*args, **kwargs)

        setattr(directory, name, spy)
    lifetimes = Lifetimes(60, 60, 5)
    await commit_plan(directory, _Served(plan, CHAIN[:4], "s1", match, refresh=False), lifetimes)
    assert calls == []
    await commit_plan(directory, _Served(plan, CHAIN[:4], "s1", match, refresh=True), lifetimes)
    assert sorted(calls) == ["renew", "set_session_owner"]


async def test_a_state_migration_hands_the_prefix_over_and_the_source_copy_ages_out():
    now = [0.0]
    directory = InMemoryDirectory(clock=lambda: now[0])
    colocated = _plan(Action.COLOCATED_PREFILL, "a", "a")
    await _commit(directory, colocated, CHAIN[:4], "s1", await directory.lookup(CHAIN[:4], "s1"))
    match = await directory.lookup(CHAIN, "s1")
    assert (match.owner, match.session_owner) == ("a", "a")
    moved = Plan(
        policy="test",
        request_class=RequestClass.SMALL_INCREMENTAL_TURN,
        chosen=Candidate(Action.STATE_MIGRATION, "b", "b", CostBreakdown(), source_worker="a"),
    )
    await _commit(directory, moved, CHAIN, "s1", match)
    after = await directory.lookup(CHAIN, "s1")
    # b owns the whole prompt now (the moved prefix and the new blocks), a holds a replica
    assert (after.owner, after.owner_blocks, after.session_owner) == ("b", 10, "b")
    assert after.owner_epoch > match.owner_epoch
    assert ("a", HoldKind.REPLICA) in {(h.worker, h.kind) for h in after.holdings}
    now[0] += 6.0  # past the replica TTL (Lifetimes(60, 60, 5)), within b's lease
    await directory.sweep()
    aged = await directory.lookup(CHAIN, "s1")
    assert aged.owner == "b" and aged.longest("a") == 0


def test_the_leases_held_per_worker_count_their_claims_renewals_keep_them_expiry_ends_them():
    now = [100.0]
    held = CommittedLeases(clock=lambda: now[0])
    held.held(Lease(1, "w0", 1, 160.0), 8)  # a session's first turn: 8 new blocks
    held.held(Lease(2, "w0", 2, 170.0), 3)  # its next turn: a delta of 3
    held.held(Lease(3, "w1", 3, 130.0), 5)
    held.held(Lease(4, "w1", 4, 200.0), None)  # a renewal of a lease never seen: nothing
    assert (held.blocks("w0"), held.blocks("w1"), len(held)) == (11, 5, 3)
    held.held(Lease(1, "w0", 1, 190.0), None)  # renewed: its 8 blocks, a later expiry
    now[0] = 165.0
    held.expire()
    assert (held.blocks("w0"), held.blocks("w1")) == (11, 0)  # w1's lease and nothing else
    now[0] = 175.0
    assert held.blocks("w0") == 11  # a read only reads: expired leases leave at `expire`
    held.expire()
    assert held.blocks("w0") == 8  # the delta's lease ended, the renewed one lives
    held.held(Lease(5, "w0", 5, 150.0), 4)  # already expired when it came: not counted
    assert held.blocks("w0") == 8
    held.forget_worker("w0")
    assert (held.blocks("w0"), len(held)) == (0, 0)


async def test_between_refreshes_a_replica_is_extended_by_the_new_blocks_only():
    now = [1000.0]
    directory = InMemoryDirectory(clock=lambda: now[0])
    a_first, b_next = (
        _plan(Action.COLOCATED_PREFILL, "a", "a"),
        _plan(Action.ARTIFACT_FETCH, "b", "b"),
    )
    await _commit(directory, a_first, CHAIN[:8], None, await directory.lookup(CHAIN[:8]))
    # b serves the first 4 blocks behind a's ownership: a replica of them, written in full
    await _commit(directory, b_next, CHAIN[:4], "s", await directory.lookup(CHAIN[:4], "s"))
    first_lines = {b: dict(directory._replicas[b]) for b in CHAIN[:4]}
    now[0] += 1.0
    # a later turn, not a refresh: b's replica grows by blocks 4..7; blocks 0..3 stay as written
    match = await directory.lookup(CHAIN[:8], "s")
    assert match.longest("b", Tier.GPU) == 4
    served = _Served(b_next, CHAIN[:8], "s", match, refresh=False)
    await commit_plan(directory, served, Lifetimes(60, 60, 5))
    assert {b: directory._replicas[b] for b in CHAIN[:4]} == first_lines
    assert all(("b", Tier.GPU) in directory._replicas[b] for b in CHAIN[4:8])
    after = await directory.lookup(CHAIN[:8], "s")
    replica = [h for h in after.holdings if h.worker == "b" and h.kind is HoldKind.REPLICA]
    assert [h.blocks for h in replica] == [8]
    # a refresh rewrites the whole prefix
    served = _Served(b_next, CHAIN[:8], "s", after, refresh=True)
    await commit_plan(directory, served, Lifetimes(60, 60, 5))
    assert all(directory._replicas[b][("b", Tier.GPU)][0] == 1061.0 for b in CHAIN[:8])
