"""The OwnerServe policy: argmin of C(a) over every candidate of `planner.cost.enumerate_routes`.

Every cost comes from the request's `planner.cost.RequestCosts` (the formulas `evaluate` uses):
one pass over the workers takes each one's terms (`RequestCosts.scan`) and generates its
candidates, one function per action (`_colocated`, `_fetch`, `_migration`); remote prefill P→D
is searched exactly in O(P + D) (`_remote`) because its cost splits into a P part, a D part and
a link that only depends on whether P and D share a node. Candidates that cannot enter the top
two are skipped by lower bounds. The chosen candidate and the runner-up get their breakdown
term by term from the same workers' terms (`RequestCosts.candidate`; tests check the search's
choice against the full reference enumeration).
"""

from __future__ import annotations

from ownerserve.errors import NoWorkerAvailableError
from ownerserve.types import Role
from planner.classify import DEFAULT_ACTION, classify
from planner.cost import (
    CostConfig,
    CostModel,
    RequestCosts,
    Route,
    WorkerTerms,
    colocated_kind,
    fetch_source,
    migration_source,
    tier_blocks,
)
from planner.policies.base import TopTwo, plan_of
from planner.types import (
    Action,
    Candidate,
    ClusterView,
    Plan,
    RequestClass,
    RequestView,
    WorkerView,
)

_INF = float("inf")
_PREFILL, _DECODE = Role.PREFILL, Role.DECODE
_COL, _CONT, _TAIL = Action.COLOCATED_PREFILL, Action.DECODE_CONTINUATION, Action.TAIL_RECOMPUTE
_FETCH, _MIG, _REMOTE = Action.ARTIFACT_FETCH, Action.STATE_MIGRATION, Action.REMOTE_PREFILL
_RC_CONT = RequestClass.DECODE_CONTINUATION

# a candidate: (action, prefill worker's terms, decode worker's terms, source)
_Rec = tuple[Action, WorkerTerms, WorkerTerms, WorkerView | None]
# the best two P parts of a node: (cost, worker's terms, cost, worker's terms)
_NodeBest = tuple[float, WorkerTerms, float, WorkerTerms | None]
# a D part of remote prefill: (cost, worker's terms)
_DPart = tuple[float, WorkerTerms]


class _Pick(TopTwo[float, _Rec]):
    """The top two candidates, the cheapest one of the request class's default action, and
    what the candidates on one worker need (`on_worker`): the fetch and migration sources, the
    session owner's GPU blocks `g_m`, and per profile its constants and the prefill after a
    fetch and after a migration at scale 1 (`profiles`)."""

    __slots__ = (
        "costs",
        "default",
        "default_cost",
        "default_rec",
        "g_m",
        "home",
        "profiles",
        "src_f",
        "src_m",
    )

    def __init__(self, default: Action, costs: RequestCosts) -> None:
        super().__init__(_INF)
        self.default = default
        self.default_cost = _INF
        self.default_rec: _Rec | None = None
        self.costs = costs
        self.home = costs.request.home_worker
        self.src_f: WorkerView | None = None
        self.src_m: WorkerView | None = None
        self.g_m = 0
        self.profiles: dict[str, tuple[tuple[float, ...], float, float]] = {}

    def consider(self, cost: float, rec: _Rec) -> None:
        """Offer a candidate to the top two, and keep it if it is the cheapest of the
        default's action. A candidate that moves a resident session off its home worker pays
        H_move here (`RequestCosts.moves`; a migration's is in its cost already): it only
        adds, so the callers' tests on the cost before it stay lower bounds."""
        home = self.home
        if home is not None and rec[0] is not _MIG and rec[2][0].worker_id != home:
            cost += self.costs.hysteresis(cost)
        if rec[0] is self.default and cost < self.default_cost:
            self.default_cost, self.default_rec = cost, rec
        if cost < self.second_key:
            self.offer(cost, rec)

    def bound(self, may_be_default: bool) -> float:
        """A candidate costing this much or more changes nothing (`may_be_default`: it may
        have the default's action)."""
        d = self.default_cost
        return d if may_be_default and d > self.second_key else self.second_key

    def on_worker(
        self, t: WorkerTerms, kind: Action, base: float, top: bool, fetch_ok: bool, mig_ok: bool
    ) -> None:
        """Consider the candidates on the worker of terms `t` (`kind`: its colocated candidate's
        action, `base`: its q + decode + restore): all of them when one may enter the top two
        (`top`), else only those of the default's action; a fetch if `fetch_ok`, a migration if
        `mig_ok`."""
        k = self.costs
        w, _, _, pf, stalled, dup, h, _ = t
        dflt = self.default
        if top or kind is dflt:
            self.consider(_colocated(k, base, pf, stalled, dup), (kind, t, t, None))
        fetch_ok = fetch_ok and (top or dflt is _FETCH)
        mig_ok = mig_ok and (top or dflt is _MIG)
        if not (fetch_ok or mig_ok):
            return
        prof = self.profiles.get(w.profile)
        if prof is None:
            c = k.consts(w.profile)
            # the profile's constants, and its prefill at scale 1 after a fetch (reusing
            # owner_blocks) and after a migration (reusing gpu(S))
            prof = self.profiles[w.profile] = (
                c,
                k.prefill_base(c, k.reused(k.ob)),
                k.prefill_base(c, k.reused(self.g_m)),
            )
        c, pf_fetch, pf_mig = prof
        sp = w.prefill_scale
        held = 0 if h is None else h[1]
        # its prefill after the move reuses (or fetches) its chunks too
        chunked = bool(w.chunks_held) or bool(k.chunk_src)
        if fetch_ok:
            src = self.src_f
            assert src is not None
            pf_f = k.prefill(w, k.reused(k.ob), c) if chunked else sp * pf_fetch
            cost = _fetch(k, w, src, base, stalled, dup, held, pf_f, c)
            self.consider(cost, (_FETCH, t, t, src))
        if mig_ok:
            src = self.src_m
            assert src is not None
            pf_m = k.prefill(w, k.reused(self.g_m), c) if chunked else sp * pf_mig
            cost = _migration(k, w, src, self.g_m, base, stalled, held, pf_m, c)
            self.consider(cost, (_MIG, t, t, src))


class OwnerServePolicy:
    """Single-owner, cost-based PD-hybrid planning: a* = argmin_a C(a)."""

    name = "ownerserve"

    def __init__(self, config: CostConfig | None = None, model: CostModel | None = None) -> None:
        self.model = model or CostModel(config)

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        model = self.model
        rclass = classify(request, model.config)
        k = RequestCosts(model, request, cluster)
        cont = rclass is _RC_CONT
        pick = _Pick(DEFAULT_ACTION[rclass], k)
        # how a colocated candidate on a worker holding nothing is named
        kind_none = colocated_kind(request, "", 0, 0, cont)
        lam, mu = k.lam, k.mu
        handshake = model.config.pd_handshake_s
        # λ·M_HBM of remote prefill from a P worker holding nothing: its copy of the prompt
        copy_none = lam * k.prompt_copy(0)
        ob = k.ob

        src_f = pick.src_f = fetch_source(request, cluster)
        src_m = pick.src_m = migration_source(request, cluster)
        g_m = pick.g_m = tier_blocks(src_m)[0] if src_m is not None else 0
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
        dflt_here = pick.default is not _REMOTE
        top_bound = bound_remote = _INF
        dflt_bound = _INF if dflt_here else -_INF
        # the least prefill (at scale 1) of any candidate on a worker holding nothing (the least
        # over the loaded profiles: a lower bound of every worker's)
        least_lo = _INF
        # a prefill fetching chunks may reuse all but the last token (`chunk_fetch`)
        r_least = k.n - 1 if k.chunk_src else r_lo
        for name in model.profiles:
            least = k.prefill_base(k.consts(name), r_least)
            if least < least_lo:
                least_lo = least
        # decode-capable workers holding nothing; of them, those with a KV API (a fetch or a
        # migration may land there) and those speaking a P/D hand-over (a remote prefill's D)
        n_lean = n_lean_api = n_lean_pd = 0
        # the workers speak more than one P/D hand-over: P parts are kept per group and node
        mixed = cluster.pd_mixed
        for t in k.scan(cluster.workers):
            w, q, dec, pf, stalled, dup, h, _ = t
            if not w.healthy:
                continue
            role = w.role
            if h is None:  # w holds nothing of the prefix (most workers): the lean path
                if role is not _PREFILL:
                    n_lean += 1
                    api = w.kv_api
                    if api:
                        n_lean_api += 1
                        if w is src_f:  # counted a fetch from itself above: none
                            considered -= 1
                    qd = q + dec
                    # every candidate on w costs at least its least prefill, stretched by the
                    # decodes it stalls; skip w unless one can enter the top two, or be the
                    # cheapest of the default's action (and then only that action is costed)
                    least = w.prefill_scale * least_lo
                    lb = qd + least + mu * (stalled * least)
                    if lb < top_bound or lb < dflt_bound:
                        fetch_ok = api and src_f is not None and w is not src_f
                        top = lb < top_bound
                        pick.on_worker(t, kind_none, qd, top, fetch_ok, api and src_m is not None)
                        top_bound = pick.second_key
                        if dflt_here:  # else no remote candidate yet: no remote bound
                            dflt_bound = pick.default_cost
                            bound_remote = top_bound
                    if w.pd_group is not None:
                        n_lean_pd += 1
                        # the D part of remote prefill into w: q + decode + handshake +
                        # handover(w) + λ·dup(w, 0)
                        bd = qd + handshake + w.handover_s + lam * dup
                        if bd < bound_remote:
                            dparts.append((bd, t))
                if role is not _DECODE and w.pd_group is not None:
                    n_p += 1
                    if role is not _PREFILL:
                        n_both += 1
                    # the P part: q + prefill + λ·N·K + μ·stalled·prefill
                    a = q + pf + copy_none
                    if stalled:
                        a += mu * (stalled * pf)
                    key = f"{w.pd_group}\0{w.node}" if mixed else w.node
                    node = nodes.get(key)
                    if node is None:
                        nodes[key] = (a, t, _INF, None)
                    elif a < node[2]:
                        nodes[key] = (a, t, *node[:2]) if a < node[0] else (*node[:2], a, t)
                continue

            _, held, r, rest, dup_g = h
            if role is not _PREFILL:
                base = q + dec + rest
                api = w.kv_api
                fetch_ok = api and src_f is not None and ob > held and w is not src_f
                mig_ok = api and src_m is not None and g_m > held and w is not src_m
                considered += 1 + fetch_ok + mig_ok
                least = pf
                if (fetch_ok or mig_ok) and (w.chunks_held or k.chunk_src):
                    least = 0.0  # after a move its chunk reuse changes: no cheap bound
                elif (fetch_ok or mig_ok) and r_lo > r:
                    least = w.prefill_scale * least_lo
                lb = base + least + mu * (stalled * least)
                if lb < top_bound or lb < dflt_bound:
                    kind = colocated_kind(request, w.worker_id, h[0], held, cont)
                    pick.on_worker(t, kind, base, lb < top_bound, fetch_ok, mig_ok)
                    top_bound = pick.second_key
                    if dflt_here:
                        dflt_bound = pick.default_cost
                        bound_remote = top_bound
                if w.pd_group is not None:
                    n_d += 1
                    # the D part: q + decode + handshake + handover(w) + λ·dup(w, gpu(w))
                    bd = q + dec + handshake + w.handover_s + lam * dup_g
                    if bd < bound_remote:
                        dparts.append((bd, t))
            if role is not _DECODE and w.pd_group is not None:
                n_p += 1
                if role is not _PREFILL:
                    n_both += 1
                # the P part: q + prefill + restore + λ·(N − r)·K + μ·stalled·prefill
                a = q + pf + rest + lam * k.prompt_copy(r) + mu * (stalled * pf)
                key = f"{w.pd_group}\0{w.node}" if mixed else w.node
                node = nodes.get(key)
                if node is None:
                    nodes[key] = (a, t, _INF, None)
                elif a < node[2]:
                    nodes[key] = (a, t, *node[:2]) if a < node[0] else (*node[:2], a, t)

        if nodes and dparts:
            if mixed:
                _remote_by_group(pick, k, nodes, dparts)
            else:
                _remote(pick, k, nodes, dparts)
        # on a worker holding nothing: colocated, and with a KV API a fetch (owner_blocks > 0)
        # unless it is the owner, a migration (the session owner holds GPU blocks, so it is
        # never that worker)
        considered += n_lean + n_lean_api * ((src_f is not None) + (src_m is not None))
        if mixed:
            considered += _pd_pairs(cluster.workers)
        else:
            n_d += n_lean_pd
            if n_p and n_d:
                considered += n_p * n_d - n_both

        first = pick.first
        if first is None:
            raise NoWorkerAvailableError("no healthy worker can serve this request")
        rdef = pick.default_rec
        if rdef is not None:
            pick.prefer(pick.default_cost, rdef, rdef[0] is not first[0])
        chosen = _candidate(k, pick.first)
        return plan_of(
            self.name,
            rclass,
            chosen,
            None if pick.second is None else _candidate(k, pick.second),
            candidates_considered=considered,
            add_replica_on=chosen.decode_worker if chosen.action is _FETCH else None,
            # the search's own total for the default (the same terms, not re-costed)
            default_cost_s=None if rdef is None else pick.default_cost,
        )


def _remote_by_group(
    pick: _Pick, k: RequestCosts, nodes: dict[str, _NodeBest], dparts: list[_DPart]
) -> None:
    """`_remote` once per P/D hand-over: `nodes` keyed `group\\0node`, each D part paired only
    with P parts of its own group."""
    groups: dict[str, tuple[dict[str, _NodeBest], list[_DPart]]] = {}
    for key, best in nodes.items():
        group, _, node = key.partition("\0")
        groups.setdefault(group, ({}, []))[0][node] = best
    for part in dparts:
        entry = groups.get(str(part[1][0].pd_group))
        if entry is not None:
            entry[1].append(part)
    for by_node, ds in groups.values():
        if by_node and ds:
            _remote(pick, k, by_node, ds)


def _pd_pairs(workers: tuple[WorkerView, ...]) -> int:
    """Remote prefill pairs P ≠ D among healthy workers that speak one P/D hand-over."""
    count: dict[str, list[int]] = {}
    for w in workers:
        g = w.pd_group
        if not w.healthy or g is None:
            continue
        c = count.setdefault(g, [0, 0, 0])
        p, d = w.role is not _DECODE, w.role is not _PREFILL
        c[0] += p
        c[1] += d
        c[2] += p and d
    return sum(p * d - both for p, d, both in count.values() if p and d)


def _candidate(k: RequestCosts, rec: _Rec | None) -> Candidate:
    """The candidate of a search record, its breakdown from the terms the search took."""
    assert rec is not None
    action, tp, td, src = rec
    return k.candidate(Route(action, tp[0], td[0], src), tp, td)


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
    c: tuple[float, ...],
) -> float:
    """C of an artifact fetch from the owner `src` to w (a read-only replica; `c`: the
    constants of w's profile): the missing owner_blocks − held blocks move, w reuses
    owner_blocks (its prefill `pf`) and pays λ·dup(w, held) for the replica."""
    tn = k.transfer(src, w, (k.ob - held) * k.bk, c)[0] + w.handover_s
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
    c: tuple[float, ...],
) -> float:
    """C of moving the session from its owner `src` (holding g_src blocks in GPU) to w (`c`:
    the constants of w's profile): the missing blocks move and stay duplicated (M_HBM), w
    reuses g_src blocks (its prefill `pf`), and the move pays its hysteresis."""
    moved = (g_src - held) * k.bk
    tn = k.transfer(src, w, moved, c)[0] + w.handover_s
    c0 = base + pf + tn + k.lam * moved + k.mu * (stalled * pf)
    return c0 + k.hysteresis(c0)


def _remote(
    pick: _Pick, k: RequestCosts, nodes: dict[str, _NodeBest], dparts: list[_DPart]
) -> None:
    """Remote prefill P→D for every D part, exactly: for each D the best P is the best P part on
    D's node (the intra-node link) or the best one overall (the inter-node link, with the P
    node's NIC backlog added when KV moves); two of each are kept to exclude P = D. A pair
    into a D that is not the session's home worker pays H_move (`_Pick.consider`), a growing
    function of the pair's other terms: D's best P stays its best P."""
    # the best two P parts overall, from the best two of each node: as they are (a pair that
    # moves nothing) and with the node's NIC backlog added (one that moves KV to another node;
    # a node's workers share its backlog, so its best two stay its best two)
    ga1 = ga2 = _INF
    gt1: WorkerTerms | None = None
    gt2: WorkerTerms | None = None
    waits = False
    for a1, t1, a2, t2 in nodes.values():
        if a1 < ga2:
            if a1 < ga1:
                ga1, gt1, ga2, gt2 = a1, t1, ga1, gt1
            else:
                ga2, gt2 = a1, t1
            if a2 < ga2:
                ga2, gt2 = a2, t2
        if t1[0].nic_backlog_s:
            waits = True
    ba1, bt1, ba2, bt2 = ga1, gt1, ga2, gt2
    if waits:
        ba1 = ba2 = _INF
        for a1, t1, a2, t2 in nodes.values():
            wait = t1[0].nic_backlog_s
            a1 += wait
            if a1 < ba2:
                if a1 < ba1:
                    ba1, bt1, ba2, bt2 = a1, t1, ba1, bt1
                else:
                    ba2, bt2 = a1, t1
                a2 += wait
                if a2 < ba2:
                    ba2, bt2 = a2, t2
    track_def = pick.default is _REMOTE
    bound = pick.bound(track_def)
    # pick.bound(track_def) after each consider, inline (a call per candidate costs more)
    link = k.link
    nbytes_none = k.kv_to_decode(0)  # into a D holding nothing of the prefix
    tp: WorkerTerms | None
    for bd, td in dparts:
        # bd + ga1 is a lower bound of every pair into D, and bd + a of a pair from P (links
        # and H_move cost >= 0): cheaper tests first
        if bd + ga1 >= bound:
            continue
        d = td[0]
        h = td[6]
        nbytes = nbytes_none if h is None else k.kv_to_decode(h[0])
        c = k.consts(d.profile)
        node = d.node
        tn = nodes.get(node)
        if tn is not None:
            a, tp = (tn[0], tn[1]) if tn[1] is not td else (tn[2], tn[3])
            if tp is not None and bd + a < bound:
                pick.consider(bd + a + link(d, nbytes, True, c), (_REMOTE, tp, td, None))
                bound = pick.second_key
                if track_def and pick.default_cost > bound:
                    bound = pick.default_cost
        if nbytes <= 0:  # nothing moves: no link, no backlog
            a, tp = (ga1, gt1) if gt1 is not td else (ga2, gt2)
        else:
            a, tp = (ba1, bt1) if bt1 is not td else (ba2, bt2)
        if tp is not None and tp[0].node != node and bd + a < bound:
            pick.consider(bd + a + link(d, nbytes, False, c), (_REMOTE, tp, td, None))
            bound = pick.second_key
            if track_def and pick.default_cost > bound:
                bound = pick.default_cost
