"""The request path's stages run alone, without HTTP, each given its services as the runner
gives them (`Router.services`): what each returns, that a raw completion prompt is identified
and tokenized once; and the request's lease: what it counts where at each moment of the
request's life, and that every path gives everything back once."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from ownerserve.config import settings_from_dict
from ownerserve.directory.base import Match
from planner.copyreuse import CopyKind
from planner.types import Action, Candidate, CostBreakdown, Plan, RequestClass, RequestView
from router.backends import WorkerLoad
from router.executor import OpenedResponse
from router.lease import RequestLease
from router.plans import GaveUp
from router.prompt import Prompt
from router.requests import Endpoint, parse_request
from router.session import SessionSource
from router.stages import identify, look_up, plan, served_model, tokenize, view
from router.state import Router
from router.tokens import Tokenized
from router.views import cluster_view
from tests.router.fake_worker import FakeWorker
from tests.router.test_app import FixedPolicy, router_for
from tests.router.waiting import until

MODEL = "tiny"
PROMPT = "def add(a, b):\n    return a + b\n" * 10  # beyond the 64 blocks a session hashes
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 10}]}


def _router(workers: int = 1, admission: bool = False) -> Router:
    return Router(
        settings_from_dict(
            {
                "models": [{"name": MODEL, "block_size": 4}],
                "workers": [
                    {"id": f"w{i}", "url": f"http://127.0.0.1:{9 + i}", "node": f"n{i}"}
                    for i in range(workers)
                ],
                "admission": {"enabled": admission},
            }
        )
    )


def _prompt(router: Router, endpoint: Endpoint, body: dict, headers=()) -> Prompt:
    svc = router.services
    req = parse_request(orjson.dumps(body), endpoint)
    mt = served_model(svc.parse, req.model)
    hdrs = {k.decode(): v.decode() for k, v in headers}
    return tokenize(req, mt, identify(req, hdrs, svc.derived_sessions), svc.sessions)


async def _planned(router: Router) -> tuple[Prompt, Match, RequestView, Plan]:
    """A chat request of session s1 taken through the stages up to its plan."""
    svc = router.services
    prompt = _prompt(router, Endpoint.CHAT, CHAT, [(b"x-session-id", b"s1")])
    match, holders = await look_up(svc.look_up, prompt)
    policy, rview, _ = view(svc.view, {}, prompt, match)
    planned = plan(policy, rview, svc.cluster, match, (), holders)
    assert planned is not None
    return prompt, match, rview, planned


def _opened(router: Router, worker: str, body: bytes = b"{}") -> OpenedResponse:
    w = router.pool.get(worker)
    assert w is not None
    return OpenedResponse(200, b"application/json", body, w, workers=[w])


def _plan(action: Action, p: str, d: str, t_nic: float = 0.0) -> Plan:
    cand = Candidate(action, p, d, CostBreakdown(t_compute=0.01, t_nic=t_nic))
    return Plan("fixed", RequestClass.NEW_LONG_PREFIX, cand)


def _counts(router: Router) -> list[tuple[int, int, int]]:
    return [
        (w.inflight, w.inflight_prefill_tokens, w.inflight_kv_tokens) for w in router.pool.all()
    ]


async def test_the_stages_return_each_what_the_next_reads_up_to_a_plan():
    router = _router()
    await router.open_directory()
    prompt, _, rview, planned = await _planned(router)
    assert prompt.session.session_id == "s1" and prompt.tok.chain
    assert rview.chain_blocks == len(prompt.tok.chain) and not prompt.is_fork
    assert planned.chosen.decode_worker == "w0"
    info = router.sessions.get("s1")
    assert info is not None and info.prompt_tokens == len(prompt.tok.token_ids)
    assert prompt.info is None  # the view saw the session as new


async def test_the_plans_feed_the_copy_reuse_rates_the_request_view_reads():
    """The router's `copy_reuse` (planner.copyreuse): a prompt copy a remote prefill left on
    a worker, unreused past the horizon, lowers the rate the next request view carries
    (X_dup weighs the copy by it); the other kind's rate is untouched."""
    router = _router()
    await router.open_directory()
    reuse = router.copy_reuse
    _, _, rview, _ = await _planned(router)
    assert rview.fetch_reuse == rview.prompt_reuse == 1.0
    long_ago = time.monotonic() - 2 * reuse.config.horizon_s
    reuse.copied("w0", (1, 2), 0, 2, CopyKind.PROMPT, long_ago)
    _, _, rview, _ = await _planned(router)
    a = reuse.config.alpha
    assert rview.prompt_reuse == pytest.approx((1 - a) ** 2)
    assert rview.fetch_reuse == 1.0
    assert reuse.samples[CopyKind.PROMPT] == 2 and reuse.tracked() == 0


async def test_a_raw_prompt_without_key_is_tokenized_once_and_its_session_derived_from_it():
    router = _router()
    mt = router.tokenizers.get(MODEL)
    assert mt is not None
    calls: list[str | None] = []
    original = mt.tokenize_prompt

    def counting(session_id: str | None, prompt: Any) -> Tokenized:
        calls.append(session_id)
        return original(session_id, prompt)

    mt.tokenize_prompt = counting  # type: ignore[method-assign]
    first = _prompt(router, Endpoint.COMPLETIONS, {"model": MODEL, "prompt": PROMPT})
    assert calls == [None]
    assert first.session.source is SessionSource.DERIVED and first.tok.previous_chain_len == 0
    nxt = _prompt(router, Endpoint.COMPLETIONS, {"model": MODEL, "prompt": PROMPT + "# more"})
    assert nxt.session == first.session  # the same leading blocks: the same derived session
    assert calls == [None, None]
    assert nxt.tok.chain[: len(first.tok.chain)] == first.tok.chain


async def test_the_kv_of_requests_in_flight_shows_in_the_view_before_the_next_scrape():
    """A worker's KV usage in the planner's view is at least what the router's own requests in
    flight hold there (their prompts, once prefilled): the scrape it last read is up to an
    interval old. Given back, the view falls back to the scrape."""
    router = _router()
    await router.open_directory()
    w0 = router.pool.get("w0")
    assert w0 is not None
    prompt, match, _, planned = await _planned(router)
    n = prompt.tokens
    w0.load = WorkerLoad(kv_usage=0.1, kv_capacity_tokens=4 * n)

    def usage() -> float:
        return cluster_view(router.services.cluster, MODEL, match, ()).workers[0].kv_usage

    assert usage() == 0.1
    with RequestLease(router.services.lease, prompt) as lease:
        lease.plan_started(planned, match)  # prefilling: queued prefill, not yet KV
        assert w0.inflight_kv_tokens == n and usage() == 0.1
        opened = _opened(router, "w0")
        lease.plan_opened(opened)
        lease.answer_started(opened)  # streaming: its prompt's KV is held there
        assert usage() == 0.25
        w0.inflight_kv_tokens += 5000  # more than the pool: the view says full, not more
        assert usage() == 1.0
        w0.inflight_kv_tokens -= 5000
        lease.answer_ended(0)
    assert w0.inflight_kv_tokens == 0 and usage() == 0.1


async def test_a_lease_moves_the_admission_charge_from_the_plans_decode_worker_to_the_streamer():
    """Admission's working sets: the prompt is pending on the plan's decode worker while the
    plan runs, then counts since the scrape on the worker streaming the answer; a P/D plan
    counts in flight on both workers and as queued prefill on P only."""
    router = _router(workers=2, admission=True)
    await router.open_directory()
    prompt, match, _, _ = await _planned(router)
    n = prompt.tokens
    w0, w1 = router.pool.get("w0"), router.pool.get("w1")
    assert w0 is not None and w1 is not None
    ws0, ws1 = router.admission.working_set(w0), router.admission.working_set(w1)
    with RequestLease(router.services.lease, prompt) as lease:
        lease.plan_started(_plan(Action.REMOTE_PREFILL, "w0", "w1"), match)
        assert _counts(router) == [(1, n, 0), (1, 0, n)]
        assert (ws0.pending, ws1.pending) == (0, n)
        opened = _opened(router, "w1")
        opened.workers = [w0, w1]
        lease.plan_opened(opened)
        assert _counts(router) == [(0, 0, 0), (0, 0, 0)] and ws1.pending == 0
        lease.answer_started(opened)
        assert _counts(router) == [(1, 0, 0), (1, 0, n)]
        assert (ws0.since_scrape, ws1.since_scrape) == (0, n)
        lease.answer_ended(3)
        assert _counts(router) == [(0, 0, 0), (0, 0, 0)] and ws1.since_scrape == 0
    assert router.leases.open == 0
    # answered: its KV stays counted in w1's working set, not in flight, until its keep time
    assert router.working_sets.home("s1", time.monotonic())[0] == "w1"
    assert router.working_sets.home("s1", 1e18) == (None, 0)


async def test_a_failed_attempt_gives_everything_back_before_the_next_takes_it_again():
    router = _router(workers=2, admission=True)
    await router.open_directory()
    prompt, match, _, _ = await _planned(router)
    n = prompt.tokens
    w1 = router.pool.get("w1")
    assert w1 is not None
    with RequestLease(router.services.lease, prompt) as lease:
        assert router.leases.open == 1
        lease.plan_started(_plan(Action.COLOCATED_PREFILL, "w0", "w0"), match)
        lease.plan_failed()
        assert _counts(router) == [(0, 0, 0), (0, 0, 0)]
        assert router.working_sets.home("s1", 0.0) == (None, 0)  # failed: released
        lease.plan_started(_plan(Action.COLOCATED_PREFILL, "w1", "w1"), match)
        assert _counts(router) == [(0, 0, 0), (1, n, n)]
        assert router.admission.working_set(w1).pending == n
    # cancelled mid-plan (the lease closes with the plan's holds taken)
    assert _counts(router) == [(0, 0, 0), (0, 0, 0)]
    assert router.admission.working_set(w1).pending == 0
    assert router.working_sets.home("s1", 0.0) == (None, 0) and router.leases.open == 0


async def test_the_session_in_flight_count_lasts_as_long_as_the_lease():
    router = _router()
    await router.open_directory()
    prompt, _, _, _ = await _planned(router)
    info = router.sessions.get("s1")
    assert info is not None
    with RequestLease(router.services.lease, prompt) as lease:
        lease.session_joined(info)
        assert info.inflight == 1
        # a second request of the session meanwhile is a fork
        assert _prompt(router, Endpoint.CHAT, CHAT, [(b"x-session-id", b"s1")]).is_fork
    assert info.inflight == 0


async def test_a_plans_nic_transfer_is_kept_once_its_kv_moves_and_taken_back_otherwise():
    router = _router(workers=2)
    await router.open_directory()
    prompt, match, _, _ = await _planned(router)
    pd = _plan(Action.REMOTE_PREFILL, "w0", "w1", t_nic=5.0)
    for outcome in ("failed", "gave_up", "moved"):
        with RequestLease(router.services.lease, prompt) as lease:
            lease.plan_started(pd, match)
            assert router.nics.backlog("n0", 0.0) > 0  # queued on P's node
            if outcome == "failed":
                lease.plan_failed()
            else:
                opened = _opened(router, "w1")
                if outcome == "gave_up":
                    opened.fallback = GaveUp("w0", "kv_transfer_timeout")
                lease.plan_opened(opened)
        kept = router.nics.snapshot(0.0)
        assert ("n0" in kept) == (outcome == "moved"), outcome


# --- the runner -----------------------------------------------------------------------------


async def test_the_runner_times_each_stage_a_request_passes_and_plans_again_after_a_failure():
    """Over real HTTP: a plan whose worker fails before its first byte is planned again
    without it, so plan and execute run twice and every other stage once; the lease is back,
    and the retried worker holds nothing."""
    bad, good = FakeWorker("w0", mode="fail500"), FakeWorker("w1")
    await bad.start()
    await good.start()
    try:
        policy = FixedPolicy(Action.COLOCATED_PREFILL, "w0", "w0")
        workers = [(bad, "hybrid", "emulator"), (good, "hybrid", "emulator")]
        async with router_for(workers, policy) as (client, router):
            resp = await client.post("/v1/chat/completions", json=CHAT)
            assert resp.status_code == 200
            await until(lambda: router.leases.open == 0)
            times = router.metrics.stages
            runs = dict(zip(times.names, times.runs, strict=True))
            metrics = (await client.get("/metrics")).text
    finally:
        await bad.stop()
        await good.stop()
    assert runs == {
        "parse": 1,
        "identify": 1,
        "tokenize": 1,
        "admit": 1,
        "look_up": 1,
        "view": 1,
        "plan": 2,
        "execute": 2,
        "stream": 1,
        "commit": 1,
        "observe": 1,
    }
    assert all(s >= 0 for s in times.seconds)
    assert 'ownerserve_stage_seconds_count{stage="execute"} 2.0' in metrics
    assert _counts(router) == [(0, 0, 0), (0, 0, 0)]
