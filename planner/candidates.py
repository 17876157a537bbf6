"""The exact candidate subset of a large cluster: the ownerserve policy's plan over the few
workers that can win it (`plan_exact`, `ExactSubsetPolicy`), equal to its plan over every
worker, found by branch and bound over orders of the workers by load (`LoadOrder`).

The subset is the workers holding any of the request's prefix (in any tier) or any of its
chunks, its owner, session owner and home worker, and the first k workers of each load order,
kept up to date as the workers' views change rather than sorted per request. Per worker w
(request-independent, from its view and profile):

    q0(w) = s_p · (per_token_s · inflight_prefill_tokens + base_s · waiting)   prefill queue
    L(w)  = s_d · (per_seq_s · running + per_ctx_token_s · kv_usage · cap(w))  decode load
    K(w)  = q0(w) + H · L(w)     H = decode_horizon_tokens: what decoding there costs at most
    R(w)  = running(w)           the decodes a prefill there stalls

The orders: PREFILL workers by q0; DECODE workers by K; HYBRID workers by K, by q0 and by R.
Every candidate a worker w holding nothing takes part in (as a remote prefill's P, on w
itself: colocated, fetch or migration, or as a remote prefill's D) costs at least a sum of
terms of C(a) that grows with its keys (planner/README.md, *Exact candidate subset*, gives
each: `_Bound`), so a worker after the k-th of its role's orders costs at least the bound at
the k-th keys (the threshold algorithm: Fagin, Lotem and Naor, "Optimal aggregation
algorithms for middleware", PODS 2001). A holder is bounded alone (`_Bound.holder`). When the
bound of every role exceeds the subset plan's cost, no worker left out can win or tie: the
subset's plan is the full view's. An exact tie is kept when the ties left out can only come
after the choice in the search's order (`_ties_come_later`). Else the k of each role not cut
grows (×4); once the subset would hold more than half the healthy workers, the full view
plans instead (it costs about as much).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

from ownerserve.errors import NoWorkerAvailableError
from ownerserve.types import KVTransport, Role, Tier
from planner.classify import classify
from planner.cost import (
    CostModel,
    ProfileConstants,
    RequestCosts,
    colocated_kind,
    fetch_source,
    gpu_blocks,
    migration_source,
)
from planner.types import Action, ClusterView, Plan, RequestClass, RequestView, WorkerView

if TYPE_CHECKING:  # planner.policies wraps its ownerserve policy in `ExactSubsetPolicy`
    from planner.policies.ownerserve import OwnerServePolicy

_INF = float("inf")
_FIRST_K = 4
"""How many workers of each load order the first subset takes (then ×4 per round)."""
_MARGIN = 1e-9
"""The relative gap by which the bound must exceed the plan's cost: above `TopTwo.prefer`'s
tie window (1e-12) and the rounding of summing the same terms in another order."""
_GROUPS = (Role.PREFILL, Role.DECODE, Role.HYBRID)
Keys = tuple[Role, float, float, float, float, float, float]
"""A ranked worker's (role, q0, K, R, s_p, s_d, s_l)."""


class _Ranked:
    """Worker indices sorted by one key, `(key, index)` pairs kept sorted as keys change."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[tuple[float, int]] = []

    def move(self, i: int, old: float | None, new: float | None) -> None:
        """Worker i's key changed from `old` to `new` (None: not ranked)."""
        items = self.items
        if old is not None:
            del items[bisect.bisect_left(items, (old, i))]
        if new is not None:
            bisect.insort(items, (new, i))

    def key(self, k: int) -> float:
        """The k-th least key (0-based); ∞ past the end."""
        items = self.items
        return items[k][0] if k < len(items) else _INF

    def index(self, k: int) -> int:
        """The worker index of the k-th; one past every index past the end."""
        items = self.items
        return items[k][1] if k < len(items) else 1 << 62


def _holds(w: WorkerView) -> bool:
    """w holds some of the request's prefix (any tier) or of its chunks."""
    if w.chunks_held:
        return True
    cb = w.cached_blocks
    return bool(cb) and any(cb.values())


class LoadOrder:
    """The workers of one cluster view in the load orders of the bound (the module's
    docstring: PREFILL by q0, DECODE by K, HYBRID by K, q0 and R) and by prefill and decode
    scale (the bound takes the least of each), kept up to date as their views change
    (`sync`, `update`): a changed worker moves in each of its orders by binary search,
    nothing is sorted per request. Also which workers hold some of the request's prefix
    (their views carry it) and each worker's index by id. Unhealthy workers are in no
    order."""

    __slots__ = (
        "_by_id",
        "_holders",
        "_keys",
        "_nodes",
        "_views",
        "d_k",
        "h_k",
        "h_q",
        "h_r",
        "horizon",
        "model",
        "p_q",
        "s_d",
        "s_l",
        "s_p",
    )

    def __init__(self, model: CostModel) -> None:
        self.model = model
        self.horizon = model.config.decode_horizon_tokens
        self._views: list[WorkerView] = []
        self._keys: list[Keys | None] = []
        self.p_q, self.d_k, self.h_k, self.h_q, self.h_r = (_Ranked() for _ in range(5))
        self.s_p, self.s_d, self.s_l = _Ranked(), _Ranked(), _Ranked()
        self._holders: set[int] = set()
        self._by_id: dict[str, int] = {}
        self._nodes: dict[str, set[int]] = {}

    @property
    def workers(self) -> list[WorkerView]:
        """The views the order was last synced to, in the cluster's order."""
        return self._views

    def keys_of(self, w: WorkerView) -> Keys | None:
        """(role, q0, K, R, s_p, s_d, s_l) of w; None when it is unhealthy."""
        if not w.healthy:
            return None
        c: ProfileConstants = self.model.constants(w.profile)
        q0 = w.prefill_scale * (
            c.prefill_per_token_s * w.inflight_prefill_tokens + c.prefill_base_s * w.waiting
        )
        if w.role is Role.PREFILL:
            return (w.role, q0, _INF, 0.0, w.prefill_scale, w.decode_scale, w.link_scale)
        cap = w.kv_capacity_tokens or c.capacity_tokens
        load = w.decode_scale * (
            c.decode_per_seq_s * w.running + c.decode_per_ctx_token_s * w.kv_usage * cap
        )
        stalled = float(w.running) if w.running > 0 else 0.0
        k = q0 + self.horizon * load
        return (w.role, q0, k, stalled, w.prefill_scale, w.decode_scale, w.link_scale)

    def _orders(self, role: Role) -> tuple[tuple[_Ranked, int], ...]:
        """The orders of a role's workers, each with the item of `Keys` it sorts by."""
        if role is Role.PREFILL:
            return ((self.p_q, 1),)
        if role is Role.DECODE:
            return ((self.d_k, 2),)
        return ((self.h_k, 2), (self.h_q, 1), (self.h_r, 3))

    def sync(self, workers: tuple[WorkerView, ...]) -> None:
        """Bring the order to `workers` (one cluster's views, in a stable order): the views
        that are not the very objects seen last time are updated. Views cached until they
        change (the router's `router.views`, the simulator's full view) make this a pass of
        identity tests."""
        views = self._views
        if len(workers) != len(views):
            self._rebuild(workers)
            return
        for i, w, old in zip(range(len(workers)), workers, views):  # noqa: B905 (equal)
            if w is not old:
                self.update(i, w)

    def update(self, i: int, w: WorkerView) -> None:
        """Worker i's view is now `w`."""
        old = self._views[i]
        if old.worker_id != w.worker_id:
            if self._by_id.get(old.worker_id) == i:
                del self._by_id[old.worker_id]
            self._by_id[w.worker_id] = i
        if old.node != w.node:
            mates = self._nodes[old.node]
            mates.discard(i)
            if not mates:
                del self._nodes[old.node]
            self._nodes.setdefault(w.node, set()).add(i)
        self._views[i] = w
        if _holds(w):
            self._holders.add(i)
        else:
            self._holders.discard(i)
        keys = self.keys_of(w)
        before = self._keys[i]
        if keys == before:
            return
        self._keys[i] = keys
        if before is not None:
            for rank, r in self._orders(before[0]):
                rank.move(i, cast(float, before[r]), None)
            self.s_p.move(i, before[4], None)
            self.s_d.move(i, before[5], None)
            self.s_l.move(i, before[6], None)
        if keys is not None:
            for rank, r in self._orders(keys[0]):
                rank.move(i, None, cast(float, keys[r]))
            self.s_p.move(i, None, keys[4])
            self.s_d.move(i, None, keys[5])
            self.s_l.move(i, None, keys[6])

    def _rebuild(self, workers: tuple[WorkerView, ...]) -> None:
        self._views = list(workers)
        self._keys = [self.keys_of(w) for w in workers]
        self._by_id = {w.worker_id: i for i, w in enumerate(workers)}
        self._holders = {i for i, w in enumerate(workers) if _holds(w)}
        self._nodes = {}
        for i, w in enumerate(workers):
            self._nodes.setdefault(w.node, set()).add(i)
        for rank in (self.p_q, self.d_k, self.h_k, self.h_q, self.h_r):
            rank.items = []
        for role in _GROUPS:
            for rank, r in self._orders(role):
                rank.items = sorted(
                    (cast(float, kk[r]), i)
                    for i, kk in enumerate(self._keys)
                    if kk is not None and kk[0] is role
                )
        self.s_p.items = sorted((kk[4], i) for i, kk in enumerate(self._keys) if kk is not None)
        self.s_d.items = sorted((kk[5], i) for i, kk in enumerate(self._keys) if kk is not None)
        self.s_l.items = sorted((kk[6], i) for i, kk in enumerate(self._keys) if kk is not None)

    def healthy(self) -> int:
        """How many workers are ranked (healthy)."""
        return len(self.s_p.items)

    def subset(self, ks: dict[Role, int], always: Iterable[int]) -> list[int]:
        """The indices of the first ks[role] workers of each role's orders and `always`,
        ascending."""
        picked = set(always)
        for role in _GROUPS:
            k = ks[role]
            for rank, _ in self._orders(role):
                picked.update(i for _, i in rank.items[:k])
        return sorted(picked)

    def exhausted(self, role: Role, k: int) -> bool:
        """The first k of the role's orders are all its workers."""
        return k >= len(self._orders(role)[0][0].items)

    def on_node(self, node: str) -> set[int]:
        """The indices of the workers on `node`."""
        return self._nodes.get(node, set())

    def holders(self) -> set[int]:
        """The workers whose views hold some of the request's prefix or chunks."""
        return self._holders

    def special(self, request: RequestView) -> set[int]:
        """The request's owner, session owner and home worker (every subset has them)."""
        out: set[int] = set()
        by_id = self._by_id
        for wid in (request.owner, request.session_owner, request.home_worker):
            if wid is not None:
                i = by_id.get(wid)
                if i is not None:
                    out.add(i)
        return out


class _Bound:
    """The bound of one request (the module's docstring): its request-wide terms, computed
    once per plan from the cost model, the special workers and the order's least scales."""

    __slots__ = (
        "a_min",
        "base",
        "bs",
        "c",
        "d_remote",
        "h_abs",
        "h_rel",
        "home_d",
        "hs",
        "into",
        "lean_actions",
        "link",
        "m_abs",
        "m_rel",
        "moves",
        "mu",
        "p_col",
        "p_side",
        "prefill",
        "src_nodes",
    )

    def __init__(
        self,
        model: CostModel,
        request: RequestView,
        order: LoadOrder,
        specials: list[WorkerView],
        sources: tuple[WorkerView, ...],
    ) -> None:
        cfg = model.config
        k = RequestCosts(model, request)
        consts = list(model._constants.values())
        sp_min = order.s_p.key(0)
        sd_min = order.s_d.key(0)
        n, o = k.n, k.o
        # D_min: the least decode of the request on any worker (its load-free part)
        d_one = min(
            c.decode_base_s + c.decode_per_seq_s + c.decode_per_ctx_token_s * n for c in consts
        )
        self.base = sd_min * o * d_one
        # ρ: what a spec's KV sizing does to the pool of a worker that reports none
        rho = 1.0
        if k.spec is not None:
            for c in consts:
                if c.capacity_tokens > 0:
                    rho = min(rho, c.hbm_kv_bytes / k.k / c.capacity_tokens)
        o_rho = o * rho
        h = order.horizon
        # c·K ≤ q0 + O·ρ·L: O ≤ H, ρ ≤ 1
        self.c = 1.0 if h <= 0 else min(1.0, o_rho / h)
        # the least prefill of a worker holding nothing reusing r tokens (all but the last
        # token with chunks, as the ownerserve search bounds it), and the least link time of
        # moving nbytes into one
        chunked = bool(request.chunk_spans)

        least: dict[int, float] = {}

        def prefill(r: int) -> float:
            pf = least.get(r)
            if pf is None:
                rr = k.n - 1 if chunked else r
                pf = least[r] = sp_min * min(k.prefill_base(c, rr) for c in consts)
            return pf

        self.prefill = prefill

        sl_min = order.s_l.key(0)

        def link(nbytes: float, src: WorkerView | None = None) -> float:
            # into a worker on another node than `src` (its node's workers are in every
            # subset): the cheapest store transport after src's NIC backlog; else within a
            # node, the cheapest path of any (`kv_transport_into`: same host or a store's)
            if nbytes <= 0:
                return 0.0
            if src is None:
                return sl_min * min(t.seconds(nbytes) for c in consts for t in c.paths.values())
            t = sl_min * min(
                t.seconds(nbytes)
                for c in consts
                for kind, t in c.paths.items()
                if kind is not KVTransport.SAME_HOST
            )
            return t + src.nic_backlog_s

        self.link = link
        near = ClusterView(workers=tuple(specials), sources=sources)
        src_f = fetch_source(request, near)
        src_m = migration_source(request, near)
        self.mu = cfg.mu
        lam, hs = cfg.lam, cfg.pd_handshake_s
        dense = k.spec is None
        dup0 = lam * k.dup(True, 0)
        # the worker-pass candidates on a worker holding nothing: (its least prefill, what
        # else it pays at least, whether it pays H_move whatever the home):
        # colocated = prefill of the whole prompt + λ·dup₀; a fetch = prefill reusing
        # owner_blocks + λ·dup₀ + the transfer; a migration = prefill reusing gpu(session
        # owner) + λ·moved + the transfer, and its hysteresis
        self.p_col = prefill(0)
        moves = [(self.p_col, dup0, False)]
        if src_f is not None:
            moved = k.ob * k.bk if dense else 0.0
            moves.append((prefill(k.reused(k.ob)), dup0 + link(moved, src_f), False))
        if src_m is not None:
            g_m = gpu_blocks(src_m)
            moved = g_m * k.bk if dense else 0.0
            moves.append((prefill(k.reused(g_m)), lam * moved + link(moved, src_m), True))
        self.moves = tuple(moves)
        # the moves into a holder: (the blocks it then reuses, bytes per block moved, from)
        bk = k.bk if dense else 0.0
        self.into: list[tuple[int, float, WorkerView, bool]] = []
        if src_f is not None:
            self.into.append((k.ob, bk, src_f, False))
        if src_m is not None:
            self.into.append((gpu_blocks(src_m), bk, src_m, True))
        self.src_nodes = {w.node for w in (src_f, src_m) if w is not None}
        self.m_abs, self.m_rel = cfg.migration_margin_s, cfg.migration_margin_rel
        # A_min: the least prefill of a remote prefill's P: one holding nothing, or a holder
        a_min = self.p_col
        for w in specials:
            if not w.healthy or w.role is Role.DECODE or w.pd_group is None:
                continue
            cb = w.cached_blocks
            held = max(cb.get(Tier.GPU, 0), cb.get(Tier.CPU, 0), cb.get(Tier.SSD, 0)) if cb else 0
            r = k.n - 1 if chunked else k.reused(held) if held else 0
            c = model.constants(w.profile)
            a_min = min(a_min, w.prefill_scale * k.prefill_base(c, r))
        self.a_min, self.hs = a_min, hs
        self.bs = request.block_size
        # as P (any D decodes: D_min is in `base`)
        self.p_side = lam * k.prompt_copy(0) + hs
        # as the D of a remote prefill: the prompt's KV moves into it (at best within a node)
        self.d_remote = hs + dup0 + a_min + link(k.kv_to_decode(0))
        # decoding anywhere but the session's home pays H_move (`_Pick.consider`), and the
        # home worker is in every subset
        home = request.home_worker is not None
        self.h_abs = cfg.migration_margin_s if home else 0.0
        self.h_rel = cfg.migration_margin_rel if home else 0.0
        # a remote prefill into the home worker pays none: what its D part costs there
        # beyond any D's least (its queue and decode load)
        self.home_d = _INF
        hv = None
        for w in specials:
            if w.worker_id == request.home_worker:
                hv = w
        keys = None if hv is None else order.keys_of(hv)
        if hv is not None and keys is not None and hv.pd_group is not None:
            self.home_d = self.c * keys[2]
        # the actions of a worker-pass candidate on a worker holding nothing
        cont = classify(request, cfg) is RequestClass.DECODE_CONTINUATION
        lean = {colocated_kind(request, "", 0, 0, cont)}
        if src_f is not None:
            lean.add(Action.ARTIFACT_FETCH)
        if src_m is not None:
            lean.add(Action.STATE_MIGRATION)
        self.lean_actions = frozenset(lean)

    def _h(self, cost: float) -> float:
        """cost + H_move when decoding off the home worker (identity without one)."""
        return cost + self.h_abs + self.h_rel * cost

    def holder(self, w: WorkerView, keys: Keys, held: int) -> float:
        """The least cost of any candidate a holder of `held` prefix blocks takes part in
        (`keys` its load keys): as `as_p` and `as_d`, its prefill reusing what it holds, or
        after a move what it then holds (the move's link from another node: the source's
        node's workers are in every subset), without the terms a holding may spare it (the
        duplicate, the copy, the restore, H_move but a migration's)."""
        role, q0, k, stalled = keys[0], keys[1], keys[2], keys[3]
        stall = 1.0 + self.mu * stalled
        bs = self.bs
        pf = self.prefill(held * bs) * stall
        least = _INF
        if role is not Role.DECODE and w.pd_group is not None:
            least = q0 + pf + self.hs + self.base
        if role is not Role.PREFILL:
            decoding = self.c * k + self.base
            d = decoding + min(pf, self.hs + self.a_min)
            for blocks, bk, src, hysteresis in self.into:
                if blocks > held and w.kv_api and w is not src:
                    x = decoding + self.prefill(blocks * bs) * stall
                    x += self.link((blocks - held) * bk, src)
                    if hysteresis:
                        x += self.m_abs + self.m_rel * x
                    if x < d:
                        d = x
            if d < least:
                least = d
        return least

    def as_p(self, q0: float, stalled: float) -> float:
        """The least cost of a worker with these keys as a remote prefill's P."""
        p = q0 + self.p_col * (1.0 + self.mu * stalled) + self.p_side + self.base
        if self.h_abs or self.h_rel:
            # into any D but the home worker it pays H_move too
            home = p + self.home_d
            p = self._h(p)
            if home < p:
                p = home
        return p

    def as_d(self, k: float, stalled: float) -> tuple[float, float]:
        """The least costs of a worker with these keys on a worker-pass candidate
        (colocated, fetch, migration) and as a remote prefill's D."""
        decoding = self.c * k + self.base
        stall = 1.0 + self.mu * stalled
        home = self.h_abs or self.h_rel
        on_w = _INF
        for pf, extra, hysteresis in self.moves:
            x = decoding + pf * stall + extra
            if hysteresis:
                x += self.m_abs + self.m_rel * x
            elif home:
                x = self._h(x)
            if x < on_w:
                on_w = x
        as_d = decoding + self.d_remote
        return on_w, self._h(as_d) if home else as_d


def plan_exact(
    policy: OwnerServePolicy, request: RequestView, cluster: ClusterView, order: LoadOrder
) -> Plan:
    """`policy.plan(request, cluster)`'s choice (its action, workers, source and cost), found
    over the exact candidate subset (the module's docstring). `order` is brought to
    `cluster.workers` first (`LoadOrder.sync`). The plan's runner-up, `default_cost_s` and
    `candidates_considered` are the subset's."""
    order.sync(cluster.workers)
    views = order.workers
    holders = order.holders()
    named = order.special(request)
    bound = _Bound(
        policy.model, request, order, [views[i] for i in named | holders], cluster.sources
    )
    for node in bound.src_nodes:
        named |= order.on_node(node)
    # the holders: the deepest few from the start, the others once the plan's cost is known
    # and the bound does not put them above it
    depth = {i: _held(views[i]) for i in holders if i not in named}
    deep = sorted(depth, key=depth.__getitem__, reverse=True)[:_FIRST_K]
    always = named | set(deep)
    pending = [i for i in depth if i not in always]
    keys = order._keys
    ks = dict.fromkeys(_GROUPS, _FIRST_K)
    healthy = order.healthy()
    while not all(order.exhausted(g, ks[g]) for g in _GROUPS):
        picked = order.subset(ks, always)
        if 2 * len(picked) > healthy:
            break  # the subset would cost about what the full view does
        sub = ClusterView(
            workers=tuple(views[i] for i in picked),
            sources=cluster.sources,
            pd_mixed=cluster.pd_mixed,
        )
        try:
            plan = policy.plan(request, sub)
        except NoWorkerAvailableError:
            always.update(pending)
            pending = []
            for g in _GROUPS:
                ks[g] *= 4
            continue
        best = plan.chosen.cost.total
        above = best + _MARGIN * (best if best > 1.0 else 1.0)
        late = []
        for i in pending:
            kk = keys[i]
            if kk is not None and bound.holder(views[i], kk, depth[i]) <= above:
                late.append(i)
        if late:
            always.update(late)
            pending = [i for i in pending if i not in always]
            continue
        grow = [g for g in _GROUPS if not _cut(order, bound, g, ks[g], plan, best, above)]
        if not grow:
            return plan
        for g in grow:
            ks[g] *= 4
    return policy.plan(request, cluster)


def _held(w: WorkerView) -> int:
    """The prefix blocks w holds in its deepest tier."""
    cb = w.cached_blocks
    return max(cb.values()) if cb else 0


def _cut(
    order: LoadOrder, bound: _Bound, role: Role, k: int, plan: Plan, best: float, above: float
) -> bool:
    """Whether no worker of `role` after the k-th of its orders can change the plan's choice
    (cost `best`): each costs more than `above`, or may only tie it where the full view
    keeps the choice too (`_ties_come_later`)."""
    if order.exhausted(role, k):
        return True
    if role is Role.PREFILL:
        return bound.as_p(order.p_q.key(k), 0.0) > above
    if role is Role.DECODE:
        keys, stalled, as_p = order.d_k, 0.0, _INF
    else:
        keys, stalled = order.h_k, order.h_r.key(k)
        as_p = bound.as_p(order.h_q.key(k), stalled)
    on_w, as_d = bound.as_d(keys.key(k), stalled)
    if as_p > above and on_w > above and as_d > above:
        return True
    # the tie rule needs a bound growing strictly with K (c > 0: the request decodes)
    return (
        bound.c > 0
        and as_p > above
        and _ties_come_later(
            plan, best, above, on_w, as_d, bound.lean_actions, order._by_id, keys.index(k)
        )
    )


def _ties_come_later(
    plan: Plan,
    best: float,
    above: float,
    on_w: float,
    as_d: float,
    lean_actions: frozenset[Action],
    by_id: dict[str, int],
    first_out: int,
) -> bool:
    """Whether the workers left out of one role (none of them a remote prefill's P below
    `above`) can only tie the plan's choice (cost `best`) where it is offered first, so the
    full view keeps it too (`TopTwo`: an equal cost keeps the candidate offered first; the
    search offers the worker pass in the cluster's order, then remote prefills by D in that
    order). `on_w`, `as_d`: the bound's least costs of one on a worker-pass candidate and as
    a D. One left out has a K above the k-th's, or an equal one and an index above
    `first_out` (the k-th's): only those may tie (the bound grows strictly with K). Unless
    the choice has the request class's default action, none may offer a default
    (`lean_actions`: the worker-pass actions of a worker holding nothing) within
    `TopTwo.prefer`'s window, and a remote choice must not be tied by a worker-pass
    candidate (the worker pass is offered first)."""
    chosen = plan.chosen
    # a bound as tight as the cost itself (a worker left out like the chosen one) may sum
    # the same terms a rounding below it
    if min(on_w, as_d) < best - (above - best):
        return False
    default = plan.default_action
    if chosen.action is not default:
        if default is Action.REMOTE_PREFILL and not as_d > above:
            return False
        if default in lean_actions and not on_w > above:
            return False
    if chosen.action is Action.REMOTE_PREFILL and not on_w > above:
        return False
    d = by_id.get(chosen.decode_worker)
    return d is not None and first_out > d


class ExactSubsetPolicy:
    """The ownerserve policy over the exact candidate subset (`plan_exact`) on a cluster of
    more than `full_view_max` workers, over every worker below; one `LoadOrder` per model
    (a model's workers are one cluster view)."""

    __slots__ = ("_orders", "full_view_max", "model", "name", "policy")

    def __init__(self, policy: OwnerServePolicy, full_view_max: int = 64) -> None:
        self.policy = policy
        self.name = policy.name
        self.model = policy.model
        self.full_view_max = full_view_max
        self._orders: dict[str, LoadOrder] = {}

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        if len(cluster.workers) <= self.full_view_max:
            return self.policy.plan(request, cluster)
        order = self._orders.get(request.model)
        if order is None:
            order = self._orders[request.model] = LoadOrder(self.model)
        return plan_exact(self.policy, request, cluster, order)
