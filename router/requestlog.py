"""One log line per request, for operators: `RequestLog` gathers what the request path learns
of a request (its id, session, plan, tokens, timings, how it ended) and `emit` writes it once,
when the request ends, as one logfmt line at INFO on the `ownerserve.requests` logger; and the
request id every answer carries in `x-request-id` (the client's, sanitised, or a new one).

    rid=9f3c... model=m session=s1 class=decode_continuation action=colocated decode=h0
    prompt_tokens=812 reused_tokens=800 output_tokens=40 queued_s=0.0000 ttft_s=0.0123
    e2e_s=0.4012 status=200 outcome=ok

(one line; a key without a value is left out, a value with spaces, quotes or `=` is quoted)."""

from __future__ import annotations

import logging
import os
import re
from typing import Literal

import orjson

from ownerserve.errors import OwnerServeError
from planner.types import Plan
from router.plans import Fallback

REQUEST_LOGGER = "ownerserve.requests"
"""The logger of the per-request lines (INFO): an operator can leave it on while the rest of
the router logs at WARNING (`ownerserve serve --request-log-level`)."""
REQUEST_ID_HEADER = b"x-request-id"
MAX_REQUEST_ID_CHARS = 128
"""A client's request id is cut to this many characters (of `_ID_CHARS`)."""
MAX_VALUE_CHARS = 256
"""A logged value longer than this (a client's session id) is cut to it."""

_NOT_ID_CHARS = re.compile(r"[^A-Za-z0-9._:@+=/-]")
"""What a request id may not hold: it is echoed in a header and logged unquoted."""
_PLAIN = re.compile(r'[^\s"=\\]+')
"""A logfmt value that needs no quotes."""

log = logging.getLogger(REQUEST_LOGGER)

Outcome = Literal["ok", "refused", "error", "cancelled"]
"""How a request ended: `ok` (answered whole), `refused` (a 4xx: the router's or the
worker's, 429 included), `error` (a 5xx, or a stream its worker failed mid-way), `cancelled`
(the client went away, or the request's task was cancelled)."""


def request_id(given: str | None) -> str:
    """The request's id: the client's `x-request-id` without what `_NOT_ID_CHARS` excludes,
    cut to `MAX_REQUEST_ID_CHARS`; a new random one when the client sent none (or nothing of
    it was left)."""
    if given:
        rid = _NOT_ID_CHARS.sub("", given[: 4 * MAX_REQUEST_ID_CHARS])[:MAX_REQUEST_ID_CHARS]
        if rid:
            return rid
    return os.urandom(16).hex()


def logfmt_value(value: str) -> str:
    """`value` as a logfmt value: as is when it holds no space, quote, backslash or `=`,
    else JSON-quoted; cut to `MAX_VALUE_CHARS` first."""
    if len(value) > MAX_VALUE_CHARS:
        value = value[:MAX_VALUE_CHARS]
    if _PLAIN.fullmatch(value):
        return value
    return orjson.dumps(value).decode()


def error_name(exc: BaseException) -> str:
    """The error's name in the log line: its OpenAI `code` when it has one, else its `type`
    (`internal_error` for an exception that is not ours)."""
    if isinstance(exc, OwnerServeError):
        return exc.code or exc.error_type
    return "internal_error"


class RequestLog:
    """What the log line of one request says, filled in by the request path as it learns it
    (`router.pipeline.respond`); `emit` writes it, once."""

    __slots__ = (
        "action",
        "decode",
        "emitted",
        "error",
        "fallback",
        "model",
        "outcome",
        "output_tokens",
        "prefill",
        "prompt_tokens",
        "queued_s",
        "request_class",
        "reused_tokens",
        "rid",
        "session",
        "source",
        "status",
        "ttft_s",
        "worker",
    )

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.model: str | None = None
        self.session: str | None = None
        self.request_class: str | None = None
        self.action: str | None = None
        self.prefill: str | None = None
        self.decode: str | None = None
        self.source: str | None = None
        self.worker: str | None = None
        """The worker that ended the answer, when not its decode worker (it moved mid-stream)."""
        self.prompt_tokens: int | None = None
        self.reused_tokens: int | None = None
        """The prompt tokens the plan as it ran reused (KV cached or fetched, not computed)."""
        self.output_tokens: int | None = None
        self.queued_s: float | None = None
        self.ttft_s: float | None = None
        self.status: int | None = None
        """The HTTP status the client got (499: it went away before any)."""
        self.outcome: Outcome | None = None
        self.error: str | None = None
        self.fallback: Fallback | None = None
        self.emitted = False

    # --- what the request path learns, in the order it learns it ---------------------------

    def planned(self, ran: Plan, block_size: int, prompt_tokens: int) -> None:
        """The plan the request's answer runs on (as it ran: a hand-over given up shows its
        colocated run)."""
        c = ran.chosen
        self.request_class = ran.request_class.value
        self.action = c.action.value
        self.prefill = c.prefill_worker
        self.decode = c.decode_worker
        self.source = c.source_worker
        self.reused_tokens = min(c.reused_blocks * block_size, prompt_tokens)

    def answered(self, status: int, whole: bool) -> None:
        """The worker's answer reached the client: `status`, and whether it came whole."""
        self.status = status
        if status >= 500:
            self.outcome, self.error = "error", "worker_error"
        elif status >= 400:
            self.outcome, self.error = "refused", "worker_refused"
        elif whole:
            self.outcome = "ok"
        else:
            self.outcome, self.error = "error", "stream_failed"

    def failed(self, status: int, exc: BaseException, started: bool) -> None:
        """The router ended the request with `exc` (`status`; sent unless the response had
        `started`, whose status the client already got)."""
        if not started or self.status is None:
            self.status = status
        self.outcome = "refused" if status < 500 else "error"
        self.error = error_name(exc)

    def cancelled(self, started: bool) -> None:
        """The client went away (or the request's task was cancelled)."""
        if not started or self.status is None:
            self.status = 499
        self.outcome = "cancelled"

    # --- the line ---------------------------------------------------------------------------

    def line(self, e2e_s: float) -> str:
        """The logfmt line (`e2e_s`: seconds from the request's bytes to its end)."""
        v = logfmt_value
        parts = [f"rid={self.rid}"]
        if self.model is not None:
            parts.append(f"model={v(self.model)}")
        if self.session is not None:
            parts.append(f"session={v(self.session)}")
        if self.request_class is not None:
            parts.append(f"class={self.request_class} action={self.action}")
        for key, worker in (
            ("prefill", self.prefill),
            ("decode", self.decode),
            ("source", self.source),
            ("worker", self.worker),
        ):
            if worker is not None:
                parts.append(f"{key}={worker}")  # worker ids need no quotes (WORKER_ID_PATTERN)
        for key, n in (
            ("prompt_tokens", self.prompt_tokens),
            ("reused_tokens", self.reused_tokens),
            ("output_tokens", self.output_tokens),
        ):
            if n is not None:
                parts.append(f"{key}={n}")
        if self.queued_s is not None:
            parts.append(f"queued_s={self.queued_s:.4f}")
        if self.ttft_s is not None:
            parts.append(f"ttft_s={self.ttft_s:.4f}")
        parts.append(f"e2e_s={e2e_s:.4f} status={self.status or 500}")
        parts.append(f"outcome={self.outcome or 'error'}")
        if self.error is not None:
            parts.append(f"error={v(self.error)}")
        fb = self.fallback
        if fb is not None:
            parts.append(f"fallback={fb.ran} fallback_reason={fb.reason}")
        return " ".join(parts)

    def emit(self, e2e_s: float) -> None:
        """Write the line, at INFO on `ownerserve.requests` (built only when that logs); a
        second call writes nothing."""
        if self.emitted:
            return
        self.emitted = True
        if log.isEnabledFor(logging.INFO):
            log.info(self.line(e2e_s))


def log_refused(rid: str, status: int, exc: BaseException, e2e_s: float) -> None:
    """The line of a request the HTTP server refused before the request path saw it (408,
    411, 413, 431, an upgrade's 400): its id, status, outcome and error."""
    record = RequestLog(rid)
    record.status = status
    record.outcome = "refused" if status < 500 else "error"
    record.error = error_name(exc)
    record.emit(e2e_s)


def parse_logfmt(line: str) -> dict[str, str]:
    """The keys and values of a logfmt line as `RequestLog.line` writes it (quoted values
    unquoted): for tests and for tools that read the log."""
    out: dict[str, str] = {}
    i, n = 0, len(line)
    while i < n:
        while i < n and line[i] == " ":
            i += 1
        j = line.find("=", i)
        if j < 0:
            break
        key = line[i:j]
        i = j + 1
        if i < n and line[i] == '"':
            # a JSON string: find its closing quote, skipping escaped characters
            k = i + 1
            while k < n and line[k] != '"':
                k += 2 if line[k] == "\\" else 1
            out[key] = orjson.loads(line[i : k + 1])
            i = k + 1
        else:
            k = line.find(" ", i)
            k = n if k < 0 else k
            out[key] = line[i:k]
            i = k
    return out
