"""The OwnerServe policy: argmin of C(a) over every candidate of `planner.cost.enumerate_routes`.

The search is one pass over the workers plus one over the decode-capable ones, computing each
candidate's total with the formulas of `planner.cost` inlined on per-profile constants (no
allocation per candidate); remote prefill P→D is searched exactly in O(P + D) because its cost
splits into a P part, a D part and a link that only depends on whether P and D share a node.
Candidates that cannot enter the top two are skipped by lower bounds. The chosen candidate and
the runner-up are then re-costed by `planner.cost.evaluate`, so the plan's breakdown is the
documented one (tests check the search's choice against the full reference enumeration).
"""

from __future__ import annotations

from ownerserve.errors import NoWorkerAvailableError
from ownerserve.types import Role, Tier
from planner.classify import DEFAULT_ACTION, classify
from planner.cost import (
    CostConfig,
    CostModel,
    Route,
    decode_tokens,
    fetch_source,
    migration_source,
    tier_blocks,
)
from planner.policies.base import make_plan
from planner.types import Action, ClusterView, Plan, RequestClass, RequestView, WorkerView

_INF = float("inf")
_GPU, _CPU, _SSD = Tier.GPU, Tier.CPU, Tier.SSD
_PREFILL, _DECODE = Role.PREFILL, Role.DECODE
_COL, _CONT, _TAIL = Action.COLOCATED_PREFILL, Action.DECODE_CONTINUATION, Action.TAIL_RECOMPUTE
_FETCH, _MIG, _REMOTE = Action.ARTIFACT_FETCH, Action.STATE_MIGRATION, Action.REMOTE_PREFILL

# A cost within this relative distance of the best counts as a tie (the class default wins ties).
_TIE = 1e-12

_RC_CONT = RequestClass.DECODE_CONTINUATION

_Rec = tuple[Action, WorkerView, WorkerView, WorkerView | None]


class OwnerServePolicy:
    """Single-owner, cost-based PD-hybrid planning (mission 3.6.5): a* = argmin_a C(a)."""

    name = "ownerserve"

    def __init__(self, config: CostConfig | None = None, model: CostModel | None = None) -> None:
        self.model = model or CostModel(config)
        # per profile: constants of the formulas that do not depend on the request
        self._prof: dict[str, tuple[float, ...]] = {}
        for name, p in self.model.profiles.items():
            self._prof[name] = (
                p.prefill.base_s,
                p.prefill.per_token_s,
                p.prefill.per_token_ctx_s,
                p.decode.base_s,
                p.decode.per_seq_s,
                p.decode.per_ctx_token_s,
                p.hbm_kv_bytes / p.kv_bytes_per_token,
                p.link.latency_s,
                p.link.intra_node_bps,
                p.link.inter_node_bps,
            )
        self._default_profile = self.model.config.profile

    def _request_consts(
        self, profile: str, n: int, o: int, rt_fetch: int, rt_mig: int, fetch: bool, mig: bool
    ) -> tuple[float, ...]:
        """Per-profile constants for one request: prompt of n tokens, o decode steps, rt_fetch /
        rt_mig tokens reused after a fetch / migration into a worker holding nothing (`fetch`,
        `mig`: whether those candidates exist)."""
        c = self._prof.get(profile) or self._prof[self._default_profile]
        pbase, ptok, pctx, dbase, dseq, dctx, cap, lat, intra, inter = c
        pf_full = pbase + ptok * n + pctx * n * (n / 2.0)
        nf, nmig = n - rt_fetch, n - rt_mig
        pf_fetch = pbase + ptok * nf + pctx * nf * (rt_fetch + nf / 2.0)
        pf_mig = pbase + ptok * nmig + pctx * nmig * (rt_mig + nmig / 2.0)
        # the least prefill of any candidate on a worker holding nothing (a lower bound)
        pf_lo = pf_full
        if fetch and pf_fetch < pf_lo:
            pf_lo = pf_fetch
        if mig and pf_mig < pf_lo:
            pf_lo = pf_mig
        # q(w) = s_p · (per_token_s · inflight + base_s · waiting): the prefill constants again
        return (
            ptok,
            pbase,
            pbase,
            ptok,
            pctx,
            pf_full,
            o * (dbase + dseq + dctx * n),
            o * dseq,
            o * dctx * cap,
            lat,
            intra,
            inter,
            pf_fetch,
            pf_mig,
            pf_lo,
        )

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        model = self.model
        cfg = model.config
        rclass = classify(request, cfg)
        dflt = DEFAULT_ACTION[rclass]
        n = request.prompt_tokens if request.prompt_tokens > 1 else 1
        nm1 = n - 1
        bs = request.block_size
        kb = request.kv_bytes_per_token
        bk = bs * kb
        o = decode_tokens(request, cfg)
        lam = cfg.lam
        mu = cfg.mu
        handshake = cfg.pd_handshake_s
        # H_move: a migration's cost C₀ becomes C₀ · (1 + migration_margin_rel) + margin_s
        mig_rel = 1.0 + cfg.migration_margin_rel
        mig_abs = cfg.migration_margin_s
        owner_id = request.owner
        ob = request.owner_blocks if owner_id is not None else 0
        sess_id = request.session_owner
        cont_ok = rclass is _RC_CONT

        src_f = fetch_source(request, cluster)
        f_node = src_f.node if src_f is not None else None
        f_wait = src_f.nic_backlog_s if src_f is not None else 0.0
        src_m = migration_source(request, cluster)
        m_node = src_m.node if src_m is not None else None
        m_wait = src_m.nic_backlog_s if src_m is not None else 0.0
        g_m = tier_blocks(src_m)[0] if src_m is not None else 0
        # the owner's view (identity tests below); None when it is not in the cluster
        owner_w: WorkerView | None = None
        if owner_id is not None:
            if src_f is not None:
                owner_w = src_f
            elif src_m is not None and src_m.worker_id == owner_id:
                owner_w = src_m
            else:
                owner_w = cluster.by_id(owner_id)
        # λ·dup(w, 0): what a non-owner holding nothing pays for materialising the owned prefix
        dup_miss = lam * ob * bk
        lam_nkb = lam * n * kb
        fm_count = 1 + (src_f is not None) + (src_m is not None)

        rt_f = min(ob * bs, nm1)
        rt_m = min(g_m * bs, nm1)
        consts: dict[str, tuple[float, ...]] = {}
        c1 = c2 = cdef = _INF
        r1: _Rec | None = None
        r2: _Rec | None = None
        rdef: _Rec | None = None
        considered = 0
        n_p = n_d = n_both = 0
        # remote prefill search state: best two P parts overall and per node
        ga1 = ga2 = _INF
        gw1: WorkerView | None = None
        gw2: WorkerView | None = None
        nodes: dict[str, tuple[float, WorkerView, float, WorkerView | None]] = {}
        dlist: list[tuple[float, WorkerView, int, float, float, float]] = []
        cur_prof: str | None = None
        # whether a candidate found in the worker pass can be the class default (else only
        # the top two matter there) and whether remote pairs can
        dflt_here = dflt is not _REMOTE
        track_def = not dflt_here

        for w in cluster.workers:
            if not w.healthy:
                continue
            prof = w.profile
            if prof is not cur_prof:
                pc = consts.get(prof)
                if pc is None:
                    pc = consts[prof] = self._request_consts(
                        prof, n, o, rt_f, rt_m, src_f is not None, src_m is not None
                    )
                (qtok, qbase, pbase, ptok, pctx, pf_full, d_a, d_b, d_c,
                 lat, intra, inter, pf_fetch, pf_mig, pf_lo) = pc  # fmt: skip
                cur_prof = prof
            sp = w.prefill_scale
            q = sp * (qtok * w.inflight_prefill_tokens + qbase * w.waiting)
            running = w.running
            role = w.role
            # I_decode: each running decode waits for the whole prefill (a prefill-only
            # worker's running requests are prefills, not decodes)
            share = running if running > 0 and role is not _PREFILL else 0
            cb = w.cached_blocks

            if not cb:
                # ---- lean path: w holds nothing of this prefix (the common case) ----
                pf = sp * pf_full
                if role is not _PREFILL:
                    n_d += 1
                    tdec = w.decode_scale * (d_a + d_b * running + d_c * w.kv_usage)
                    qd = q + tdec
                    # colocated + fetch + migration (src_m holds GPU blocks: never on this path)
                    considered += fm_count if w is not src_f else fm_count - 1
                    dup = dup_miss if w is not owner_w else 0.0
                    # every candidate on w costs at least lb: skip w if none can enter the top
                    # two (the prefill, stretched by the decodes it stalls, dominates)
                    ms = 1.0 + mu * share
                    lb = qd + sp * pf_lo * ms
                    top = lb < c2
                    if top or (dflt_here and lb < cdef):
                        if top or dflt is _COL:
                            cost = qd + pf * ms + dup
                            if dflt is _COL and cost < cdef:
                                cdef, rdef = cost, (_COL, w, w, None)
                            if cost < c2:
                                if cost < c1:
                                    c2, r2 = c1, r1
                                    c1, r1 = cost, (_COL, w, w, None)
                                else:
                                    c2, r2 = cost, (_COL, w, w, None)
                        if src_f is not None and w is not src_f and (top or dflt is _FETCH):
                            if w.node == f_node:
                                lt = w.link_scale * (lat + ob * bk / intra)
                            else:
                                lt = w.link_scale * (lat + ob * bk / inter) + f_wait
                            cost = qd + sp * pf_fetch * ms + lt
                            cost += lam * ob * bk
                            if dflt is _FETCH and cost < cdef:
                                cdef, rdef = cost, (_FETCH, w, w, src_f)
                            if cost < c2:
                                if cost < c1:
                                    c2, r2 = c1, r1
                                    c1, r1 = cost, (_FETCH, w, w, src_f)
                                else:
                                    c2, r2 = cost, (_FETCH, w, w, src_f)
                        if src_m is not None and (top or dflt is _MIG):
                            if w.node == m_node:
                                lt = w.link_scale * (lat + g_m * bk / intra)
                            else:
                                lt = w.link_scale * (lat + g_m * bk / inter) + m_wait
                            cost = qd + sp * pf_mig * ms + lt
                            cost = (cost + lam * g_m * bk) * mig_rel + mig_abs
                            if dflt is _MIG and cost < cdef:
                                cdef, rdef = cost, (_MIG, w, w, src_m)
                            if cost < c2:
                                if cost < c1:
                                    c2, r2 = c1, r1
                                    c1, r1 = cost, (_MIG, w, w, src_m)
                                else:
                                    c2, r2 = cost, (_MIG, w, w, src_m)
                    bd = qd + handshake + dup
                    if bd < c2 or track_def:  # c2 only falls: a D part above it never counts
                        dlist.append((bd, w, 0, lat, intra, inter))
                if role is not _DECODE:
                    n_p += 1
                    if role is not _PREFILL:
                        n_both += 1
                    a = q + pf + lam_nkb + mu * pf * share
                    t = nodes.get(w.node)
                    if t is None:
                        nodes[w.node] = (a, w, _INF, None)
                    elif a < t[2]:
                        nodes[w.node] = (a, w, t[0], t[1]) if a < t[0] else (t[0], t[1], a, w)
                continue

            # ---- full path: w holds part of the prefix in some tier ----
            g = cb.get(_GPU, 0)
            c = cb.get(_CPU, 0)
            s = cb.get(_SSD, 0)
            held = g
            rest = 0.0
            if c > g or s > g:
                gc = c if c > g else g
                held = s if s > gc else gc
                rest = model.tier_restore_s(w, g, c, s, request)
            rt = held * bs
            if rt > nm1:
                rt = nm1
            new = n - rt
            pf = sp * (pbase + ptok * new + pctx * new * (rt + new / 2.0))

            if role is not _PREFILL:
                n_d += 1
                tdec = w.decode_scale * (d_a + d_b * running + d_c * w.kv_usage)
                qdr = q + tdec + rest
                fetch_ok = src_f is not None and ob > held and w is not src_f
                mig_ok = src_m is not None and g_m > held and w is not src_m
                considered += 1 + fetch_ok + mig_ok
                # every candidate on w costs at least qdr: skip w if none can enter the top two
                if qdr < c2 or (dflt_here and qdr < cdef):
                    ms = 1.0 + mu * share
                    # colocated on w (continuation / tail recompute / colocated prefill)
                    cost = qdr + pf * ms
                    if ob > held and w is not owner_w:
                        cost += lam * (ob - held) * bk
                    if c > g or s > g:
                        kind = _TAIL
                    elif cont_ok and g > 0 and w.worker_id == sess_id:
                        kind = _CONT
                    else:
                        kind = _COL
                    if kind is dflt and cost < cdef:
                        cdef, rdef = cost, (kind, w, w, None)
                    if cost < c2:
                        if cost < c1:
                            c2, r2 = c1, r1
                            c1, r1 = cost, (kind, w, w, None)
                        else:
                            c2, r2 = cost, (kind, w, w, None)
                    # artifact fetch from the owner to w (a read-only replica)
                    if fetch_ok:
                        moved = ob - held
                        rt2 = ob * bs
                        if rt2 > nm1:
                            rt2 = nm1
                        new2 = n - rt2
                        pf2 = sp * (pbase + ptok * new2 + pctx * new2 * (rt2 + new2 / 2.0))
                        fbytes = moved * bk
                        if w.node == f_node:
                            lt = w.link_scale * (lat + fbytes / intra)
                        else:
                            lt = w.link_scale * (lat + fbytes / inter) + f_wait
                        cost = qdr + pf2 * ms + lt + lam * fbytes
                        if dflt is _FETCH and cost < cdef:
                            cdef, rdef = cost, (_FETCH, w, w, src_f)
                        if cost < c2:
                            if cost < c1:
                                c2, r2 = c1, r1
                                c1, r1 = cost, (_FETCH, w, w, src_f)
                            else:
                                c2, r2 = cost, (_FETCH, w, w, src_f)
                    # state migration: the session moves from its owner to w
                    if mig_ok:
                        moved = g_m - held
                        rt2 = g_m * bs
                        if rt2 > nm1:
                            rt2 = nm1
                        new2 = n - rt2
                        pf2 = sp * (pbase + ptok * new2 + pctx * new2 * (rt2 + new2 / 2.0))
                        if w.node == m_node:
                            lt = w.link_scale * (lat + moved * bk / intra)
                        else:
                            lt = w.link_scale * (lat + moved * bk / inter) + m_wait
                        cost = qdr + pf2 * ms + lt
                        cost = (cost + lam * moved * bk) * mig_rel + mig_abs
                        if dflt is _MIG and cost < cdef:
                            cdef, rdef = cost, (_MIG, w, w, src_m)
                        if cost < c2:
                            if cost < c1:
                                c2, r2 = c1, r1
                                c1, r1 = cost, (_MIG, w, w, src_m)
                            else:
                                c2, r2 = cost, (_MIG, w, w, src_m)
                # the D part of remote prefill into w
                bd = q + tdec + handshake
                if ob > g and w is not owner_w:
                    bd += lam * (ob - g) * bk
                if bd < c2 or track_def:
                    dlist.append((bd, w, g, lat, intra, inter))

            if role is not _DECODE:
                n_p += 1
                if role is not _PREFILL:
                    n_both += 1
                a = q + pf + rest + lam * (n - rt) * kb + mu * pf * share
                t = nodes.get(w.node)
                if t is None:
                    nodes[w.node] = (a, w, _INF, None)
                elif a < t[2]:
                    nodes[w.node] = (a, w, t[0], t[1]) if a < t[0] else (t[0], t[1], a, w)

        # the best two P parts overall, from the best two of each node: as they are (a pair
        # that moves nothing) and with the node's NIC backlog added (one that moves KV to
        # another node; a node's workers share its backlog, so its best two stay its best two)
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
        # remote prefill: for each D, the best P on its node (intra-node link) and overall;
        # bd + ga1 is a lower bound of every pair into D
        p: WorkerView | None
        if gw1 is not None:
            for bd, d, gd, d_lat, d_intra, d_inter in dlist:
                if bd + ga1 >= c2 and not (track_def and bd + ga1 < cdef):
                    continue
                nbytes = (n - gd * bs) * kb
                node = d.node
                ls = d.link_scale
                tn = nodes.get(node)
                if tn is not None:
                    if tn[1] is not d:
                        a, p = tn[0], tn[1]
                    else:
                        a, p = tn[2], tn[3]
                    if p is not None:
                        cost = bd + a
                        if nbytes > 0:
                            cost += ls * (d_lat + nbytes / d_intra)
                        if cost < c2:
                            rec: _Rec = (_REMOTE, p, d, None)
                            if cost < c1:
                                c2, r2 = c1, r1
                                c1, r1 = cost, rec
                            else:
                                c2, r2 = cost, rec
                        if track_def and cost < cdef:
                            cdef, rdef = cost, (_REMOTE, p, d, None)
                if nbytes <= 0:  # nothing moves: no link, no backlog
                    a, p = (ga1, gw1) if gw1 is not d else (ga2, gw2)
                else:
                    a, p = (ba1, bw1) if bw1 is not d else (ba2, bw2)
                if p is not None and p.node != node:
                    cost = bd + a
                    if nbytes > 0:
                        cost += ls * (d_lat + nbytes / d_inter)
                    if cost < c2:
                        rec = (_REMOTE, p, d, None)
                        if cost < c1:
                            c2, r2 = c1, r1
                            c1, r1 = cost, rec
                        else:
                            c2, r2 = cost, rec
                    if track_def and cost < cdef:
                        cdef, rdef = cost, (_REMOTE, p, d, None)
            considered += n_p * n_d - n_both

        if r1 is None:
            raise NoWorkerAvailableError("no healthy worker can serve this request")
        # the class default wins ties
        tie = _TIE * (c1 if c1 > 1.0 else 1.0)
        if rdef is not None and rdef[0] is not r1[0] and cdef - c1 <= tie:
            r1, r2 = rdef, r1
        chosen = Route(*r1)
        runner = None if r2 is None else Route(*r2)
        return make_plan(
            self.name,
            model,
            request,
            chosen,
            runner,
            request_class=rclass,
            candidates_considered=considered,
            add_replica_on=chosen.decode.worker_id if chosen.action is _FETCH else None,
            # the search's own total for the default (the same formulas, not re-costed)
            default_cost_s=None if rdef is None else cdef,
        )
