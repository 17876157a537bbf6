"""The replay client: runs a `Workload` against any OpenAI-compatible endpoint and records timings.

Sessions start at their (open-loop) start times — a subagent when its parent sends the step
that spawns it (`Session.spawned_at`) — and run their steps in order, sleeping each step's
tool gap; requests stream, so every request gets TTFT, inter-token gaps and E2E, and every
session its E2E including the gaps. Concurrency is bounded (in-flight requests, active sessions)
and so is total time; every failure — HTTP error, transport error, error event in the stream,
or a request cut by the time limit — is recorded with its reason, never dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from loadgen.progress import ProgressBar
from loadgen.workloads import Session, Step, Workload


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What one request did. Times are seconds; `sent_s` is relative to the run's start."""

    session_id: str
    step: int
    kind: str
    label: str
    sent_s: float
    e2e_s: float
    ttft_s: float | None
    itl_s: tuple[float, ...]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    status: int
    error: str | None = None
    plan: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """What one session did; `e2e_s` runs from its first request to its last response."""

    session_id: str
    kind: str
    group: str
    planned_start_s: float
    started_s: float | None
    e2e_s: float | None
    steps_total: int
    steps_done: int
    idle_s: float
    error: str | None = None

    @property
    def completed(self) -> bool:
        return self.error is None and self.steps_done == self.steps_total


@dataclass(frozen=True, slots=True)
class RunOptions:
    """How to drive the endpoint."""

    target: str
    model: str = "ownerserve-tiny"
    max_inflight: int = 64
    max_sessions: int | None = None
    duration_s: float | None = None
    request_timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    stream: bool = True
    ignore_eos: bool = True
    session_header: bool = True
    api_key: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    progress: bool | None = None
    label: str = ""


@dataclass(frozen=True, slots=True)
class RunResult:
    label: str
    workload: str
    target: str
    started_at: str
    wall_s: float
    requests: tuple[RequestRecord, ...]
    sessions: tuple[SessionRecord, ...]
    time_limited: bool
    meta: dict[str, Any] = field(default_factory=dict)


class _StreamError(Exception):
    """An error event inside a 200 stream."""


_CUT = "cancelled: run time limit reached"


class _Runner:
    def __init__(self, workload: Workload, opts: RunOptions) -> None:
        self.workload = workload
        self.opts = opts
        self.requests: list[RequestRecord] = []
        self.sessions: dict[str, SessionRecord] = {}
        self.inflight = asyncio.Semaphore(max(1, opts.max_inflight))
        self.active = asyncio.Semaphore(opts.max_sessions) if opts.max_sessions else None
        self.bar = ProgressBar(workload.n_requests, opts.label, enabled=opts.progress)
        self.t0 = 0.0
        self.spawns: dict[str, dict[int, asyncio.Event]] = {}
        """Parent session -> its step -> set when it sends that step (its subagents start)."""
        for sess in workload.sessions:
            if sess.spawned_at is not None:
                parent, step = sess.spawned_at
                self.spawns.setdefault(parent, {}).setdefault(step, asyncio.Event())

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def _body(self, messages: list[dict[str, Any]], step: Step) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.opts.model,
            "messages": messages,
            "max_tokens": step.max_tokens,
            "stream": self.opts.stream,
        }
        if self.opts.stream:
            body["stream_options"] = {"include_usage": True}
        if self.opts.ignore_eos:
            body["ignore_eos"] = True
        return body

    def _headers(self, session: Session) -> dict[str, str]:
        headers = dict(self.opts.headers)
        if self.opts.session_header:
            headers["x-session-id"] = session.session_id
            if session.spawned_at is not None:  # a subagent names its spawner, as OpenCode's do
                headers["x-parent-session-id"] = session.spawned_at[0]
        if self.opts.api_key:
            headers["authorization"] = f"Bearer {self.opts.api_key}"
        return headers

    async def request(
        self, client: httpx.AsyncClient, session: Session, k: int, messages: list[dict[str, Any]]
    ) -> RequestRecord:
        step = session.steps[k]
        sent = self.now()
        t0 = time.perf_counter()
        ttft: float | None = None
        last = t0
        itl: list[float] = []
        chunks = 0
        usage: dict[str, Any] = {}
        status = 0
        plan = ""
        error: str | None = None
        try:
            async with client.stream(
                "POST",
                "/v1/chat/completions",
                json=self._body(messages, step),
                headers=self._headers(session),
            ) as resp:
                status = resp.status_code
                plan = resp.headers.get("x-ownerserve-plan", "")
                if status != 200:
                    detail = (await resp.aread()).decode(errors="replace")[:300]
                    raise _StreamError(f"HTTP {status}: {detail}")
                if self.opts.stream:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        chunk = orjson.loads(data)
                        if chunk.get("error"):
                            raise _StreamError(f"stream error: {chunk['error']}")
                        for choice in chunk.get("choices") or ():
                            delta = choice.get("delta") or {}
                            if delta.get("content") or choice.get("text"):
                                now = time.perf_counter()
                                if ttft is None:
                                    ttft = now - t0
                                else:
                                    itl.append(now - last)
                                last = now
                                chunks += 1
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                else:
                    payload = orjson.loads(await resp.aread())
                    ttft = time.perf_counter() - t0
                    usage = payload.get("usage") or {}
        except asyncio.CancelledError:
            self._record(session, k, step, sent, t0, ttft, itl, usage, chunks, status, _CUT, plan)
            raise
        except _StreamError as exc:
            error = str(exc)
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"[:300] or type(exc).__name__
        except (orjson.JSONDecodeError, ValueError, TypeError, AttributeError) as exc:
            error = f"bad response: {exc}"[:300]
        if error is None and self.opts.stream and ttft is None and step.max_tokens > 0:
            error = "stream ended without any token"
        return self._record(
            session, k, step, sent, t0, ttft, itl, usage, chunks, status, error, plan
        )

    def _record(
        self,
        session: Session,
        k: int,
        step: Step,
        sent: float,
        t0: float,
        ttft: float | None,
        itl: list[float],
        usage: dict[str, Any],
        chunks: int,
        status: int,
        error: str | None,
        plan: str,
    ) -> RequestRecord:
        details = usage.get("prompt_tokens_details") or {}
        rec = RequestRecord(
            session_id=session.session_id,
            step=k,
            kind=session.kind,
            label=step.label,
            sent_s=sent,
            e2e_s=time.perf_counter() - t0,
            ttft_s=ttft,
            itl_s=tuple(itl),
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or chunks),
            cached_tokens=int(details.get("cached_tokens") or 0),
            status=status,
            error=error,
            plan=plan,
        )
        self.requests.append(rec)
        self.bar.update(1, 0 if error is None else 1)
        return rec

    async def session(self, client: httpx.AsyncClient, s: Session) -> None:
        started: float | None = None
        done = 0
        error: str | None = None
        spawns = self.spawns.get(s.session_id, {})
        try:
            if s.spawned_at is not None:
                parent, step_k = s.spawned_at
                await self.spawns[parent][step_k].wait()
            else:
                delay = s.start_s - self.now()
                if delay > 0:
                    await asyncio.sleep(delay)
            async with self.active if self.active else contextlib.nullcontext():
                messages: list[dict[str, Any]] = []
                for k, step in enumerate(s.steps):
                    if k and step.gap_s > 0:
                        await asyncio.sleep(step.gap_s)
                    messages.extend(m.as_dict() for m in step.new_messages)
                    spawned = spawns.get(k)
                    if spawned is not None:
                        spawned.set()
                    async with self.inflight:
                        if started is None:
                            started = self.now()
                        rec = await self.request(client, s, k, messages)
                    if not rec.ok:
                        error = rec.error
                        break
                    done += 1
                    reply = step.reply_message()
                    if reply is not None:
                        messages.append(reply)
        except asyncio.CancelledError:
            error = _CUT if started is not None else "not started: run time limit reached"
            raise
        finally:
            for spawned in spawns.values():  # ended before a spawning step: they start now
                spawned.set()
            finished = self.now()
            self.sessions[s.session_id] = SessionRecord(
                session_id=s.session_id,
                kind=s.kind,
                group=s.group,
                planned_start_s=s.start_s,
                started_s=started,
                e2e_s=None if started is None else finished - started,
                steps_total=len(s.steps),
                steps_done=done,
                idle_s=sum(st.gap_s for st in s.steps[1 : done + 1]),
                error=error,
            )
            if error is not None and done + 1 < len(s.steps):
                self.bar.update(len(s.steps) - done - 1, 0)  # steps never sent

    async def run(self) -> RunResult:
        opts = self.opts
        timeout = httpx.Timeout(opts.request_timeout_s, connect=opts.connect_timeout_s)
        limits = httpx.Limits(
            max_connections=opts.max_inflight + 8, max_keepalive_connections=opts.max_inflight
        )
        started_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        async with httpx.AsyncClient(
            base_url=opts.target, timeout=timeout, limits=limits
        ) as client:
            self.t0 = time.perf_counter()
            tasks = [asyncio.create_task(self.session(client, s)) for s in self.workload.sessions]
            _, pending = (
                await asyncio.wait(tasks, timeout=opts.duration_s) if tasks else ((), set())
            )
            for t in pending:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            wall = self.now()
        self.bar.close()
        ordered = tuple(self.sessions[s.session_id] for s in self.workload.sessions)
        return RunResult(
            label=opts.label,
            workload=self.workload.name,
            target=opts.target,
            started_at=started_at,
            wall_s=wall,
            requests=tuple(sorted(self.requests, key=lambda r: r.sent_s)),
            sessions=ordered,
            time_limited=bool(pending),
            meta={"seed": self.workload.seed, "model": opts.model},
        )


async def run_workload(workload: Workload, opts: RunOptions) -> RunResult:
    """Replay `workload` against `opts.target` (a base URL without `/v1`)."""
    return await _Runner(workload, opts).run()
