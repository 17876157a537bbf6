"""`ownerserve status`'s screen without a router (`ownerserve.cli.status.render`): no line
over 100 columns whatever the ids and counts, each worker's state words."""

from __future__ import annotations

from typing import Any

from ownerserve.cli.status import WIDTH, render


def worker(wid: str, **over: Any) -> dict[str, Any]:
    w: dict[str, Any] = {
        "id": wid,
        "role": "prefill",
        "healthy": True,
        "draining": False,
        "breaker": "closed",
        "running": 12345,
        "waiting": 999,
        "kv_usage": 0.5,
        "admission": {
            "kv_usage": 1.25,
            "paused": False,
            "working_set_tokens": 123_456_789,
            "budget_tokens": 987_654_321,
            "sessions": 4096,
            "closed": False,
        },
        "calibration": {"prefill": 123.4, "decode": 0.25, "link": 1.0},
        "nic_backlog_s": 12.5,
    }
    w.update(over)
    return w


def status(workers: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "policy": "ownerserve",
        "requests_in_flight": 7,
        "workers": workers,
        "admission": {
            "enabled": True,
            "queued": 3,
            "max_queued": 1024,
            "high_watermark": 0.95,
            "low_watermark": 0.8,
            "cluster_full": True,
        },
        "plans": {
            "recent": 256,
            "actions": {f"action_{i}": 10 for i in range(20)},
            "classes": {"new_long_prefix": 200, "cold_resume": 56},
            "policies": {"ownerserve": 256},
            "fallbacks": 3,
            "migrated": 1,
        },
        "top_sessions": [
            {"session": "s" * 300, "worker": "w" * 128, "tokens": 10**7} for _ in range(10)
        ],
        "directory": {"backend": "redis", "healthy": False, "detail": "connection refused"},
    }


def test_no_line_is_wider_than_the_screen() -> None:
    broken = {**worker("x" * 128), "breaker": "half_open", "draining": True, "healthy": False}
    broken["admission"] = {**broken["admission"], "paused": True, "closed": True}
    text = render(status([worker("p0"), broken]), "http://" + "h" * 150 + ":8000")
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= WIDTH
    assert "directory redis: UNHEALTHY connection refused" in text
    assert "cluster full: yes" in text
    (row,) = [ln for ln in lines if ln.startswith("x")]
    assert row.split()[2] == "down,draining,h…"  # its state words, cut to the column


def test_a_router_with_no_workers_or_plans_says_so() -> None:
    empty = status([])
    empty["plans"] = {**empty["plans"], "recent": 0}
    empty["top_sessions"] = []
    empty["admission"] = {**empty["admission"], "enabled": False}
    text = render(empty, "http://127.0.0.1:8000")
    assert "no workers" in text and "no plans yet" in text and "admission off" in text
