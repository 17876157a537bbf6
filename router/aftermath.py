"""What follows an answer: commit ownership to the directory, copy a hot prefix to a replica
when the plan asks for one, and observe the request (metrics, calibration)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from ownerserve.errors import OwnerServeError
from ownerserve.types import Tier
from router.commit import commit_plan
from router.executor import FetchSpec

if TYPE_CHECKING:
    from router.pipeline import RequestContext

log = logging.getLogger(__name__)

REPLICA_TTL_S = 30.0
"""Lifetime of the record of the transient prefill-side copy after a remote prefill."""
CHUNK_TTL_S = 120.0
"""Lifetime of the record that a worker holds a chunk's KV (renewed by each request that
uses the chunk there): its chunk store is an LRU, so an unused chunk may be gone sooner — a
stale record only misprices (the worker computes a chunk it no longer holds)."""


async def after_first_bytes(ctx: RequestContext) -> None:
    """The answer is there: commit ownership (inline with the in-process directory, whose
    calls never wait, so a client's next turn always sees it; concurrently with the
    response otherwise) and start a replica copy if the plan asked for one."""
    router = ctx.router
    if router.inline_commit:
        await commit(ctx)
    else:
        router.spawn(commit(ctx))
    if ctx.chunks is not None:
        if router.inline_commit:
            await record_chunks(ctx)
        else:
            router.spawn(record_chunks(ctx))
    target = ctx.plan.add_replica_on
    match = ctx.match
    if target and match.owner and match.owner_blocks:
        router.spawn(replicate(ctx, target))


async def commit(ctx: RequestContext) -> None:
    """The decode worker now holds the prompt's KV: it owns the newly sealed blocks, it is
    the session's decode owner, and a remote prefill left a transient copy on P. A failure
    is counted and logged; the answer stands."""
    router = ctx.router
    directory = router.directory
    if directory is None:
        return
    # rewrite unchanged records (session owner, leases, replicas) only every quarter of
    # their lifetime; what changed is always written
    info = router.sessions.get(ctx.session.session_id)
    if info is None:
        ctx.refresh = True
    else:
        now = time.monotonic()
        ctx.refresh = now - info.committed_at >= router.refresh_period_s
        if ctx.refresh:
            info.committed_at = now
    try:
        with router.telemetry.start_span("ownerserve.directory.commit"):
            await commit_plan(directory, ctx, router.lifetimes, concurrent=not router.inline_commit)
    except OwnerServeError as exc:
        router.metrics.commit_errors.inc()
        log.warning("directory commit failed: %s", exc)
    except Exception:
        router.metrics.commit_errors.inc()
        log.exception("directory commit failed")


async def record_chunks(ctx: RequestContext) -> None:
    """Chunk reuse: the plan's prefill worker computed or copied every chunk of the prompt and
    its chunk store keeps them, so the directory records it as a holder of each — a one-block
    read-only replica keyed by the chunk's content hash (`Directory.add_replica`), expiring
    after `CHUNK_TTL_S`. A failure is counted and logged; the answer stands."""
    router = ctx.router
    directory = router.directory
    chunks = ctx.chunks
    if directory is None or chunks is None:
        return
    worker = ctx.plan.chosen.prefill_worker
    try:
        await asyncio.gather(
            *(
                directory.add_replica(c.hash, worker, Tier.GPU, CHUNK_TTL_S, True, (c.hash,))
                for c in chunks.chunks
            )
        )
    except Exception as exc:
        router.metrics.commit_errors.inc()
        log.warning("recording chunk holders failed: %r", exc)


async def replicate(ctx: RequestContext, target: str) -> None:
    """The hot-spot rule (planner/README.md): the plan asked for a read-only replica of the
    owner's prefix on `target`; copy it there and record it."""
    router = ctx.router
    worker = router.pool.get(target)
    match, tok = ctx.match, ctx.tok
    owner = match.owner
    if worker is None or owner is None or router.executor is None or router.directory is None:
        return
    blocks = min(match.owner_blocks, len(tok.chain))
    spec = FetchSpec(tuple(tok.chain[:blocks]), tok.token_ids, ctx.rview.block_size)
    with router.telemetry.start_span("ownerserve.transfer", source=owner, to=target):
        got = min(blocks, await router.executor.fetch(worker, owner, ctx.req, spec))
    if got > 0:
        await router.directory.add_replica(
            tok.chain[got - 1], target, Tier.GPU, router.lifetimes.lease_s,
            True, tok.chain[:got],
        )  # fmt: skip


def observe(ctx: RequestContext, ok: bool) -> None:
    """Count the plan's action and owner lookup; for a served answer, record its TTFT, TPOT,
    end-to-end and transfer times and feed them to the calibrator."""
    m = ctx.router.metrics
    plan, match = ctx.plan, ctx.match
    action = plan.action.value
    m.of(m.actions, plan.policy, action).inc()
    if match.owner is not None:
        used = match.owner in (plan.chosen.decode_worker, plan.chosen.source_worker)
        m.of(m.owner_lookups, "hit" if used else "miss").inc()
    else:
        m.of(m.owner_lookups, "none").inc()
    if not ok:
        return
    ttft = ctx.ttft_s
    if ttft is not None:
        m.of(m.ttft, action).observe(ttft)
    tpot = ctx.tpot_s
    if tpot is not None:
        m.of(m.tpot, action).observe(tpot)
    m.of(m.e2e, action).observe(ctx.e2e_s)
    transfer = ctx.transfer_s
    if transfer is not None:
        m.of(m.transfer, action).observe(transfer)
    if ctx.fallback is None:
        # after a fallback the timings include the hops given up: not the plan's to learn from
        ctx.router.calibrator.observe_plan(plan, ttft_s=ttft, tpot_s=tpot, transfer_s=transfer)
