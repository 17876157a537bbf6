"""The request path's stages up to the answer's first bytes, each a function of what it reads —
the request's values so far and its own services (`router.services`), as arguments — that
returns what it computes. The runner (`router.pipeline`) calls them in order, times each and
opens their trace spans:

    parse -> identify -> tokenize (-> chunk) -> admit -> look_up -> view -> plan -> execute

`router.streaming.stream` then sends the answer, and `router.aftermath` commits and observes.
No stage reaches the router's state but through its arguments, so a bench or a test runs any
of them alone (`bench/router_overhead/stages.py` times them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

import orjson

from ownerserve.chunks import PARAMS_KEY as CHUNK_PARAMS_KEY
from ownerserve.chunks import ChunkedPrompt, layout_params
from ownerserve.directory.base import Match
from ownerserve.errors import ModelNotFoundError
from ownerserve.types import Tier
from planner.types import Action, Candidate, CostBreakdown, Plan, Policy, RequestView
from router.admission import Admission
from router.chunk_prefill import ChunkPrefillOutcome, prefill_chunks
from router.executor import ChunkFetchSpec, FetchSpec, OpenedResponse
from router.plans import Fallback, GaveUp, Ran
from router.prompt import Prompt
from router.requests import CompletionRequest, Endpoint
from router.services import (
    ClusterSources,
    ExecuteServices,
    LookUpServices,
    ParseServices,
    ViewServices,
)
from router.session import (
    DerivedSessionCache,
    SessionInfo,
    SessionKey,
    SessionTable,
    chain_session,
    identify_session,
)
from router.tokens import ModelTokenizer, Tokenized
from router.views import cluster_view, request_view
from router.writer import ResponseWriter

log = logging.getLogger(__name__)

POLICY_HEADER = "x-ownerserve-policy"
NOT_A_WORKER_FAILURE = frozenset({"kv_fetch_empty"})
"""`GaveUp` reasons that say nothing of the worker's health (its breaker is left alone)."""

ChunkHolders = Mapping[str, tuple[int, ...]]
"""Per worker, the chunks (indices into `Prompt.chunks.chunks`) the directory says it holds."""
NO_HOLDERS: ChunkHolders = {}


# --- parse ----------------------------------------------------------------------------------
# (the body itself: `router.requests.parse_request`, a 400 when it is not a valid request)


def model_label(svc: ParseServices, model: str) -> str:
    """The model as a metric label: only configured models (client input must not grow
    labels)."""
    return model if model in svc.tokenizers else "unknown"


def served_model(svc: ParseServices, model: str) -> ModelTokenizer:
    """The model's tokenizer; an unknown model, or one no worker serves, is a 404."""
    mt = svc.tokenizers.get(model)
    if mt is None or not svc.pool.for_model(model):
        raise ModelNotFoundError(f"The model '{model}' does not exist")
    return mt


# --- identify, tokenize -----------------------------------------------------------------------


def identify(
    req: CompletionRequest, headers: Mapping[str, str], derived: DerivedSessionCache
) -> SessionKey:
    """The request's session: an explicit key, or derived from a chat's stable prefix. A raw
    completion prompt without a key gets its session from its chain (`tokenize`)."""
    if req.endpoint is Endpoint.CHAT:
        return identify_session(headers, req.body, req.model, req.messages, derived=derived)
    return identify_session(headers, req.body, req.model, None)


def tokenize(
    req: CompletionRequest, mt: ModelTokenizer, session: SessionKey, sessions: SessionTable
) -> Prompt:
    """Token ids and block hashes of the prompt (only what changed since the session's
    previous turn; with chunk reuse on, its chunks: `chunk`), and whether the request forks
    its session: `n > 1`, another request of the session in flight, or a prompt that does
    not extend the previous one."""
    if req.endpoint is Endpoint.CHAT:
        tok = mt.tokenize_chat(session.session_id, req.messages, req.body.get("tools"))
    elif session.session_id is None:
        # its session derives from its chain, so there is no previous turn to start from:
        # hashed whole, once
        tok = mt.tokenize_prompt(None, req.body.get("prompt"))
        session = chain_session(req.model, tok.chain)
    else:
        tok = mt.tokenize_prompt(session.session_id, req.body.get("prompt"))
    chunks = None
    if mt.chunking is not None:
        found = chunk(req, mt, tok)
        if found is not None:
            req, chunks = found
    info = sessions.get(session.session_id)
    is_fork = req.n > 1 or (
        info is not None
        and (info.inflight > 0 or (tok.previous_chain_len > 0 and not tok.extends_previous))
    )
    return Prompt(req, session, tok, mt.block_size, chunks, info, is_fork)


def chunk(
    req: CompletionRequest, mt: ModelTokenizer, tok: Tokenized
) -> tuple[CompletionRequest, ChunkedPrompt] | None:
    """Chunk reuse (the model's `chunks:` settings): the prompt's chunks (a malformed chunked
    prompt is a 400), and the request with a body that tells the workers their layout in
    `kv_transfer_params.ownerserve` (`ownerserve/chunks.py`); None without chunks."""
    cp = mt.chunk_prompt(tok, req.messages if req.endpoint is Endpoint.CHAT else None)
    if cp is None:
        return None
    body = dict(req.body)
    ktp = body.get("kv_transfer_params")
    params = dict(ktp) if isinstance(ktp, dict) else {}
    params[CHUNK_PARAMS_KEY] = layout_params(cp)
    body["kv_transfer_params"] = params
    return replace(req, body=body, raw=orjson.dumps(body)), cp


# --- admit, look_up, view ---------------------------------------------------------------------


async def admit(admission: Admission, prompt: Prompt, out: ResponseWriter) -> float:
    """Admission before the lookup (a request released after a wait is planned on what the
    directory and the loads say then, not on what they said when it arrived): at once, or
    after waiting in the queue (`router.admission`; a 429 past its bounds). The seconds it
    waited."""
    session = prompt.session
    model = prompt.req.model
    if admission.admit_now(model, session.session_id, session.parent):
        return 0.0
    return await admission.wait(model, session.session_id, prompt.tokens, out, session.parent)


async def look_up(svc: LookUpServices, prompt: Prompt) -> tuple[Match, ChunkHolders]:
    """The directory's answer for the chain and, for a chunked prompt, one lookup per chunk
    hash, concurrently: its holders. Without an answer (backend down and no local view) the
    request is still routed, as if nothing were cached anywhere."""
    directory = svc.directory
    assert directory is not None
    chain = prompt.tok.chain
    sid = prompt.session.session_id
    if svc.pending:
        await svc.pending.landed(sid)  # the session's last answer's writes, if still going
    try:
        if prompt.chunks is None:
            return await directory.lookup(chain, sid), NO_HOLDERS
        chunks = prompt.chunks.chunks
        found = await asyncio.gather(
            directory.lookup(chain, sid), *(directory.lookup((c.hash,)) for c in chunks)
        )
        holders: dict[str, list[int]] = {}
        for i, m in enumerate(found[1:]):
            for h in m.holdings:
                if h.tier is Tier.GPU and h.blocks > 0:
                    held = holders.setdefault(h.worker, [])
                    if not held or held[-1] != i:
                        held.append(i)
        return found[0], {w: tuple(ix) for w, ix in holders.items()}
    except Exception as exc:
        svc.errors.inc()
        log.warning("directory lookup failed, routing without it: %r", exc)
        return Match(chain_len=len(chain)), NO_HOLDERS


def view(
    svc: ViewServices, headers: Mapping[str, str], prompt: Prompt, match: Match
) -> tuple[Policy, RequestView, SessionInfo | None]:
    """The policy (`x-ownerserve-policy` when allowed) and the request as it sees it; then
    the session is marked seen with this prompt: (policy, request view, the session's info
    now, None without a session)."""
    override = headers.get(POLICY_HEADER) if svc.policy_header else None
    policy = svc.planner.for_request(override)
    rview = request_view(
        prompt,
        match,
        svc.working_sets,
        svc.kv_bytes_per_token,
        svc.kv_specs.get(prompt.req.model),
        svc.copy_reuse,
    )
    sid = prompt.session.session_id
    info = svc.sessions.touch(sid, prompt.tokens) if sid else prompt.info
    return policy, rview, info


# --- plan, execute ----------------------------------------------------------------------------


def plan(
    policy: Policy,
    rview: RequestView,
    sources: ClusterSources,
    match: Match,
    excluded: Collection[str],
    holders: ChunkHolders,
    chain: Sequence[int] = (),
) -> Plan | None:
    """The policy's plan over the routable workers of the request's model not yet excluded
    (those that failed it before its first byte); None when there is none left. `chain`: the
    request's block chain (`cluster_view`). The plan feeds `copy_reuse`."""
    cluster = cluster_view(sources, rview.model, match, excluded, holders, chain)
    if not cluster.workers:
        return None
    planned = policy.plan(rview, cluster)
    # the copies it reuses served; those it makes are followed (planner.copyreuse)
    sources.copy_reuse.observe(planned, rview, cluster, time.monotonic())
    return planned


async def execute(
    svc: ExecuteServices,
    plan: Plan,
    req: CompletionRequest,
    prompt: Prompt,
    match: Match,
    holders: ChunkHolders,
    headers: bytes,
) -> tuple[OpenedResponse, CompletionRequest, Plan]:
    """Open the plan's final response (the executor: every hop within `server.*_timeout_s`;
    a worker that fails before the first byte raises `RetryableUpstreamError`). A chunked
    prompt's missing chunks are prefilled on a vLLM worker first (`router.chunk_prefill`).
    Returns the response, the request as sent (a chunk prefill salts it) and the plan as it
    ran: colocated on its decode worker when its P/D hand-over or fetch was given up."""
    executor = svc.executor
    assert executor is not None
    prefilled: ChunkPrefillOutcome | None = None
    if prompt.chunks is not None:
        done = await prefill_chunks(
            executor, svc.pool.get(plan.chosen.prefill_worker), req, prompt, svc.limits
        )
        if done is not None:
            prefilled, req = done
    opened = await executor.open_plan(
        plan,
        req,
        headers,
        fetch_spec(plan, prompt, match),
        svc.limits,
        chunks=chunk_fetch_spec(plan, prompt),
    )
    if opened.fetched is not None:
        svc.metrics.kv_fetches.labels(fetch_result(opened)).inc()
    ran = plan if opened.fallback is None else ran_colocated(plan)
    if prefilled is not None:  # what its sidecar held intact, what was prefilled
        opened.chunks = (prefilled.reused, 0, prefilled.prefilled + prefilled.failed)
    elif prompt.chunks is not None:
        opened.chunks = chunk_counts(ran, prompt, holders, opened)
    return opened, req, ran


def give_up(
    svc: ExecuteServices, fallback: Fallback | None, gave_up: GaveUp, ran: Ran | None
) -> Fallback | None:
    """Record a hop given up before the first byte: its worker's breaker, the timeout and
    fallback counters; returns what ran instead so far (`fallback` and, when something ran
    instead of this hop, `ran`)."""
    metrics = svc.metrics
    worker = svc.pool.get(gave_up.worker)
    reason = gave_up.reason
    if worker is not None and reason not in NOT_A_WORKER_FAILURE:
        worker.breaker.record_failure()
        metrics.breaker.labels(gave_up.worker).set(int(worker.breaker.state))
    if reason.endswith("_timeout"):
        metrics.upstream_timeouts.labels(gave_up.worker, reason.removesuffix("_timeout")).inc()
    if ran is None:
        return fallback
    metrics.fallbacks.labels(ran, reason).inc()
    return Fallback(ran, (gave_up,)) if fallback is None else fallback.then(ran, gave_up)


def ran_colocated(plan: Plan) -> Plan:
    """A plan as it ran after its P/D hand-over or fetch was given up: colocated on its
    decode worker (what the commit records). Unpriced (zero costs), so the calibrator learns
    nothing from it: its TTFT includes the hop given up."""
    d = plan.chosen.decode_worker
    return replace(
        plan, chosen=Candidate(Action.COLOCATED_PREFILL, d, d, CostBreakdown()), runner_up=None
    )


def fetch_result(opened: OpenedResponse) -> str:
    """`ownerserve_kv_fetches_total`'s result of a plan's fetch or migration."""
    if not opened.fetched:
        fb = opened.fallback
        return "empty" if fb is not None and fb.reason == "kv_fetch_empty" else "failed"
    blocks = opened.fetched_blocks
    return "partial" if blocks is not None and blocks[0] < blocks[1] else "full"


def fetch_spec(plan: Plan, prompt: Prompt, match: Match) -> FetchSpec | None:
    """What a fetch or migration moves: the prefix its source holds (as the plan says)."""
    src = plan.chosen.source_worker
    if plan.action not in (Action.ARTIFACT_FETCH, Action.STATE_MIGRATION) or not src:
        return None
    tok = prompt.tok
    blocks = plan.chosen.reused_blocks or match.longest(src)
    blocks = min(blocks or len(tok.chain), len(tok.chain))
    return FetchSpec(tuple(tok.chain[:blocks]), tok.token_ids, prompt.block_size)


def chunk_fetch_spec(plan: Plan, prompt: Prompt) -> ChunkFetchSpec | None:
    """Chunk reuse: the chunks the plan's prefill worker fetches (`Candidate.chunk_fetches`),
    grouped by holder."""
    fetches = plan.chosen.chunk_fetches
    if not fetches or prompt.chunks is None:
        return None
    chunks = prompt.chunks.chunks
    by_source: dict[str, list[int]] = {}
    for i, src in fetches:
        if 0 <= i < len(chunks):
            by_source.setdefault(src, []).append(chunks[i].hash)
    return ChunkFetchSpec(tuple((s, tuple(h)) for s, h in by_source.items()))


def chunk_counts(
    plan: Plan, prompt: Prompt, holders: ChunkHolders, opened: OpenedResponse
) -> tuple[int, int, int]:
    """(reused, fetched, recomputed) chunks of the prompt as `plan` ran: reused, those the
    directory says the prefill worker that ran holds; fetched, those its KV API says it
    pulled in; recomputed, the rest."""
    assert prompt.chunks is not None
    chunks = prompt.chunks.chunks
    worker = plan.chosen.prefill_worker
    held = set(holders.get(worker, ()))
    fetched = 0
    got = opened.chunks_fetched
    if got is not None and got[0] == worker:
        fetched = sum(1 for i, c in enumerate(chunks) if i not in held and c.hash in got[1])
    reused = sum(1 for i in held if 0 <= i < len(chunks))
    return reused, fetched, len(chunks) - reused - fetched
