"""The request pipeline's stages on a `RequestContext`, without HTTP: what each stage sets,
and that a raw completion prompt is identified and tokenized once."""

from __future__ import annotations

from typing import Any

import orjson

from ownerserve.config import settings_from_dict
from router.backends import WorkerLoad
from router.inflight import hold, release
from router.pipeline import RequestContext, identify, look_up, parse, plan, tokenize, view
from router.requests import Endpoint
from router.session import SessionSource
from router.state import Router
from router.tokens import Tokenized
from router.views import cluster_view
from router.writer import ResponseWriter

MODEL = "tiny"
PROMPT = "def add(a, b):\n    return a + b\n" * 10  # beyond the 64 blocks a session hashes


def _router() -> Router:
    return Router(
        settings_from_dict(
            {
                "models": [{"name": MODEL, "block_size": 4}],
                "workers": [{"id": "w0", "url": "http://127.0.0.1:9"}],
            }
        )
    )


def _context(router: Router, endpoint: Endpoint, body: dict, headers=()) -> RequestContext:
    ctx = RequestContext(router, endpoint, list(headers), ResponseWriter(), 0.0)
    parse(ctx, orjson.dumps(body))
    return ctx


async def _planned(router: Router) -> RequestContext:
    """A chat request of session s1 taken through the stages up to its plan."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 10}]}
    ctx = _context(router, Endpoint.CHAT, body, [(b"x-session-id", b"s1")])
    identify(ctx)
    tokenize(ctx)
    await look_up(ctx)
    view(ctx)
    assert plan(ctx)
    return ctx


async def test_stages_fill_the_context_up_to_a_plan():
    router = _router()
    await router.open_directory()
    ctx = await _planned(router)
    assert ctx.session.session_id == "s1" and ctx.tok.chain
    assert ctx.rview.chain_blocks == len(ctx.tok.chain) and not ctx.is_fork
    assert ctx.plan.chosen.decode_worker == "w0"
    info = router.sessions.get("s1")
    assert info is not None and info is ctx.info
    assert info.prompt_tokens == len(ctx.tok.token_ids)


async def test_a_raw_prompt_without_key_is_tokenized_once_and_its_session_derived_from_it():
    router = _router()
    mt = router.tokenizers.get(MODEL)
    assert mt is not None
    calls: list[str | None] = []
    original = mt.tokenize_prompt

    def counting(session_id: str | None, prompt: Any) -> Tokenized:
        calls.append(session_id)
        return original(session_id, prompt)

    mt.tokenize_prompt = counting  # type: ignore[method-assign]
    ctx = _context(router, Endpoint.COMPLETIONS, {"model": MODEL, "prompt": PROMPT})
    identify(ctx)
    tokenize(ctx)
    assert calls == [None]
    assert ctx.session.source is SessionSource.DERIVED and ctx.tok.previous_chain_len == 0
    nxt = _context(router, Endpoint.COMPLETIONS, {"model": MODEL, "prompt": PROMPT + "# more"})
    identify(nxt)
    tokenize(nxt)
    assert nxt.session == ctx.session  # the same leading blocks: the same derived session
    assert calls == [None, None]
    assert nxt.tok.chain[: len(ctx.tok.chain)] == ctx.tok.chain


async def test_the_kv_of_requests_in_flight_shows_in_the_view_before_the_next_scrape():
    """A worker's KV usage in the planner's view is at least what the router's own requests in
    flight hold there (their prompts, once prefilled): the scrape it last read is up to an
    interval old. Released, the view falls back to the scrape."""
    router = _router()
    await router.open_directory()
    w0 = router.pool.get("w0")
    assert w0 is not None
    ctx = await _planned(router)
    n = ctx.tok.prompt_tokens
    w0.load = WorkerLoad(kv_usage=0.1, kv_capacity_tokens=4 * n)

    def usage() -> float:
        return cluster_view(router, MODEL, ctx.match, ()).workers[0].kv_usage

    assert usage() == 0.1
    hold(ctx, [w0], w0, w0)  # prefilling: its tokens count as queued prefill, not yet as KV
    assert w0.inflight_kv_tokens == n and usage() == 0.1
    release(ctx)
    hold(ctx, [w0], kv=w0)  # streaming: its prompt's KV is held there
    assert usage() == 0.25
    w0.inflight_kv_tokens += 5000  # more than the pool: the view says full, not more
    assert usage() == 1.0
    w0.inflight_kv_tokens -= 5000
    release(ctx)
    assert w0.inflight_kv_tokens == 0 and usage() == 0.1
