"""P/D hand-overs that fail, against real emulated workers (real processes, real HTTP; vLLM's
flow: P prefills with `max_tokens=1` and holds the prompt's KV, D pulls it before decoding).

Each way a hand-over can fail after P prefilled — D refuses or dies, P's KV is gone before D
pulls it, P stalls or dies while D pulls — ends with a clean answer (a colocated run on D, or
the request planned again without the worker that failed) that says so in `x-ownerserve-plan`
and `ownerserve_fallbacks_total`; and afterwards every worker is idle with its KV blocks back
to free (`ownerserve_emulator_kv_blocks_in_use` 0, no transfer held), and the directory names
no copy on P for it. Waits are on conditions (workers' metrics), never sleeps."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from loadgen.cluster import EmulatedWorker, emulated_workers
from ownerserve.config import Settings, settings_from_dict
from ownerserve.directory.base import HoldKind
from router.state import Router
from tests.e2e.router_cluster import DATA, MODEL, metric_value, plan_fields, proxy_client
from tests.e2e.test_router_cancellation import Tasks, inflight, leave_once
from tests.e2e.test_router_timeouts import MARGIN_S, eventually, held_transfers, idle

pytestmark = pytest.mark.timeout(180)

MESSAGES = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Summarise the repository layout. " * 20},
]
STREAM = {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, "stream": True}
SESSION = {"x-session-id": "pd-failure"}
SLOW_LINK_PROFILE = str(DATA / "router-slow-kv-link.yaml")
"""A decode side whose pull of `MESSAGES`' KV takes ~90 s at `--speed 50`: a test acts while
it runs, and nothing ends it but what the test does."""
BOUND_S = 1.0
"""`server.kv_transfer_timeout_s` where a test waits on it."""
LONG_S = 60.0
"""Bounds no test here waits on: only the failure under test ends a hop."""


def settings(ws: tuple[EmulatedWorker, ...], **server: Any) -> Settings:
    return settings_from_dict(
        {
            # one health round at start: a worker stopped or killed stays routable, as it
            # would until the probes notice
            "server": {
                "port": 0,
                "health_interval_s": 300,
                "first_byte_timeout_s": LONG_S,
                "kv_transfer_timeout_s": LONG_S,
                "stream_gap_timeout_s": LONG_S,
                "request_timeout_s": 2 * LONG_S,
                **server,
            },
            "planner": {"policy": "static-pd"},
            "models": [{"name": MODEL}],
            "workers": [w.worker_settings() for w in ws],
        }
    )


def pid_of(worker: EmulatedWorker) -> int:
    assert worker.process is not None and worker.process.pid is not None
    return worker.process.pid


@contextlib.contextmanager
def stopped(worker: EmulatedWorker) -> Iterator[None]:
    """The worker's process stopped (SIGSTOP) until the block ends: the kernel accepts its
    connections, nothing answers."""
    os.kill(pid_of(worker), signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid_of(worker), signal.SIGCONT)


def gauge(worker: EmulatedWorker, name: str, **labels: str) -> float:
    return metric_value(worker.metrics(), name, **labels)


def blocks_in_use(worker: EmulatedWorker) -> float:
    return gauge(worker, "ownerserve_emulator_kv_blocks_in_use")


def at_rest(worker: EmulatedWorker) -> bool:
    """Nothing running or queued, no KV block referenced, no prefill result held."""
    return idle(worker) and blocks_in_use(worker) == 0 and held_transfers(worker) == 0


async def answer(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, str, list[str]]:
    """Stream `body` through the router: (status, plan header, data lines)."""
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=SESSION) as resp:
        lines = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
    return resp.status_code, resp.headers.get("x-ownerserve-plan", ""), lines


def whole(lines: list[str]) -> bool:
    return len(lines) > 2 and lines[-1] == "data: [DONE]" and all("error" not in x for x in lines)


def sent_pd_blocks(worker: EmulatedWorker) -> float:
    """KV blocks `worker` handed to decode sides' pulls."""
    return gauge(worker, "ownerserve_emulator_kv_sent_blocks_total", kind="pd")


def received_pd_blocks(worker: EmulatedWorker) -> float:
    return gauge(worker, "ownerserve_emulator_kv_received_blocks_total", kind="pd")


async def at_rest_everywhere(*workers: EmulatedWorker) -> bool:
    return await eventually(lambda: all(at_rest(w) for w in workers), timeout_s=30.0)


async def p_copy_recorded(router: Router, prefill: str) -> bool:
    """Whether the directory names a copy of `MESSAGES`' prefix on `prefill` that the router
    recorded (an owner lease or a replica; its own KV events may still say it has it cached,
    which it does)."""
    tokenizer = router.tokenizers.get(MODEL)
    assert router.directory is not None and tokenizer is not None
    chain = tokenizer.tokenize_chat(None, MESSAGES).chain
    match = await router.directory.lookup(chain, SESSION["x-session-id"])
    return any(h.worker == prefill and h.kind is not HoldKind.CACHED for h in match.holdings)


def ran_colocated_on_d(header: str, reason: str) -> None:
    """The plan was P/D p0 -> d0, and ran colocated on d0 after giving up on p0 for `reason`."""
    plan = plan_fields(header)
    assert (plan["action"], plan["p"], plan["d"]) == ("remote_prefill", "p0", "d0"), plan
    assert plan["fallback"] == "colocated" and plan["gave_up"] == f"{reason}:p0", plan
    assert plan["ran"] == "colocated_prefill" and plan["ran_workers"] == "d0>d0", plan


async def fallbacks(client: httpx.AsyncClient, **labels: str) -> float:
    return metric_value((await client.get("/metrics")).text, "ownerserve_fallbacks_total", **labels)


async def started_then(
    client: httpx.AsyncClient, ready: Callable[[], bool]
) -> asyncio.Task[tuple[int, str, list[str]]]:
    """`STREAM` sent, once `ready()` holds (the request is where the test acts)."""
    call = asyncio.create_task(answer(client, STREAM))
    assert await eventually(lambda: ready() or call.done(), timeout_s=30.0)
    assert not call.done(), call.result()
    return call


# --- decode fails after prefill ---------------------------------------------------------------


async def test_p_kv_gone_before_d_pulls_runs_colocated_on_d_and_frees_both():
    # P's lease on the KV it holds for D is short, and D is stopped until it ran out: D's
    # pull then finds nothing (as after P restarted or lost it) and D refuses the hand-over
    p0 = EmulatedWorker("p0", "prefill", speed=50, extra=("--kv-lease-duration", "0.5"))
    d0 = EmulatedWorker("d0", "decode", speed=50)
    expired = "ownerserve_emulator_kv_transfers_expired_total"
    with emulated_workers(p0, d0) as ws:
        async with proxy_client(settings(ws)) as (client, router):
            with stopped(d0):
                call = await started_then(client, lambda: gauge(p0, expired) == 1)
            status, header, lines = await call
            assert await at_rest_everywhere(p0, d0)
            assert not await p_copy_recorded(router, "p0")
            counted = await fallbacks(client, fallback="colocated", reason="kv_transfer_failed")
        assert status == 200 and whole(lines), lines
        ran_colocated_on_d(header, "kv_transfer_failed")
        assert counted == 1
        assert received_pd_blocks(d0) == 0


async def test_d_killed_after_p_prefilled_frees_p_and_plans_again_without_d():
    # D is stopped when the router sends it the decode, then killed: the connection to it
    # resets before any byte; P holds the KV for it until the router tells it to free it
    p0 = EmulatedWorker("p0", "prefill", speed=50)
    d0 = EmulatedWorker("d0", "decode", speed=50)
    h0 = EmulatedWorker("h0", "hybrid", speed=50)
    with emulated_workers(p0, d0, h0) as ws:
        async with proxy_client(settings(ws)) as (client, router):
            with stopped(d0):
                call = await started_then(
                    client, lambda: held_transfers(p0) == 1 and router.pool.get("d0").inflight == 1
                )
                d0.kill()
            status, header, lines = await call
            assert await at_rest_everywhere(p0, h0)
            assert not await p_copy_recorded(router, "d0")
            metrics = (await client.get("/metrics")).text
        plan = plan_fields(header)
        assert status == 200 and whole(lines), lines
        # planned again without d0: static-pd's decode pool is then the hybrid
        assert (plan["action"], plan["p"], plan["d"]) == ("remote_prefill", "p0", "h0"), plan
        assert plan["fallback"] == "other_worker" and plan["gave_up"] == "upstream_failed:d0"
        labels = {"fallback": "other_worker", "reason": "upstream_failed"}
        assert metric_value(metrics, "ownerserve_fallbacks_total", **labels) == 1
        # P's first hold (for d0) was freed by the router's release, its second taken by h0
        assert sent_pd_blocks(p0) == received_pd_blocks(h0) > 0


# --- a transfer that fails or never completes ---------------------------------------------


async def test_a_stopped_p_runs_colocated_on_d_within_the_hand_over_bound():
    p0 = EmulatedWorker("p0", "prefill", speed=50)
    d0 = EmulatedWorker("d0", "decode", speed=50)
    with emulated_workers(p0, d0) as ws:
        async with proxy_client(settings(ws, kv_transfer_timeout_s=BOUND_S)) as (client, _):
            with stopped(p0):
                t0 = time.monotonic()
                call = await started_then(client, lambda: True)
                status, header, lines = await call
                elapsed = time.monotonic() - t0
            # P continues and finds the router's connection closed
            assert await at_rest_everywhere(p0, d0)
            counted = await fallbacks(client, fallback="colocated", reason="kv_transfer_timeout")
        assert status == 200 and whole(lines), lines
        assert elapsed < BOUND_S + MARGIN_S
        ran_colocated_on_d(header, "kv_transfer_timeout")
        assert counted == 1


async def test_p_stopped_after_its_answer_fails_d_pull_and_runs_colocated_on_d():
    # P answered and holds the KV; it stops before D pulls: D's pull waits for an answer at
    # most `workers.emulator.transfer.PULL_ANSWER_S`, then D refuses the hand-over
    p0 = EmulatedWorker("p0", "prefill", speed=50)
    d0 = EmulatedWorker("d0", "decode", speed=50)
    with emulated_workers(p0, d0) as ws:
        async with proxy_client(settings(ws)) as (client, router):
            with stopped(d0):
                call = await started_then(
                    client, lambda: held_transfers(p0) == 1 and router.pool.get("d0").inflight == 1
                )
                os.kill(pid_of(p0), signal.SIGSTOP)
            try:
                status, header, lines = await call
            finally:
                os.kill(pid_of(p0), signal.SIGCONT)
            # P continues: the pull it answers late finds D gone, and P frees the KV
            assert await at_rest_everywhere(p0, d0)
            assert not await p_copy_recorded(router, "p0")
            counted = await fallbacks(client, fallback="colocated", reason="kv_transfer_failed")
        assert status == 200 and whole(lines), lines
        ran_colocated_on_d(header, "kv_transfer_failed")
        assert counted == 1
        assert received_pd_blocks(d0) == 0


PULL_BOUND_S = 3.0
"""`server.kv_transfer_timeout_s` where D's slow pull outlasts it: P's prefill call (at
`--speed 50`, well under a second) always fits in it, D's pull (~90 s) never does."""


@pytest.mark.parametrize("kind", ["emulator", "sglang"])
async def test_a_pull_past_the_hand_over_bound_runs_colocated_on_d_and_frees_both(kind: str):
    # D pulls P's KV over its slow link: the hand-over's bound (P's call until D's first byte)
    # runs out while the blocks are on their way; D's own first-byte bound is far longer.
    # vLLM's flow (P answers, then D pulls) and SGLang's (both at once, D pulls at P's room)
    p0 = EmulatedWorker("p0", "prefill", kind=kind, speed=50)
    d0 = EmulatedWorker("d0", "decode", kind=kind, profile=SLOW_LINK_PROFILE, speed=50)
    with emulated_workers(p0, d0) as ws:
        async with proxy_client(settings(ws, kv_transfer_timeout_s=PULL_BOUND_S)) as (
            client,
            router,
        ):
            t0 = time.monotonic()
            status, header, lines = await answer(client, STREAM)
            elapsed = time.monotonic() - t0
            # D's request was aborted (its pull with it) and P let go of the blocks D read
            assert await at_rest_everywhere(p0, d0)
            assert not await p_copy_recorded(router, "p0")
            metrics = (await client.get("/metrics")).text
        assert status == 200 and whole(lines), lines
        assert elapsed < PULL_BOUND_S + MARGIN_S
        ran_colocated_on_d(header, "kv_transfer_timeout")
        labels = {"fallback": "colocated", "reason": "kv_transfer_timeout"}
        assert metric_value(metrics, "ownerserve_fallbacks_total", **labels) == 1
        timeouts = {"worker": "p0", "hop": "kv_transfer"}
        assert metric_value(metrics, "ownerserve_upstream_timeouts_total", **timeouts) == 1
        # the pull had begun (P sent the blocks), and nothing of the cut transfer was kept
        assert sent_pd_blocks(p0) > 0 and received_pd_blocks(d0) == 0
        assert gauge(d0, "vllm:request_success_total", finished_reason="abort") == 1


# --- a prefill worker dies mid-hand-over ----------------------------------------------------


async def test_p_killed_while_d_pulls_runs_colocated_on_d_and_d_frees_what_it_allocated():
    p0 = EmulatedWorker("p0", "prefill", speed=50)
    d0 = EmulatedWorker("d0", "decode", profile=SLOW_LINK_PROFILE, speed=50)
    with emulated_workers(p0, d0) as ws:
        async with proxy_client(settings(ws)) as (client, router):
            # P answered D's pull: the blocks are on their way (for ~90 s) when P dies
            call = await started_then(
                client, lambda: sent_pd_blocks(p0) > 0 and blocks_in_use(d0) > 0
            )
            p0.kill()
            status, header, lines = await call
            assert await at_rest_everywhere(d0)
            assert not await p_copy_recorded(router, "p0")
            counted = await fallbacks(client, fallback="colocated", reason="kv_transfer_failed")
        assert status == 200 and whole(lines), lines
        ran_colocated_on_d(header, "kv_transfer_failed")
        assert counted == 1
        # nothing of the cut transfer was kept
        assert received_pd_blocks(d0) == 0


# --- the client leaves during the hand-over ---------------------------------------------------


async def test_a_client_gone_while_d_pulls_ends_every_call_and_frees_both_sides():
    p0 = EmulatedWorker("p0", "prefill", speed=50)
    d0 = EmulatedWorker("d0", "decode", profile=SLOW_LINK_PROFILE, speed=50)
    with emulated_workers(p0, d0) as ws:
        async with proxy_client(settings(ws)) as (client, router):
            tasks = Tasks()
            tasks.snapshot()
            # D is pulling P's KV (P holds it while D reads it) when the client leaves
            await leave_once(
                client, STREAM, lambda: sent_pd_blocks(p0) > 0 and held_transfers(p0) == 0
            )
            assert await tasks.all_ended(), tasks.new()
            assert inflight(router) == 0
            # the router closed its connection to D: D aborts the request, its pull ends, and
            # P frees the blocks D was reading
            assert await at_rest_everywhere(p0, d0)
        assert received_pd_blocks(d0) == 0
        aborted = "vllm:request_success_total"
        assert gauge(d0, aborted, finished_reason="abort") == 1
