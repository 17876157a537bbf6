"""The planner's inputs, built from the router's state: the `ClusterView` of the workers that
may serve a request (each worker's `WorkerView` cached until something it shows changes) and
the request's `RequestView`."""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from ownerserve.directory.base import HoldKind, Match
from ownerserve.kvstate import KVStateSpec
from ownerserve.types import Tier
from planner.copyreuse import CopyKind, CopyReuse
from planner.types import ClusterView, RequestView, WorkerView

if TYPE_CHECKING:
    from planner.workingset import WorkingSets
    from router.pool import WorkerPool, WorkerState
    from router.prompt import Prompt
    from router.services import ClusterSources


def cluster_view(
    router: ClusterSources,
    model: str,
    match: Match,
    excluded: Collection[str],
    chunk_holders: Mapping[str, tuple[int, ...]] | None = None,
    chain: Sequence[int] = (),
) -> ClusterView:
    """The routable workers of `model` but `excluded`, with what `match` found on each (and,
    for a chunked prompt, the chunks `chunk_holders` says each holds), and the draining ones
    that can still serve their KV (`ClusterView.sources`: their sessions move away by fetch
    or migration instead of recomputing). `chain` is the request's block chain (what
    `held_by_worker` checks a fresh lease against)."""
    cached = held_by_worker(match, router.pool, chain)
    windows = restorable_by_worker(match)
    now = time.monotonic()
    views = []
    scales = router.calibrator.scales
    nics = router.nics if router.nics else None  # most of the time no transfer is queued
    wsets = router.working_sets
    admission = router.admission
    # past the knee only (off by default): once per view, not per worker
    past_knee = admission.enabled and admission.cluster_full(now)
    sources: list[WorkerView] = []
    pd_first: str | None = None
    pd_mixed = False
    for w in router.pool.for_model(model):
        if w.worker_id in excluded:
            continue
        if not w.routable(now):
            if w.draining and w.healthy and w.kv_api and w.worker_id in cached:
                backlog = 0.0 if nics is None else nics.backlog(w.settings.node, now)
                known = windows.get(w.worker_id)
                view = _view(router, w, cached[w.worker_id], w.load.kv_usage, backlog, 0, False)
                if known is not None:
                    view = replace(view, restorable_blocks=known)
                if chunk_holders and w.worker_id in chunk_holders:
                    view = replace(view, chunks_held=chunk_holders[w.worker_id])
                sources.append(view)
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
        # what the view shows that the caller computes (`_view`'s arguments)
        backlog = 0.0 if nics is None else nics.backlog(w.settings.node, now)
        ws_tokens = wsets.tokens(wid, now)
        closed = past_knee and admission.closed_to_programs(w, now)
        chunks = chunk_holders.get(wid, ()) if chunk_holders else ()
        restorable = windows.get(wid)
        # the view is rebuilt only when something it shows changed (a frozen dataclass of
        # a dozen fields costs ~2 µs to build); who owns the request's prefix is in the
        # request view, so the same worker view serves every request of any session. The
        # key is only ever compared whole.
        key = (
            max(load.running, w.inflight, w.shared_inflight),
            load.waiting,
            w.inflight_prefill_tokens,
            kv_usage,
            tuple(held.items()) if held else (),
            sc.prefill,
            sc.decode,
            sc.link,
            sc.handover_s,
            w.settings,
            backlog,
            load.kv_capacity_tokens,
            ws_tokens,
            load.offloads,
            closed,
            w.kv_api_ok,  # with the settings: kv_api and chunk_api
            chunks,
            restorable,
            w.cached_tokens,
        )
        group = w.pd_group
        if group is not None:
            if pd_first is None:
                pd_first = group
            elif group != pd_first:
                pd_mixed = True
        last = w.view_cache
        if last is not None:
            last_key, last_view = last  # as stored below
            if last_key == key:
                views.append(last_view)
                continue
        view = _view(router, w, held, kv_usage, backlog, ws_tokens, closed, chunks, restorable)
        w.view_cache = (key, view)
        views.append(view)
    return ClusterView(tuple(views), tuple(sources), pd_mixed)


def held_by_worker(
    match: Match, pool: WorkerPool, chain: Sequence[int] = ()
) -> dict[str, dict[Tier, int]]:
    """The longest prefix of the request's `chain` each worker holds in each tier, as the
    planner prices it (`WorkerView.cached_blocks`). On a worker that publishes KV events
    (`kv_events_endpoint`), a lease (an owner's or a replica's record: `HoldKind.OWNER`,
    `REPLICA`) counts only as far as its events show the blocks cached in that tier: a lease
    does not pin the engine's blocks, and once the engine evicts them (its BlockRemoved) the
    lease still names them, which priced prefix hits the engine no longer had. Except a
    lease this router committed after the newest event batch it applied from the worker
    (`WorkerState.fresh_lease`): the events that show those blocks stored are still on their
    way (a client's next turn can beat them, by seconds on a loaded router), and nothing
    newer says they left."""
    cached: dict[str, dict[Tier, int]] = {}
    leased: dict[str, dict[Tier, int]] = {}
    for h in match.holdings:
        by_kind = cached if h.kind is HoldKind.CACHED else leased
        tiers = by_kind.setdefault(h.worker, {})
        if h.blocks > tiers.get(h.tier, 0):
            tiers[h.tier] = h.blocks
    for worker, tiers in leased.items():
        w = pool.get(worker)
        if w is not None and w.settings.kv_events_endpoint is not None:
            # min(lease, cached) adds nothing to what the events show, unless they lag
            n = len(chain)
            fresh = {t: b for t, b in tiers.items() if 0 < b <= n and w.fresh_lease(chain[b - 1])}
            if not fresh:
                continue
            tiers = fresh
        seen = cached.setdefault(worker, {})
        for tier, blocks in tiers.items():
            if blocks > seen.get(tier, 0):
                seen[tier] = blocks
    return cached


def restorable_by_worker(match: Match) -> dict[str, int]:
    """Per worker whose KV events name KV cache groups (a hybrid-attention engine), the
    deepest boundary of the request's chain at which its HBM holds every group
    (`Match.restorable`'s GPU units: `WorkerView.restorable_blocks`); {} for a dense
    deployment."""
    return {u.worker: u.blocks for u in match.restorable if u.tier is Tier.GPU}


def _view(
    router: ClusterSources,
    w: WorkerState,
    held: dict[Tier, int] | None,
    kv_usage: float,
    nic_backlog_s: float,
    ws_tokens: int,
    programs_closed: bool,
    chunks_held: tuple[int, ...] = (),
    restorable: int | None = None,
) -> WorkerView:
    """A worker's view from its state and what the caller computed for it."""
    sc = router.calibrator.scales(w.worker_id)
    load = w.load
    return WorkerView(
        worker_id=w.worker_id,
        role=w.settings.role,
        profile=w.settings.profile or router.settings.planner.profile,
        running=max(load.running, w.inflight, w.shared_inflight),
        waiting=load.waiting,
        inflight_prefill_tokens=w.inflight_prefill_tokens,
        kv_usage=kv_usage,
        cached_blocks=held or {},
        node=w.settings.node,
        prefill_scale=sc.prefill,
        decode_scale=sc.decode,
        link_scale=sc.link,
        nic_backlog_s=nic_backlog_s,
        kv_same_host=w.settings.kv_same_host,
        kv_transport=w.settings.kv_transport,
        kv_capacity_tokens=load.kv_capacity_tokens,
        ws_tokens=ws_tokens,
        offloads=load.offloads,
        handover_s=sc.handover_s,
        programs_closed=programs_closed,
        pd_group=w.pd_group,
        kv_api=w.kv_api,
        chunk_api=w.chunk_api,
        chunks_held=chunks_held,
        restorable_blocks=restorable,
        rebuilds_windows=w.backend.rebuilds_windows,
        cached_tokens=w.cached_tokens,
    )


def request_view(
    prompt: Prompt,
    match: Match,
    working_sets: WorkingSets,
    kv_bytes_per_token: int,
    kv_spec: KVStateSpec | None = None,
    copy_reuse: CopyReuse | None = None,
) -> RequestView:
    """The request as the planner sees it: its prompt, its session (`prompt.info`, as it was
    before this request touched it), what the directory matched, where the sessions' working
    sets (`working_sets`) hold its session's KV, and its model's KV state spec (`kv_spec`,
    `models[].kv_spec`: the hybrid cost terms the simulator prices with; None: a dense model
    of `kv_bytes_per_token`), and how often the planner's copies are hit again
    (`copy_reuse`; None: as if always)."""
    req, tok, info = prompt.req, prompt.tok, prompt.info
    session_id = prompt.session.session_id
    now = time.monotonic()
    home, home_tokens = working_sets.home(session_id, now)
    return RequestView(
        model=req.model,
        prompt_tokens=tok.prompt_tokens,
        block_size=prompt.block_size,
        chain_blocks=len(tok.chain),
        max_tokens=req.max_tokens,
        session_id=session_id,
        session_owner=match.session_owner,
        owner=match.owner,
        owner_blocks=match.owner_blocks,
        previous_prompt_tokens=info.prompt_tokens if info else 0,
        idle_s=(now - info.last_seen) if info else 0.0,
        n=req.n,
        is_fork=prompt.is_fork,
        kv_bytes_per_token=kv_bytes_per_token,
        chain=tok.chain,
        home_worker=home,
        home_tokens=home_tokens,
        growth_tokens=working_sets.growth(tok.prompt_tokens),
        chunk_spans=() if prompt.chunks is None else prompt.chunks.spans,
        kv_spec=kv_spec,
        fetch_reuse=1.0 if copy_reuse is None else copy_reuse.rate(CopyKind.FETCH, now),
        prompt_reuse=1.0 if copy_reuse is None else copy_reuse.rate(CopyKind.PROMPT, now),
    )
