"""Admission (`router.admission`): when a request may go at once, the queue's release order
(least attained service per session, aging), its bounds (429 with `Retry-After`), requests
leaving it (client gone, cancelled) and its metrics; the working sets it decides by. The rules
alone, without a router: `tests/planner/test_admission.py`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from ownerserve.config import Settings, settings_from_dict
from ownerserve.directory.base import Match
from ownerserve.errors import ConfigError, RateLimitError
from ownerserve.profiles import PROFILES_DIR
from router.answers import completion_tokens
from router.app import create_app
from router.backends import WorkerLoad
from router.pool import WorkerState
from router.server import running_app
from router.state import Router
from router.views import cluster_view
from router.writer import ResponseWriter
from tests.e2e.router_cluster import metric_value
from tests.router.fake_worker import FakeWorker
from tests.router.waiting import until

MODEL = "tiny"
CAPACITY = 1000
"""Tokens of KV pool each test worker has (its profile's `hbm_kv_bytes`)."""
PROMPT = 300


@pytest.fixture
def profile(tmp_path: Path) -> str:
    data = yaml.safe_load((PROFILES_DIR / "fast-test.yaml").read_text())
    data["hbm_kv_bytes"] = CAPACITY * data["kv_bytes_per_token"]
    path = tmp_path / "small-kv.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.fixture
def router(profile: str) -> Router:
    """A router (not serving) of one hybrid worker on `profile`, admission on by default."""
    return Router(_settings(profile))


def _settings(profile: str, roles: tuple[str, ...] = ("hybrid",), **admission: Any) -> Settings:
    return settings_from_dict(
        {
            "server": {"port": 0, "health_interval_s": 60},
            "admission": {"aging_s": 60, **admission},
            "models": [{"name": MODEL, "block_size": 4}],
            "workers": [
                {"id": f"w{i}", "url": "http://127.0.0.1:9", "role": role, "profile": profile}
                for i, role in enumerate(roles)
            ],
        }
    )


def _worker(router: Router, worker_id: str = "w0") -> WorkerState:
    w = router.pool.get(worker_id)
    assert w is not None
    return w


def _scrape(router: Router, kv_usage: float, worker_id: str = "w0") -> None:
    """A new scrape of the worker's `/metrics` (a new `WorkerLoad`, as the health loop sets)."""
    _worker(router, worker_id).load = WorkerLoad(kv_usage=kv_usage)


def _metrics(router: Router) -> str:
    return router.metrics.exposition().decode()


class Clock:
    """The admission's clock, moved by the test (the wait bounds' timers, on the loop's
    clock, act only once it shows them passed)."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


def _clock(router: Router) -> Clock:
    clock = Clock()
    router.admission.clock = clock
    return clock


async def _queued(router: Router, n: int) -> None:
    """Until `n` requests wait in the admission queue."""
    await until(lambda: router.admission.queued == n, timeout_s=2.0)


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


class Client:
    """One queued request: waits, then is sent to w0 as the pipeline would (so its prompt
    counts in w0's working set until `finish`)."""

    def __init__(
        self, router: Router, session: str | None, order: list[str], parent: str | None = None
    ) -> None:
        self.router = router
        self.session = session
        self.parent = parent
        self.out = ResponseWriter()
        self.task = asyncio.create_task(self._run(order))

    async def _run(self, order: list[str]) -> None:
        admission = self.router.admission
        await admission.wait(MODEL, self.session, PROMPT, self.out, self.parent)
        order.append(str(self.session))
        self.charged = admission.sent("w0", PROMPT)

    def finish(self) -> None:
        assert self.charged is not None
        self.router.admission.unsent(self.charged, PROMPT)


def _two_programs_and_one_back(router: Router) -> None:
    """w0's working set full of two programs in flight (960 of its 1000 tokens), and a session
    "back" that was served before and whose KV was released."""
    _scrape(router, 0.1)
    now = time.monotonic()
    router.working_sets.started("old", "w0", 500, now)
    router.working_sets.started("old2", "w0", 460, now)
    router.sessions.touch("back", 0).attained_tokens = 500


# --- admitting at once --------------------------------------------------------------------------


async def test_a_request_goes_at_once_while_a_worker_has_headroom(profile: str) -> None:
    router = Router(_settings(profile, ("hybrid", "hybrid")))
    _scrape(router, 0.99, "w0")
    _scrape(router, 0.5, "w1")
    assert router.admission.admit_now(MODEL)
    _scrape(router, 0.99, "w1")
    assert not router.admission.admit_now(MODEL)
    assert metric_value(_metrics(router), "ownerserve_admission_admitted_total", path="immediate")
    assert metric_value(_metrics(router), "ownerserve_admission_worker_paused", worker="w1") == 1


async def test_prefill_workers_do_not_count_as_headroom_when_decode_workers_exist(
    profile: str,
) -> None:
    router = Router(_settings(profile, ("prefill", "decode")))
    _scrape(router, 0.99, "w1")
    assert not router.admission.admit_now(MODEL)  # the prefill worker w0 is empty


async def test_without_a_routable_worker_the_request_goes_on_for_the_planner_to_answer(
    router: Router,
) -> None:
    _scrape(router, 0.99)
    _worker(router).healthy = False
    assert router.admission.admit_now(MODEL)


async def test_disabled_admission_admits_everything(profile: str) -> None:
    router = Router(_settings(profile, enabled=False))
    _scrape(router, 1.0)
    assert router.admission.admit_now(MODEL)


async def test_a_full_worker_takes_requests_again_only_below_the_low_watermark(
    router: Router,
) -> None:
    admission = router.admission
    _scrape(router, 0.94)
    assert admission.admit_now(MODEL)
    _scrape(router, 0.95)
    assert not admission.admit_now(MODEL)
    _scrape(router, 0.85)  # under the high watermark, not yet under the low one
    assert not admission.admit_now(MODEL)
    _scrape(router, 0.79)
    assert admission.admit_now(MODEL)


async def test_the_working_set_counts_what_the_router_sent_and_streams_since_the_scrape(
    router: Router,
) -> None:
    admission = router.admission
    worker = _worker(router)
    _scrape(router, 0.5)
    ws = admission.working_set(worker)
    assert ws.profile_capacity_tokens == CAPACITY
    sent = admission.sent("w0", 500)  # waiting or prefilling: the gauge may not show it
    assert sent is ws and ws.usage(worker.load) == pytest.approx(1.0)
    assert not admission.admit_now(MODEL)
    admission.unsent(ws, 500)
    admission.streaming(worker, 500)  # answered: streams until it ends
    assert ws.usage(worker.load) == pytest.approx(1.0)
    _scrape(router, 0.8)  # the new scrape shows it
    assert ws.usage(worker.load) == pytest.approx(0.8)
    admission.ended(worker, ws, 500)  # ended after the scrape: its KV is free
    assert ws.usage(worker.load) == pytest.approx(0.3)
    assert admission.admit_now(MODEL)


async def test_a_new_session_waits_while_the_sessions_working_sets_fill_every_worker(
    router: Router,
) -> None:
    """Program-level admission: sessions between turns leave the engines' KV gauge low, but
    their KV is the working set; a new session waits while it fills the workers (hysteresis on
    the same watermarks), a session whose KV is counted (resident) goes on."""
    admission, programs = router.admission, router.working_sets
    _scrape(router, 0.1)
    now = time.monotonic()
    programs.started("old", "w0", 450, now - 1)
    programs.ended("old", 500, now - 1)  # in a tool gap, kept 4 s (2 × the 2 s prior)
    programs.started("old2", "w0", 400, now - 1)
    programs.ended("old2", 460, now - 1)  # the two sessions: 960 of 1000 tokens
    assert admission.resident("old") and not admission.resident("new")
    assert admission.admit_now(MODEL, "old")
    assert not admission.admit_now(MODEL, "new")
    assert not admission.admit_now(MODEL)  # no session: nothing counted for it either
    assert metric_value(_metrics(router), "ownerserve_admission_worker_paused", worker="w0") == 0
    # a new session queued is released once the working set drops below the low watermark
    order: list[str] = []
    client = Client(router, "new", order)
    await _settle()
    assert order == []
    # the old session's next turn, smaller, after a 1 s gap (then kept 2 s)
    programs.started("old", "w0", 390, now)
    programs.ended("old", 390, now)
    admission.pump()
    await _settle()
    assert order == []  # 0.85: under the high watermark, not yet under the low one
    programs.forget_worker("w0")
    admission.pump()
    await _settle()
    assert order == ["new"]
    client.task.cancel()


async def test_a_started_session_queued_past_the_wait_bound_waits_for_kv_headroom_only(
    profile: str,
) -> None:
    router = Router(_settings(profile, max_queue_wait_s=10))
    admission = router.admission
    clock = _clock(router)
    _two_programs_and_one_back(router)
    assert not admission.admit_now(MODEL, "back") and not admission.admit_now(MODEL, "new")
    order: list[str] = []
    back = Client(router, "back", order)
    new = Client(router, "new", order)
    await _queued(router, 2)
    admission.pump()
    await _settle()
    assert order == []
    clock.now += 10.01
    admission.pump()  # past the bound the programs' working set no longer holds "back" back
    await _settle()
    assert order == ["back"]
    with pytest.raises(RateLimitError):  # a new session is refused at the bound instead
        await new.task
    back.task.cancel()


async def test_a_session_on_a_worker_whose_programs_are_full_is_paused_at_its_tool_boundary(
    profile: str,
) -> None:
    router = Router(_settings(profile, roles=("hybrid", "hybrid"), pause_watermark=0.95))
    admission, programs = router.admission, router.working_sets
    _scrape(router, 0.1)
    _scrape(router, 0.1, "w1")
    now = time.monotonic()
    router.sessions.touch("s", 0).attained_tokens = 500
    programs.started("s", "w0", 400, now)
    programs.ended("s", 450, now)  # between turns: counted on w0 through its tool gap
    programs.started("big", "w0", 600, now)  # w0's programs: 1050 of 1000 tokens
    assert admission.resident("s")
    # w1 has room: the cluster is not full, nothing is paused (the planner spreads sessions)
    assert admission.admit_now(MODEL, "s") and not admission.cluster_full(now)
    programs.started("other", "w1", 850, now)  # 1900 of 2000: the cluster is full
    now = time.monotonic() + 0.1  # past cluster_full's 50 ms
    assert admission.cluster_full(now)
    assert not admission.admit_now(MODEL, "s")  # paused: its KV leaves the working set
    assert not admission.resident("s") and programs.tokens("w0", time.monotonic()) == 600
    assert metric_value(_metrics(router), "ownerserve_admission_sessions_paused_total") == 1
    order: list[str] = []
    Client(router, "s", order)
    await _settle()
    assert order == ["s"]  # w1 is open to programs: it resumes there at once
    # a worker with a CPU tier counts the programs against HBM plus that tier
    router2 = Router(
        settings_from_dict(
            {
                "server": {"port": 0, "health_interval_s": 60},
                "models": [{"name": MODEL, "block_size": 4}],
                "workers": [
                    {"id": "w0", "url": "http://127.0.0.1:9", "profile": profile,
                     "cpu_kv_tokens": 1000}
                ],
            }
        )
    )  # fmt: skip
    _scrape(router2, 0.1)
    router2.sessions.touch("s", 0).attained_tokens = 500
    router2.working_sets.started("s", "w0", 400, now)
    router2.working_sets.ended("s", 450, now)
    router2.working_sets.started("big", "w0", 600, now)  # 1050 of 2000: room
    assert router2.admission.admit_now(MODEL, "s")


async def test_the_pool_size_a_worker_reports_outweighs_its_profiles(router: Router) -> None:
    worker = _worker(router)
    ws = router.admission.sent("w0", 500)
    assert ws is not None
    worker.load = WorkerLoad(kv_usage=0.25)  # a worker that does not say: the profile's 1000
    assert ws.usage(worker.load) == pytest.approx(0.75)
    worker.load = WorkerLoad(kv_usage=0.25, kv_capacity_tokens=4000)  # vllm:cache_config_info
    assert ws.usage(worker.load) == pytest.approx(0.375)


# --- the queue ----------------------------------------------------------------------------------


async def test_the_queue_releases_started_sessions_least_served_first_then_new_ones(
    router: Router,
) -> None:
    admission = router.admission
    for sid, tokens in (("heavy", 5000), ("light", 10), ("mid", 100)):
        router.sessions.touch(sid, 0).attained_tokens = tokens
    _scrape(router, 0.99)
    order: list[str] = []
    clients = [Client(router, sid, order) for sid in ("heavy", "light", "new", "mid")]
    await _settle()
    assert order == [] and admission.queued == 4
    assert metric_value(_metrics(router), "ownerserve_admission_queued") == 4
    # started sessions first, least served first; the new session after them
    for expected in (["light"], ["light", "mid"], ["light", "mid", "heavy"]):
        # one request's worth of headroom: 0.7 + 300/1000 reaches the high watermark
        _scrape(router, 0.7)
        admission.pump()
        await _settle()
        assert order == expected
        next(c for c in clients if c.session == expected[-1]).finish()
        _scrape(router, 0.4)  # under the low watermark: the worker resumes
    admission.pump()
    await _settle()
    assert order == ["light", "mid", "heavy", "new"]
    m = _metrics(router)
    assert metric_value(m, "ownerserve_admission_queued") == 0
    assert metric_value(m, "ownerserve_admission_admitted_total", path="queued") == 4
    assert metric_value(m, "ownerserve_admission_wait_seconds_count", outcome="admitted") == 4


async def test_a_request_past_the_aging_bound_goes_before_less_served_sessions(
    profile: str,
) -> None:
    router = Router(_settings(profile, aging_s=10))
    clock = _clock(router)
    router.sessions.touch("heavy", 0).attained_tokens = 10**6
    router.sessions.touch("light", 0).attained_tokens = 1
    _scrape(router, 0.99)
    order: list[str] = []
    Client(router, "heavy", order)
    await _queued(router, 1)
    clock.now += 10.5
    Client(router, "light", order)
    await _queued(router, 2)
    _scrape(router, 0.7)
    router.admission.pump()
    await _settle()
    assert order == ["heavy"]


async def test_a_new_request_queues_behind_waiting_ones_even_with_headroom(router: Router) -> None:
    _scrape(router, 0.99)
    order: list[str] = []
    Client(router, "first", order)
    await _settle()
    _scrape(router, 0.7)  # room for one request
    assert not router.admission.admit_now(MODEL)  # not past the one waiting
    Client(router, "second", order)  # queued; its own pump releases the first
    await _settle()
    assert order == ["first"] and router.admission.queued == 1


async def test_a_full_queue_answers_429_with_retry_after_at_once(profile: str) -> None:
    router = Router(_settings(profile, max_queued=1, retry_after_s=7))
    _scrape(router, 0.99)
    Client(router, "a", [])
    await _settle()
    with pytest.raises(RateLimitError) as info:
        await router.admission.wait(MODEL, "b", PROMPT, ResponseWriter())
    assert info.value.status_code == 429 and info.value.code == "queue_full"
    assert info.value.retry_after_s == 7
    assert router.admission.queued == 1
    m = _metrics(router)
    assert metric_value(m, "ownerserve_admission_rejected_total", reason="queue_full") == 1
    # the bound counts new sessions only: a session under way still queues
    router.sessions.touch("started", 0).attained_tokens = 100
    order: list[str] = []
    Client(router, "started", order)
    await _settle()
    assert router.admission.queued == 2


async def test_a_request_waiting_past_its_bound_is_answered_429_and_leaves_the_queue(
    profile: str,
) -> None:
    router = Router(_settings(profile, max_queue_wait_s=0.05))
    _scrape(router, 0.99)
    with pytest.raises(RateLimitError) as info:
        await router.admission.wait(MODEL, "a", PROMPT, ResponseWriter())
    assert info.value.code == "queue_timeout"
    assert router.admission.queued == 0
    m = _metrics(router)
    assert metric_value(m, "ownerserve_admission_rejected_total", reason="queue_timeout") == 1
    assert metric_value(m, "ownerserve_admission_wait_seconds_count", outcome="rejected") == 1
    assert metric_value(m, "ownerserve_admission_queued") == 0


@pytest.mark.parametrize("disconnected", [True, False])
async def test_a_queued_request_whose_client_goes_away_leaves_the_queue_and_is_counted(
    router: Router, disconnected: bool
) -> None:
    _scrape(router, 0.99)
    gone = Client(router, "a", [])
    stays = Client(router, "b", [])
    await _settle()
    gone.out.disconnected = disconnected  # what the server sets before it cancels
    gone.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone.task
    assert router.admission.queued == 1 and not stays.task.done()
    reason = "client_disconnected" if disconnected else "cancelled"
    m = _metrics(router)
    assert metric_value(m, "ownerserve_admission_abandoned_total", reason=reason) == 1
    assert metric_value(m, "ownerserve_admission_wait_seconds_count", outcome=reason) == 1
    assert metric_value(m, "ownerserve_admission_queued") == 1
    stays.task.cancel()


async def test_a_request_released_then_cancelled_gives_its_headroom_to_the_next(
    router: Router,
) -> None:
    admission = router.admission
    _scrape(router, 0.99)
    order: list[str] = []
    first = Client(router, "first", order)
    Client(router, "second", order)
    await _settle()
    _scrape(router, 0.7)
    admission.pump()  # room for one: first is released, reserving its prompt on w0
    ws = admission.working_set(_worker(router))
    assert ws.reserved == PROMPT
    first.task.cancel()  # before it could be sent
    await _settle()
    assert order == ["second"] and ws.reserved == 0


async def test_the_queue_looks_again_at_each_new_scrape_without_a_request_ending(
    profile: str,
) -> None:
    settings = _settings(profile)
    settings = settings.model_copy(
        update={"server": settings.server.model_copy(update={"health_interval_s": 0.1})}
    )
    router = Router(settings)
    _scrape(router, 0.99)
    order: list[str] = []
    Client(router, "a", order)
    await _settle()
    _scrape(router, 0.1)  # as the health loop would; nothing calls pump
    await until(lambda: order == ["a"], timeout_s=2.0)
    await router.admission.close()


# --- settings, service ---------------------------------------------------------------------------


def test_admission_settings_are_validated_and_overridable_from_the_environment() -> None:
    with pytest.raises(ConfigError, match="low_watermark"):
        settings_from_dict({"admission": {"low_watermark": 0.9, "high_watermark": 0.8}})
    with pytest.raises(ConfigError, match=r"admission\.max_queued"):
        settings_from_dict({"admission": {"max_queued": -1}})
    s = settings_from_dict({}, env={"OWNERSERVE_ADMISSION__MAX_QUEUED": "5"})
    assert s.admission.max_queued == 5 and s.admission.enabled
    assert (s.admission.high_watermark, s.admission.low_watermark) == (0.95, 0.80)


def test_completion_tokens_are_read_from_a_whole_answers_usage() -> None:
    body = b'{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens": 34,"total_tokens":46}}'
    assert completion_tokens(body) == 34
    assert completion_tokens(b'{"choices":[]}') == 0


# --- through the router ---------------------------------------------------------------------------


@pytest.fixture
async def worker() -> Any:
    w = await FakeWorker("w0").start()
    yield w
    await w.stop()


def _app_settings(worker: FakeWorker, profile: str, **admission: Any) -> Settings:
    return settings_from_dict(
        {
            "server": {"port": 0, "health_interval_s": 60},
            "admission": admission,
            "models": [{"name": MODEL, "block_size": 4}],
            "workers": [{"id": "w0", "url": worker.url, "role": "hybrid", "profile": profile}],
        }
    )


async def _scraped(router: Router, before: WorkerLoad) -> None:
    """After the health loop's first round scraped the worker (which would overwrite a load
    set before it): its load is no longer `before`, the one it had when the router was made
    (the round marks the worker seen before it asks for its metrics)."""
    await until(lambda: _worker(router).load is not before, timeout_s=2.0)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 20}]}


@asynccontextmanager
async def _router_at_full_kv(
    worker: FakeWorker, profile: str, **admission: Any
) -> AsyncIterator[tuple[Router, httpx.AsyncClient]]:
    """A running router (settings `_app_settings`) and a client of it, its one worker scraped
    at 99% KV use: every new request has to wait for headroom."""
    app = create_app(_app_settings(worker, profile, **admission))
    router: Router = app.state.router
    before = _worker(router).load
    async with (
        running_app(app, "127.0.0.1", 0) as url,
        httpx.AsyncClient(base_url=url, timeout=10) as client,
    ):
        await _scraped(router, before)
        _scrape(router, 0.99)
        yield router, client


async def test_the_router_answers_429_in_the_openai_shape_with_retry_after(
    worker: FakeWorker, profile: str
) -> None:
    async with _router_at_full_kv(worker, profile, max_queued=0, retry_after_s=3) as (_, client):
        resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        metrics = (await client.get("/metrics")).text
    assert resp.status_code == 429
    assert resp.headers["retry-after"] == "3"
    assert resp.json() == {
        "error": {
            "message": resp.json()["error"]["message"],
            "type": "rate_limit_exceeded",
            "param": None,
            "code": "queue_full",
        }
    }
    assert worker.completions() == []
    assert metric_value(metrics, "ownerserve_requests_total", status="429") == 1


async def test_the_router_holds_a_request_until_headroom_returns_then_serves_it(
    worker: FakeWorker, profile: str
) -> None:
    async with _router_at_full_kv(worker, profile) as (router, client):
        headers = {"x-session-id": "s1"}
        pending = asyncio.create_task(
            client.post("/v1/chat/completions", json=CHAT, headers=headers)
        )
        await until(lambda: router.admission.queued, timeout_s=1.0)
        assert router.admission.queued == 1 and worker.completions() == []
        _scrape(router, 0.1)
        router.admission.pump()
        resp = await pending
        info = router.sessions.get("s1")
    assert resp.status_code == 200 and len(worker.completions()) == 1
    assert info is not None and info.attained_tokens > 0
    ws = router.admission.working_set(_worker(router))
    assert (ws.pending, ws.reserved, ws.since_scrape) == (0, 0, 0)


async def test_a_worker_closed_to_programs_says_so_in_the_planners_view(profile: str) -> None:
    default = Router(_settings(profile, roles=("hybrid", "hybrid")))
    router = Router(_settings(profile, roles=("hybrid", "hybrid"), pause_watermark=0.95))
    _scrape(router, 0.1)
    _scrape(router, 0.1, "w1")
    now = time.monotonic()
    for r in (router, default):
        r.working_sets.started("big", "w0", 500, now)  # w0's programs over the watermark
        r.working_sets.started("big2", "w0", 490, now)
        r.working_sets.started("mid", "w1", 920, now)  # 1910 of 2000: the cluster is full
    # ... but not by the default pause watermark (1.2 of HBM + CPU tier)
    assert not default.admission.cluster_full(now)
    match = Match(chain_len=0)  # nothing cached anywhere
    closed = {
        v.worker_id: v.programs_closed for v in cluster_view(router, MODEL, match, ()).workers
    }
    assert closed == {"w0": True, "w1": False}
    router.working_sets.ended("big", 500, now)
    router.working_sets.release("big", now)  # gone from the working set: 0.49 < the low one
    view = cluster_view(router, MODEL, match, ())
    assert not any(v.programs_closed for v in view.workers)
    off = Router(_settings(profile, enabled=False))
    off.working_sets.started("big", "w0", 990, now)
    assert not cluster_view(off, MODEL, match, ()).workers[0].programs_closed


async def test_a_started_session_ages_into_a_full_worker_below_the_knee_a_new_one_does_not(
    profile: str,
) -> None:
    """Below the knee a started session's request queued `aging_s` needs only KV headroom (no
    program under way starves); a new session's waits for a worker open to programs or its 429
    (starting it there would evict the KV of the sessions under way)."""
    router = Router(_settings(profile, aging_s=10))
    admission, programs = router.admission, router.working_sets
    clock = _clock(router)
    _two_programs_and_one_back(router)
    assert not admission.admit_now(MODEL, "new") and not admission.admit_now(MODEL, "back")
    order: list[str] = []
    new = Client(router, "new", order)
    back = Client(router, "back", order)
    await _queued(router, 2)
    admission.pump()
    await _settle()
    assert order == []
    clock.now += 10.5
    admission.pump()  # both aged; 0.96 of the cluster is under the pause watermark
    await _settle()
    assert order == ["back"]
    programs.ended("old", 500, clock.now)
    programs.release("old", clock.now)  # paused at its tool boundary: 0.46 < low
    admission.pump()
    await _settle()
    assert order == ["back", "new"]
    new.task.cancel()
    back.task.cancel()


async def test_a_worker_that_one_session_fills_stays_open_to_new_sessions(
    router: Router,
) -> None:
    """A session whose KV fills a worker alone does not close it: holding new sessions back
    would run whole programs one after another with the worker idle in every tool gap. Two
    sessions filling it do; a request released onto it counts as a session until it is sent."""
    admission, programs = router.admission, router.working_sets
    _scrape(router, 0.1)
    now = time.monotonic()
    programs.started("big", "w0", 900, now)
    programs.ended("big", 990, now)  # 0.99 of the working set, one session
    assert admission.admit_now(MODEL, "new")
    worker = _worker(router)
    ws = admission.working_set(worker)
    ws.reserved_sessions += 1  # a request released onto it, not sent yet
    assert admission.closed_to_programs(worker, now)  # two sessions at 0.99: closed
    assert not admission.admit_now(MODEL, "new")
    ws.reserved_sessions -= 1
    assert not admission.closed_to_programs(worker, now)  # one again: open


async def test_a_subagent_of_a_program_under_way_is_queued_as_started_not_as_a_new_session(
    profile: str,
) -> None:
    """A session spawned by one the router knows (its `parent`) is part of that program: it
    goes before the started sessions already served (no service of its own yet) and is not
    refused at the wait bound; a spawner the router never saw makes it a new session.

    The clock is the test's: on the loop's, "back" reached its bound a little before "sub"
    and went alone, by its own timer."""
    router = Router(_settings(profile, max_queue_wait_s=10))
    admission = router.admission
    clock = _clock(router)
    _two_programs_and_one_back(router)
    order: list[str] = []
    back = Client(router, "back", order)
    orphan = Client(router, "orphan", order, parent="never-seen")
    sub = Client(router, "sub", order, parent="back")
    await _queued(router, 3)
    admission.pump()
    await _settle()
    assert order == []
    clock.now += 10.01  # past the wait bound: started sessions need KV headroom only
    admission.pump()
    await _settle()
    assert order == ["sub", "back"]
    with pytest.raises(RateLimitError):  # a new session is refused at the bound
        await orphan.task
    sub.task.cancel()
    back.task.cancel()


async def test_a_request_queued_while_every_worker_was_paused_waits_as_any_started_one(
    profile: str,
) -> None:
    """Resident when it came (its KV counted on w0), it passes the queue only at once: queued
    because no worker had KV headroom, it then waits for room for programs or its aging, as the
    simulator measured it (`planner/README.md`, *Admission*)."""
    router = Router(_settings(profile, aging_s=10))
    admission = router.admission
    clock = _clock(router)
    _two_programs_and_one_back(router)  # w0 closed to programs; "old" counted there
    router.sessions.touch("old", 0).attained_tokens = 500
    _scrape(router, 0.99)
    assert admission.resident("old") and not admission.admit_now(MODEL, "old")
    order: list[str] = []
    old = Client(router, "old", order)
    await _queued(router, 1)
    _scrape(router, 0.1)  # KV headroom again; w0 still full of programs
    admission.pump()
    await _settle()
    assert order == [] and admission.resident("old")
    clock.now += 10.5
    admission.pump()  # aged, below the knee: KV headroom is enough
    await _settle()
    assert order == ["old"]
    old.task.cancel()


async def test_a_subagent_starts_at_once_on_its_spawners_counted_kv(profile: str) -> None:
    """A subagent's first request is resident while its spawner's KV is counted: it shares
    that KV, so it goes on KV headroom where a new session waits for the programs' room."""
    router = Router(_settings(profile))
    admission = router.admission
    _two_programs_and_one_back(router)  # w0's programs full; "old" in flight there
    assert not admission.admit_now(MODEL, "new")
    assert admission.admit_now(MODEL, "sub", parent="old")
    assert admission.resident("sub", "old") and not admission.resident("sub")
    assert not admission.admit_now(MODEL, "sub2", parent="back")  # its KV was released
    router.sessions.touch("sub", 0).attained_tokens = 10  # served: its own KV decides now
    assert not admission.admit_now(MODEL, "sub", parent="old")
