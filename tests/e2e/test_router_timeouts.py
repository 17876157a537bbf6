"""Every hop the router waits on is bounded, against real workers: emulated engines that are
slow (a tiny `--speed`) or stalled (SIGSTOP: the kernel still accepts their connections, nothing
answers), and a socket whose accept queue is full (connecting hangs). Before the first byte
the router falls back and says so in `x-ownerserve-plan` and its metrics; after it, the stream
ends with an error event; either way within the bound, and what the worker held is released."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from loadgen.cluster import EmulatedWorker, emulated_workers
from ownerserve.config import Settings, settings_from_dict
from tests.e2e.router_cluster import MODEL, metric_value, plan_fields, proxy_client

pytestmark = pytest.mark.timeout(120)

BOUND_S = 1.0
"""Each hop's bound in these tests (the connect bound: `CONNECT_S`)."""
CONNECT_S = 0.5
MARGIN_S = 10.0
"""Allowed past a bound: the router, the workers and the client share two CPU cores here, with
other work beside them at times. Still far below what ends these stalls otherwise (the
defaults' 120 s, a stopped process, a full accept queue: never)."""

MESSAGES = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Summarise the repository layout. " * 20},
]
STREAM = {"model": MODEL, "messages": MESSAGES, "max_tokens": 40, "stream": True}


def settings(workers: list[dict[str, Any]], policy: str, **server: Any) -> Settings:
    limits = {
        "connect_timeout_s": CONNECT_S,
        "first_byte_timeout_s": BOUND_S,
        "kv_transfer_timeout_s": BOUND_S,
        "stream_gap_timeout_s": BOUND_S,
    }
    return settings_from_dict(
        {
            # one health round at start only: a stalled worker stays routable, as it would
            # until the probes notice
            "server": {"port": 0, "health_interval_s": 300, **limits, **server},
            "planner": {"policy": policy},
            "models": [{"name": MODEL}],
            "workers": workers,
        }
    )


@contextlib.contextmanager
def stalled(worker: EmulatedWorker) -> Iterator[None]:
    """The worker's process stopped: connections to it open (the kernel accepts them), but
    nothing answers until it continues."""
    assert worker.process is not None and worker.process.pid is not None
    pid = worker.process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


FREED_S = 10.0
"""How soon a prefill side frees KV the router gave up on, when told to: well before its own
lease (30 s) would."""


def idle(worker: EmulatedWorker) -> bool:
    m = worker.metrics()
    return (
        metric_value(m, "vllm:num_requests_running") == 0
        and metric_value(m, "vllm:num_requests_waiting") == 0
    )


def held_transfers(worker: EmulatedWorker) -> float:
    return metric_value(worker.metrics(), "ownerserve_emulator_kv_transfers_held")


async def stream_lines(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[Any, list[str]]:
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        lines = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
    return resp, lines


async def answered_within(
    client: httpx.AsyncClient, bound_s: float
) -> tuple[dict[str, str], list[str]]:
    """Stream `STREAM` through the router, which must answer it (200) within `bound_s` and
    the margin: (its plan header's fields, its data lines)."""
    t0 = time.monotonic()
    resp, lines = await stream_lines(client, STREAM)
    elapsed = time.monotonic() - t0
    assert resp.status_code == 200
    assert elapsed < bound_s + MARGIN_S
    return plan_fields(resp.headers["x-ownerserve-plan"]), lines


async def test_a_prefill_slower_than_the_kv_transfer_bound_runs_colocated_on_the_decode_worker():
    # ~16 s for this prompt's prefill on p0
    p0 = EmulatedWorker("p0", "prefill", speed=0.001)
    d0 = EmulatedWorker("d0", "decode", speed=50)
    with emulated_workers(p0, d0) as ws:
        s = settings([w.worker_settings() for w in ws], "static-pd")
        async with proxy_client(s) as (client, _):
            plan, lines = await answered_within(client, BOUND_S)
            metrics = (await client.get("/metrics")).text
        # what was planned, what ran instead and why
        assert (plan["action"], plan["p"], plan["d"]) == ("remote_prefill", "p0", "d0")
        assert plan["fallback"] == "colocated" and plan["reason"] == "kv_transfer_timeout"
        assert plan["gave_up"] == "kv_transfer_timeout:p0"
        assert lines[-1] == "data: [DONE]" and len(lines) > 3
        assert all("error" not in line for line in lines)
        labels = {"fallback": "colocated", "reason": "kv_transfer_timeout"}
        assert metric_value(metrics, "ownerserve_fallbacks_total", **labels) == 1
        assert metric_value(metrics, "ownerserve_upstream_timeouts_total", worker="p0") == 1
        # the router closed its connection to p0: the prefill was aborted there
        assert await eventually(lambda: idle(p0))
        assert held_transfers(p0) == 0


async def test_a_stalled_decode_worker_is_given_up_at_the_first_byte_and_p_frees_its_kv():
    p0 = EmulatedWorker("p0", "prefill", speed=50)
    d0 = EmulatedWorker("d0", "decode", speed=50)
    h0 = EmulatedWorker("h0", "hybrid", speed=50)
    with emulated_workers(p0, d0, h0) as ws:
        # static-pd decodes on the decode pool: d0, else (d0 given up) the hybrid h0; D's
        # first-byte bound is the sooner one (the hand-over's, which would run the prompt
        # colocated on d0, is longer here)
        s = settings(
            [w.worker_settings() for w in ws], "static-pd", kv_transfer_timeout_s=BOUND_S * 4
        )
        async with proxy_client(s) as (client, _):
            with stalled(d0):
                plan, lines = await answered_within(client, BOUND_S)
                metrics = (await client.get("/metrics")).text
                # p0 answered for d0 and holds the KV for it: the router told p0 to free it
                # (its own lease would keep it 30 s), and h0 took its own hand-over
                assert await eventually(lambda: held_transfers(p0) == 0, timeout_s=FREED_S)
            # d0 continues: it finds the request abandoned and ends it
            assert await eventually(lambda: idle(d0))
        assert (plan["action"], plan["p"], plan["d"]) == ("remote_prefill", "p0", "h0")
        assert plan["fallback"] == "other_worker" and plan["reason"] == "first_byte_timeout"
        assert plan["gave_up"] == "first_byte_timeout:d0"
        assert lines[-1] == "data: [DONE]" and all("error" not in line for line in lines)
        labels = {"fallback": "other_worker", "reason": "first_byte_timeout"}
        assert metric_value(metrics, "ownerserve_fallbacks_total", **labels) == 1
        timeouts = {"worker": "d0", "hop": "first_byte"}
        assert metric_value(metrics, "ownerserve_upstream_timeouts_total", **timeouts) == 1


async def test_a_worker_stalled_mid_stream_ends_the_stream_with_an_error_event():
    h0 = EmulatedWorker("h0", "hybrid", speed=1)  # ~6.5 ms a token: a long stream
    with emulated_workers(h0) as ws:
        s = settings([w.worker_settings() for w in ws], "ownerserve")
        async with proxy_client(s) as (client, _):
            body = {**STREAM, "max_tokens": 2000}
            lines: list[str] = []
            stop: contextlib.ExitStack = contextlib.ExitStack()
            with stop:
                async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line)
                            if len(lines) == 3:
                                stop.enter_context(stalled(h0))
                                t_stop = time.monotonic()
                ended = time.monotonic() - t_stop
                metrics = (await client.get("/metrics")).text
            assert await eventually(lambda: idle(h0))  # the router's close aborted it
        assert ended < BOUND_S + MARGIN_S
        assert lines[-1] == "data: [DONE]"
        error = orjson.loads(lines[-2][6:])["error"]
        assert error["code"] == "upstream_timeout" and "mid-stream" in error["message"]
        assert "h0" in error["message"]
        assert metric_value(metrics, "ownerserve_stream_errors_total", worker="h0") == 1
        timeouts = {"worker": "h0", "hop": "stream_gap"}
        assert metric_value(metrics, "ownerserve_upstream_timeouts_total", **timeouts) == 1
        assert metric_value(h0.metrics(), "vllm:generation_tokens_total") < 2000


async def test_a_worker_that_never_accepts_the_connection_is_retried_elsewhere():
    # a listener whose accept queue is full: the kernel drops further SYNs (a host gone quiet)
    ghost = socket.socket()
    ghost.bind(("127.0.0.1", 0))
    ghost.listen(0)
    filler = socket.create_connection(ghost.getsockname(), timeout=1.0)
    ghost_settings = {
        "id": "ghost",
        "url": f"http://127.0.0.1:{ghost.getsockname()[1]}",
        "role": "decode",
        "kind": "emulator",
        "models": [MODEL],
    }
    p0 = EmulatedWorker("p0", "prefill", speed=50)
    h0 = EmulatedWorker("h0", "hybrid", speed=50)
    try:
        with emulated_workers(p0, h0) as ws:
            s = settings([ghost_settings, *(w.worker_settings() for w in ws)], "static-pd")
            async with proxy_client(s) as (client, _):
                plan, lines = await answered_within(client, CONNECT_S)
                metrics = (await client.get("/metrics")).text
                assert await eventually(lambda: held_transfers(p0) == 0, timeout_s=FREED_S)
    finally:
        filler.close()
        ghost.close()
    assert plan["d"] == "h0" and plan["fallback"] == "other_worker"
    assert plan["reason"] == "connect_timeout" and plan["gave_up"] == "connect_timeout:ghost"
    assert lines[-1] == "data: [DONE]"
    timeouts = {"worker": "ghost", "hop": "connect"}
    assert metric_value(metrics, "ownerserve_upstream_timeouts_total", **timeouts) == 1


async def test_a_stalled_sglang_prefill_runs_colocated_on_the_decode_worker():
    p0 = EmulatedWorker("p0", "prefill", kind="sglang", speed=50)
    d0 = EmulatedWorker("d0", "decode", kind="sglang", speed=50)
    with emulated_workers(p0, d0) as ws:
        # D waits at the room for P: its first-byte bound must be the longer one here
        s = settings(
            [w.worker_settings() for w in ws], "static-pd", first_byte_timeout_s=BOUND_S * 4
        )
        async with proxy_client(s) as (client, _):
            with stalled(p0):
                plan, lines = await answered_within(client, BOUND_S)
        assert (plan["action"], plan["p"], plan["d"]) == ("remote_prefill", "p0", "d0")
        assert plan["fallback"] == "colocated" and plan["gave_up"] == "kv_transfer_timeout:p0"
        assert lines[-1] == "data: [DONE]" and all("error" not in line for line in lines)
