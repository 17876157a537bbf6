"""`router.reservations` on a real redis-server: the bound holds over processes, a release
frees a slot, a stopped process's slots stop counting at once and a dead one's once its
liveness expires."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from router.reservations import InflightReservations
from tests.waiting import until

pytestmark = [pytest.mark.timeout(60), pytest.mark.redis]


def _two(url: str, bound: int, ttl_s: float = 10.0) -> tuple[InflightReservations, ...]:
    prefix = f"resv-{uuid.uuid4().hex[:8]}"
    return tuple(
        InflightReservations(url, prefix, bound=bound, ttl_s=ttl_s, process=name)
        for name in ("a", "b")
    )


async def test_the_bound_holds_over_processes_and_a_release_frees_a_slot(redis_server):
    a, b = _two(redis_server.url, bound=2)
    try:
        # one event-loop turn's asks go in one call: three at once, two taken
        got = await asyncio.gather(a.reserve("w0"), a.reserve("w0"), b.reserve("w0"))
        assert sorted(r.taken for r in got) == [False, True, True]
        assert max(r.total for r in got) == 2
        assert (await b.reserve("w1")).taken  # another worker has its own count
        taker = a if any(r.taken for r in got[:2]) else b
        taker.release("w0")
        assert (await b.reserve("w0")).taken
        assert not (await a.reserve("w0")).taken
    finally:
        await a.close()
        await b.close()


async def test_a_stopped_process_frees_its_slots_at_once(redis_server):
    a, b = _two(redis_server.url, bound=1)
    try:
        assert (await a.reserve("w0")).taken
        assert not (await b.reserve("w0")).taken
        await a.close()  # its slot stays reserved in Redis, but a is no longer live
        assert (await b.reserve("w0")).taken
    finally:
        await b.close()


async def test_a_dead_process_frees_its_slots_when_its_liveness_expires(redis_server):
    # `a` never renews (no `start`): as a process that died after reserving
    a, b = _two(redis_server.url, bound=1, ttl_s=0.3)
    try:
        assert (await a.reserve("w0")).taken
        first = await b.reserve("w0")
        assert not first.taken and first.total == 1

        async def freed() -> bool:
            return (await b.reserve("w0")).taken

        await until(freed, what="a's slot freed once its liveness expired")
    finally:
        await b.close()
        await a.client.aclose()
