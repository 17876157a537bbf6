"""Mid-stream migration against real emulated workers (real processes): a worker SIGKILLed or
SIGSTOPped while it streams an answer hands the answer to another worker, and the client sees
one unbroken stream — one `id`, the dead worker's text then the new worker's continuation of
it, one final chunk, the whole answer's usage, `[DONE]`. A whole (non-streamed) answer whose
worker dies is run again elsewhere; constrained answers and `max_migrations: 0` end with the
error event, as before.

The emulated workers write the same deterministic text for the same prompt on every worker
(`workers.emulator.textgen`), in byte tokens: so the answer a worker would have written is
known, and so is the continuation of any part of it (asked of a worker directly)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from loadgen.cluster import EmulatedWorker, emulated_workers
from tests.e2e.router_cluster import (
    MODEL,
    metric_value,
    plan_fields,
    proxy_client,
    router_settings,
)
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)

MESSAGES = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Summarise the repository layout. " * 20},
]
TOKENS = 300
"""The answer's length: byte tokens, `ignore_eos`, so every answer (and so the two halves of a
migrated one together) has exactly this many; ~2 s at `--speed 1`, long enough to be cut."""
BODY: dict[str, Any] = {
    "model": MODEL,
    "messages": MESSAGES,
    "max_tokens": TOKENS,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
}
CUT_AFTER = 5
"""Chunks the client has when the worker streaming to it is killed or stopped."""


def hybrids() -> tuple[EmulatedWorker, EmulatedWorker]:
    return EmulatedWorker("h0", "hybrid", speed=1), EmulatedWorker("h1", "hybrid", speed=1)


@contextlib.contextmanager
def stopped(worker: EmulatedWorker) -> Iterator[None]:
    """The worker's process SIGSTOPped (its connections stay open, nothing answers), continued
    on the way out."""
    assert worker.process is not None and worker.process.proc is not None
    pid = worker.process.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def whole(
    worker: EmulatedWorker, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> dict[str, Any]:
    """`body` answered by `worker` itself, whole."""
    async with httpx.AsyncClient(timeout=60) as direct:
        resp = await direct.post(worker.url + path, json={**body, "stream": False})
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


async def cut_stream(
    client: httpx.AsyncClient,
    body: dict[str, Any],
    workers: dict[str, EmulatedWorker],
    cut: Any,
    path: str = "/v1/chat/completions",
) -> tuple[str, list[str]]:
    """Stream `body` through the router; once the client has `CUT_AFTER` chunks, `cut(worker)`
    the worker streaming them (entering what it returns, a context manager, for the rest of
    the stream): (that worker's id, every `data:` line the client got)."""
    lines: list[str] = []
    with contextlib.ExitStack() as stack:
        async with client.stream("POST", path, json=body) as resp:
            assert resp.status_code == 200
            victim = plan_fields(resp.headers["x-ownerserve-plan"])["d"]
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == CUT_AFTER:
                        held = cut(workers[victim])
                        if held is not None:
                            stack.enter_context(held)
    return victim, lines


def chunks_of(lines: list[str]) -> list[dict[str, Any]]:
    """The JSON chunks of a stream's lines, which must end in `[DONE]` with no error."""
    assert lines[-1] == "data: [DONE]"
    chunks = [orjson.loads(line[6:]) for line in lines[:-1]]
    errors = [c for c in chunks if "error" in c]
    assert not errors, errors
    return chunks


def text_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")
    )


def assert_one_answer(chunks: list[dict[str, Any]], prompt_tokens: int) -> str:
    """The stream is one answer: one id, created and model throughout, the role once, one
    final chunk, the usage of the whole answer last. Its text."""
    heads = {(c["id"], c["created"], c["model"]) for c in chunks}
    assert len(heads) == 1, heads
    roles = [c for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
    assert len(roles) == 1 and chunks[0] is roles[0]
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["completion_tokens"] == TOKENS
    assert usage["total_tokens"] == prompt_tokens + TOKENS
    text = text_of(chunks)
    assert len(text.encode()) == TOKENS  # byte tokens: no text lost, none twice
    return text


async def assert_spliced(
    text: str, reference: str, continued: Callable[[str], Awaitable[str]]
) -> None:
    """`text` is `reference` (what the first worker was writing) up to some point, then
    exactly what a worker writes when asked to continue `reference` from that point
    (`continued(partial)`)."""
    common = 0
    while common < len(text) and text[common] == reference[common]:
        common += 1
    assert 0 < common < len(text)  # the first worker's text, then something else
    # the continuation's first byte may equal the reference's next by chance: the cut is at
    # the common prefix or shortly before it
    for cut in range(common, max(0, common - 8), -1):
        partial = reference[:cut]
        if partial + await continued(partial) == text:
            return
    raise AssertionError(f"not the first worker's text continued: {text!r} vs {reference!r}")


def chat_continued(worker: EmulatedWorker) -> Callable[[str], Awaitable[str]]:
    """What `worker` writes to continue `BODY`'s answer after `partial`."""

    async def continued(partial: str) -> str:
        answer = await whole(
            worker,
            {
                **BODY,
                "messages": [*MESSAGES, {"role": "assistant", "content": partial}],
                "continue_final_message": True,
                "add_generation_prompt": False,
                "max_tokens": TOKENS - len(partial),
            },
        )
        content: str = answer["choices"][0]["message"]["content"]
        return content

    return continued


@contextlib.asynccontextmanager
async def cluster(**server: Any) -> AsyncIterator[tuple[httpx.AsyncClient, Any, dict[str, Any]]]:
    with emulated_workers(*hybrids()) as ws:
        async with proxy_client(router_settings(ws, server=server)) as (client, router):
            yield client, router, {w.worker_id: w for w in ws}


async def test_a_worker_killed_mid_stream_hands_the_answer_to_another_worker():
    async with cluster() as (client, router, workers):
        reference = await whole(workers["h0"], BODY)
        victim, lines = await cut_stream(client, BODY, workers, lambda w: w.kill())
        metrics = (await client.get("/metrics")).text
        survivor = workers["h1" if victim == "h0" else "h0"]
        text = assert_one_answer(chunks_of(lines), reference["usage"]["prompt_tokens"])
        reference_text = reference["choices"][0]["message"]["content"]
        await assert_spliced(text, reference_text, chat_continued(survivor))
        assert metric_value(metrics, "ownerserve_migrations_total", outcome="migrated") == 1
        assert metric_value(metrics, "ownerserve_stream_errors_total", worker=victim) == 1
        assert metric_value(metrics, "ownerserve_requests_total", status="ok") == 1
        continued = router.recent_plans[-1]
        assert continued.migrated_from == victim
        assert continued.plan.chosen.decode_worker == survivor.worker_id


async def test_a_worker_stopped_mid_stream_is_given_up_after_the_stall_bound():
    stall_s = 1.0
    async with cluster(stall_timeout_s=stall_s, stream_gap_timeout_s=60) as (client, _, workers):
        reference = await whole(workers["h0"], BODY)
        t0 = time.monotonic()
        victim, lines = await cut_stream(client, BODY, workers, stopped)
        elapsed = time.monotonic() - t0
        metrics = (await client.get("/metrics")).text
        assert_one_answer(chunks_of(lines), reference["usage"]["prompt_tokens"])
        # the stall bound, not the stream gap's 60 s, ended the wait on the stopped worker
        assert elapsed < 30
        assert metric_value(metrics, "ownerserve_migrations_total", outcome="migrated") == 1
        gaps = {"worker": victim, "hop": "stream_gap"}
        assert metric_value(metrics, "ownerserve_upstream_timeouts_total", **gaps) == 1


async def test_a_completion_killed_mid_stream_continues_its_text_on_another_worker():
    path = "/v1/completions"
    body = {k: v for k, v in BODY.items() if k != "messages"}
    body["prompt"] = "The repository layout, file by file: " * 20
    async with cluster() as (client, _, workers):
        reference = await whole(workers["h0"], body, path)
        victim, lines = await cut_stream(client, body, workers, lambda w: w.kill(), path)
        metrics = (await client.get("/metrics")).text
        survivor = workers["h1" if victim == "h0" else "h0"]
        chunks = chunks_of(lines)
        assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
        finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
        usage = chunks[-1]["usage"]
        assert usage["prompt_tokens"] == reference["usage"]["prompt_tokens"]
        assert usage["completion_tokens"] == TOKENS
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert len(text.encode()) == TOKENS

        async def continued(partial: str) -> str:
            following = {**body, "prompt": body["prompt"] + partial}
            answer = await whole(survivor, {**following, "max_tokens": TOKENS - len(partial)}, path)
            return str(answer["choices"][0]["text"])

        await assert_spliced(text, reference["choices"][0]["text"], continued)
        assert metric_value(metrics, "ownerserve_migrations_total", outcome="migrated") == 1


def generating(worker: EmulatedWorker) -> bool:
    m = worker.metrics()
    return (
        metric_value(m, "vllm:num_requests_running") == 1
        and metric_value(m, "vllm:generation_tokens_total") >= 20
    )


async def test_a_whole_answer_whose_worker_dies_mid_generation_comes_whole_from_another():
    async with cluster() as (client, _, workers):
        body = {**BODY, "stream": False}
        reference = await whole(workers["h0"], body)
        task = asyncio.create_task(client.post("/v1/chat/completions", json=body))
        busy: list[EmulatedWorker] = []

        def one_generating() -> bool:
            busy[:] = [w for w in workers.values() if generating(w)]
            return bool(busy)

        await until(one_generating, what="a worker generating the answer")
        (victim,) = busy
        victim.kill()
        resp = await task
        metrics = (await client.get("/metrics")).text
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    # nothing had reached the client: the other worker wrote the whole answer
    assert answer["choices"][0]["message"] == reference["choices"][0]["message"]
    assert answer["usage"]["completion_tokens"] == TOKENS
    plan = plan_fields(resp.headers["x-ownerserve-plan"])
    assert plan["d"] != victim.worker_id and plan["fallback"] == "other_worker"
    assert plan["gave_up"].endswith(":" + victim.worker_id)
    assert metric_value(metrics, "ownerserve_retries_total", worker=victim.worker_id) == 1


async def test_a_constrained_answer_is_not_moved_and_ends_with_an_error_event_saying_why():
    schema = {"type": "object", "properties": {"summary": {"type": "string"}}}
    body = {
        **BODY,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }
    async with cluster() as (client, _, workers):
        victim, lines = await cut_stream(client, body, workers, lambda w: w.kill())
        metrics = (await client.get("/metrics")).text
    assert lines[-1] == "data: [DONE]"
    error = orjson.loads(lines[-2][6:])["error"]
    assert error["type"] == "upstream_error"
    assert error["message"].startswith(f"worker {victim} failed mid-stream")
    assert "not continued on another worker" in error["message"]
    assert "response_format" in error["message"]
    assert metric_value(metrics, "ownerserve_migrations_total", outcome="refused_guided") == 1
    assert metric_value(metrics, "ownerserve_migrations_total", outcome="migrated") == 0


async def test_max_migrations_zero_ends_the_stream_with_the_error_event_as_before():
    async with cluster(max_migrations=0) as (client, _, workers):
        victim, lines = await cut_stream(client, BODY, workers, lambda w: w.kill())
        metrics = (await client.get("/metrics")).text
    assert lines[-1] == "data: [DONE]"
    error = orjson.loads(lines[-2][6:])["error"]
    assert error["type"] == "upstream_error"
    assert error["message"] == f"worker {victim} failed mid-stream"  # as without migrations
    assert metric_value(metrics, "ownerserve_migrations_total", outcome="refused_limit") == 1
    assert metric_value(metrics, "ownerserve_migrations_total", outcome="migrated") == 0
    # the answer stopped where the worker did: less than the whole of it
    assert len(text_of(chunks_of_until_error(lines)).encode()) < TOKENS


def chunks_of_until_error(lines: list[str]) -> list[dict[str, Any]]:
    chunks = [orjson.loads(line[6:]) for line in lines if line != "data: [DONE]"]
    return [c for c in chunks if "error" not in c]
