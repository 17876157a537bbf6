"""The per-request log line (`router.requestlog`) against the real router app in front of an
emulated worker (a real process): exactly one logfmt line on `ownerserve.requests` for each
request however it ends — a streamed and a whole answer, a request refused with a 4xx (by the
pipeline, by a front door before it, by the HTTP server before either), a client that walks
away mid-stream — whose fields parse and whose request id is the one its answer's
`x-request-id` header carries (the client's, sanitised, or a new one)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from loadgen.cluster import MODEL, EmulatedWorker
from router.httpserver import MAX_HEADER_BYTES
from router.requestlog import REQUEST_LOGGER, parse_logfmt
from tests.e2e.router_cluster import proxy_client, router_settings, workers_fixture
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)

workers = workers_fixture(lambda: (EmulatedWorker("h0", "hybrid", speed=5),))

MESSAGES = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Summarise the repository layout. " * 10},
]


def lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, str]]:
    """The request log's lines so far, parsed."""
    return [parse_logfmt(r.getMessage()) for r in caplog.records if r.name == REQUEST_LOGGER]


@pytest.fixture
def request_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger=REQUEST_LOGGER)
    return caplog


async def one_line(caplog: pytest.LogCaptureFixture) -> dict[str, str]:
    """The one line written so far, once it is there (a client may read the answer before
    the router has ended the request)."""
    await until(lambda: lines(caplog), what="the request's log line")
    (line,) = lines(caplog)
    return line


async def test_a_streamed_answer_logs_one_line_with_its_plan_tokens_and_timings(
    workers: Any, request_log: pytest.LogCaptureFixture
) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "stream": True}
    headers = {"x-session-id": "agent one", "x-request-id": 'client-7 "x"<>' + "z" * 500}
    async with proxy_client(router_settings(workers)) as (client, _):
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers=headers
        ) as resp:
            assert resp.status_code == 200
            events = [x async for x in resp.aiter_lines() if x.startswith("data: {")]
            rid = resp.headers["x-request-id"]
        line = await one_line(request_log)
    # sanitised: the unsafe characters dropped, cut to 128
    assert rid == "client-7x" + "z" * 119
    assert line["rid"] == rid
    assert line["session"] == "agent one"  # quoted in the line, parsed back whole
    assert line["model"] == MODEL
    assert (line["status"], line["outcome"]) == ("200", "ok")
    assert line["decode"] == line["prefill"] == "h0"
    assert line["action"] and line["class"]
    assert int(line["prompt_tokens"]) > 100
    assert 0 <= int(line["reused_tokens"]) <= int(line["prompt_tokens"])
    # a stream's output as the router counts it: its events before `[DONE]`
    assert int(line["output_tokens"]) == len(events)
    assert 0 < float(line["ttft_s"]) <= float(line["e2e_s"])
    assert float(line["queued_s"]) >= 0
    assert "error" not in line and "fallback" not in line
    assert len(lines(request_log)) == 1


async def test_a_whole_answer_logs_one_line_under_the_id_the_router_made(
    workers: Any, request_log: pytest.LogCaptureFixture
) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6}
    async with proxy_client(router_settings(workers)) as (client, _):
        resp = await client.post("/v1/chat/completions", json=body)
        line = await one_line(request_log)
    assert resp.status_code == 200
    rid = resp.headers["x-request-id"]
    assert len(rid) == 32 and int(rid, 16) >= 0
    assert line["rid"] == rid
    assert (line["status"], line["outcome"]) == ("200", "ok")
    assert int(line["output_tokens"]) == resp.json()["usage"]["completion_tokens"]
    assert "ttft_s" not in line  # a whole answer has no first token of its own
    assert float(line["e2e_s"]) > 0
    assert len(lines(request_log)) == 1


async def test_a_refused_request_logs_one_line_with_its_status_and_error(
    workers: Any, request_log: pytest.LogCaptureFixture
) -> None:
    body = {"model": "no-such-model", "messages": MESSAGES, "max_tokens": 4}
    async with proxy_client(router_settings(workers)) as (client, _):
        resp = await client.post(
            "/v1/chat/completions", json=body, headers={"x-request-id": "r-404"}
        )
        line = await one_line(request_log)
    assert resp.status_code == 404
    assert resp.headers["x-request-id"] == "r-404" == line["rid"]
    assert (line["status"], line["outcome"], line["error"]) == (
        "404",
        "refused",
        "model_not_found",
    )
    assert line["model"] == "unknown"  # a client's model name is no label
    assert "decode" not in line and "output_tokens" not in line
    assert len(lines(request_log)) == 1


async def test_a_request_a_front_door_refuses_logs_one_line(
    workers: Any, request_log: pytest.LogCaptureFixture
) -> None:
    bad = {"model": MODEL, "messages": [{"role": "user", "content": "no max_tokens"}]}
    good = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    async with proxy_client(router_settings(workers)) as (client, _):
        refused = await client.post("/v1/messages", json=bad, headers={"x-request-id": "m-1"})
        line = await one_line(request_log)
        answered = await client.post("/v1/messages", json=good, headers={"x-request-id": "m-2"})
        await until(lambda: len(lines(request_log)) == 2, what="the second request's line")
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "m-1"
    assert (line["rid"], line["status"], line["outcome"]) == ("m-1", "400", "refused")
    assert answered.status_code == 200 and answered.headers["x-request-id"] == "m-2"
    second = lines(request_log)[1]
    assert (second["rid"], second["status"], second["outcome"]) == ("m-2", "200", "ok")
    assert len(lines(request_log)) == 2


async def test_requests_the_http_server_refuses_log_one_line_each_under_their_answer_id(
    workers: Any, request_log: pytest.LogCaptureFixture
) -> None:
    # refused before the request path: a body over server.max_body_bytes (413, under the
    # client's id), request headers over the server's limit (431, under a new one)
    settings = router_settings(workers, server={"max_body_bytes": 4096})
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 10_000}]}
    async with proxy_client(settings) as (client, _):
        too_big = await client.post(
            "/v1/chat/completions", json=big, headers={"x-request-id": "big-1"}
        )
        first = await one_line(request_log)
        too_long = await client.post(
            "/v1/chat/completions", json={}, headers={"x-filler": "y" * (MAX_HEADER_BYTES + 1)}
        )
        await until(lambda: len(lines(request_log)) == 2, what="the second refusal's line")
    assert too_big.status_code == 413 and too_big.headers["x-request-id"] == "big-1"
    assert (first["rid"], first["status"], first["outcome"]) == ("big-1", "413", "refused")
    error = too_big.json()["error"]
    assert first["error"] == (error.get("code") or error["type"])
    second = lines(request_log)[1]
    assert too_long.status_code == 431
    assert second["rid"] == too_long.headers["x-request-id"] and len(second["rid"]) == 32
    assert (second["status"], second["outcome"]) == ("431", "refused")
    assert float(first["e2e_s"]) >= 0 and float(second["e2e_s"]) >= 0
    assert len(lines(request_log)) == 2


async def test_a_client_that_leaves_mid_stream_logs_one_cancelled_line(
    workers: Any, request_log: pytest.LogCaptureFixture
) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4000, "stream": True}
    async with proxy_client(router_settings(workers)) as (client, router):
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            rid = resp.headers["x-request-id"]
            async for _ in resp.aiter_lines():
                break  # the client walks away after the first bytes
        line = await one_line(request_log)
        await until(lambda: router.leases.open == 0, what="the abandoned request's end")
    assert line["rid"] == rid
    # the answer had started: its status was sent
    assert (line["status"], line["outcome"]) == ("200", "cancelled")
    assert line["decode"] == "h0"
    assert "output_tokens" not in line
    assert len(lines(request_log)) == 1
