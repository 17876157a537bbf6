"""Sending fuzz cases (`bench.fuzz.strategies`) to a real router and judging each answer.

`FuzzTarget` runs the router (`router.app.create_app` on its own server, `router.server
.running_app`) in an event loop of its own thread, in front of emulated workers that are real
processes (`loadgen.cluster.EmulatedWorker`, `strategies.WORKERS`: a vLLM-protocol P/D pair and
an SGLang one). `Fuzzer` sends one case at a time from the caller's thread — bodies with httpx,
byte-level cases over a raw socket — each within `bound_s` (`asyncio.timeout`), and judges it:

- no status of 500 or more (the emulated workers are healthy: a 5xx is the router's);
- a 4xx body in its route's error shape (OpenAI's `{"error": {...}}`; Anthropic's
  `{"type": "error", "error": {...}}` on `/v1/messages`);
- a streamed 200 that ends as its route's stream ends, with no error event;
- nothing logged at ERROR by the router while the case ran;
- a byte-level case's answers well-formed HTTP.

`Fuzzer.after_problems` checks the router afterwards: a normal request served (whole and
streamed), `/health` ok with every worker healthy; `held` and `workers_busy` say what the
router's requests and the workers still hold (the caller waits on them with a bound)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from bench.fuzz.strategies import ADMIN_TOKEN, ANTHROPIC, OPENAI, STORED, WORKERS, Case
from loadgen.cluster import MODEL, EmulatedWorker, start_workers
from ownerserve.config import settings_from_dict
from planner.explain import parse_plan_header
from router.app import create_app
from router.server import running_app
from router.state import Router

T = TypeVar("T")

BOUND_S = 20.0
"""How long one case may take, answer read whole (the emulated workers run 50× their profile's
speed and answers are at most a few tokens: a valid case takes milliseconds)."""
MAX_BODY_BYTES = 2 * 1024 * 1024
"""The fuzzed router's `server.max_body_bytes`: the strategies' huge strings reach past it."""
MAX_MODEL_LEN = 8192
"""The model's context, in the router's settings and the workers': a fuzzed `min_tokens` or
`ignore_eos` cannot make an answer longer than this."""
CLOSING_REQUEST = b"GET /health HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\n\r\n"
"""Sent after a complete byte-level case: the router answers it last and closes, so reading
until the connection closes reads every answer."""


class _ErrorLog(logging.Handler):
    """Counts what the router's and the core's loggers log at ERROR or above."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += f": {record.exc_info[1]!r}"
        self.records.append(f"{record.name}: {text}")


class FuzzTarget:
    """The router in front of `WORKERS`, each emulated worker a process on loopback ports; the
    router in its own thread's event loop (`call` runs a function there)."""

    def __init__(self, speed: float = 50.0, log_dir: Path | None = None) -> None:
        self.workers = [
            EmulatedWorker(
                wid,
                role,
                kind=kind,
                speed=speed,
                extra=("--max-model-len", str(MAX_MODEL_LEN)),
                log_path=None if log_dir is None else log_dir / f"worker_{wid}.log",
            )
            for wid, role, kind in WORKERS
        ]
        self.url = ""
        self.router: Router | None = None
        self.errors = _ErrorLog()
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._failed: BaseException | None = None

    def settings(self) -> dict[str, Any]:
        return {
            "server": {
                "port": 0,
                "health_interval_s": 0.5,
                "admin_token": ADMIN_TOKEN,
                "max_body_bytes": MAX_BODY_BYTES,
            },
            "planner": {"policy": "ownerserve", "allow_policy_header": True},
            "models": [{"name": MODEL, "max_model_len": MAX_MODEL_LEN}],
            "workers": [w.worker_settings() for w in self.workers],
        }

    def __enter__(self) -> FuzzTarget:
        start_workers(self.workers)
        try:
            app = create_app(settings_from_dict(self.settings()))
            self.router = app.state.router
            for name in ("router", "ownerserve"):
                logging.getLogger(name).addHandler(self.errors)
            self._thread = threading.Thread(target=self._serve, args=(app,), daemon=True)
            self._thread.start()
            if not self._ready.wait(60.0) or self._failed is not None:
                raise RuntimeError(f"the router did not start: {self._failed!r}")
            self._wait_healthy()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _serve(self, app: Any) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main(app))
        except BaseException as exc:
            self._failed = exc
            self._ready.set()

    async def _main(self, app: Any) -> None:
        self._stop = asyncio.Event()
        async with running_app(app, "127.0.0.1", 0) as url:
            self.url = url
            self._ready.set()
            await self._stop.wait()

    def _wait_healthy(self, timeout_s: float = 60.0) -> None:
        """Until the router's health checks found every worker healthy."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=self.url, timeout=10.0) as client:
            while True:
                got = client.get("/health").json()
                if got["workers"]["healthy"] == len(self.workers):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"workers not healthy at the router: {got}")
                time.sleep(0.1)

    def call(self, fn: Callable[[], T], timeout_s: float = 30.0) -> T:
        """`fn()` run in the router's event loop (what reads the router's state)."""

        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout_s)

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(60.0)
        for name in ("router", "ownerserve"):
            logging.getLogger(name).removeHandler(self.errors)
        for w in self.workers:
            w.stop()


# --- judging answers ------------------------------------------------------------------------------


def error_shape_problem(data: bytes, shape: str | None) -> str | None:
    """What is wrong with a 4xx body for `shape` (`OPENAI`, `ANTHROPIC`, None: either), or
    None when it is that error shape."""
    try:
        obj = json.loads(data)
    except ValueError:
        return f"4xx body is not JSON: {data[:200]!r}"
    err = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return f"4xx body has no error object with a message: {data[:200]!r}"
    anthropic = obj.get("type") == "error" and isinstance(err.get("type"), str)
    openai = set(obj) == {"error"} and isinstance(err.get("type"), str)
    if shape == ANTHROPIC and not anthropic:
        return f"4xx body is not Anthropic's error shape: {data[:200]!r}"
    if shape == OPENAI and not openai:
        return f"4xx body is not OpenAI's error shape: {data[:200]!r}"
    if shape is None and not (anthropic or openai):
        return f"4xx body is in neither error shape: {data[:200]!r}"
    return None


_STREAM_ENDS = {
    "chat": "data: [DONE]",
    "completions": "data: [DONE]",
    "messages": "event: message_stop",
    "responses": "event: response.completed",
}


def stream_problem(route: str, data: bytes) -> str | None:
    """What is wrong with a streamed 200 of `route`: an error event, or no proper end."""
    text = data.decode("utf-8", "replace")
    if route in ("chat", "completions"):
        for line in text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                with contextlib.suppress(ValueError):
                    if "error" in json.loads(line[6:]):
                        return f"error event in the stream: {line[:300]}"
    elif "event: error" in text or "event: response.failed" in text:
        return f"error event in the stream: {text[-300:]!r}"
    end = _STREAM_ENDS.get(route)
    if end is not None and end not in text:
        if route == "responses" and "event: response.incomplete" in text:
            return None
        return f"the stream did not end with {end!r}: {text[-300:]!r}"
    return None


@dataclass(frozen=True, slots=True)
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes


def parse_responses(data: bytes, head_first: bool = False) -> list[RawResponse]:
    """The HTTP/1.x responses in `data`, in order (interim 1xx left out); `ValueError` when
    it is not a sequence of well-formed responses. `head_first`: the first answers a HEAD
    request, so it has no content (what follows it is the next response, or, when it closes
    the connection, nothing a client reads)."""
    out: list[RawResponse] = []
    pos = 0
    while pos < len(data):
        end = data.find(b"\r\n\r\n", pos)
        if end < 0:
            raise ValueError(f"a response head without its end: {data[pos : pos + 200]!r}")
        lines = data[pos:end].decode("latin-1").split("\r\n")
        m = re.fullmatch(r"HTTP/1\.[01] (\d{3}) [^\r\n]*", lines[0])
        if m is None:
            raise ValueError(f"not a status line: {lines[0][:200]!r}")
        status = int(m.group(1))
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise ValueError(f"not a header line: {line[:200]!r}")
            headers[name.strip().lower()] = value.strip()
        pos = end + 4
        if 100 <= status < 200:
            continue
        if head_first and not out:
            out.append(RawResponse(status, headers, b""))
            if headers.get("connection", "").lower() == "close":
                break
            continue
        if "content-length" in headers:
            n = int(headers["content-length"])
            if pos + n > len(data):
                raise ValueError(f"a body shorter than its content-length {n}")
            body, pos = data[pos : pos + n], pos + n
        elif "chunked" in headers.get("transfer-encoding", ""):
            parts = []
            while True:
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    raise ValueError("a chunked body without its end")
                size = int(data[pos:eol].split(b";")[0], 16)
                pos = eol + 2
                if size == 0:
                    pos = data.index(b"\r\n", pos) + 2  # no trailers from this server
                    break
                parts.append(data[pos : pos + size])
                pos += size + 2
            body = b"".join(parts)
        else:
            body, pos = data[pos:], len(data)
        out.append(RawResponse(status, headers, body))
    return out


# --- sending --------------------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    """What one case got: the statuses of its answers, how long it took, what was wrong."""

    case: Case
    statuses: list[int]
    elapsed_s: float
    problems: list[str]
    hang: bool = False
    reset: bool = False
    """A byte-level case whose connection the router reset before any answer."""

    def report(self) -> str:
        what = "; ".join(self.problems)
        return f"{what}\n    case: {self.case.summary()}\n    statuses {self.statuses}, {self.elapsed_s:.3f} s"  # noqa: E501


@dataclass
class Tally:
    """What a run saw, for its summary."""

    cases: Counter[str] = field(default_factory=Counter)
    statuses: dict[str, Counter[int]] = field(default_factory=dict)
    plans: Counter[str] = field(default_factory=Counter)
    failures: list[Outcome] = field(default_factory=list)
    server_errors: int = 0
    hangs: int = 0
    resets: int = 0
    slowest: tuple[float, int, Case | None] = (0.0, 0, None)
    """How long the slowest case took, its number and the case."""

    def add(self, outcome: Outcome) -> None:
        route = outcome.case.route
        self.cases[route] += 1
        seen = self.statuses.setdefault(route, Counter())
        for s in outcome.statuses:
            seen[s] += 1
        self.server_errors += sum(1 for s in outcome.statuses if s >= 500)
        self.hangs += outcome.hang
        self.resets += outcome.reset
        if outcome.problems:
            self.failures.append(outcome)
        if outcome.elapsed_s > self.slowest[0]:
            self.slowest = (outcome.elapsed_s, sum(self.cases.values()), outcome.case)

    def render(self) -> str:
        lines = ["| route | cases | statuses |", "| --- | ---: | --- |"]
        for route in sorted(self.cases):
            seen = ", ".join(f"{s}×{n}" for s, n in sorted(self.statuses.get(route, {}).items()))
            lines.append(f"| {route} | {self.cases[route]} | {seen} |")
        lines.append(f"| all | {sum(self.cases.values())} | |")
        lines.append("")
        lines.append(f"5xx answers: {self.server_errors}; hangs: {self.hangs}; "
                     f"failed cases: {len(self.failures)}; connections reset before an answer: "
                     f"{self.resets}")  # fmt: skip
        elapsed, number, slowest = self.slowest
        if slowest is not None:
            lines.append(f"slowest answer: {elapsed:.3f} s, case {number}: {slowest.summary(2000)}")
        if self.plans:
            ran = ", ".join(f"{k}×{n}" for k, n in self.plans.most_common())
            lines.append(f"plans run: {ran}")
        return "\n".join(lines)


def _split(data: bytes, at: tuple[int, ...]) -> list[bytes]:
    cuts = [0, *(i for i in at if 0 < i < len(data)), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(cuts) if b > a]


class Fuzzer:
    """Sends cases to a `FuzzTarget` from the calling thread (its own event loop), one at a
    time, and tallies them."""

    def __init__(self, target: FuzzTarget, bound_s: float = BOUND_S) -> None:
        self.target = target
        self.bound_s = bound_s
        self.loop = asyncio.new_event_loop()
        self.client = httpx.AsyncClient(base_url=target.url, timeout=bound_s * 3)
        self.stored: list[str] = []
        """Ids of responses the router stored (`STORED` in a case stands for the newest)."""
        self.tally = Tally()
        host, _, port = target.url.removeprefix("http://").partition(":")
        self.address = (host, int(port))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.close()

    def run(self, case: Case) -> Outcome:
        """Send `case`, judge what came back, tally it."""
        outcome = self.loop.run_until_complete(self._run(case))
        self.tally.add(outcome)
        return outcome

    async def _run(self, case: Case) -> Outcome:
        logged = len(self.target.errors.records)
        t0 = time.perf_counter()
        outcome = Outcome(case, [], 0.0, [])
        try:
            async with asyncio.timeout(self.bound_s):
                if case.raw is not None:
                    await self._raw(case, outcome)
                else:
                    await self._http(case, outcome)
        except TimeoutError:
            outcome.hang = True
            outcome.problems.append(f"no answer within {self.bound_s:g} s")
        except httpx.HTTPError as exc:
            outcome.problems.append(f"the connection failed: {exc!r}")
        outcome.elapsed_s = time.perf_counter() - t0
        for record in self.target.errors.records[logged:]:
            outcome.problems.append(f"the router logged an error: {record[:500]}")
        return outcome

    def _stored_id(self) -> str:
        return self.stored[-1] if self.stored else "resp_none"

    async def _http(self, case: Case, outcome: Outcome) -> None:
        sid = self._stored_id()
        path = case.path.replace(STORED, sid)
        body = case.body.replace(STORED.encode(), sid.encode())
        content = body if body or case.method not in ("GET", "DELETE") else None
        async with self.client.stream(
            case.method, path, content=content, headers=list(case.headers)
        ) as resp:
            data = await resp.aread()
        status = resp.status_code
        outcome.statuses.append(status)
        plan = resp.headers.get("x-ownerserve-plan")
        if plan:
            f = parse_plan_header(plan)
            workers = f.get("ran_workers") or f"{f.get('p')}>{f.get('d')}"
            self.tally.plans[f"{f.get('ran') or f.get('action')} {workers}"] += 1
        if status >= 500:
            outcome.problems.append(f"{status}: {data[:300]!r}")
        elif status >= 400:
            problem = error_shape_problem(data, case.shape)
            if problem:
                outcome.problems.append(f"{status}: {problem}")
        elif "text/event-stream" in resp.headers.get("content-type", ""):
            problem = stream_problem(case.route, data)
            if problem:
                outcome.problems.append(problem)
        elif 200 <= status < 300 and case.route != "metrics":
            try:
                answer = json.loads(data)
            except ValueError:
                outcome.problems.append(f"{status} body is not JSON: {data[:200]!r}")
                return
            await self._after(case, path, status, answer, outcome)

    async def _after(
        self, case: Case, path: str, status: int, answer: Any, outcome: Outcome
    ) -> None:
        """Keep what later cases use (stored response ids); undo what would change the
        cluster for them (a worker added, drained or removed)."""
        if case.route == "responses" and isinstance(answer, dict):
            rid = answer.get("id")
            if isinstance(rid, str) and b'"store":false' not in case.body.replace(b" ", b""):
                self.stored = [*self.stored[-31:], rid]
        elif case.route == "responses/{id}" and case.method == "DELETE" and status == 200:
            self.stored = [r for r in self.stored if not path.endswith("/" + r)]
        elif case.route == "admin":
            auth = [("x-admin-token", ADMIN_TOKEN)]
            undo = None
            removed = {f"/admin/workers/{w.worker_id}": w for w in self.target.workers}
            if path == "/admin/workers" and status == 201 and isinstance(answer, dict):
                undo = self.client.delete(f"/admin/workers/{answer['id']}", headers=auth)
            elif path.endswith("/drain") and status == 200 and case.method == "POST":
                undo = self.client.post(path.removesuffix("/drain") + "/undrain", headers=auth)
            elif path in removed and status == 200 and case.method == "DELETE":
                # one of the cluster's own workers: added back, as an operator would
                settings = removed[path].worker_settings()
                undo = self.client.post("/admin/workers", json=settings, headers=auth)
            if undo is not None:
                got = await undo
                if got.status_code not in (200, 201):
                    outcome.problems.append(f"undoing it answered {got.status_code}: {got.text}")

    async def _raw(self, case: Case, outcome: Outcome) -> None:
        assert case.raw is not None
        reader, writer = await asyncio.open_connection(*self.address)
        data = case.raw + (CLOSING_REQUEST if case.complete else b"")
        received = b""
        try:
            try:
                for piece in _split(data, case.pieces):
                    writer.write(piece)
                    await writer.drain()
            except ConnectionError:
                pass  # refused mid-way: what it answered is read below
            if not case.complete:
                return
            chunks = []
            try:
                while chunk := await reader.read(65536):
                    chunks.append(chunk)
            except ConnectionError:
                outcome.reset = not chunks
            received = b"".join(chunks)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        try:
            head = case.raw.split(b" ", 1)[0] == b"HEAD"
            answers = parse_responses(received, head_first=head)
        except ValueError as exc:
            outcome.problems.append(f"the answer is not HTTP: {exc}")
            return
        outcome.statuses.extend(a.status for a in answers)
        if not answers and not outcome.reset:
            outcome.problems.append("the connection closed without an answer")
        for i, a in enumerate(answers):
            if i == 0 and head:
                continue  # a HEAD request's answer has no content to judge
            if a.status >= 500:
                outcome.problems.append(f"{a.status}: {a.body[:300]!r}")
            elif a.status >= 400:
                problem = error_shape_problem(a.body, case.shape)
                if problem:
                    outcome.problems.append(f"{a.status}: {problem}")

    # --- after a run -----------------------------------------------------------------------------

    def after_problems(self) -> list[str]:
        """What is wrong with the router after the cases: a normal chat request (whole and
        streamed) and a Messages request must be served, `/health` must be ok with every
        worker healthy."""
        return self.loop.run_until_complete(self._after_problems())

    async def _after_problems(self) -> list[str]:
        problems: list[str] = []
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        messages = {**chat, "messages": [{"role": "user", "content": "hi"}]}
        async with asyncio.timeout(self.bound_s * 3):
            r = await self.client.post("/v1/chat/completions", json=chat)
            if r.status_code != 200 or not r.json().get("choices"):
                problems.append(f"a normal chat request got {r.status_code}: {r.text[:300]}")
            r = await self.client.post("/v1/chat/completions", json={**chat, "stream": True})
            if r.status_code != 200 or stream_problem("chat", r.content):
                problems.append(f"a streamed chat request got {r.status_code}: {r.text[-300:]}")
            r = await self.client.post("/v1/messages", json=messages)
            if r.status_code != 200 or r.json().get("type") != "message":
                problems.append(f"a Messages request got {r.status_code}: {r.text[:300]}")
            total = len(self.target.workers)
            deadline = time.monotonic() + self.bound_s
            while True:  # a worker added back is healthy at the router's next health check
                r = await self.client.get("/health")
                health = r.json()
                every = health.get("workers") == {"total": total, "healthy": total}
                if every or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            if r.status_code != 200 or health.get("status") != "ok":
                problems.append(f"/health answered {r.status_code}: {r.text}")
            elif not every:
                problems.append(f"/health counts workers {health['workers']}")
        return problems

    def held(self) -> list[str]:
        """What the router's requests still hold (empty when all was given back): open
        leases, per worker in-flight requests and queued tokens, queued admissions."""

        def read() -> list[str]:
            router = self.target.router
            assert router is not None
            found = [f"{router.leases.open} open request leases"] if router.leases.open else []
            for w in router.pool.all():
                held = (w.inflight, w.inflight_prefill_tokens, w.inflight_kv_tokens)
                if any(held):
                    found.append(f"{w.worker_id}: in flight, prefill tokens, KV tokens {held}")
            if router.admission.queued:
                found.append(f"{router.admission.queued} requests in the admission queue")
            return found

        return self.target.call(read)

    def workers_busy(self) -> list[str]:
        """`busy_workers`, from outside the fuzzer's event loop."""
        return self.loop.run_until_complete(self.busy_workers())

    async def busy_workers(self) -> list[str]:
        """The emulated workers that still run or queue requests (their own metrics)."""
        busy = []
        async with httpx.AsyncClient(timeout=10.0) as client:
            for w in self.target.workers:
                text = (await client.get(w.url + "/metrics")).text
                n = 0.0
                for line in text.splitlines():
                    if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                        n += float(line.rsplit(" ", 1)[1])
                if n:
                    busy.append(f"{w.worker_id}: {n:g} requests running or waiting")
        return busy

    def wait(self, what: Callable[[], list[str]], timeout_s: float = 30.0) -> list[str]:
        """`what()` polled until it is empty, for at most `timeout_s`; what it last said."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = what()
            if not left or time.monotonic() > deadline:
                return left
            self.loop.run_until_complete(asyncio.sleep(0.05))
