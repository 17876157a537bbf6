"""The planner's inputs, built from the router's state: the `ClusterView` of the workers that
may serve a request (each worker's `WorkerView` cached until something it shows changes) and
the request's `RequestView`."""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import TYPE_CHECKING

from ownerserve.directory.base import Match
from ownerserve.types import Tier
from planner.types import ClusterView, RequestView, WorkerView

if TYPE_CHECKING:
    from router.pipeline import RequestContext
    from router.state import Router


def cluster_view(
    router: Router, model: str, match: Match, excluded: Collection[str]
) -> ClusterView:
    """The routable workers of `model` but `excluded`, with what `match` found on each."""
    cached: dict[str, dict[Tier, int]] = {}
    for h in match.holdings:
        tiers = cached.setdefault(h.worker, {})
        if h.blocks > tiers.get(h.tier, 0):
            tiers[h.tier] = h.blocks
    now = time.monotonic()
    default_profile = router.settings.planner.profile
    views = []
    scales = router.calibrator.scales
    nics = router.nics if router.nics else None  # most of the time no transfer is queued
    wsets = router.working_sets
    admission = router.admission
    # past the knee only (off by default): once per view, not per worker
    past_knee = admission.enabled and admission.cluster_full(now)
    for w in router.pool.for_model(model):
        if w.worker_id in excluded or not w.routable(now):
            continue
        wid = w.worker_id
        sc = scales(wid)
        held = cached.get(wid)
        load = w.load
        kv_usage = load.kv_usage
        cap = load.kv_capacity_tokens
        if cap > 0:
            # the KV of the requests in flight here, which the router knows now while the
            # scrape is up to an interval old (its prefills are in inflight_prefill_tokens)
            mine = (w.inflight_kv_tokens - w.inflight_prefill_tokens) / cap
            if mine > kv_usage:
                kv_usage = mine if mine < 1.0 else 1.0
        # the view is rebuilt only when something it shows changed (a frozen dataclass of
        # a dozen fields costs ~2 µs to build); who owns the request's prefix is in the
        # request view, so the same worker view serves every request of any session
        key = (
            max(load.running, w.inflight),
            load.waiting,
            w.inflight_prefill_tokens,
            kv_usage,
            tuple(held.items()) if held else (),
            sc.prefill,
            sc.decode,
            sc.link,
            sc.handover_s,
            w.settings,
            0.0 if nics is None else nics.backlog(w.settings.node, now),
            load.kv_capacity_tokens,
            wsets.tokens(wid, now),
            load.offloads,
            past_knee and admission.closed_to_programs(w, now),
        )
        last = w.view_cache
        if last is not None and last[0] == key:
            views.append(last[1])
            continue
        view = WorkerView(
            worker_id=wid,
            role=w.settings.role,
            profile=w.settings.profile or default_profile,
            running=key[0],
            waiting=load.waiting,
            inflight_prefill_tokens=w.inflight_prefill_tokens,
            kv_usage=kv_usage,
            cached_blocks=held or {},
            node=w.settings.node,
            prefill_scale=sc.prefill,
            decode_scale=sc.decode,
            link_scale=sc.link,
            nic_backlog_s=key[10],
            kv_capacity_tokens=load.kv_capacity_tokens,
            ws_tokens=key[12],
            offloads=load.offloads,
            handover_s=sc.handover_s,
            programs_closed=key[14],
        )
        w.view_cache = (key, view)
        views.append(view)
    return ClusterView(tuple(views))


def request_view(ctx: RequestContext) -> RequestView:
    """The request as the planner sees it: its prompt, its session (`ctx.info` as it was
    before this request touched it) and what the directory matched."""
    req, tok, match, info = ctx.req, ctx.tok, ctx.match, ctx.info
    now = time.monotonic()
    home, home_tokens = ctx.router.working_sets.home(ctx.session.session_id, now)
    return RequestView(
        model=req.model,
        prompt_tokens=tok.prompt_tokens,
        block_size=ctx.mt.block_size,
        chain_blocks=len(tok.chain),
        max_tokens=req.max_tokens,
        session_id=ctx.session.session_id,
        session_owner=match.session_owner,
        owner=match.owner,
        owner_blocks=match.owner_blocks,
        previous_prompt_tokens=info.prompt_tokens if info else 0,
        idle_s=(now - info.last_seen) if info else 0.0,
        n=req.n,
        is_fork=ctx.is_fork,
        kv_bytes_per_token=ctx.router.kv_bytes_per_token,
        chain=tok.chain,
        home_worker=home,
        home_tokens=home_tokens,
        growth_tokens=ctx.router.working_sets.growth(tok.prompt_tokens),
    )
