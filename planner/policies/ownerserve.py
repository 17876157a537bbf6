"""The OwnerServe policy: argmin of C(a) over every candidate of `planner.cost.enumerate_routes`.

Every cost comes from the request's `planner.cost.RequestCosts` (the formulas `evaluate` uses):
one pass over the workers takes each one's terms (`RequestCosts.worker`) and generates its
candidates, one function per action (`_colocated`, `_fetch`, `_migration`); remote prefill P→D
is searched exactly in O(P + D) (`_remote`) because its cost splits into a P part, a D part and
a link that only depends on whether P and D share a node. Candidates that cannot enter the top
two are skipped by lower bounds. The chosen candidate and the runner-up are then re-costed
term by term (`RequestCosts.candidate`) for the plan's breakdown (tests check the search's
choice against the full reference enumeration).
"""

from __future__ import annotations

from ownerserve.errors import NoWorkerAvailableError
from ownerserve.types import Role, Tier
from planner.classify import DEFAULT_ACTION, classify
from planner.cost import (
    CostConfig,
    CostModel,
    RequestCosts,
    Route,
    fetch_source,
    migration_source,
    tier_blocks,
)
from planner.policies.base import TopTwo, make_plan
from planner.types import Action, ClusterView, Plan, RequestClass, RequestView, WorkerView

_INF = float("inf")
_GPU, _CPU, _SSD = Tier.GPU, Tier.CPU, Tier.SSD
_PREFILL, _DECODE = Role.PREFILL, Role.DECODE
_COL, _CONT, _TAIL = Action.COLOCATED_PREFILL, Action.DECODE_CONTINUATION, Action.TAIL_RECOMPUTE
_FETCH, _MIG, _REMOTE = Action.ARTIFACT_FETCH, Action.STATE_MIGRATION, Action.REMOTE_PREFILL
_RC_CONT = RequestClass.DECODE_CONTINUATION

# a candidate: (action, prefill worker, decode worker, source)
_Rec = tuple[Action, WorkerView, WorkerView, WorkerView | None]
# the best two P parts of a node: (cost, worker, cost, worker)
_NodeBest = tuple[float, WorkerView, float, WorkerView | None]
# a D part of remote prefill: (cost, worker, gpu blocks held, its profile's constants)
_DPart = tuple[float, WorkerView, int, tuple[float, ...]]


class _Pick(TopTwo[float, _Rec]):
    """The top two candidates, and the cheapest one of the request class's default action."""

    __slots__ = ("default", "default_cost", "default_rec")

    def __init__(self, default: Action) -> None:
        super().__init__(_INF)
        self.default = default
        self.default_cost = _INF
        self.default_rec: _Rec | None = None

    def consider(self, cost: float, rec: _Rec) -> None:
        if rec[0] is self.default and cost < self.default_cost:
            self.default_cost, self.default_rec = cost, rec
        if cost < self.second_key:
            self.offer(cost, rec)

    def bound(self, may_be_default: bool) -> float:
        """A candidate costing this much or more changes nothing (`may_be_default`: it may
        have the default's action)."""
        d = self.default_cost
        return d if may_be_default and d > self.second_key else self.second_key


class OwnerServePolicy:
    """Single-owner, cost-based PD-hybrid planning (mission 3.6.5): a* = argmin_a C(a)."""

    name = "ownerserve"

    def __init__(self, config: CostConfig | None = None, model: CostModel | None = None) -> None:
        self.model = model or CostModel(config)

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        model = self.model
        rclass = classify(request, model.config)
        k = RequestCosts(model, request)
        pick = _Pick(DEFAULT_ACTION[rclass])
        cont = rclass is _RC_CONT
        sess_id = request.session_owner
        lam, mu = k.lam, k.mu
        handshake = model.config.pd_handshake_s
        n = k.n
        kb = request.kv_bytes_per_token
        lam_nk = lam * (n * kb)  # λ·(N − r)·K for r = 0
        ob = k.ob

        src_f = fetch_source(request, cluster)
        src_m = migration_source(request, cluster)
        g_m = tier_blocks(src_m)[0] if src_m is not None else 0
        # the most a worker holding nothing can reuse (after a fetch or a migration): its least
        # prefill, for the lower bound of its candidates
        r_fetch, r_mig = k.reused(ob), k.reused(g_m)
        r_lo = max(r_fetch if src_f is not None else 0, r_mig)
        considered = n_p = n_d = n_both = 0
        nodes: dict[str, _NodeBest] = {}
        dparts: list[_DPart] = []
        # what a candidate must cost less than to matter: to enter the top two (`top_bound`),
        # to be the cheapest of the default's action (`dflt_bound`; -inf when the default is
        # remote prefill, which the worker pass does not generate), and a remote one
        # (`bound_remote`, `_Pick.bound`); bounds only fall, and only when a candidate is offered
        dflt = pick.default
        dflt_here = dflt is not _REMOTE
        dflt_colocated = dflt is _COL or dflt is _CONT or dflt is _TAIL
        top_bound = bound_remote = _INF
        dflt_bound = _INF if dflt_here else -_INF
        # candidates on a worker holding nothing: colocated, a fetch, a migration
        per_none = 1 + (src_f is not None) + (src_m is not None)
        # per profile, in the order workers come: the constants and, for a worker holding
        # nothing, the least prefill (at scale 1) of its candidates
        cur_prof: str | None = None
        c: tuple[float, ...] = ()
        least_none = pf_fetch = pf_mig = 0.0
        workers = cluster.workers
        for w, (q, dec, pf, stalled, g, held, r, rest, dup_g, dup_h) in zip(
            workers, k.scan(workers), strict=True
        ):
            if not w.healthy:
                continue
            if w.profile is not cur_prof:
                cur_prof = w.profile
                c = k.consts(cur_prof)
                least_none = k.prefill_base(c, r_lo)
                # prefill after a fetch / a migration (reusing owner_blocks / gpu(S)), scale 1
                pf_fetch = k.prefill_base(c, r_fetch)
                pf_mig = k.prefill_base(c, r_mig)
            role = w.role
            if role is not _PREFILL:
                n_d += 1
                base = q + dec + rest
                # every candidate on w costs at least its least prefill, stretched by the
                # decodes it stalls, on top of `base`
                if not held:
                    # a fetch (owner_blocks > 0) unless w is the owner, a migration (the session
                    # owner holds GPU blocks, so it is never w)
                    considered += per_none if w is not src_f else per_none - 1
                    fetch_ok = src_f is not None and w is not src_f
                    mig_ok = src_m is not None
                    least = w.prefill_scale * least_none
                else:
                    fetch_ok = src_f is not None and ob > held and w is not src_f
                    mig_ok = src_m is not None and g_m > held and w is not src_m
                    considered += 1 + fetch_ok + mig_ok
                    if (fetch_ok or mig_ok) and r_lo > r:
                        least = w.prefill_scale * k.prefill_base(c, r_lo)
                    else:
                        least = pf
                # skip w unless a candidate on it can enter the top two, or be the cheapest
                # of the default's action (and then only that action is costed)
                lb = base + least + mu * (stalled * least)
                top = lb < top_bound
                if top or lb < dflt_bound:
                    offered = False
                    if top or dflt_colocated:
                        if held > g:
                            kind = _TAIL
                        elif cont and g > 0 and w.worker_id == sess_id:
                            kind = _CONT
                        else:
                            kind = _COL
                        cost = _colocated(k, base, pf, stalled, dup_h)
                        if cost < top_bound or cost < dflt_bound:
                            pick.consider(cost, (kind, w, w, None))
                            offered = True
                    if fetch_ok and (top or dflt is _FETCH):
                        assert src_f is not None
                        sp = w.prefill_scale
                        cost = _fetch(k, w, src_f, base, stalled, dup_h, held, sp * pf_fetch)
                        if cost < top_bound or cost < dflt_bound:
                            pick.consider(cost, (_FETCH, w, w, src_f))
                            offered = True
                    if mig_ok and (top or dflt is _MIG):
                        assert src_m is not None
                        sp = w.prefill_scale
                        cost = _migration(k, w, src_m, g_m, base, stalled, held, sp * pf_mig)
                        if cost < top_bound or cost < dflt_bound:
                            pick.consider(cost, (_MIG, w, w, src_m))
                            offered = True
                    if offered:
                        top_bound = pick.second_key
                        if dflt_here:  # else no remote candidate yet: no remote bound
                            dflt_bound = pick.default_cost
                            bound_remote = top_bound
                # the D part of remote prefill into w: q(D) + decode(D) + handshake + λ·dup(D)
                bd = q + dec + handshake + lam * dup_g
                if bd < bound_remote:
                    dparts.append((bd, w, g, c))

            if role is not _DECODE:
                n_p += 1
                if role is not _PREFILL:
                    n_both += 1
                # the P part: q(P) + prefill + restore + λ·(N − r)·K + μ·stalled(P)·prefill
                a = q + pf + rest + (lam * ((n - r) * kb) if r else lam_nk) + mu * (stalled * pf)
                t = nodes.get(w.node)
                if t is None:
                    nodes[w.node] = (a, w, _INF, None)
                elif a < t[2]:
                    nodes[w.node] = (a, w, t[0], t[1]) if a < t[0] else (t[0], t[1], a, w)

        if nodes and dparts:
            _remote(pick, k, nodes, dparts)
        if n_p and n_d:
            considered += n_p * n_d - n_both

        if pick.first is None:
            raise NoWorkerAvailableError("no healthy worker can serve this request")
        rdef = pick.default_rec
        if rdef is not None:
            pick.prefer(pick.default_cost, rdef, rdef[0] is not pick.first[0])
        chosen = Route(*pick.first)
        runner = None if pick.second is None else Route(*pick.second)
        return make_plan(
            self.name,
            model,
            request,
            chosen,
            runner,
            request_class=rclass,
            candidates_considered=considered,
            add_replica_on=chosen.decode.worker_id if chosen.action is _FETCH else None,
            # the search's own total for the default (the same terms, not re-costed)
            default_cost_s=None if rdef is None else pick.default_cost,
            costs=k,
        )


def _colocated(k: RequestCosts, base: float, pf: float, stalled: int, dup: int) -> float:
    """C of prefilling and decoding on w with what it holds (continuation, tail recompute or
    colocated prefill; the name never changes the cost): `base` (q + decode + restore of w) +
    prefill + λ·dup(w, held) + μ·stalled(w)·prefill."""
    return base + pf + k.lam * dup + k.mu * (stalled * pf)


def _fetch(
    k: RequestCosts,
    w: WorkerView,
    src: WorkerView,
    base: float,
    stalled: int,
    dup: int,
    held: int,
    pf: float,
) -> float:
    """C of an artifact fetch from the owner `src` to w (a read-only replica): the missing
    owner_blocks − held blocks move, w reuses owner_blocks (its prefill `pf`) and pays
    λ·dup(w, held) for the replica."""
    tn = k.transfer(src, w, (k.ob - held) * k.bk)[0]
    return base + pf + tn + k.lam * dup + k.mu * (stalled * pf)


def _migration(
    k: RequestCosts,
    w: WorkerView,
    src: WorkerView,
    g_src: int,
    base: float,
    stalled: int,
    held: int,
    pf: float,
) -> float:
    """C of moving the session from its owner `src` (holding g_src blocks in GPU) to w: the
    missing blocks move and stay duplicated (M_HBM), w reuses g_src blocks (its prefill `pf`),
    and the move pays its hysteresis."""
    moved = (g_src - held) * k.bk
    tn = k.transfer(src, w, moved)[0]
    c0 = base + pf + tn + k.lam * moved + k.mu * (stalled * pf)
    return c0 + k.hysteresis(c0)


def _remote(
    pick: _Pick, k: RequestCosts, nodes: dict[str, _NodeBest], dparts: list[_DPart]
) -> None:
    """Remote prefill P→D for every D part, exactly: for each D the best P is the best P part on
    D's node (the intra-node link) or the best one overall (the inter-node link, with the P
    node's NIC backlog added when KV moves); two of each are kept to exclude P = D."""
    # the best two P parts overall, from the best two of each node: as they are (a pair that
    # moves nothing) and with the node's NIC backlog added (one that moves KV to another node;
    # a node's workers share its backlog, so its best two stay its best two)
    ga1 = ga2 = _INF
    gw1: WorkerView | None = None
    gw2: WorkerView | None = None
    waits = False
    for a1, w1, a2, w2 in nodes.values():
        if a1 < ga2:
            if a1 < ga1:
                ga1, gw1, ga2, gw2 = a1, w1, ga1, gw1
            else:
                ga2, gw2 = a1, w1
            if a2 < ga2:
                ga2, gw2 = a2, w2
        if w1.nic_backlog_s:
            waits = True
    ba1, bw1, ba2, bw2 = ga1, gw1, ga2, gw2
    if waits:
        ba1 = ba2 = _INF
        for a1, w1, a2, w2 in nodes.values():
            wait = w1.nic_backlog_s
            a1 += wait
            if a1 < ba2:
                if a1 < ba1:
                    ba1, bw1, ba2, bw2 = a1, w1, ba1, bw1
                else:
                    ba2, bw2 = a1, w1
                a2 += wait
                if a2 < ba2:
                    ba2, bw2 = a2, w2
    n = k.n
    bs = k.request.block_size
    kb = k.request.kv_bytes_per_token
    track_def = pick.default is _REMOTE
    bound = pick.bound(track_def)
    link = k.link
    p: WorkerView | None
    for bd, d, gd, c in dparts:
        # bd + ga1 is a lower bound of every pair into D, and bd + a of a pair from P (links
        # cost >= 0): cheaper tests first
        if bd + ga1 >= bound:
            continue
        nbytes = (n - gd * bs) * kb
        node = d.node
        tn = nodes.get(node)
        if tn is not None:
            a, p = (tn[0], tn[1]) if tn[1] is not d else (tn[2], tn[3])
            if p is not None and bd + a < bound:
                pick.consider(bd + a + link(d, nbytes, True, c), (_REMOTE, p, d, None))
                bound = pick.bound(track_def)
        if nbytes <= 0:  # nothing moves: no link, no backlog
            a, p = (ga1, gw1) if gw1 is not d else (ga2, gw2)
        else:
            a, p = (ba1, bw1) if bw1 is not d else (ba2, bw2)
        if p is not None and p.node != node and bd + a < bound:
            pick.consider(bd + a + link(d, nbytes, False, c), (_REMOTE, p, d, None))
            bound = pick.bound(track_def)
