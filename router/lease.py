"""`RequestLease`: everything one request holds while it runs, each taken at the moment of the
request's life that needs it and given back exactly once on every path (answered, failed,
retried on another worker, run colocated after a hand-over given up, timed out, its client
gone, cancelled). The runner (`router.pipeline`) owns one per request, from `tokenize` on:

- `session_joined` (the request is viewed): its session's in-flight count, so that another
  request of the session that starts meanwhile is a fork. Given back by `close`.
- `plan_started` (each attempt, right before its plan runs): in flight on the plan's prefill
  and decode workers; its prompt tokens as queued prefill on the prefill worker and as KV on
  the decode worker (the planner's views show them before the workers' gauges catch up); its
  prompt in the decode worker's admission working set (`Admission.sent`); its session's KV in
  the decode worker's sessions' working set (`WorkingSets.started`: from now, not from the
  first byte, so that a new session admitted meanwhile sees this KV where its prefill is
  filling); the plan's KV transfer queued on its source node's NIC (`NicLedger.reserve`).
  Given back by `plan_opened` (all but the sessions' working set, which the answer keeps, and
  the NIC's queue once the KV moves) or `plan_failed` (all: the next attempt takes it again).
- `answer_started` (the final response opened): in flight on the workers it opened on; its
  prompt as KV on the worker streaming the answer and in that worker's admission working set
  (`Admission.streaming`). Given back by `answer_ended`, or by `answer_cut` when the worker
  failed mid-stream and the answer continues on another (a migration, `router.migration`):
  then the continuation's attempts run `plan_started` ... `answer_started` again, the session's
  KV moving with them to the new worker (`WorkingSets.moved`), so every hold moves from the
  failed worker to the new one once.
- `close` (the request is over, however it ended): what is still held, then its session's KV
  in the sessions' working set — kept there with prompt and output tokens while its predicted
  gap is short for an answer (`WorkingSets.ended`), only out of flight for a failure
  (`WorkingSets.failed`) — then its session's in-flight count.

A queued request's reservation on a worker's working set is taken and given back by
`Admission.wait` itself (released from the queue, a request is planned and sent with no wait
in between): the lease holds nothing for it.

`LeaseLedger` counts the router's open leases, for `close` to report and tests to wait on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

from ownerserve.directory.base import Match
from planner.types import Action, Plan
from planner.workingset import WorkingSets
from router.admission import Admission, WorkingSet
from router.answers import output_tokens, tool_answered, tool_called
from router.executor import OpenedResponse
from router.links import NicLedger
from router.pool import WorkerPool, WorkerState
from router.prompt import Prompt
from router.session import SessionInfo

_NO_WORKERS: tuple[WorkerState, ...] = ()


class LeaseLedger:
    """How many requests hold a `RequestLease` now (`open`), and a wait until none does."""

    __slots__ = ("_idle", "open")

    def __init__(self) -> None:
        self.open = 0
        self._idle: list[asyncio.Future[None]] = []

    def opened(self) -> None:
        self.open += 1

    def closed(self) -> None:
        self.open -= 1
        if not self.open and self._idle:
            for waiter in self._idle:
                if not waiter.done():
                    waiter.set_result(None)
            self._idle.clear()

    async def settled(self) -> None:
        """Return once no lease is open (the caller bounds the wait)."""
        while self.open:
            waiter = asyncio.get_running_loop().create_future()
            self._idle.append(waiter)
            await waiter


@dataclass(frozen=True, slots=True)
class LeaseServices:
    """What a lease counts in: the ledger of open leases, the pool's workers, admission's and
    the sessions' working sets, the nodes' NICs."""

    ledger: LeaseLedger
    pool: WorkerPool
    admission: Admission
    working_sets: WorkingSets
    nics: NicLedger


class RequestLease:
    """What one request holds (see the module docstring); a context manager whose exit is
    `close`."""

    __slots__ = (
        "_charge",
        "_events",
        "_info",
        "_kv",
        "_kv_counted",
        "_nic",
        "_opened",
        "_prefill",
        "_prompt",
        "_services",
        "_streaming_on",
        "_tokens",
        "_workers",
    )

    def __init__(self, services: LeaseServices, prompt: Prompt) -> None:
        self._services = services
        self._prompt = prompt
        self._info: SessionInfo | None = None
        self._workers: Sequence[WorkerState] = _NO_WORKERS
        """Where the request is counted in flight now (the plan's or the answer's)."""
        self._prefill: WorkerState | None = None
        self._kv: WorkerState | None = None
        self._charge: WorkingSet | None = None
        """The admission working set its prompt counts in now."""
        self._streaming_on: WorkerState | None = None
        """The worker streaming the answer, while the holds are the answer's."""
        self._nic: tuple[str, float] | None = None
        self._kv_counted = False
        """Its session's KV counts in the sessions' working set."""
        self._opened: OpenedResponse | None = None
        self._events = 0
        self._tokens = prompt.tokens
        """The KV its holds count: the prompt's, and the answer so far after a migration."""

    def __enter__(self) -> RequestLease:
        self._services.ledger.opened()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- the request's life, in order -------------------------------------------------------

    def session_joined(self, info: SessionInfo | None) -> None:
        """The request is viewed: count it in flight in its session (`info`; nothing for a
        request without one) until `close`."""
        if info is not None:
            info.inflight += 1
            self._info = info

    def plan_started(self, plan: Plan, match: Match) -> None:
        """`plan` is about to run (an attempt): take its NIC transfer, its in-flight counts
        and prompt tokens, its admission charge and its session's KV in the working set, until
        `plan_opened` or `plan_failed`."""
        s = self._services
        pool = s.pool
        chosen = plan.chosen
        seconds = chosen.cost.t_nic
        if seconds > 0:
            src = (
                chosen.prefill_worker
                if chosen.action is Action.REMOTE_PREFILL
                else chosen.source_worker
            )
            state = pool.get(src) if src else None
            if state is not None:
                node = state.settings.node
                s.nics.reserve(node, seconds, time.monotonic())
                self._nic = (node, seconds)
        prefill_id, decode_id = chosen.prefill_worker, chosen.decode_worker
        prefill = pool.get(prefill_id)
        decode = pool.get(decode_id)
        # in flight once on each worker the plan involves (P and D may be one worker)
        workers = [w for w in (prefill, decode if decode is not prefill else None) if w is not None]
        tokens = self._tokens
        for w in workers:
            w.inflight += 1
        if prefill is not None:
            prefill.inflight_prefill_tokens += tokens
        if decode is not None:
            decode.inflight_kv_tokens += tokens
        self._workers = workers
        self._prefill = prefill
        self._kv = decode
        admission = s.admission
        if admission.enabled:
            self._charge = admission.sent(decode_id, tokens)
        prompt = self._prompt
        sid = prompt.session.session_id
        if sid is None:
            return
        ws = s.working_sets
        if self._kv_counted:  # a continuation (`answer_cut`): the session's KV moves with it
            ws.moved(sid, decode_id, tokens)
        else:
            now = time.monotonic()
            ws.started(sid, decode_id, tokens, now, tool_answered(prompt.req.messages))
        parent = prompt.session.parent
        if parent is not None:
            ws.shares(sid, parent, match.longest(decode_id) * prompt.block_size)
        self._kv_counted = True

    def plan_opened(self, opened: OpenedResponse) -> None:
        """The plan's final response opened: its holds go (its prompt's KV now counts with
        the answer, `answer_started`) but for the session's KV in the working set, and the
        NIC's queue, unless a hand-over was given up (no KV moved)."""
        if opened.fallback is None:
            self._nic = None  # its KV moves (or has moved)
        self._plan_given_back()
        self._opened = opened

    def plan_failed(self) -> None:
        """The plan failed before the first byte: everything it took goes; the next attempt
        takes it again."""
        self._kv_ended()
        self._plan_given_back()

    def answer_started(self, opened: OpenedResponse) -> None:
        """The answer streams from `opened.final_worker`: count it in flight on the workers
        it opened on, its prompt as KV there and in that worker's admission working set,
        until `answer_ended`."""
        worker = opened.final_worker
        workers = opened.workers
        for w in workers:
            w.inflight += 1
        worker.inflight_kv_tokens += self._tokens
        self._workers = workers
        self._kv = worker
        self._streaming_on = worker
        self._opened = opened
        admission = self._services.admission
        if admission.enabled:
            self._charge = admission.streaming(worker, self._tokens)

    def answer_ended(self, output_events: int) -> None:
        """The answer is over (sent whole or streamed, or cut short): its holds go;
        `output_events` says how much of a streamed one the client got."""
        self._events = output_events
        worker = self._streaming_on
        if worker is None:
            return
        self._streaming_on = None
        tokens = self._tokens
        for w in self._workers:
            w.inflight -= 1
        worker.inflight_kv_tokens -= tokens
        self._workers = _NO_WORKERS
        self._kv = None
        charge = self._charge
        if charge is not None:
            self._charge = None
            self._services.admission.ended(worker, charge, tokens)

    def answer_cut(self, tokens: int) -> None:
        """The worker streaming the answer failed mid-stream and the answer is to continue on
        another (`router.migration`): its answer's holds go now, and what the continuation's
        attempts take counts `tokens` of KV (the prompt and the answer so far); the session's
        KV stays counted, to move with the continuation's plan (`plan_started`), or to leave
        as a failure's should no worker take it over."""
        self.answer_ended(self._events)
        self._opened = None
        self._tokens = tokens

    def close(self) -> None:
        """The request is over: give back whatever it still holds (see the module docstring),
        in the order the moments above give them back."""
        try:
            if self._streaming_on is not None:
                self.answer_ended(self._events)
            else:
                self._plan_given_back()
            self._kv_ended()
            info = self._info
            if info is not None:
                self._info = None
                info.inflight -= 1
        finally:
            self._services.ledger.closed()

    # --- internals ----------------------------------------------------------------------------

    def _plan_given_back(self) -> None:
        nic = self._nic
        if nic is not None:
            self._nic = None
            self._services.nics.release(nic[0], nic[1], time.monotonic())
        tokens = self._tokens
        for w in self._workers:
            w.inflight -= 1
        prefill = self._prefill
        if prefill is not None:
            prefill.inflight_prefill_tokens -= tokens
        kv = self._kv
        if kv is not None:
            kv.inflight_kv_tokens -= tokens
        self._workers = _NO_WORKERS
        self._prefill = None
        self._kv = None
        charge = self._charge
        if charge is not None:
            self._charge = None
            self._services.admission.unsent(charge, tokens)

    def _kv_ended(self) -> None:
        """Its session's KV stops counting as in flight: an answered request's stays in the
        working set with prompt and output tokens while its predicted gap is short (a whole
        answer that calls a tool names it); a failed one's only leaves flight."""
        if not self._kv_counted:
            return
        self._kv_counted = False
        prompt = self._prompt
        sid = prompt.session.session_id
        assert sid is not None
        ws = self._services.working_sets
        now = time.monotonic()
        opened = self._opened
        streamed = prompt.req.stream
        output = output_tokens(opened, streamed, self._events)
        if output is None:
            ws.failed(sid, now)
            return
        assert opened is not None
        tool = None if streamed else tool_called(opened.first)
        ws.ended(sid, prompt.tokens + output, now, tool)
