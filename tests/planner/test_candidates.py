"""The exact candidate subset (planner.candidates): its plan is the full view's on random
clusters of 1 to 1,200 workers, and its load order stays the order of the current views."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ownerserve.errors import NoWorkerAvailableError
from ownerserve.types import Role, Tier
from planner.candidates import ExactSubsetPolicy, LoadOrder, plan_exact
from planner.policies import OwnerServePolicy, Planner
from planner.types import ClusterView, Plan, RequestView, WorkerView
from tests.planner.test_properties import MODELS

BLOCK = 16
PROFILES = ["default", "unit", "h100-llama3-8b"]


def random_cluster(rng: random.Random, n: int, chain: int, style: str) -> tuple[WorkerView, ...]:
    """n workers: `idle` ones all alike but for a few (ties everywhere), `few` with loads
    from a handful of values, `spread` with loads drawn over wide ranges; random roles,
    nodes, profiles, scales, P/D groups and holders in every tier."""
    nodes = max(1, n // rng.choice([1, 4, 8, 16]))
    backlog = [rng.choice([0.0, 0.0, 0.0, 0.003, 0.2, 5.0]) for _ in range(nodes)]
    holders = rng.sample(range(n), min(n, rng.choice([0, 1, 3, 8, 20])))
    out = []
    for i in range(n):
        node = rng.randrange(nodes)
        busy = style == "spread" or (style == "few" and rng.random() < 0.7) or rng.random() < 0.02
        pick = rng.choice if style == "few" else None
        cached: dict[Tier, int] = {}
        if i in holders:
            for tier in Tier:
                if rng.random() < 0.5:
                    cached[tier] = rng.randint(0, chain)
        running = (pick([0, 4, 32]) if pick else rng.randint(0, 300)) if busy else 0
        out.append(
            WorkerView(
                worker_id=f"w{i}",
                role=rng.choice(list(Role)),
                healthy=rng.random() < 0.95,
                running=running,
                waiting=(pick([0, 1, 3]) if pick else rng.randint(0, 8)) if busy else 0,
                inflight_prefill_tokens=(
                    (pick([0, 2000, 9000]) if pick else rng.randint(0, 50_000)) if busy else 0
                ),
                kv_usage=(pick([0.0, 0.5]) if pick else rng.random()) if busy else 0.0,
                cached_blocks=cached,
                node=f"n{node}",
                nic_backlog_s=backlog[node],
                prefill_scale=rng.choice([1.0, 1.0, rng.uniform(0.5, 3.0)]),
                decode_scale=rng.choice([1.0, 1.0, rng.uniform(0.5, 3.0)]),
                link_scale=rng.choice([1.0, rng.uniform(0.5, 3.0)]),
                profile=rng.choice(PROFILES) if style != "idle" else PROFILES[0],
                kv_capacity_tokens=rng.choice([0, 10_000, 100_000]),
                ws_tokens=rng.choice([0, 0, 5_000, 90_000]),
                offloads=rng.random() < 0.3,
                handover_s=rng.choice([0.0, 0.0, 0.3]),
                pd_group=rng.choice(["pd", "pd", "pd", "pd", "other", None]),
                kv_api=rng.random() < 0.8,
                programs_closed=rng.random() < 0.05,
            )
        )
    return tuple(out)


def random_request(rng: random.Random, ws: tuple[WorkerView, ...], chain: int) -> RequestView:
    prompt = max(1, chain * BLOCK + rng.randint(0, BLOCK - 1))
    holders = [w.worker_id for w in ws if w.cached_blocks] or [w.worker_id for w in ws]
    ids = [w.worker_id for w in ws]

    def some(pool: list[str]) -> str | None:
        return rng.choice([None, rng.choice(pool), rng.choice(ids)])

    req = RequestView(
        model="m",
        prompt_tokens=prompt,
        block_size=BLOCK,
        chain_blocks=chain,
        max_tokens=rng.choice([1, 16, 256, 2000]),
        session_id="s",
        session_owner=some(holders),
        owner=some(holders),
        owner_blocks=rng.randint(0, chain),
        previous_prompt_tokens=rng.randint(0, prompt),
        idle_s=rng.choice([0.0, 5.0, 1000.0]),
        is_fork=rng.random() < 0.2,
        home_worker=some(holders),
        home_tokens=rng.choice([0, 4_000]),
        growth_tokens=rng.choice([0, 20_000]),
    )
    if rng.random() < 0.15:
        spans = ((0, prompt // 3), (prompt // 2, prompt - 1))
        req = replace(req, chunk_spans=tuple(s for s in spans if s[1] > s[0]))
    return req


def cluster_of(ws: tuple[WorkerView, ...], rng: random.Random) -> ClusterView:
    groups = {w.pd_group for w in ws if w.pd_group is not None}
    sources: tuple[WorkerView, ...] = ()
    if len(ws) > 2 and rng.random() < 0.1:
        sources, ws = ws[:1], ws[1:]
    return ClusterView(workers=ws, sources=sources, pd_mixed=len(groups) > 1)


def same_choice(a: Plan, b: Plan) -> bool:
    x, y = a.chosen, b.chosen
    return (
        x.action is y.action
        and x.prefill_worker == y.prefill_worker
        and x.decode_worker == y.decode_worker
        and x.source_worker == y.source_worker
        and x.cost.total == y.cost.total
    )


def full_and_subset(
    policy: OwnerServePolicy, req: RequestView, view: ClusterView, order: LoadOrder
) -> tuple[Plan | None, Plan | None]:
    try:
        full: Plan | None = policy.plan(req, view)
    except NoWorkerAvailableError:
        full = None
    try:
        sub: Plan | None = plan_exact(policy, req, view, order)
    except NoWorkerAvailableError:
        sub = None
    return full, sub


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from([1, 2, 5, 30, 65, 200, 1000, 1200]),
    st.sampled_from(["idle", "few", "spread"]),
    st.sampled_from(sorted(MODELS)),
)
def test_the_subset_chooses_what_the_full_view_chooses(
    seed: int, n: int, style: str, model: str
) -> None:
    rng = random.Random(seed)
    chain = rng.choice([0, 1, 40, 600])
    ws = random_cluster(rng, n, chain, style)
    view = cluster_of(ws, rng)
    policy = OwnerServePolicy(model=MODELS[model])
    order = LoadOrder(policy.model)
    for _ in range(3):  # one order, several requests: it is synced, not rebuilt
        req = random_request(rng, ws, chain)
        full, sub = full_and_subset(policy, req, view, order)
        assert (full is None) == (sub is None)
        if full is not None and sub is not None:
            assert same_choice(full, sub), (full.chosen, sub.chosen)


def test_an_idle_cluster_of_1000_is_planned_over_a_few_workers() -> None:
    """The bound cuts: on identical idle workers (every one ties) the subset is a few of
    them, and it still picks the full view's worker (the first of the ties)."""
    rng = random.Random(7)
    ws = tuple(
        WorkerView(worker_id=f"w{i}", role=(Role.PREFILL, Role.DECODE, Role.HYBRID)[i % 3])
        for i in range(1000)
    )
    view = ClusterView(workers=ws)
    policy = OwnerServePolicy(model=MODELS["h100"])
    order = LoadOrder(policy.model)
    for _ in range(5):
        req = random_request(rng, ws, 0)
        full = policy.plan(req, view)
        sub = plan_exact(policy, req, view, order)
        assert same_choice(full, sub)
        assert sub.candidates_considered < full.candidates_considered / 20


def test_the_order_kept_by_sync_is_the_order_built_afresh() -> None:
    """Views change a few at a time (loads, health, holders, a worker replaced by another):
    the order `sync` keeps equals one built from the current views."""
    rng = random.Random(3)
    model = MODELS["mixed"]
    ws = list(random_cluster(rng, 300, 40, "spread"))
    kept = LoadOrder(model)
    kept.sync(tuple(ws))
    for step in range(200):
        for change_no in range(rng.randint(1, 6)):
            i = rng.randrange(len(ws))
            w = ws[i]
            change = rng.randrange(4)
            if change == 0:
                w = replace(w, running=rng.randint(0, 300), waiting=rng.randint(0, 8))
            elif change == 1:
                w = replace(w, healthy=not w.healthy)
            elif change == 2:
                w = replace(w, cached_blocks={} if w.cached_blocks else {Tier.GPU: 3})
            else:
                w = replace(
                    w, worker_id=f"new{step}.{change_no}", prefill_scale=rng.uniform(0.5, 2)
                )
            ws[i] = w
        kept.sync(tuple(ws))
        fresh = LoadOrder(model)
        fresh.sync(tuple(ws))
        ranks = ("p_q", "d_k", "h_k", "h_q", "h_r", "s_p", "s_d", "s_l")
        assert [getattr(kept, r).items for r in ranks] == [getattr(fresh, r).items for r in ranks]
        assert kept._holders == fresh._holders
        assert kept._by_id == fresh._by_id
        assert kept._nodes == fresh._nodes


def test_a_resized_cluster_rebuilds_the_order() -> None:
    model = MODELS["unit"]
    order = LoadOrder(model)
    a = tuple(WorkerView(worker_id=f"w{i}", role=Role.HYBRID, running=i) for i in range(10))
    order.sync(a)
    order.sync(a[:4])
    assert order.healthy() == 4
    assert [i for _, i in order.h_r.items] == [0, 1, 2, 3]


@pytest.mark.parametrize("n", [10, 100])
def test_the_policy_wrapper_plans_small_clusters_over_every_worker(n: int) -> None:
    policy = OwnerServePolicy(model=MODELS["unit"])
    wrapped = ExactSubsetPolicy(policy, full_view_max=64)
    rng = random.Random(n)
    ws = random_cluster(rng, n, 40, "spread")
    view = ClusterView(workers=ws)
    req = random_request(rng, ws, 40)
    a, b = policy.plan(req, view), wrapped.plan(req, view)
    assert same_choice(a, b)
    if n <= 64:  # under the threshold it is the policy's own plan, candidates and all
        assert a == b


def test_the_deployment_planner_plans_large_pools_over_the_exact_subset() -> None:
    """The router's planner (`Planner`, what its plan stage resolves a request's policy
    with) wraps ownerserve: a pool above 64 workers is planned over the exact subset, to the
    full view's choice."""
    planner = Planner(model=MODELS["h100"])
    policy = planner.for_request(None)
    assert isinstance(policy, ExactSubsetPolicy)
    rng = random.Random(5)
    ws = random_cluster(rng, 400, 40, "few")
    view = ClusterView(workers=ws)
    for _ in range(5):
        req = random_request(rng, ws, 40)
        a, b = policy.plan(req, view), policy.policy.plan(req, view)
        assert same_choice(a, b)
