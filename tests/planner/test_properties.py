"""Properties of the ownerserve policy over random clusters and requests (hypothesis)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ownerserve.errors import NoWorkerAvailableError
from ownerserve.profiles import load_profile
from ownerserve.types import Role, Tier
from planner.calibration import Calibrator
from planner.classify import classify
from planner.cost import CostConfig, CostModel, RequestCosts, Route, enumerate_routes, evaluate
from planner.policies import POLICY_NAMES, OwnerServePolicy, get_policy
from planner.types import Action, ClusterView, RequestClass, RequestView, WorkerView
from tests.planner.util import UNIT, UNIT_CONFIG

H100 = CostModel()
H100_SPEC = CostModel(CostConfig(kv_spec="llama3-8b"))
UNITM = CostModel(UNIT_CONFIG, {"unit": UNIT})
# two profiles in one cluster: workers naming h100-llama3-8b use it, the rest the unit profile
MIXED = CostModel(UNIT_CONFIG, {"unit": UNIT, "h100-llama3-8b": load_profile("h100-llama3-8b")})
MODELS = {"h100": H100, "h100+spec": H100_SPEC, "unit": UNITM, "mixed": MIXED}
BLOCK = 16
PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def workers(draw: st.DrawFn, chain: int, n_max: int = 10) -> tuple[WorkerView, ...]:
    n = draw(st.integers(1, n_max))
    # each node's NIC backlog (shared by its workers): mostly none, sometimes seconds
    backlog = [draw(st.sampled_from([0.0, 0.0, 0.003, 0.2, 5.0])) for _ in range(3)]
    out = []
    for i in range(n):
        cached: dict[Tier, int] = {}
        for tier in Tier:
            if draw(st.booleans()):
                cached[tier] = draw(st.integers(0, chain))
        node = draw(st.integers(0, 2))
        out.append(
            WorkerView(
                worker_id=f"w{i}",
                role=draw(st.sampled_from(list(Role))),
                healthy=draw(st.sampled_from([True, True, True, False])),
                running=draw(st.integers(0, 300)),
                waiting=draw(st.integers(0, 8)),
                inflight_prefill_tokens=draw(st.integers(0, 50_000)),
                kv_usage=draw(st.floats(0.0, 1.0)),
                cached_blocks=cached,
                node=f"n{node}",
                nic_backlog_s=backlog[node],
                prefill_scale=draw(st.floats(0.5, 3.0)),
                decode_scale=draw(st.floats(0.5, 3.0)),
                link_scale=draw(st.floats(0.5, 3.0)),
                profile=draw(st.sampled_from(["default", "unit", "h100-llama3-8b"])),
                kv_capacity_tokens=draw(st.sampled_from([0, 10_000, 100_000])),
                ws_tokens=draw(st.sampled_from([0, 5_000, 90_000])),
                offloads=draw(st.booleans()),
                handover_s=draw(st.sampled_from([0.0, 0.3])),
                # mostly one P/D hand-over and a KV API everywhere, as most clusters are
                pd_group=draw(st.sampled_from(["pd", "pd", "pd", "other", None])),
                kv_api=draw(st.sampled_from([True, True, False])),
                chunk_api=draw(st.sampled_from([True, True, False])),
            )
        )
    return tuple(out)


def cluster_of(ws: tuple[WorkerView, ...], sources: tuple[WorkerView, ...] = ()) -> ClusterView:
    """The cluster the router would build: `pd_mixed` when its workers speak more than one
    P/D hand-over."""
    groups = {w.pd_group for w in ws if w.pd_group is not None}
    return ClusterView(workers=ws, sources=sources, pd_mixed=len(groups) > 1)


@st.composite
def scenario(draw: st.DrawFn) -> tuple[RequestView, ClusterView]:
    prompt = draw(st.integers(1, 40_000))
    chain = prompt // BLOCK
    ws = draw(workers(chain))
    ids = [w.worker_id for w in ws]
    req = RequestView(
        model="m",
        prompt_tokens=prompt,
        block_size=BLOCK,
        chain_blocks=chain,
        max_tokens=draw(st.integers(1, 2000)),
        session_owner=draw(st.sampled_from([None, *ids])),
        owner=draw(st.sampled_from([None, *ids])),
        owner_blocks=draw(st.integers(0, chain)),
        previous_prompt_tokens=draw(st.integers(0, prompt)),
        idle_s=draw(st.sampled_from([0.0, 5.0, 1000.0])),
        is_fork=draw(st.booleans()),
        home_worker=draw(st.sampled_from([None, *ids])),
        home_tokens=draw(st.sampled_from([0, 4_000])),
        growth_tokens=draw(st.sampled_from([0, 20_000])),
    )
    # sometimes a chunked prompt (chunk reuse), its chunks' KV held here and there
    if draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(0, prompt), min_size=2, max_size=12)))
        spans = tuple((lo, hi) for lo, hi in zip(cuts[::2], cuts[1::2], strict=False) if hi > lo)
        req = replace(req, chunk_spans=spans)
        idx = list(range(len(spans)))
        held_ws = []
        for w in ws:
            if draw(st.booleans()) and idx:
                w = replace(w, chunks_held=tuple(draw(st.lists(st.sampled_from(idx), unique=True))))
            held_ws.append(w)
        ws = tuple(held_ws)
    # sometimes the owner is draining: a KV source only, outside the routable workers
    if draw(st.booleans()) and req.owner is not None and len(ws) > 1:
        src = next(w for w in ws if w.worker_id == req.owner)
        return req, cluster_of(tuple(w for w in ws if w is not src), (src,))
    return req, cluster_of(ws)


@PROPS
@given(scenario(), st.sampled_from(sorted(MODELS)))
def test_chosen_plan_costs_no_more_than_any_candidate(
    case: tuple[RequestView, ClusterView], model_name: str
) -> None:
    req, cl = case
    model = MODELS[model_name]
    assume(any(w.healthy and w.role is not Role.PREFILL for w in cl.workers))
    p = OwnerServePolicy(model=model).plan(req, cl)
    cont = classify(req, model.config) is RequestClass.DECODE_CONTINUATION
    routes = enumerate_routes(req, cl, continuation=cont)
    # with the cluster: a chunked prompt's prefill may fetch the chunks it lacks
    totals = [evaluate(model, req, r, cl).total for r in routes]
    best = min(totals)
    chosen = p.chosen.cost.total
    assert chosen <= best + 1e-9 * max(1.0, best)
    assert chosen >= best - 1e-9 * max(1.0, best)  # the argmin, not cheaper than any route
    assert p.candidates_considered == len(routes)
    if p.runner_up is not None:
        assert p.runner_up.cost.total >= chosen - 1e-9 * max(1.0, chosen)
    if p.default_cost_s is not None:
        assert p.default_cost_s >= best - 1e-9 * max(1.0, best)
    if p.action is Action.ARTIFACT_FETCH:
        assert p.add_replica_on == p.chosen.decode_worker
    else:
        assert p.add_replica_on is None
    # the plan's workers are healthy and able to do their part
    byid = {w.worker_id: w for w in cl.workers}
    assert byid[p.chosen.decode_worker].healthy
    assert byid[p.chosen.decode_worker].role is not Role.PREFILL
    assert byid[p.chosen.prefill_worker].role is not Role.DECODE or (
        p.chosen.prefill_worker == p.chosen.decode_worker
    )
    # ... and to move KV the way the plan moves it
    if p.action is Action.REMOTE_PREFILL:
        pw, dw = byid[p.chosen.prefill_worker], byid[p.chosen.decode_worker]
        assert pw.pd_group is not None and pw.pd_group == dw.pd_group
    if p.action in (Action.ARTIFACT_FETCH, Action.STATE_MIGRATION):
        src = cl.by_id(p.chosen.source_worker or "")
        assert src is not None and src.kv_api and byid[p.chosen.decode_worker].kv_api


@st.composite
def session_turn(draw: st.DrawFn) -> tuple[RequestView, ClusterView]:
    """A session turn whose decode owner w0 holds the prefix in GPU and may be overloaded;
    the other decode workers hold nothing or an older part of it (a move lands there)."""
    prefix = draw(st.integers(10, 2000))
    new = draw(st.integers(1, 3000))
    ws = [
        WorkerView(
            worker_id="w0",
            role=Role.DECODE,
            running=draw(st.integers(0, 100)),
            waiting=draw(st.integers(0, 30)),
            inflight_prefill_tokens=draw(st.integers(0, 100_000)),
            kv_usage=draw(st.floats(0.0, 1.0)),
            cached_blocks={Tier.GPU: prefix},
            node=f"n{draw(st.integers(0, 1))}",
        )
    ]
    for i in range(1, draw(st.integers(2, 5))):
        old = draw(st.integers(0, prefix))
        ws.append(
            WorkerView(
                worker_id=f"w{i}",
                role=draw(st.sampled_from(list(Role))),
                running=draw(st.integers(0, 100)),
                waiting=draw(st.integers(0, 3)),
                kv_usage=draw(st.floats(0.0, 1.0)),
                cached_blocks={Tier.GPU: old} if old else {},
                node=f"n{draw(st.integers(0, 1))}",
            )
        )
    n = prefix * BLOCK + new
    req = RequestView(
        model="m", prompt_tokens=n, block_size=BLOCK, chain_blocks=n // BLOCK,
        session_owner="w0", owner="w0", owner_blocks=prefix,
        previous_prompt_tokens=prefix * BLOCK,
    )  # fmt: skip
    return req, ClusterView(workers=tuple(ws))


@PROPS
@given(session_turn(), st.sampled_from(sorted(MODELS)))
def test_a_session_moves_only_when_staying_costs_more_by_the_hysteresis(
    case: tuple[RequestView, ClusterView], model_name: str
) -> None:
    req, cl = case
    model = MODELS[model_name]
    p = OwnerServePolicy(model=model).plan(req, cl)
    # the exact search prices migrations (hysteresis included) as the reference does
    best = min(evaluate(model, req, r, cl).total for r in enumerate_routes(req, cl))
    assert p.chosen.cost.total <= best + 1e-9 * max(1.0, best)
    if p.action is not Action.STATE_MIGRATION:
        return
    cfg = model.config
    src = cl.by_id(p.chosen.source_worker or "")
    assert src is not None and src.worker_id == req.session_owner
    stay = evaluate(model, req, Route(Action.COLOCATED_PREFILL, src, src)).total
    move = p.chosen.cost.total - p.chosen.cost.h_move  # C0: the move without its hysteresis
    assert stay - move >= cfg.migration_margin_s + cfg.migration_margin_rel * move - 1e-9
    assert p.chosen.cost.m_hbm_bytes > 0  # the copy left on the source is counted


@st.composite
def no_cache_cluster(draw: st.DrawFn, running: tuple[int, int] = (64, 128)) -> ClusterView:
    """Decode-capable workers with a running batch of `running` decodes (default 25-50% of
    max_num_seqs, 256), prefill workers idle, no queues, nothing cached anywhere, random nodes
    and sizes."""
    n_p = draw(st.integers(1, 3))
    n_d = draw(st.integers(1, 4))
    n_h = draw(st.integers(0, 2))
    out = []
    for i in range(n_p + n_d + n_h):
        role = Role.PREFILL if i < n_p else Role.DECODE if i < n_p + n_d else Role.HYBRID
        out.append(
            WorkerView(
                worker_id=f"w{i}",
                role=role,
                running=0 if role is Role.PREFILL else draw(st.integers(*running)),
                kv_usage=draw(st.floats(0.0, 0.5)),
                node=f"n{draw(st.integers(0, 2))}",
            )
        )
    return ClusterView(workers=tuple(out))


@PROPS
@given(st.data(), st.integers(8192, 32768), st.integers(1, 128))
def test_without_any_cached_prefix_long_prompts_go_remote_and_short_ones_colocate(
    data: st.DataObject, long_n: int, short_n: int
) -> None:
    policy = OwnerServePolicy(model=H100)
    long_req = RequestView(model="m", prompt_tokens=long_n, block_size=BLOCK, chain_blocks=0)
    short_req = replace(long_req, prompt_tokens=short_n)
    busy = data.draw(no_cache_cluster())
    assert policy.plan(long_req, busy).action is Action.REMOTE_PREFILL
    # a short turn colocates where no decode would wait for it; on busy decode workers
    # every running decode would wait its prefill (4-9 ms each), so an idle P takes it
    light = data.draw(no_cache_cluster(running=(0, 0)))
    assert policy.plan(short_req, light).action is Action.COLOCATED_PREFILL
    assert policy.plan(short_req, busy).action is Action.REMOTE_PREFILL


@PROPS
@given(st.data(), st.integers(1, 64), st.integers(200, 3000))
def test_decode_continuation_sticks_to_the_session_owner_holding_the_prefix(
    data: st.DataObject, new: int, prefix_blocks: int
) -> None:
    n_workers = data.draw(st.integers(2, 8))
    owner = data.draw(st.integers(0, n_workers - 1))
    # up to 20 running decodes: stalling them for a ≤ 64-token prefill (≤ 7 ms each) costs less
    # than recomputing a ≥ 3200-token prefix on an idle P (test_ownerserve has the other side)
    running = data.draw(st.integers(0, 20))
    kv = data.draw(st.floats(0.0, 0.9))
    ws = []
    for i in range(n_workers):
        role = data.draw(st.sampled_from([Role.PREFILL, Role.DECODE, Role.HYBRID]))
        if i == owner:
            role = data.draw(st.sampled_from([Role.DECODE, Role.HYBRID]))
        ws.append(
            WorkerView(
                worker_id=f"w{i}",
                role=role,
                running=running,
                kv_usage=kv,
                node=f"n{data.draw(st.integers(0, 2))}",
                cached_blocks={Tier.GPU: prefix_blocks} if i == owner else {},
            )
        )
    prompt = prefix_blocks * BLOCK + new
    req = RequestView(
        model="m", prompt_tokens=prompt, block_size=BLOCK, chain_blocks=prompt // BLOCK,
        session_owner=f"w{owner}", owner=f"w{owner}", owner_blocks=prefix_blocks,
        previous_prompt_tokens=prefix_blocks * BLOCK,
    )  # fmt: skip
    p = OwnerServePolicy(model=H100).plan(req, ClusterView(workers=tuple(ws)))
    assert p.request_class is RequestClass.DECODE_CONTINUATION
    assert (p.action, p.chosen.decode_worker) == (Action.DECODE_CONTINUATION, f"w{owner}")


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(100, 20_000), min_size=10, max_size=30), st.integers(0, 3))
def test_a_worker_whose_observed_times_double_loses_traffic(prompts: list[int], slow: int) -> None:
    # four hybrids; the one that turns out slow is the least loaded, so it starts with traffic
    # (12 running decodes against 16: a prefill there stalls 12 decodes; twice as slow, it
    # would stall them for the time of 24, more than the others' 16)
    ws = tuple(
        WorkerView(
            worker_id=f"h{i}", role=Role.HYBRID, running=12 if i == slow else 16, kv_usage=0.2
        )
        for i in range(4)
    )
    cl = ClusterView(workers=ws)
    policy = OwnerServePolicy(model=H100)
    cal = Calibrator()
    name = f"h{slow}"

    def traffic(view: ClusterView) -> int:
        hits = 0
        for n in prompts:
            req = RequestView(model="m", prompt_tokens=n, block_size=BLOCK, chain_blocks=0)
            p = policy.plan(req, view)
            hits += name in (p.chosen.prefill_worker, p.chosen.decode_worker)
        return hits

    before = traffic(cal.apply_all(cl))
    assert before > 0
    # its prefills and decode steps really take twice the profile's time
    raw = ws[slow]
    for n in prompts:
        planned = cal.apply(raw)
        k = RequestCosts(
            H100, RequestView(model="m", prompt_tokens=n, block_size=BLOCK, chain_blocks=0)
        )
        cal.observe_prefill(name, 2.0 * k.prefill(raw, 0), k.prefill(planned, 0))
        cal.observe_decode(name, 2.0 * k.worker(raw).decode_s, k.worker(planned).decode_s)
    if len(prompts) >= 15:
        assert 1.9 < cal.scales(name).prefill <= 2.0 + 1e-9
    after = traffic(cal.apply_all(cl))
    assert after < before


def test_identical_workers_share_ties_deterministically() -> None:
    # the search is deterministic: the same input gives the same plan
    ws = tuple(WorkerView(worker_id=f"h{i}", role=Role.HYBRID) for i in range(3))
    req = RequestView(model="m", prompt_tokens=500, block_size=BLOCK, chain_blocks=31)
    a = OwnerServePolicy(model=H100).plan(req, ClusterView(workers=ws))
    b = OwnerServePolicy(model=H100).plan(req, ClusterView(workers=ws))
    assert a == b


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_every_model_plans_the_readme_example(model_name: str) -> None:
    from tests.planner.util import example

    req, cl = example()
    p = OwnerServePolicy(model=MODELS[model_name]).plan(req, cl)
    assert p.chosen.cost.total > 0


@PROPS
@given(scenario(), st.sampled_from(POLICY_NAMES))
def test_every_policy_plans_with_healthy_capable_workers_and_exact_costs(
    case: tuple[RequestView, ClusterView], name: str
) -> None:
    req, cl = case
    policy = get_policy(name, model=H100)
    try:
        p = policy.plan(req, cl)
    except NoWorkerAvailableError:
        live = [w for w in cl.workers if w.healthy]
        assert not any(w.role is not Role.PREFILL for w in live) or not any(
            w.role is not Role.DECODE for w in live
        )
        return
    byid = {w.worker_id: w for w in cl.workers}
    pw, dw = byid[p.chosen.prefill_worker], byid[p.chosen.decode_worker]
    assert pw.healthy and dw.healthy
    assert dw.role is not Role.PREFILL
    assert pw.role is not Role.DECODE or pw is dw
    # the source may be a draining worker (`ClusterView.sources`)
    src = cl.by_id(p.chosen.source_worker) if p.chosen.source_worker else None
    route = Route(p.action, pw, dw, src)
    # the ownerserve policy prices fetching chunks from their holders in the cluster; the
    # baselines never fetch chunks
    assert p.chosen.cost == evaluate(H100, req, route, cl if name == "ownerserve" else None)
    if name != "ownerserve":
        assert p.chosen.chunk_fetches == ()
    assert p.policy == name


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["prefill", "decode", "transfer"]),
            st.one_of(st.floats(-1.0, 1e6), st.just(float("nan")), st.just(float("inf"))),
            st.one_of(st.floats(-1.0, 1e6), st.just(float("nan")), st.just(0.0)),
        ),
        max_size=50,
    )
)
def test_calibration_scales_stay_within_bounds(samples: list[tuple[str, float, float]]) -> None:
    cal = Calibrator()
    for kind, observed, predicted in samples:
        getattr(cal, f"observe_{kind}")("w", observed, predicted)
    s = cal.scales("w")
    for v in (s.prefill, s.decode, s.link):
        assert cal.config.min_scale <= v <= cal.config.max_scale


@PROPS
@given(st.integers(1, 20), st.integers(0, 2000), st.integers(100, 3000))
def test_a_hotter_owner_never_wins_back_a_fork_it_lost(
    waiting: int, step: int, prefix: int
) -> None:
    """Hot-spot rule: raising the owner's queue can only move forks off it (to a replica)."""

    def view(inflight: int) -> ClusterView:
        return ClusterView(
            workers=(
                WorkerView(worker_id="p0", role=Role.PREFILL),
                WorkerView(
                    worker_id="d0", role=Role.DECODE, running=32, kv_usage=0.2, waiting=waiting,
                    inflight_prefill_tokens=inflight, cached_blocks={Tier.GPU: prefix},
                ),
                WorkerView(worker_id="d1", role=Role.DECODE, running=32, kv_usage=0.2, node="n1"),
                WorkerView(worker_id="h0", role=Role.HYBRID, running=32, kv_usage=0.2),
            )
        )  # fmt: skip

    req = RequestView(
        model="m", prompt_tokens=prefix * BLOCK + 200, block_size=BLOCK,
        chain_blocks=prefix + 12, owner="d0", owner_blocks=prefix, is_fork=True,
    )  # fmt: skip
    policy = OwnerServePolicy(model=H100)
    left = False
    for k in range(8):
        p = policy.plan(req, view(k * step * 50))
        on_owner = p.chosen.decode_worker == "d0"
        assert not (left and on_owner)
        left = left or not on_owner
        if p.action is Action.ARTIFACT_FETCH:
            assert p.add_replica_on == p.chosen.decode_worker != "d0"
    # a queue of a million prefill tokens (~40 s) certainly moves it
    far = policy.plan(req, view(1_000_000))
    assert far.chosen.decode_worker != "d0"
