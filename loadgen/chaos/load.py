"""The chaos bench's load: a fixed number of concurrent agent sessions (multi-turn, the context
growing each turn) whose turns go round robin over the router replicas, each turn streamed or
not at random, for a set time.

A failed turn is retried (on the next replica, after a short backoff) until it succeeds or has
failed for `recover_s`: then its session is *lost*. Every attempt is recorded with its outcome:
`ok`; a clean error, `status` (an HTTP error answer) or `sse_error` (an error event in the
stream); `connect` (no connection: nothing was sent); `transport` (the connection broke after
the request was sent, without an error answer); `truncated` (an answer that ended without
`[DONE]` or with fewer tokens than asked, without saying why); `bad` (an answer that does not
parse); `hung` (no answer within `hang_s`, a bound past every timeout of the router's).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import orjson

from loadgen.workloads import AgenticParams, Session, agentic

CLEAN = ("status", "sse_error")
"""Failures the client was told about: an error answer, or an error event in the stream."""


def chaos_params(sessions_per_batch: int = 32) -> AgenticParams:
    """Small coding-agent sessions (a 1.5-5K-token prefix shared by a third of a batch, 3-6
    turns of short tool outputs and replies, now and then a tool output past the planner's
    `small_turn_tokens`): enough turns and reuse to exercise ownership, and prompts the
    planner sends to remote prefill (a new long prefix, a long tool output), at little
    enough compute for a 2-core machine running every process."""
    return AgenticParams(
        sessions=sessions_per_batch,
        repo_groups=3,
        system_tokens=300,
        repo_tokens=(1_200, 4_500),
        task_tokens=(20, 80),
        turns=(3, 6),
        tool_tokens=(40, 400),
        long_tool_prob=0.15,
        long_tool_tokens=(2_200, 3_500),
        short_output=(8, 24),
        long_output_prob=0.2,
        long_output=(48, 96),
        tool_gap_median_s=0.5,
        tool_gap_sigma=0.6,
        tool_gap_max_s=3.0,
    )


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """How the load runs: `targets` are the replicas' base URLs (without `/v1`)."""

    targets: tuple[str, ...]
    sessions: int
    duration_s: float
    seed: int
    model: str
    stream_share: float = 0.5
    hang_s: float = 45.0
    recover_s: float = 30.0
    time_scale: float = 1.0
    """Multiplies the sessions' tool gaps."""
    params: AgenticParams = field(default_factory=chaos_params)


@dataclass(frozen=True, slots=True)
class Attempt:
    """One request: its turn, where it went, what came back. Times are seconds from the
    load's start."""

    session_id: str
    step: int
    attempt: int
    target: int
    stream: bool
    sent_s: float
    e2e_s: float
    outcome: str
    status: int = 0
    detail: str = ""
    plan: str = ""
    """Its `x-ownerserve-plan` header's `PLAN_KEYS` (`key=value;...`): what ran and what was
    given up."""

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    def as_dict(self) -> dict[str, Any]:
        return {
            "session": self.session_id,
            "step": self.step,
            "attempt": self.attempt,
            "target": self.target,
            "stream": self.stream,
            "sent_s": round(self.sent_s, 3),
            "e2e_s": round(self.e2e_s, 3),
            "outcome": self.outcome,
            "status": self.status,
            "detail": self.detail,
            "plan": self.plan,
        }

    def plan_fields(self) -> dict[str, str]:
        return plan_fields(self.plan)


PLAN_KEYS = ("action", "p", "d", "src", "fetched", "fetched_blocks", "ran", "fallback", "reason")
"""The plan header's fields an attempt keeps (the cost terms are left out)."""


def plan_fields(header: str) -> dict[str, str]:
    """`key=value;...` as a dict (a value holding `=` keeps it)."""
    out = {}
    for part in header.split(";"):
        key, sep, value = part.partition("=")
        if sep:
            out[key] = value
    return out


def kept_plan(header: str | None) -> str:
    """The `PLAN_KEYS` of a plan header, in the header's order."""
    if not header:
        return ""
    fields = plan_fields(header)
    return ";".join(f"{k}={fields[k]}" for k in PLAN_KEYS if k in fields)


@dataclass(frozen=True, slots=True)
class SessionOutcome:
    """One session: `completed` (every turn answered), `lost` (a turn kept failing for
    `recover_s`) or `cut` (the load ended between its turns)."""

    session_id: str
    started_s: float
    ended_s: float
    steps_total: int
    steps_done: int
    state: str
    error: str = ""


@dataclass
class LoadResult:
    attempts: list[Attempt]
    sessions: list[SessionOutcome]
    wall_s: float


class _Failed(Exception):
    def __init__(self, outcome: str, detail: str, status: int = 0) -> None:
        super().__init__(detail)
        self.outcome = outcome
        self.detail = detail[:300]
        self.status = status


def _sessions(params: AgenticParams, seed: int) -> Iterator[Session]:
    """Sessions without end: batches of the `agentic` workload, each batch its own seed (so
    session ids never repeat)."""
    for batch in range(1_000_000):
        yield from agentic(params, seed=seed * 1_000_003 + batch).sessions


class ChaosLoad:
    """Runs `LoadOptions`; `run()` returns every attempt and session. `stopping` is set once
    the load's time is up: no session starts and no turn is sent after it, but a turn being
    retried goes on until it succeeds or its session is lost (the report waits for that)."""

    def __init__(self, opts: LoadOptions) -> None:
        if not opts.targets or opts.sessions < 1:
            raise ValueError("the load needs at least one target and one session")
        self.opts = opts
        self.attempts: list[Attempt] = []
        self.sessions: list[SessionOutcome] = []
        self.stopping = asyncio.Event()
        self.rng = random.Random(f"chaos-load:{opts.seed}")
        self.source = _sessions(opts.params, opts.seed)
        self.t0 = 0.0
        self.inflight = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self) -> LoadResult:
        opts = self.opts
        timeout = httpx.Timeout(opts.hang_s + 10.0, connect=5.0)
        limits = httpx.Limits(max_connections=opts.sessions * 2 + 4)
        clients = [
            httpx.AsyncClient(base_url=t, timeout=timeout, limits=limits) for t in opts.targets
        ]
        self.t0 = time.monotonic()
        try:
            slots = [asyncio.create_task(self._slot(clients, i)) for i in range(opts.sessions)]
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(opts.duration_s):
                    await self.stopping.wait()
            self.stopping.set()
            await asyncio.gather(*slots)
        finally:
            for c in clients:
                await c.aclose()
        return LoadResult(self.attempts, self.sessions, self.now())

    async def _slot(self, clients: list[httpx.AsyncClient], i: int) -> None:
        # staggered starts: the first turns do not all land in the same instant
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(i * 0.3):
                await self.stopping.wait()
        while not self.stopping.is_set():
            await self._session(clients, next(self.source))

    async def _session(self, clients: list[httpx.AsyncClient], s: Session) -> None:
        opts = self.opts
        started = self.now()
        offset = self.rng.randrange(len(clients))
        messages: list[dict[str, Any]] = []
        done = 0
        state, error = "completed", ""
        for k, step in enumerate(s.steps):
            if k and step.gap_s > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(step.gap_s * opts.time_scale):
                        await self.stopping.wait()
            if self.stopping.is_set():
                if k == 0:
                    return  # never started
                state = "cut"
                break
            messages.extend(m.as_dict() for m in step.new_messages)
            attempt, failing_since = 0, None
            while True:
                target = (offset + k + attempt) % len(clients)
                stream = self.rng.random() < opts.stream_share
                a = await self._request(clients[target], s, k, attempt, target, stream, messages)
                self.attempts.append(a)
                if a.ok:
                    break
                failing_since = a.sent_s if failing_since is None else failing_since
                if self.now() - failing_since >= opts.recover_s:
                    state, error = "lost", f"step {k}: {a.outcome} {a.detail}"[:300]
                    break
                attempt += 1
                await asyncio.sleep(min(4.0, 0.25 * 2 ** min(attempt, 4)))
            if state == "lost":
                break
            done += 1
            reply = step.reply_message()
            if reply is not None:
                messages.append(reply)
        self.sessions.append(
            SessionOutcome(s.session_id, started, self.now(), len(s.steps), done, state, error)
        )

    async def _request(
        self,
        client: httpx.AsyncClient,
        s: Session,
        k: int,
        attempt: int,
        target: int,
        stream: bool,
        messages: list[dict[str, Any]],
    ) -> Attempt:
        step = s.steps[k]
        body: dict[str, Any] = {
            "model": self.opts.model,
            "messages": messages,
            "max_tokens": step.max_tokens,
            "ignore_eos": True,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        headers = {"x-session-id": s.session_id}
        sent = self.now()
        record = Attempt(s.session_id, k, attempt, target, stream, sent, 0.0, "ok")
        self.inflight += 1
        try:
            async with asyncio.timeout(self.opts.hang_s):
                status, plan = await self._exchange(client, body, headers, step.max_tokens)
            record = replace(record, status=status, plan=plan)
        except TimeoutError:
            record = replace(record, outcome="hung", detail=f"no answer in {self.opts.hang_s:g} s")
        except _Failed as exc:
            record = replace(record, outcome=exc.outcome, detail=exc.detail, status=exc.status)
        finally:
            self.inflight -= 1
        return replace(record, e2e_s=self.now() - sent)

    async def _exchange(
        self, client: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str], want: int
    ) -> tuple[int, str]:
        """Send one request and read its whole answer; its status and plan (`kept_plan`), or
        `_Failed`."""
        try:
            async with client.stream(
                "POST", "/v1/chat/completions", content=orjson.dumps(body), headers=headers
            ) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode(errors="replace")
                    raise _Failed("status", f"HTTP {resp.status_code}: {detail}", resp.status_code)
                if body["stream"]:
                    await self._read_stream(resp, want)
                else:
                    self._check_whole(await resp.aread(), want)
                return resp.status_code, kept_plan(resp.headers.get("x-ownerserve-plan"))
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise _Failed("connect", f"{type(exc).__name__}: {exc}") from None
        except httpx.HTTPError as exc:
            raise _Failed("transport", f"{type(exc).__name__}: {exc}") from None

    async def _read_stream(self, resp: httpx.Response, want: int) -> None:
        done, tokens = False, 0
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            try:
                chunk = orjson.loads(data)
            except orjson.JSONDecodeError:
                raise _Failed("bad", f"not JSON: {data[:200]}") from None
            if chunk.get("error"):
                raise _Failed("sse_error", f"stream error: {chunk['error']}")
            usage = chunk.get("usage")
            if usage:
                tokens = int(usage.get("completion_tokens") or 0)
        if not done:
            raise _Failed("truncated", "the stream ended without [DONE] or an error event")
        if tokens != want:
            raise _Failed("truncated", f"{tokens} completion tokens of {want} (usage)")

    def _check_whole(self, raw: bytes, want: int) -> None:
        try:
            payload = orjson.loads(raw)
            tokens = int((payload.get("usage") or {}).get("completion_tokens") or 0)
            if not isinstance(payload["choices"][0]["message"], dict):
                raise TypeError("the choice has no message")
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as exc:
            raise _Failed("bad", f"bad answer ({exc!r}): {raw[:200]!r}") from None
        if tokens != want:
            raise _Failed("truncated", f"{tokens} completion tokens of {want} (usage)")
