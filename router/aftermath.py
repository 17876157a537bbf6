"""What follows an answer: the `commit` stage (ownership into the directory, the chunk holders
of a chunked prompt, a hot prefix's replica when the plan asks for one), then `observe`
(metrics, calibration), the prompt's prefix reuse (`record_reuse`) and the session's attained
service (`record_service`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ownerserve.directory.base import Lease, Match
from ownerserve.errors import OwnerServeError
from ownerserve.records import fast_init
from ownerserve.types import Tier
from planner.calibration import predicted_ttft_s
from planner.explain import deciding_term
from planner.types import Plan
from router.commit import commit_plan
from router.executor import FetchSpec
from router.plans import Fallback
from router.prompt import Prompt
from router.services import CommitServices, ObserveServices
from router.session import SessionInfo

log = logging.getLogger(__name__)

REPLICA_TTL_S = 30.0
"""Lifetime of the record of the transient prefill-side copy after a remote prefill."""
CHUNK_TTL_S = 120.0
"""Lifetime of the record that a worker holds a chunk's KV (renewed by each request that
uses the chunk there): its chunk store is an LRU, so an unused chunk may be gone sooner — a
stale record only misprices (the worker computes a chunk it no longer holds)."""


@fast_init
@dataclass(frozen=True, slots=True)
class ServedRequest:
    """One served request as its commit needs it (`router.commit.Served`)."""

    plan: Plan
    chain: Sequence[int]
    session_id: str | None
    match: Match
    kv_bytes_per_block: int
    fork_from_blocks: int
    refresh: bool


async def after_first_bytes(svc: CommitServices, plan: Plan, prompt: Prompt, match: Match) -> None:
    """The answer is there: commit ownership (inline with the in-process directory, whose
    calls never wait, so a client's next turn always sees it; concurrently with the
    response otherwise) and start a replica copy if the plan asked for one."""
    if svc.inline:
        await commit(svc, plan, prompt, match)
    else:
        svc.pending.add(prompt.session.session_id, svc.spawn(commit(svc, plan, prompt, match)))
    if prompt.chunks is not None:
        if svc.inline:
            await record_chunks(svc, plan, prompt)
        else:
            svc.spawn(record_chunks(svc, plan, prompt))
    target = plan.add_replica_on
    if target and match.owner and match.owner_blocks:
        svc.spawn(replicate(svc, target, prompt, match))


async def commit(svc: CommitServices, plan: Plan, prompt: Prompt, match: Match) -> None:
    """The decode worker now holds the prompt's KV: it owns the newly sealed blocks, it is
    the session's decode owner, and a remote prefill left a transient copy on P. A failure
    is counted and logged; the answer stands."""
    directory = svc.directory
    if directory is None:
        return
    # rewrite unchanged records (session owner, leases, replicas) only every quarter of
    # their lifetime; what changed is always written
    sid = prompt.session.session_id
    info = svc.sessions.get(sid)
    if info is None:
        refresh = True
    else:
        now = time.monotonic()
        refresh = now - info.committed_at >= svc.refresh_period_s
        if refresh:
            info.committed_at = now
    tok = prompt.tok
    served = ServedRequest(
        plan,
        tok.chain,
        sid,
        match,
        svc.kv_bytes_per_token * prompt.block_size,
        tok.common_blocks if prompt.is_fork else 0,
        refresh,
    )
    try:
        with svc.span("ownerserve.directory.commit"):
            lease = await commit_plan(directory, served, svc.lifetimes, concurrent=not svc.inline)
        decode = svc.pool.get(plan.chosen.decode_worker)
        if decode is not None and tok.chain:
            decode.note_commit(tok.chain[-1], time.time())  # its KV events may lag this
            if lease is not None and not decode.settings.kv_events_endpoint:
                held_for(svc, decode.worker_id, lease, len(tok.chain), match)
    except OwnerServeError as exc:
        svc.errors.inc()
        log.warning("directory commit failed: %s", exc)
    except Exception:
        svc.errors.inc()
        log.exception("directory commit failed")


def held_for(svc: CommitServices, worker: str, lease: Lease, blocks: int, match: Match) -> None:
    """A commit of a prompt of `blocks` blocks on `worker`, which publishes no KV events, got
    `lease`: the KV the router holds there (`CommittedLeases`) takes the blocks its claim
    covered (those past the prefix `match` found owned), or keeps a renewed lease's count.
    Another worker's lease (it owned the blocks already) is not this worker's."""
    if lease.worker != worker:
        return
    owned = min(match.owner_blocks, blocks) if match.owner is not None else 0
    svc.committed.held(lease, blocks - owned if owned < blocks else None)


async def record_chunks(svc: CommitServices, plan: Plan, prompt: Prompt) -> None:
    """Chunk reuse: the plan's prefill worker computed or copied every chunk of the prompt and
    its chunk store keeps them, so the directory records it as a holder of each — a one-block
    read-only replica keyed by the chunk's content hash (`Directory.add_replica`), expiring
    after `CHUNK_TTL_S`. A failure is counted and logged; the answer stands."""
    directory = svc.directory
    chunks = prompt.chunks
    if directory is None or chunks is None:
        return
    worker = plan.chosen.prefill_worker
    try:
        await asyncio.gather(
            *(
                directory.add_replica(c.hash, worker, Tier.GPU, CHUNK_TTL_S, True, (c.hash,))
                for c in chunks.chunks
            )
        )
    except Exception as exc:
        svc.errors.inc()
        log.warning("recording chunk holders failed: %r", exc)


async def replicate(svc: CommitServices, target: str, prompt: Prompt, match: Match) -> None:
    """The hot-spot rule (planner/README.md): the plan asked for a read-only replica of the
    owner's prefix on `target`; copy it there and record it."""
    worker = svc.pool.get(target)
    owner = match.owner
    executor, directory = svc.executor, svc.directory
    if worker is None or owner is None or executor is None or directory is None:
        return
    tok = prompt.tok
    blocks = min(match.owner_blocks, len(tok.chain))
    spec = FetchSpec(tuple(tok.chain[:blocks]), tok.token_ids, prompt.block_size)
    with svc.span("ownerserve.transfer", source=owner, to=target):
        got = min(blocks, await executor.fetch(worker, owner, prompt.req, spec))
    if got > 0:
        await directory.add_replica(
            tok.chain[got - 1], target, Tier.GPU, svc.lifetimes.lease_s, True, tok.chain[:got]
        )


def observe(
    svc: ObserveServices,
    plan: Plan,
    match: Match,
    fallback: Fallback | None,
    ok: bool,
    ttft_s: float | None,
    tpot_s: float | None,
    e2e_s: float,
    transfer_s: float | None,
    queued_s: float = 0.0,
) -> None:
    """Count the plan's action and owner lookup; for a served answer, record its TTFT, TPOT,
    end-to-end and transfer times and feed them to the calibrator (not after a `fallback`:
    its timings include the hops given up). `ttft_s` runs from the request's arrival (what
    the client saw, and the metric); the calibrator gets it less `queued_s`, the seconds
    admission held the request before it was planned: that wait is not the worker's, and
    learnt as its prefill scale it would push traffic off a worker for the router's queue."""
    m = svc.metrics
    action = plan.action.value
    m.of(m.actions, plan.policy, action).inc()
    m.of(m.decisions, plan.request_class.value, action, deciding_term(plan)).inc()
    if plan.runner_up is not None and plan.margin_s >= 0.0:
        m.of(m.margin, action).observe(plan.margin_s)
    if match.owner is not None:
        used = match.owner in (plan.chosen.decode_worker, plan.chosen.source_worker)
        m.of(m.owner_lookups, "hit" if used else "miss").inc()
    else:
        m.of(m.owner_lookups, "none").inc()
    if not ok:
        return
    if ttft_s is not None:
        m.of(m.ttft, action).observe(ttft_s)
    if tpot_s is not None:
        m.of(m.tpot, action).observe(tpot_s)
    m.of(m.e2e, action).observe(e2e_s)
    if transfer_s is not None:
        m.of(m.transfer, action).observe(transfer_s)
    if fallback is None:
        if ttft_s is not None and queued_s > 0.0:
            ttft_s -= queued_s
        cost = plan.chosen.cost
        if ttft_s is not None and (predicted := predicted_ttft_s(cost)) > 0.0:
            m.of(m.prediction, "ttft", action).observe(ttft_s / predicted)
        if tpot_s is not None and cost.t_decode_step > 0.0:
            m.of(m.prediction, "tpot", action).observe(tpot_s / cost.t_decode_step)
        svc.calibrator.observe_plan(plan, ttft_s=ttft_s, tpot_s=tpot_s, transfer_s=transfer_s)


def record_reuse(
    svc: ObserveServices,
    model: str,
    plan: Plan,
    match: Match,
    prompt_tokens: int,
    block_size: int,
    delivered: int | None,
) -> None:
    """Count an answered request's prompt and its prefix reuse in
    `ownerserve_prefix_tokens_total`, under the worker that ran its prefill (`plan`: the plan
    as it ran): the prompt; the longest prefix its directory lookup (`match`, the one the
    request made) found held anywhere; what the plan expected that worker to reuse; and what
    the worker reported cached (`delivered`, with the prompt as `reported`; nothing when its
    answer did not say). Each capped at the prompt; no directory call, no scan but the
    match's holdings."""
    c = plan.chosen
    prompt, available, predicted, cached, reported = svc.metrics.prefix_tokens_of(
        model, c.prefill_worker
    )
    held = 0
    for h in match.holdings:
        if h.blocks > held:
            held = h.blocks
    prompt.inc(prompt_tokens)
    available.inc(min(held * block_size, prompt_tokens))
    predicted.inc(min(c.reused_blocks * block_size, prompt_tokens))
    if delivered is not None:
        cached.inc(min(delivered, prompt_tokens))
        reported.inc(prompt_tokens)


def tpot(ttft_s: float | None, e2e_s: float, output_events: int) -> float | None:
    """Seconds per output event after the first (None without two of them)."""
    if ttft_s is None or output_events < 2:
        return None
    return (e2e_s - ttft_s) / (output_events - 1)


def record_service(info: SessionInfo | None, prompt_tokens: int, output: int | None) -> None:
    """Add an answered request's prompt and `output` tokens to its session's attained service
    (`info`: nothing without a session, or for a request not answered)."""
    if info is None or output is None:
        return
    info.attained_tokens += prompt_tokens + output
