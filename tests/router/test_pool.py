"""Circuit breakers and the load scraped from workers' Prometheus metrics."""

from __future__ import annotations

from ownerserve.config import WorkerSettings
from router.backends import parse_load_metrics
from router.pool import BreakerState, CircuitBreaker, WorkerPool


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
