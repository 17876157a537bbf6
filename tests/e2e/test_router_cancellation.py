"""A request given up before its first byte, against real workers (emulated engines, real
processes): its client leaving, or its own `server.request_timeout_s` running out, during each
hop the router waits on (an artifact fetch, a P/D hand-over of either protocol, a stream's
first token). Each time every task the request started ends, the timeout gives its 504
rather than a hang, and a worker that was computing for the request sees the connection close
and aborts it (the emulator counts it as finished with reason `abort`; a fetch stops pulling
and stores nothing). P/D hand-overs given up while D pulls: `test_router_pd_failures.py`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from loadgen.cluster import EmulatedWorker, emulated_workers
from ownerserve.config import Settings, settings_from_dict
from tests.e2e.router_cluster import FAST_DECODE_PROFILE, MODEL, metric_value, proxy_client
from tests.e2e.test_router_timeouts import MARGIN_S, eventually, held_transfers, idle, stalled

pytestmark = pytest.mark.timeout(180)

TIMEOUT_S = 2.0
"""`server.request_timeout_s` where a slow hop outlasts it (its own bound is far longer)."""
SLOW = 0.002
"""`--speed` of a worker whose prefill of `MESSAGES` takes ~8 s: it outlasts `TIMEOUT_S`, and a
request that was not aborted is still computing there when the test looks."""

MESSAGES = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Summarise the repository layout. " * 20},
]
STREAM = {"model": MODEL, "messages": MESSAGES, "max_tokens": 40, "stream": True}


def settings(ws: tuple[EmulatedWorker, ...], policy: str, **server: Any) -> Settings:
    return settings_from_dict(
        {
            # one health round at start: no probe tasks come and go while the test counts tasks,
            # and a stalled worker stays routable
            "server": {
                "port": 0,
                "health_interval_s": 300,
                "request_timeout_s": TIMEOUT_S,
                "first_byte_timeout_s": 60,
                "kv_transfer_timeout_s": 60,
                "stream_gap_timeout_s": 60,
                **server,
            },
            "planner": {"policy": policy},
            "models": [{"name": MODEL}],
            "workers": [w.worker_settings() for w in ws],
        }
    )


def aborted(worker: EmulatedWorker) -> float:
    """Requests `worker` finished as aborted (its client, the router, closed the connection)."""
    return metric_value(worker.metrics(), "vllm:request_success_total", finished_reason="abort")


def finished(worker: EmulatedWorker) -> float:
    return metric_value(worker.metrics(), "vllm:request_success_total")


def completed(worker: EmulatedWorker) -> float:
    """Requests `worker` ran to their end (not aborted, not failed)."""
    m = worker.metrics()
    return sum(
        metric_value(m, "vllm:request_success_total", finished_reason=reason)
        for reason in ("stop", "length")
    )


def running(worker: EmulatedWorker) -> float:
    return metric_value(worker.metrics(), "vllm:num_requests_running")


def inflight(router: Any) -> int:
    return sum(w.inflight for w in router.pool.all())


class Tasks:
    """The event loop's tasks started after `snapshot()` (the router runs in this loop): those
    a request started, and the request's own."""

    def __init__(self) -> None:
        self.before: set[asyncio.Task[Any]] = set()

    def snapshot(self) -> None:
        self.before = asyncio.all_tasks()

    def new(self) -> set[asyncio.Task[Any]]:
        me = asyncio.current_task()
        return {t for t in asyncio.all_tasks() - self.before if t is not me}

    async def all_ended(self) -> bool:
        return await eventually(lambda: not self.new(), timeout_s=10.0)


async def leave_once(
    client: httpx.AsyncClient, body: dict[str, Any], started: Callable[[], bool], **kw: Any
) -> None:
    """Send `body`; once `started()` holds (the request is at the hop under test), walk away
    (cancel the client's request: its connection closes) before any answer came."""
    call = asyncio.create_task(client.post("/v1/chat/completions", json=body, **kw))
    assert await eventually(lambda: started() or call.done(), timeout_s=30.0)
    assert not call.done(), call.result().text  # nothing may have come back yet
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


async def times_out(client: httpx.AsyncClient, body: dict[str, Any], **kw: Any) -> None:
    """Send `body`: its request's timeout runs out at the slow hop, which answers 504 within
    the timeout (and the margin), not when the hop would have ended."""
    t0 = time.monotonic()
    resp = await client.post("/v1/chat/completions", json=body, **kw)
    elapsed = time.monotonic() - t0
    assert resp.status_code == 504, resp.text
    error = orjson.loads(resp.content)["error"]
    assert error["code"] == "upstream_timeout" and "timed out" in error["message"]
    assert elapsed < TIMEOUT_S + MARGIN_S


async def test_a_stream_whose_client_leaves_before_its_first_token_is_aborted_on_the_worker():
    h0 = EmulatedWorker("h0", "hybrid", speed=SLOW)
    with emulated_workers(h0) as ws:
        async with proxy_client(settings(ws, "ownerserve", request_timeout_s=600)) as (c, r):
            tasks = Tasks()
            tasks.snapshot()
            # the worker answered the headers at once (its SSE stream is open) and is now
            # prefilling: the router waits for the first token
            await leave_once(c, STREAM, lambda: running(h0) == 1)
            assert await tasks.all_ended(), tasks.new()
            assert inflight(r) == 0
            # the router closed its connection: the worker aborts the request, well before the
            # ~8 s its prefill would take
            assert await eventually(lambda: idle(h0), timeout_s=30.0)
            assert aborted(h0) == 1 and finished(h0) == 1
            assert metric_value(h0.metrics(), "vllm:generation_tokens_total") == 0


@pytest.mark.parametrize("kind", ["emulator", "sglang"])
async def test_a_remote_prefill_given_up_during_the_hand_over_ends_everywhere(kind: str):
    # `emulator`: vLLM's protocol (P first, then D with what P hands over); `sglang`: P and D
    # at once, D waiting at P's bootstrap room (two tasks in the router)
    p0 = EmulatedWorker("p0", "prefill", kind=kind, speed=SLOW)
    d0 = EmulatedWorker("d0", "decode", kind=kind, speed=50)
    with emulated_workers(p0, d0) as ws:
        async with proxy_client(settings(ws, "static-pd")) as (c, r):
            tasks = Tasks()
            tasks.snapshot()
            # the client leaves while P prefills
            await leave_once(c, STREAM, lambda: running(p0) == 1)
            assert await tasks.all_ended(), tasks.new()
            assert inflight(r) == 0
            assert await eventually(lambda: idle(p0) and idle(d0), timeout_s=30.0)
            assert aborted(p0) == 1 and finished(p0) == 1
            # D ran nothing: its wait at the hand-over ended aborted, or failed with P's
            assert completed(d0) == 0
            assert await eventually(lambda: held_transfers(p0) == 0)
            # the request's timeout runs out while P prefills
            tasks.snapshot()
            await times_out(c, STREAM)
            assert await tasks.all_ended(), tasks.new()
            assert inflight(r) == 0
            assert await eventually(lambda: idle(p0) and idle(d0), timeout_s=30.0)
            assert aborted(p0) == 2 and finished(p0) == 2
            assert completed(d0) == 0
            assert await eventually(lambda: held_transfers(p0) == 0)


SYSTEM = {"role": "system", "content": "You are a coding agent. Use the tools.\n"}
REPO = "".join(
    f"def handler_{i}(request):\n    return route(request, shard={i})\n" for i in range(90)
)


def long_turn(question: str) -> list[dict[str, Any]]:
    """A first turn of ~6k tokens (byte tokenizer): a long prefix another session shares."""
    return [SYSTEM, {"role": "user", "content": "Repository:\n" + REPO + question}]


def chat(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 8, "stream": True}


async def test_an_artifact_fetch_given_up_ends_its_tasks_and_honours_the_request_timeout():
    # as in test_router_actions: the prefix computed on h0, then another session sharing it
    # is planned on the faster decoder h1, which fetches it from h0
    h0 = EmulatedWorker("h0", "hybrid", speed=20)
    # h1's own bound on a pull (`--transfer-timeout-s`) far past the test's waits: only the
    # router's closed connection can end its fetch sooner
    h1 = EmulatedWorker(
        "h1",
        "hybrid",
        profile=FAST_DECODE_PROFILE,
        speed=20,
        extra=("--transfer-timeout-s", "600"),
    )
    admin = {"x-admin-token": "adm"}
    with emulated_workers(h0, h1) as ws:
        # the first turn runs within the timeout; a fetch from a stalled h0 never answers
        s = settings(ws, "ownerserve", admin_token="adm", request_timeout_s=TIMEOUT_S * 4)
        async with proxy_client(s) as (c, r):
            assert (await c.post("/admin/workers/h1/drain", headers=admin)).is_success
            first = long_turn("Question A?")
            resp = await c.post("/v1/chat/completions", json=chat(first),
                                headers={"x-session-id": "session-a"})  # fmt: skip
            assert resp.status_code == 200, resp.text
            assert (await c.post("/admin/workers/h1/undrain", headers=admin)).is_success
            chain = r.tokenizers.get(MODEL).tokenize_chat(None, long_turn("Question B?")).chain
            holder: list[str | None] = [None]

            async def h0_holds_the_prefix() -> bool:
                holder[0] = (await r.directory.lookup(chain, "session-b")).owner
                return holder[0] == "h0"

            deadline = time.monotonic() + 30.0
            while not await h0_holds_the_prefix() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert holder[0] == "h0"
            fetched_before = metric_value(
                h1.metrics(), "ownerserve_emulator_kv_received_blocks_total", kind="fetch"
            )
            with stalled(h0):  # h1's pull from h0 hangs: the router waits on h1's fetch
                tasks = Tasks()
                tasks.snapshot()
                await leave_once(
                    c,
                    chat(long_turn("Question B?")),
                    lambda: r.pool.get("h1").inflight == 1,
                    headers={"x-session-id": "session-b"},
                )
                assert await tasks.all_ended(), tasks.new()
                assert inflight(r) == 0
                tasks.snapshot()
                t0 = time.monotonic()
                resp = await c.post("/v1/chat/completions", json=chat(long_turn("Question C?")),
                                    headers={"x-session-id": "session-c"})  # fmt: skip
                elapsed = time.monotonic() - t0
                assert resp.status_code == 504, resp.text
                assert orjson.loads(resp.content)["error"]["code"] == "upstream_timeout"
                assert elapsed < TIMEOUT_S * 4 + MARGIN_S
                assert await tasks.all_ended(), tasks.new()
                assert inflight(r) == 0
                # both requests were at h1's fetch: the router closed its connections to h1,
                # and h1 gave up its pulls from h0 (closed its connections to h0) while h0
                # still answers nothing
                assert await eventually(lambda: not pulls_open(h1, h0), timeout_s=30.0)
            # h0 answers again: h1 stored nothing of the fetches given up, and ran no
            # completion for either
            h0.wait_healthy()
            assert finished(h1) == 0 and idle(h1)
            fetched = metric_value(
                h1.metrics(), "ownerserve_emulator_kv_received_blocks_total", kind="fetch"
            )
            assert fetched == fetched_before
            assert metric_value(h1.metrics(), "ownerserve_emulator_kv_blocks_in_use") == 0


def pulls_open(worker: EmulatedWorker, source: EmulatedWorker) -> bool:
    """Whether `worker`'s process has a TCP connection to `source`'s API port established (a
    pull under way), read from Linux's /proc: its socket inodes, the namespace's TCP table."""
    assert worker.process is not None and worker.process.pid is not None
    pid = worker.process.pid
    port = int(source.url.rsplit(":", 1)[1])
    sockets = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                sockets.add(link[8:-1])
    with open(f"/proc/{pid}/net/tcp") as table:
        for row in list(table)[1:]:
            fields = row.split()
            remote, state, inode = fields[2], fields[3], fields[9]
            if int(remote.split(":")[1], 16) == port and state == "01" and inode in sockets:
                return True  # 01: ESTABLISHED
    return False
