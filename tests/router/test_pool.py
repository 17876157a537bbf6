"""Circuit breakers and the load scraped from workers' Prometheus metrics."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from pydantic import ValidationError

from ownerserve.config import WorkerSettings
from ownerserve.types import BackendKind, Role
from router.backends import parse_load_metrics
from router.pool import BreakerState, CircuitBreaker, WorkerPool
from router.upstream import UpstreamPool
from tests.router.fake_worker import FakeWorker
from tests.waiting import until


def test_breaker_opens_after_threshold_and_half_opens_after_cooldown():
    b = CircuitBreaker(threshold=2, cooldown_s=5.0)
    b.record_failure(now=0.0)
    assert b.allow(now=0.1) and b.state is BreakerState.CLOSED
    b.record_failure(now=1.0)
    assert b.state is BreakerState.OPEN and not b.allow(now=2.0)
    assert b.allow(now=6.5) and b.state is BreakerState.HALF_OPEN
    b.on_attempt()
    assert not b.allow(now=6.6)  # one trial at a time
    b.record_failure(now=7.0)
    assert b.state is BreakerState.OPEN and not b.allow(now=8.0)
    assert b.allow(now=12.5)
    b.on_attempt()
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.allow(now=12.6)


def test_load_parsed_from_vllm_metric_names():
    text = """# HELP vllm:num_requests_running x
vllm:num_requests_running{model_name="m",engine="0"} 3.0
vllm:num_requests_running{model_name="m",engine="1"} 2.0
vllm:num_requests_waiting{model_name="m"} 4.0
vllm:kv_cache_usage_perc{model_name="m"} 0.25
vllm:prefix_cache_hits_total{model_name="m"} 10.0
vllm:prefix_cache_queries_total{model_name="m"} 40.0
vllm:other 7
"""
    load = parse_load_metrics(text)
    assert (load.running, load.waiting, load.kv_usage) == (5, 4, 0.25)
    assert (load.prefix_cache_hits, load.prefix_cache_queries) == (10.0, 40.0)


def test_pool_membership_drain_and_models():
    pool = WorkerPool(
        [
            WorkerSettings(id="a", url="http://127.0.0.1:1", models=("m1",)),
            WorkerSettings(id="b", url="http://127.0.0.1:2", models=("m1", "m2")),
        ]
    )
    assert [w.worker_id for w in pool.for_model("m2")] == ["b"]
    assert pool.models() == ["m1", "m2"]
    pool.drain("a")
    assert not pool.get("a").routable()  # type: ignore[union-attr]
    assert pool.remove("a") is not None and len(pool) == 1


async def test_a_sidecar_that_stops_answering_takes_its_worker_out_of_kv_moves() -> None:
    engine, sidecar = await FakeWorker("engine").start(), await FakeWorker("sidecar").start()
    http = UpstreamPool(connect_timeout_s=1.0)
    pool = WorkerPool(
        [
            WorkerSettings(id="v0", url=engine.url, kind=BackendKind.VLLM, sidecar_url=sidecar.url),
            WorkerSettings(id="v1", url=engine.url, kind=BackendKind.VLLM),
        ],
        health_timeout_s=1.0,
    )
    await pool.start(http)
    try:
        v0, v1 = pool.get("v0"), pool.get("v1")
        assert v0 is not None and v1 is not None
        await pool.check_all()
        assert v0.kv_api and v0.healthy
        assert not v1.kv_api  # no sidecar: nothing to load a fetched prefix with
        await sidecar.stop()
        await pool.check_all()
        assert v0.kv_api  # one failed probe is not enough (`dead_after_failures`: 2)
        await pool.check_all()
        assert v0.healthy and not v0.kv_api  # the engine serves on; KV moves skip it
        sidecar.port = 0
        await sidecar.start()
        v0.settings = v0.settings.model_copy(update={"sidecar_url": sidecar.url})
        v0.address = replace(v0.address, sidecar_url=sidecar.url)
        await pool.check_all()
        assert v0.kv_api
    finally:
        await pool.close()
        await http.close()
        await engine.stop()
        await sidecar.stop()


async def test_a_dead_worker_is_marked_dead_while_another_hangs_its_probe() -> None:
    # each GET may take a minute: a health loop that waited for every worker's probe before
    # the next round would count the dead worker's second failure only after the hung one
    slow = await FakeWorker("slow", health_hangs=True).start()
    dead = await FakeWorker("dead").start()
    await dead.stop()  # its port refuses connections
    http = UpstreamPool(connect_timeout_s=60.0)
    pool = WorkerPool(
        [WorkerSettings(id="slow", url=slow.url), WorkerSettings(id="dead", url=dead.url)],
        health_interval_s=0.01,
        health_timeout_s=60.0,
        dead_after_failures=2,
    )
    marked: list[str] = []

    async def on_dead(worker_id: str) -> None:
        marked.append(worker_id)

    pool.on_worker_dead = on_dead
    await pool.start(http)
    try:
        await until(lambda: marked == ["dead"], timeout_s=20.0, what="the dead worker marked")
        slow_state = pool.get("slow")
        assert slow_state is not None and slow_state.healthy  # its probe is still waiting
    finally:
        await pool.close()
        await http.close()
        await slow.stop()


def test_kv_paths_default_by_kind_and_role() -> None:
    def paths(**kw: Any) -> set[str]:
        return {
            str(p) for p in WorkerSettings(id="w", url="http://127.0.0.1:1", **kw).kv_paths_of()
        }

    assert paths(kind="emulator") == {"nixl_pd", "sidecar", "chunk_fetch"}
    assert paths(kind="vllm", role="decode") == {"nixl_pd"}
    assert paths(kind="vllm") == set()  # a hybrid needs its connector named in kv_paths
    assert paths(kind="vllm", sidecar_url="http://127.0.0.1:2") == {"sidecar"}
    assert paths(kind="sglang", role="prefill") == {"bootstrap_pd"}
    assert paths(kind="vllm", kv_paths=["nixl_pd"]) == {"nixl_pd"}
    assert pool_groups() == {"p": "emulator", "v": None, "s": "sglang"}


def pool_groups() -> dict[str, str | None]:
    pool = WorkerPool(
        [
            WorkerSettings(id="p", url="http://127.0.0.1:1"),
            WorkerSettings(id="v", url="http://127.0.0.1:1", kind=BackendKind.VLLM),
            WorkerSettings(
                id="s", url="http://127.0.0.1:1", kind=BackendKind.SGLANG, role=Role.DECODE
            ),
        ]
    )
    return {w.worker_id: w.pd_group for w in pool.all()}


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        ({"kind": "vllm", "kv_paths": ["bootstrap_pd"]}, "a vllm worker speaks nixl_pd"),
        ({"kind": "sglang", "kv_paths": ["sidecar"]}, "sidecar needs sidecar_url"),
        ({"kind": "vllm", "kv_paths": ["rdma"]}, "kv_paths"),
        (
            {"kind": "vllm", "kv_paths": ["chunk_fetch"], "sidecar_url": "http://127.0.0.1:2"},
            "chunk_fetch is served by the emulated engine only",
        ),
    ],
)
def test_kv_paths_a_worker_cannot_have_are_config_errors(entry: dict[str, Any], error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        WorkerSettings(id="w", url="http://127.0.0.1:1", **entry)


async def test_a_death_the_directory_failed_to_record_is_recorded_at_the_next_probe() -> None:
    # the death hook's drop may fail (a directory error at that moment): the dead life must
    # still go, at a later probe while the worker is dead, or before it counts as back
    worker = await FakeWorker("w").start()
    http = UpstreamPool(connect_timeout_s=10.0)
    pool = WorkerPool(
        [WorkerSettings(id="w", url=worker.url)],
        health_interval_s=3600.0,  # one round at start; the test probes by hand after it
        health_timeout_s=10.0,
        dead_after_failures=1,
    )
    calls: list[str] = []
    failures = [RuntimeError("directory said no")] * 2

    async def on_dead(worker_id: str) -> None:
        calls.append("dead")
        if failures:
            raise failures.pop()

    async def on_back(worker_id: str) -> None:
        calls.append("back")

    pool.on_worker_dead, pool.on_worker_back = on_dead, on_back
    await pool.start(http)
    try:
        state = pool.get("w")
        assert state is not None
        await until(lambda: state.last_seen > 0, what="the first round's probe")
        worker.health_hangs = True  # a stalled worker: each probe times out
        pool.health_timeout_s = 0.05
        await pool.check(state)
        assert not state.healthy and state.death_unrecorded and calls == ["dead"]
        await pool.check(state)  # still dead: the hook runs again (and fails again)
        assert state.death_unrecorded and calls == ["dead", "dead"]
        worker.health_hangs = False
        pool.health_timeout_s = 10.0
        await pool.check(state)  # back: the old life is dropped first, then it counts
        assert calls == ["dead", "dead", "dead", "back"]
        assert state.healthy and not state.death_unrecorded
        await pool.check(state)
        assert calls == ["dead", "dead", "dead", "back"]
    finally:
        await pool.close()
        await http.close()
        await worker.stop()
