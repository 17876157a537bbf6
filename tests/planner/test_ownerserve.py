"""The ownerserve policy: each class's default wins where the design says it should, with
hand-computed costs (round-number profile of `util.py`), and the hot-spot rule."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ownerserve.errors import NoWorkerAvailableError
from ownerserve.types import Role, Tier
from planner.cost import CostModel, Route, enumerate_routes, evaluate
from planner.policies import OwnerServePolicy
from planner.types import Action, ClusterView, Plan, RequestClass, RequestView, WorkerView
from tests.planner.util import (
    UNIT,
    UNIT_CONFIG,
    cluster,
    example,
    owned_turn,
    request,
    unit_model,
    with_p0,
    worker,
)

MODEL = unit_model()


def plan(req: RequestView, cl: ClusterView) -> Plan:
    return OwnerServePolicy(model=MODEL).plan(req, cl)


def assert_route(
    p: Plan, action: Action, sender: str | None, decode: str, of: RequestClass | None = None
) -> None:
    """`p` chose `action` onto `decode` from `sender`: its P worker for a remote prefill, the
    worker the KV comes from for a migration or a fetch, None where no other worker takes part;
    for a request of class `of` when given."""
    if of is not None:
        assert p.request_class is of
    chosen = p.chosen
    via = chosen.prefill_worker if action is Action.REMOTE_PREFILL else chosen.source_worker
    assert (p.action, via, chosen.decode_worker) == (action, sender, decode)


def test_new_long_prefix_goes_to_remote_prefill() -> None:
    req = request(5000, session_id="s")
    cl = with_p0(
        worker("d0", Role.DECODE, "node0", running=50),
        worker("d1", Role.DECODE, "node1", running=50),
        worker("h0", Role.HYBRID, "node1", running=50),
    )
    p = plan(req, cl)
    assert_route(p, Action.REMOTE_PREFILL, "p0", "d0", of=RequestClass.NEW_LONG_PREFIX)
    # prefill 0.01 + 0.5 + 1e-8·5000·2500 = 0.635; decode 10·(0.005 + 1e-4·51 + 1e-8·5000)
    # = 0.1015; network 0.002 + 1e-3 + 5e6/1e11 = 0.00305; λ·M = 1e-9 · 5e6 = 0.005; joining
    # d0's batch: B(d0) = 50 · 10 · (1e-4 + 1e-8·5000) = 0.075
    assert p.chosen.cost.total == pytest.approx(0.81955)
    assert not p.overrides_default
    assert p.default_cost_s == pytest.approx(0.81955)


def test_a_remote_prefill_is_not_handed_to_a_decode_worker_without_room_for_its_kv() -> None:
    # the same cluster, but d0's pool (20,000 tokens, from its cache config) is 90% used by
    # running requests: 5,010 tokens of KV would wait for 3,010 of the 18,000 used to free
    req = request(5000, session_id="s")
    cl = with_p0(
        worker("d0", Role.DECODE, "node0", running=50, kv_usage=0.9, kv_capacity_tokens=20_000),
        worker("d1", Role.DECODE, "node1", running=50),
        worker("h0", Role.HYBRID, "node1", running=50),
    )
    p = plan(req, cl)
    assert_route(p, Action.REMOTE_PREFILL, "p0", "d1")
    # a pool smaller than the sequence refuses it: no route through d1 either
    small = replace(cl.workers[2], kv_capacity_tokens=4_000)
    p2 = plan(req, cluster(cl.workers[0], cl.workers[1], small, cl.workers[3]))
    assert p2.chosen.decode_worker == "h0"


def test_remote_prefill_avoids_a_p_whose_node_nic_is_backlogged() -> None:
    req = request(5000, session_id="s")
    p0 = worker("p0", Role.PREFILL, "node0")
    p1 = worker("p1", Role.PREFILL, "node1", waiting=1)  # queue 0.01 s more than p0
    d2 = worker("d2", Role.DECODE, "node2", running=50)
    assert plan(req, cluster(p0, p1, d2)).chosen.prefill_worker == "p0"
    # p0's node has 0.1 s of KV queued on its NIC: p1 is now the cheaper sender
    busy = cluster(replace(p0, nic_backlog_s=0.1), p1, d2)
    p = plan(req, busy)
    assert_route(p, Action.REMOTE_PREFILL, "p1", "d2")
    assert p.chosen.cost.t_network == pytest.approx(0.002 + 1e-3 + 5e6 / 1e10)
    # a D on p0's own node receives over the node's fast link, past the backlog
    d0 = worker("d0", Role.DECODE, "node0", running=50)
    p = plan(req, cluster(replace(p0, nic_backlog_s=0.1), p1, d0))
    assert (p.chosen.prefill_worker, p.chosen.decode_worker) == ("p0", "d0")


def test_a_fetch_from_an_owner_behind_a_busy_nic_loses_to_recomputing() -> None:
    # a fork of a long owned prefix: the hot owner's replica is fetched to the idle d1 ...
    req = request(20_000, session_id="s", owner="d0", owner_blocks=190, is_fork=True)
    d0 = worker("d0", Role.DECODE, "node0", gpu=190, running=90)
    d1 = worker("d1", Role.DECODE, "node1")
    assert plan(req, cluster(d0, d1)).action is Action.ARTIFACT_FETCH
    # ... unless the owner's node NIC has 5 s queued: computing it again is cheaper
    p = plan(req, cluster(replace(d0, nic_backlog_s=5.0), d1))
    assert p.action is not Action.ARTIFACT_FETCH
    assert p.runner_up is not None


def test_small_incremental_turn_colocates_on_the_owner() -> None:
    req, cl = example()
    p = plan(req, cl)
    assert_route(p, Action.COLOCATED_PREFILL, None, "d0", of=RequestClass.SMALL_INCREMENTAL_TURN)
    assert p.chosen.cost.total == pytest.approx(0.2472)
    assert p.runner_up is not None
    # moving to d1 would cost 0.22056 before its hysteresis: it does not win by 0.05 + 10%
    assert (p.runner_up.action, p.runner_up.decode_worker) == (Action.STATE_MIGRATION, "d1")
    assert p.runner_up.cost.total - p.runner_up.cost.h_move == pytest.approx(0.22056)
    assert p.margin_s == pytest.approx(0.292616 - 0.2472)
    assert p.candidates_considered == 5
    assert p.add_replica_on is None


def test_without_hysteresis_the_same_turn_would_move() -> None:
    req, cl = example()
    free = replace(UNIT_CONFIG, migration_margin_s=0.0, migration_margin_rel=0.0)
    p = OwnerServePolicy(model=unit_model(free)).plan(req, cl)
    assert_route(p, Action.STATE_MIGRATION, "d0", "d1")
    assert p.chosen.cost.total == pytest.approx(0.22056)
    assert p.margin_s == pytest.approx(0.2472 - 0.22056)  # less than 0.05 + 10%: a flip-flop


def test_a_move_must_beat_staying_by_the_margin() -> None:
    # with the margins above, d1 wins exactly when staying on d0 costs more than
    # 1.1 · C0(move) + 0.05; vary d0's queue (waiting requests, 0.01 s each) around that point
    req, cl = example()
    move0 = 0.22056
    stay0 = 0.2472 - 0.01  # without d0's one waiting request
    threshold = 1.1 * move0 + 0.05 - stay0  # d0's queue at which moving starts to pay
    below = int(threshold / 0.01)
    for waiting, moves in ((1, False), (below, False), (below + 1, True)):
        d0 = replace(cl.workers[1], waiting=waiting)
        p = plan(req, replace(cl, workers=(cl.workers[0], d0, cl.workers[2])))
        assert (p.action is Action.STATE_MIGRATION) is moves, waiting


def test_long_tool_output_goes_to_remote_prefill() -> None:
    req = owned_turn(3700, previous_prompt_tokens=600, owner_blocks=6)
    cl = with_p0(
        worker("d0", Role.DECODE, "node0", gpu=6, running=5),
        worker("d1", Role.DECODE, "node1", running=5),
    )
    p = plan(req, cl)
    assert_route(p, Action.REMOTE_PREFILL, "p0", "d0", of=RequestClass.LONG_TOOL_OUTPUT)
    # p0: 0.01 + 0.37 + 1e-8·3700·1850 = 0.44845; d0: 10·(0.005 + 1e-4·6 + 1e-8·3700)
    # = 0.05637; 0.002 + 1e-3 + 3.1e6/1e11 = 0.003031; λ·3.7e6 = 0.0037; joining d0's batch:
    # B(d0) = 5 · 10 · (1e-4 + 1e-8·3700) = 0.00685
    assert p.chosen.cost.total == pytest.approx(0.518401)
    # colocated on d0: 3100 new tokens on 600 take 0.38665 s, and d0's 5 running decodes each
    # wait that long: 0.38665 + 0.05637 + 5 · 0.38665 + 0.00685 = 2.38312
    col = evaluate(MODEL, req, Route(Action.COLOCATED_PREFILL, cl.workers[1], cl.workers[1]))
    assert col.i_decode == pytest.approx(1.9401)  # 5 · 0.38665 + 0.00685
    assert col.total == pytest.approx(2.38312)


def continuation_case() -> tuple[RequestView, ClusterView]:
    req = owned_turn(1030, previous_prompt_tokens=1000, owner_blocks=10)
    cl = with_p0(
        worker("d0", Role.DECODE, "node0", gpu=10, running=2, kv_usage=0.1),
        worker("d1", Role.DECODE, "node0", running=2, kv_usage=0.1),
    )
    return req, cl


def test_decode_continuation_stays_on_the_session_owner() -> None:
    req, cl = continuation_case()
    p = plan(req, cl)
    assert_route(p, Action.DECODE_CONTINUATION, None, "d0", of=RequestClass.DECODE_CONTINUATION)
    # 0.01 + 0.003 + 1e-8·30·1015 = 0.0133045; 10·(0.005 + 1e-4·3 + 1e-8·101030) = 0.063103;
    # interference 2 · 0.0133045 + B(d0), B(d0) = 2 · 10 · (1e-4 + 1e-8·1030) = 0.002206
    assert p.chosen.cost.total == pytest.approx(0.1052225)
    assert p.runner_up is not None
    # moving to the identical d1 (B(d1) = B(d0)): + 1e-3 + 1e6/1e11 of transfer + λ·1e6 of
    # the copy left on d0, then the hysteresis: 1.1 · 0.1072325 + 0.05
    assert p.runner_up.action is Action.STATE_MIGRATION
    assert p.runner_up.cost.total == pytest.approx(0.16795575)


def test_a_continuation_on_a_short_prefix_leaves_a_very_busy_owner_for_an_idle_p() -> None:
    # h100 profile: 300 decodes on d0 would each wait 4.04 ms for a 1-token prefill (1.2 s in
    # all); recomputing the 3201 tokens on idle p0 takes 0.14 s
    req = RequestView(
        model="m", prompt_tokens=3201, block_size=16, chain_blocks=200, session_id="s",
        session_owner="d0", owner="d0", owner_blocks=200, previous_prompt_tokens=3200,
    )  # fmt: skip
    cl = ClusterView(
        workers=(
            WorkerView("p0", Role.PREFILL),
            WorkerView("d0", Role.DECODE, running=300, cached_blocks={Tier.GPU: 200}),
        )
    )
    p = OwnerServePolicy().plan(req, cl)
    assert_route(p, Action.REMOTE_PREFILL, "p0", "d0", of=RequestClass.DECODE_CONTINUATION)
    quiet = replace(cl, workers=(cl.workers[0], replace(cl.workers[1], running=10)))
    assert OwnerServePolicy().plan(req, quiet).action is Action.DECODE_CONTINUATION


def test_overloaded_session_owner_sheds_the_session_by_migration() -> None:
    req, cl = continuation_case()
    hot = replace(cl.workers[1], waiting=30, inflight_prefill_tokens=50_000)
    p = plan(req, replace(cl, workers=(cl.workers[0], hot, cl.workers[2])))
    assert_route(p, Action.STATE_MIGRATION, "d0", "d1")
    assert p.overrides_default
    assert p.add_replica_on is None  # a session moves; it is not replicated


def fork_case(owner_busy: bool) -> tuple[RequestView, ClusterView]:
    req = request(1000, session_id="s-b2", owner="d0", owner_blocks=6, is_fork=True)
    busy = {"waiting": 20, "inflight_prefill_tokens": 20_000} if owner_busy else {}
    cl = with_p0(
        worker("d0", Role.DECODE, "node0", gpu=6, **busy),
        worker("d1", Role.DECODE, "node1"),
    )
    return req, cl


def test_hot_owner_forked_rollout_fetches_and_adds_a_read_only_replica() -> None:
    req, cl = fork_case(owner_busy=True)
    p = plan(req, cl)
    assert_route(p, Action.ARTIFACT_FETCH, "d0", "d1", of=RequestClass.FORKED_ROLLOUT)
    # q(d0) = 1e-4·20000 + 0.01·20 = 2.2 s > fetch: 0.0532 + 0.0511 + 0.00106 + λ·6e5
    assert p.chosen.cost.total == pytest.approx(0.10596)
    assert p.add_replica_on == "d1"


def test_idle_owner_keeps_the_fork_without_a_replica() -> None:
    req, cl = fork_case(owner_busy=False)
    p = plan(req, cl)
    # colocated on d0: 0.0532 + 0.0511 = 0.1043 < 0.10596 for the fetch
    assert_route(p, Action.COLOCATED_PREFILL, None, "d0")
    assert p.chosen.cost.total == pytest.approx(0.1043)
    assert p.add_replica_on is None
    assert p.overrides_default and p.default_cost_s == pytest.approx(0.10596)


def test_cold_resume_restores_the_artifact_and_recomputes_the_tail() -> None:
    req = request(
        1050, session_id="s", session_owner="d0", previous_prompt_tokens=1000, idle_s=1000.0
    )
    cl = with_p0(
        worker("d0", Role.DECODE, "node0", cpu=10),
        worker("d1", Role.DECODE, "node1"),
    )
    p = plan(req, cl)
    assert_route(p, Action.TAIL_RECOMPUTE, None, "d0", of=RequestClass.COLD_RESUME)
    # load 1e6 B / 1e9 = 0.001; 50 new: 0.01 + 0.005 + 1e-8·50·1025; decode 10·0.0051105
    assert p.chosen.cost.t_restore == pytest.approx(0.001)
    assert p.chosen.cost.total == pytest.approx(0.0676175)


def test_default_wins_an_exact_tie() -> None:
    # free links, no λ: remote p0→d0 and colocated on d0 cost exactly the same when both hold
    # the one-block prompt; the class (new long prefix at a 50-token threshold) says remote
    cfg = replace(UNIT_CONFIG, lam=0.0, pd_handshake_s=0.0, long_prefix_tokens=50)
    free = replace(UNIT, link=replace(UNIT.link, latency_s=0.0))
    policy = OwnerServePolicy(model=CostModel(cfg, {"unit": free}))
    req = request(100)
    cl = cluster(worker("d0", Role.DECODE, gpu=1), worker("p0", Role.PREFILL, gpu=1))
    p = policy.plan(req, cl)
    assert p.request_class is RequestClass.NEW_LONG_PREFIX
    assert p.action is Action.REMOTE_PREFILL
    assert p.runner_up is not None and p.runner_up.action is Action.COLOCATED_PREFILL
    assert p.margin_s == 0.0


def test_plan_breakdown_is_the_reference_evaluation() -> None:
    req, cl = example()
    p = plan(req, cl)
    route = Route(p.action, cl.workers[1], cl.workers[1])
    assert p.chosen.cost == evaluate(MODEL, req, route)
    assert p.candidates_considered == len(enumerate_routes(req, cl))


def test_unhealthy_workers_are_never_chosen_and_none_left_is_an_error() -> None:
    req, cl = example()
    sick = replace(cl.workers[1], healthy=False)
    p = plan(req, replace(cl, workers=(cl.workers[0], sick, cl.workers[2])))
    assert "d0" not in (p.chosen.prefill_worker, p.chosen.decode_worker)
    with pytest.raises(NoWorkerAvailableError):
        plan(req, cluster(*(replace(w, healthy=False) for w in cl.workers)))
    with pytest.raises(NoWorkerAvailableError):
        plan(req, cluster(worker("p0", Role.PREFILL)))  # nobody can decode


def test_prefill_only_cluster_side_and_decode_only_cluster() -> None:
    req = request(2000)
    p = plan(req, cluster(worker("d0", Role.DECODE), worker("d1", Role.DECODE, "node1")))
    assert p.action is Action.COLOCATED_PREFILL  # decode workers can prefill their own prompts
    assert p.candidates_considered == 2


@pytest.mark.parametrize(
    "kw",
    [
        {"prompt_tokens": 0},
        {"prompt_tokens": -5},
        {"prompt_tokens": 1, "max_tokens": 0},
        {"prompt_tokens": 500, "max_tokens": -3},
        {"prompt_tokens": 500, "owner": "ghost", "owner_blocks": 3},
        {"prompt_tokens": 500, "session_owner": "ghost", "previous_prompt_tokens": 400},
        {"prompt_tokens": 500, "owner_blocks": 99, "owner": "d0"},
    ],
)
def test_odd_requests_still_plan(kw: dict[str, object]) -> None:
    kw = dict(kw)
    n = int(kw.pop("prompt_tokens"))  # type: ignore[call-overload]
    max_tokens = int(kw.pop("max_tokens", 10))  # type: ignore[call-overload]
    _, cl = example()
    p = plan(replace(request(100, **kw), prompt_tokens=n, max_tokens=max_tokens), cl)
    assert p.chosen.cost.total >= 0.0
    assert p.runner_up is not None
