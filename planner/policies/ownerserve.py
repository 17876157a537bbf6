"""The OwnerServe policy: argmin of C(a) over every candidate of `planner.cost.enumerate_routes`.

Every cost comes from the request's `planner.cost.RequestCosts` (the formulas `evaluate` uses):
one pass over the workers takes each one's terms (`RequestCosts.scan`) and generates its
candidates, one function per action (`_colocated`, `_fetch`, `_migration`); remote prefill P→D
is searched exactly in O(P + D) (`_remote`) because its cost splits into a P part, a D part and
a link that only depends on whether P and D share a node. Candidates that cannot enter the top
two are skipped by lower bounds. The chosen candidate and the runner-up get their breakdown
term by term from the same workers' terms (`RequestCosts.candidate_of`; tests check the
search's choice against the full reference enumeration). Every value is read by name: the
workers' terms are `ScanTerms` columns, and what the search keeps refers to them by index.
"""

from __future__ import annotations

from collections.abc import Sequence

from ownerserve.errors import NoWorkerAvailableError
from ownerserve.types import Role
from planner.classify import DEFAULT_ACTION, classify
from planner.cost import (
    CostConfig,
    CostModel,
    ProfileConstants,
    RequestCosts,
    ScanTerms,
    colocated_kind,
    fetch_source,
    gpu_blocks,
    migration_source,
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


class _Moves:
    """What a fetch or a migration into a worker of one profile needs (`_Pick.on_worker`):
    the profile's constants and its prefill_base at scale 1 reusing owner_blocks (after a
    fetch, `prefill_fetch`) and gpu(session owner) (after a migration, `prefill_migration`).
    A `__slots__` class, as `planner.cost`'s records of the search's hot path."""

    __slots__ = ("constants", "prefill_fetch", "prefill_migration")

    def __init__(
        self, constants: ProfileConstants, prefill_fetch: float, prefill_migration: float
    ) -> None:
        self.constants = constants
        self.prefill_fetch = prefill_fetch
        self.prefill_migration = prefill_migration


class _NodeBest:
    """The best two P parts of a node: their costs and the indices of their workers' terms
    (an accumulator, updated inline by the search; of equal costs the first offered
    stays first, as in `TopTwo`)."""

    __slots__ = ("cost1", "cost2", "p1", "p2")

    def __init__(self, cost: float, p: int) -> None:
        self.cost1 = cost
        self.p1 = p
        self.cost2 = _INF
        self.p2: int | None = None


class _Pick(TopTwo[float, int]):
    """The top two candidates, the cheapest one of the request class's default action, and
    what the candidates on one worker need (`on_worker`): the scanned workers, the fetch and
    migration sources, the session owner's GPU blocks `g_m`, and per profile what a move into
    it needs (`profiles`). A candidate kept is a number j: its action is `actions[j]`, its
    prefill and decode workers `workers[prefills[j]]` and `workers[decodes[j]]`, its source
    that of its action (`src_f` for a fetch, `src_m` for a migration, else none) (columns: a
    record per kept candidate costs more to build)."""

    __slots__ = (
        "actions",
        "costs",
        "decodes",
        "default",
        "default_cost",
        "default_rec",
        "g_m",
        "home",
        "prefills",
        "profiles",
        "src_f",
        "src_m",
        "workers",
    )

    def __init__(self, default: Action, costs: RequestCosts) -> None:
        super().__init__(_INF)
        self.default = default
        self.default_cost = _INF
        self.default_rec: int | None = None
        self.actions: list[Action] = []
        self.prefills: list[int] = []
        self.decodes: list[int] = []
        self.costs = costs
        self.home = costs.request.home_worker
        self.workers: Sequence[WorkerView] = ()
        self.src_f: WorkerView | None = None
        self.src_m: WorkerView | None = None
        self.g_m = 0
        self.profiles: dict[str, _Moves] = {}

    def consider(self, cost: float, action: Action, p: int, d: int) -> None:
        """Offer a candidate (prefill on `workers[p]`, decode on `workers[d]`, from the source
        of its action) to the top two, and keep it if it is the cheapest of the default's
        action. A candidate that moves a resident session off its home worker pays H_move
        here (`RequestCosts.moves`; a migration's is in its cost already): it only adds, so
        the callers' tests on the cost before it stay lower bounds."""
        home = self.home
        if home is not None and action is not _MIG and self.workers[d].worker_id != home:
            cost += self.costs.hysteresis(cost)
        default = action is self.default and cost < self.default_cost
        if default or cost < self.second_key:
            j = len(self.actions)
            self.actions.append(action)
            self.prefills.append(p)
            self.decodes.append(d)
            if default:
                self.default_cost, self.default_rec = cost, j
            if cost < self.second_key:
                self.offer(cost, j)

    def bound(self, may_be_default: bool) -> float:
        """A candidate costing this much or more changes nothing (`may_be_default`: it may
        have the default's action)."""
        d = self.default_cost
        return d if may_be_default and d > self.second_key else self.second_key

    def on_worker(
        self,
        i: int,
        pf: float,
        stalled: int,
        dup: int,
        held: int,
        kind: Action,
        base: float,
        top: bool,
        fetch_ok: bool,
        mig_ok: bool,
    ) -> None:
        """Consider the candidates on `workers[i]` (its terms: prefill `pf`, `stalled`, `dup`
        = dup(w, held), `held` blocks; `kind`: its colocated candidate's action, `base`: its q +
        decode + restore): all of them when one may enter the top two (`top`), else only those
        of the default's action; a fetch if `fetch_ok`, a migration if `mig_ok`."""
        k = self.costs
        dflt = self.default
        if top or kind is dflt:
            self.consider(_colocated(k, base, pf, stalled, dup), kind, i, i)
        fetch_ok = fetch_ok and (top or dflt is _FETCH)
        mig_ok = mig_ok and (top or dflt is _MIG)
        if not (fetch_ok or mig_ok):
            return
        w = self.workers[i]
        moves = self.profiles.get(w.profile)
        if moves is None:
            c = k.constants(w.profile)
            moves = self.profiles[w.profile] = _Moves(
                c, k.prefill_base(c, k.reused(k.ob)), k.prefill_base(c, k.reused(self.g_m))
            )
        c = moves.constants
        sp = w.prefill_scale
        # its prefill after the move reuses (or fetches) its chunks too
        chunked = bool(w.chunks_held) or bool(k.chunk_src)
        # a hybrid spec's hit after the move resumes where w's windows let it
        hybrid = k.rule is not None
        if fetch_ok:
            src = self.src_f
            assert src is not None
            if hybrid:
                pf_f = k.prefill(w, k.reused(k.resume_moved(w, held, k.ob - held, c)[0]), c)
            elif chunked:
                pf_f = k.prefill(w, k.reused(k.ob), c)
            else:
                pf_f = sp * moves.prefill_fetch
            cost = _fetch(k, w, src, base, stalled, dup, held, pf_f, c)
            self.consider(cost, _FETCH, i, i)
        if mig_ok:
            src = self.src_m
            assert src is not None
            g_m = self.g_m
            if hybrid:
                pf_m = k.prefill(w, k.reused(k.resume_moved(w, held, g_m - held, c)[0]), c)
            elif chunked:
                pf_m = k.prefill(w, k.reused(g_m), c)
            else:
                pf_m = sp * moves.prefill_migration
            cost = _migration(k, w, src, g_m, base, stalled, held, pf_m, c)
            self.consider(cost, _MIG, i, i)


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
        xi_on = k.xi > 0
        handshake = model.config.pd_handshake_s
        # λ·M_HBM of remote prefill from a P worker holding nothing: its copy of the prompt
        copy_none = lam * k.prompt_copy(0)
        ob = k.ob

        src_f = pick.src_f = fetch_source(request, cluster)
        src_m = pick.src_m = migration_source(request, cluster)
        g_m = pick.g_m = gpu_blocks(src_m) if src_m is not None else 0
        # the most a worker holding nothing can reuse (after a fetch or a migration): its least
        # prefill, for the lower bound of its candidates
        r_fetch, r_mig = k.reused(ob), k.reused(g_m)
        r_lo = max(r_fetch if src_f is not None else 0, r_mig)
        considered = n_p = n_d = n_both = 0
        nodes: dict[str, _NodeBest] = {}
        # the D parts of remote prefill: each one's cost and its worker's index
        d_costs: list[float] = []
        d_index: list[int] = []
        # what a candidate must cost less than to matter: to enter the top two (`top_bound`),
        # to be the cheapest of the default's action (`dflt_bound`; -inf when the default is
        # remote prefill, which the worker pass does not generate), and a remote one
        # (`bound_remote`, `_Pick.bound`); bounds only fall, and only when a candidate is offered
        dflt_here = pick.default is not _REMOTE
        top_bound = bound_remote = _INF
        dflt_bound = _INF if dflt_here else -_INF
        worker_bound = _INF  # the greater of the two: what a worker's candidates must beat
        # the least prefill (at scale 1) of any candidate on a worker holding nothing (the least
        # over the loaded profiles: a lower bound of every worker's)
        least_lo = _INF
        # a prefill fetching chunks may reuse all but the last token (`chunk_fetch`)
        r_least = k.n - 1 if k.chunk_src else r_lo
        for name in model.profiles:
            least = k.prefill_base(k.constants(name), r_least)
            if least < least_lo:
                least_lo = least
        # decode-capable workers holding nothing; of them, those with a KV API (a fetch or a
        # migration may land there) and those speaking a P/D hand-over (a remote prefill's D)
        n_lean = n_lean_api = n_lean_pd = 0
        # the workers speak more than one P/D hand-over: P parts are kept per group and node
        mixed = cluster.pd_mixed
        terms = k.scan(cluster.workers)
        ws = pick.workers = terms.workers
        # what a holder holds (`ScanTerms.holds`)
        t_gpu, t_held, t_reused = terms.gpu, terms.held, terms.reused
        t_restore, t_dup_gpu = terms.restore_s, terms.dup_gpu
        # the columns of one scan (one length: no `strict`, whose keyword costs a parse)
        for i, w, q, dec, pf, stalled, dup, holds in zip(  # noqa: B905
            range(len(ws)),
            ws,
            terms.queue_s,
            terms.decode_s,
            terms.prefill_s,
            terms.stalled,
            terms.dup,
            terms.holds,
        ):
            if not w.healthy:
                continue
            role = w.role
            if not holds:  # w holds nothing of the prefix (most workers): the lean path
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
                    if lb < worker_bound:
                        fetch_ok = api and src_f is not None and w is not src_f
                        top = lb < top_bound
                        mig_ok = api and src_m is not None
                        pick.on_worker(i, pf, stalled, dup, 0, kind_none, qd, top, fetch_ok, mig_ok)
                        top_bound = pick.second_key
                        if dflt_here:  # else no remote candidate yet: no remote bound
                            dflt_bound = pick.default_cost
                            bound_remote = top_bound
                        worker_bound = top_bound if top_bound > dflt_bound else dflt_bound
                    if w.pd_group is not None:
                        n_lean_pd += 1
                        # the D part of remote prefill into w: q + decode + handshake +
                        # handover(w) + λ·dup(w, 0)
                        bd = qd + handshake + w.handover_s + lam * dup
                        if bd < bound_remote:
                            d_costs.append(bd)
                            d_index.append(i)
                if role is not _DECODE and w.pd_group is not None:
                    n_p += 1
                    if role is not _PREFILL:
                        n_both += 1
                    # the P part: q + prefill + λ·N·K + μ·stalled·prefill + copy(P)
                    a = q + pf + copy_none
                    if stalled:
                        a += mu * (stalled * pf)
                    key = f"{w.pd_group}\0{w.node}" if mixed else w.node
                    node = nodes.get(key)
                    if xi_on and (node is None or a < node.cost2):  # copy(P) ≥ 0: else no use
                        a += k.copy_price(w, 0, dup)
                    if node is None:
                        nodes[key] = _NodeBest(a, i)
                    elif a < node.cost2:  # one of its best two (inline: a call costs more)
                        if a < node.cost1:
                            node.cost2, node.p2, node.cost1, node.p1 = node.cost1, node.p1, a, i
                        else:
                            node.cost2, node.p2 = a, i
                continue

            held = t_held[i]
            r = t_reused[i]
            rest = t_restore[i]
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
                if lb < worker_bound:
                    kind = colocated_kind(request, w.worker_id, t_gpu[i], held, cont)
                    top = lb < top_bound
                    pick.on_worker(i, pf, stalled, dup, held, kind, base, top, fetch_ok, mig_ok)
                    top_bound = pick.second_key
                    if dflt_here:
                        dflt_bound = pick.default_cost
                        bound_remote = top_bound
                    worker_bound = top_bound if top_bound > dflt_bound else dflt_bound
                if w.pd_group is not None:
                    n_d += 1
                    # the D part: q + decode + handshake + handover(w) + λ·dup(w, gpu(w))
                    bd = q + dec + handshake + w.handover_s + lam * t_dup_gpu[i]
                    if bd < bound_remote:
                        d_costs.append(bd)
                        d_index.append(i)
            if role is not _DECODE and w.pd_group is not None:
                n_p += 1
                if role is not _PREFILL:
                    n_both += 1
                # the P part: q + prefill + restore + λ·(N − r)·K + μ·stalled·prefill + copy(P)
                a = q + pf + rest + lam * k.prompt_copy(r) + mu * (stalled * pf)
                key = f"{w.pd_group}\0{w.node}" if mixed else w.node
                node = nodes.get(key)
                if xi_on and (node is None or a < node.cost2):
                    a += k.copy_price(w, r, dup)
                if node is None:
                    nodes[key] = _NodeBest(a, i)
                elif a < node.cost2:  # one of its best two (inline: a call costs more)
                    if a < node.cost1:
                        node.cost2, node.p2, node.cost1, node.p1 = node.cost1, node.p1, a, i
                    else:
                        node.cost2, node.p2 = a, i

        if nodes and d_costs:
            if mixed:
                _remote_by_group(pick, k, terms, nodes, d_costs, d_index)
            else:
                _remote(pick, k, terms, nodes, d_costs, d_index)
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
            pick.prefer(pick.default_cost, rdef, pick.actions[rdef] is not pick.actions[first])
        chosen = _candidate(k, terms, pick, pick.first)
        return plan_of(
            self.name,
            rclass,
            chosen,
            None if pick.second is None else _candidate(k, terms, pick, pick.second),
            candidates_considered=considered,
            add_replica_on=chosen.decode_worker if chosen.action is _FETCH else None,
            # the search's own total for the default (the same terms, not re-costed)
            default_cost_s=None if rdef is None else pick.default_cost,
        )


def _remote_by_group(
    pick: _Pick,
    k: RequestCosts,
    terms: ScanTerms,
    nodes: dict[str, _NodeBest],
    d_costs: list[float],
    d_index: list[int],
) -> None:
    """`_remote` once per P/D hand-over: `nodes` keyed `group\\0node`, each D part paired only
    with P parts of its own group."""
    groups: dict[str, dict[str, _NodeBest]] = {}
    for key, best in nodes.items():
        group, _, node = key.partition("\0")
        groups.setdefault(group, {})[node] = best
    costs: dict[str, list[float]] = {}
    index: dict[str, list[int]] = {}
    ws = terms.workers
    for bd, i in zip(d_costs, d_index):  # noqa: B905 (appended together)
        group = str(ws[i].pd_group)
        if group in groups:
            costs.setdefault(group, []).append(bd)
            index.setdefault(group, []).append(i)
    for group, by_node in groups.items():
        if group in costs:
            _remote(pick, k, terms, by_node, costs[group], index[group])


def _pd_pairs(workers: tuple[WorkerView, ...]) -> int:
    """Remote prefill pairs P ≠ D among healthy workers that speak one P/D hand-over."""
    # per group: prefill-capable, decode-capable and both
    n_p: dict[str, int] = {}
    n_d: dict[str, int] = {}
    n_both: dict[str, int] = {}
    for w in workers:
        g = w.pd_group
        if not w.healthy or g is None:
            continue
        p, d = w.role is not _DECODE, w.role is not _PREFILL
        n_p[g] = n_p.get(g, 0) + p
        n_d[g] = n_d.get(g, 0) + d
        n_both[g] = n_both.get(g, 0) + (p and d)
    return sum(n_p[g] * n_d[g] - n_both[g] for g in n_p if n_p[g] and n_d[g])


def _candidate(k: RequestCosts, terms: ScanTerms, pick: _Pick, j: int | None) -> Candidate:
    """Kept candidate j of the pick, its breakdown from the terms the search took."""
    assert j is not None
    action = pick.actions[j]
    p, d, ws = pick.prefills[j], pick.decodes[j], terms.workers
    src = pick.src_f if action is _FETCH else pick.src_m if action is _MIG else None
    return k.candidate_of(action, ws[p], ws[d], src, terms, p, d)


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
    c: ProfileConstants,
) -> float:
    """C of an artifact fetch from the owner `src` to w (a read-only replica; `c`: the
    constants of w's profile): the missing owner_blocks − held blocks move, w reuses
    owner_blocks (its prefill `pf`; a hybrid spec's where it resumes after the move,
    `RequestCosts.resume_moved`) and pays λ·dup(w, held) and fetch(w) (`RequestCosts
    .fetch_price`: its X_dup at the fetched replicas' reuse) for the replica; with a KV spec,
    what restoring them from src costs (`RequestCosts.peer_restore`)."""
    tn, tr, _ = k.peer_restore(w, src, held, k.ob - held, c)
    return base + pf + tn + tr + k.lam * dup + k.mu * (stalled * pf) + k.fetch_price(w, dup, c)


def _migration(
    k: RequestCosts,
    w: WorkerView,
    src: WorkerView,
    g_src: int,
    base: float,
    stalled: int,
    held: int,
    pf: float,
    c: ProfileConstants,
) -> float:
    """C of moving the session from its owner `src` (holding g_src blocks in GPU) to w (`c`:
    the constants of w's profile): the missing blocks move and stay duplicated (M_HBM), w
    reuses g_src blocks (its prefill `pf`; a hybrid spec's where it resumes after the move),
    and the move pays its hysteresis; with a KV spec,
    what restoring them from src costs (`RequestCosts.peer_restore`)."""
    tn, tr, moved = k.peer_restore(w, src, held, g_src - held, c)
    c0 = base + pf + tn + tr + k.lam * moved + k.mu * (stalled * pf)
    return c0 + k.hysteresis(c0)


def _remote(
    pick: _Pick,
    k: RequestCosts,
    terms: ScanTerms,
    nodes: dict[str, _NodeBest],
    d_costs: list[float],
    d_index: list[int],
) -> None:
    """Remote prefill P→D for every D part, exactly: for each D the best P is the best P part on
    D's node (the intra-node link) or the best one overall (the inter-node link, with the P
    node's NIC backlog added when KV moves); two of each are kept to exclude P = D. A pair
    into a D that is not the session's home worker pays H_move (`_Pick.consider`), a growing
    function of the pair's other terms: D's best P stays its best P."""
    # the best two P parts overall, from the best two of each node: as they are (a pair that
    # moves nothing) and with the node's NIC backlog added (one that moves KV to another node;
    # a node's workers share its backlog, so its best two stay its best two)
    ws = terms.workers
    ga1 = ga2 = _INF
    gt1: int | None = None
    gt2: int | None = None
    waits = False
    for best in nodes.values():
        a1, t1, a2, t2 = best.cost1, best.p1, best.cost2, best.p2
        if a1 < ga2:
            if a1 < ga1:
                ga1, gt1, ga2, gt2 = a1, t1, ga1, gt1
            else:
                ga2, gt2 = a1, t1
            if a2 < ga2:
                ga2, gt2 = a2, t2
        if ws[t1].nic_backlog_s:
            waits = True
    ba1, bt1, ba2, bt2 = ga1, gt1, ga2, gt2
    if waits:
        ba1 = ba2 = _INF
        for best in nodes.values():
            a1, t1, a2, t2 = best.cost1, best.p1, best.cost2, best.p2
            wait = ws[t1].nic_backlog_s
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
    gpus = terms.gpu
    tp: int | None
    for bd, td in zip(d_costs, d_index):  # noqa: B905 (appended together)
        # bd + ga1 is a lower bound of every pair into D, and bd + a of a pair from P (links
        # and H_move cost >= 0): cheaper tests first
        if bd + ga1 >= bound:
            continue
        d = ws[td]
        gpu = gpus[td] if gpus else 0
        nbytes = k.kv_to_decode(gpu) if gpu else nbytes_none
        c = k.constants(d.profile)
        node = d.node
        tn = nodes.get(node)
        if tn is not None:
            a, tp = (tn.cost1, tn.p1) if tn.p1 != td else (tn.cost2, tn.p2)
            if tp is not None and bd + a < bound:
                pick.consider(bd + a + link(d, nbytes, True, c), _REMOTE, tp, td)
                bound = pick.second_key
                if track_def and pick.default_cost > bound:
                    bound = pick.default_cost
        # (indices compare by value: `is` holds only for small ints)
        if nbytes <= 0:  # nothing moves: no link, no backlog
            a, tp = (ga1, gt1) if gt1 != td else (ga2, gt2)
        else:
            a, tp = (ba1, bt1) if bt1 != td else (ba2, bt2)
        if tp is not None and ws[tp].node != node and bd + a < bound:
            pick.consider(bd + a + link(d, nbytes, False, c), _REMOTE, tp, td)
            bound = pick.second_key
            if track_def and pick.default_cost > bound:
                bound = pick.default_cost
