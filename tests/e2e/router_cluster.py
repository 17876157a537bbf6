"""The router in-process in front of emulated workers (`loadgen.cluster.EmulatedWorker`, real
processes), for the router's e2e tests (`test_router_*.py`); and the check that a router gave
back everything its requests held (`outstanding`), which `tests/e2e/conftest.py` runs after
every test on each router `proxy` built in it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from loadgen.cluster import MODEL, EmulatedWorker, emulated_workers
from ownerserve.config import Settings, settings_from_dict
from planner.explain import parse_plan_header
from router.app import create_app
from router.server import running_app
from router.state import Router

DATA = Path(__file__).resolve().parent / "data"
FAST_DECODE_PROFILE = str(DATA / "router-fast-decode.yaml")
REPO = Path(__file__).resolve().parents[2]


def workers_fixture(make: Callable[[], Sequence[EmulatedWorker]]) -> Any:
    """A module-scoped fixture, named by pytest after the module-level name it is assigned to:
    the workers `make` makes (when a test first asks for them, so their ports are picked then),
    started (`emulated_workers`) for the module's tests."""

    def started() -> Iterator[tuple[EmulatedWorker, ...]]:
        with emulated_workers(*make()) as ws:
            yield ws

    return pytest.fixture(scope="module")(started)


def router_settings(workers: Sequence[EmulatedWorker], **sections: dict[str, Any]) -> Settings:
    data: dict[str, Any] = {
        "server": {"port": 0, "health_interval_s": 0.5, **sections.get("server", {})},
        "planner": {"policy": "ownerserve", **sections.get("planner", {})},
        "models": [{"name": MODEL}],
        "workers": [w.worker_settings() for w in workers],
    }
    for name in ("directory", "telemetry", "admission"):
        if name in sections:
            data[name] = sections[name]
    return settings_from_dict(data)


SETTLE_S = 30.0
"""How long a router's last requests may take to finish after its test's block (a response
the client has read whole may still be closing upstream, observing, giving its lease back)."""

_built: list[Router] | None = None
"""The routers `proxy` built in the current test and left cleanly (`checked_routers`)."""


@contextlib.contextmanager
def checked_routers() -> Iterator[list[Router]]:
    """Collect the routers `proxy` builds in the block (those whose block raised are left out:
    the test failed already)."""
    global _built
    built: list[Router] = []
    _built = built
    try:
        yield built
    finally:
        _built = None


def outstanding(router: Router) -> list[str]:
    """What `router`'s requests still hold: open leases, per worker its in-flight requests,
    queued prefill and KV tokens and its admission working set's charges (`since_scrape` may
    end below zero: an answer that started before a scrape and ended after it), requests
    waiting for admission, sessions' KV counted as in flight, sessions' in-flight counts.
    Empty when everything was given back."""
    found = []
    if router.leases.open:
        found.append(f"{router.leases.open} open request leases")
    admission = router.admission
    for w in router.pool.all():
        held = (w.inflight, w.inflight_prefill_tokens, w.inflight_kv_tokens)
        if any(held):
            found.append(f"{w.worker_id}: in flight, prefill tokens, KV tokens {held}")
        ws = admission.working_set(w)
        if ws.pending or ws.reserved or ws.reserved_sessions or ws.since_scrape > 0:
            found.append(
                f"{w.worker_id}: admission pending {ws.pending}, reserved {ws.reserved} "
                f"({ws.reserved_sessions} requests), since scrape {ws.since_scrape}"
            )
    if admission.queued:
        found.append(f"{admission.queued} requests in the admission queue")
    # planner.workingset has no reader of its sessions in flight: read them here
    in_flight = {s: v.inflight for s, v in router.working_sets._sessions.items() if v.inflight}
    if in_flight:
        found.append(f"sessions' KV counted in flight: {in_flight}")
    sessions = router.sessions.in_flight()
    if sessions:
        found.append(f"sessions with requests in flight: {sessions}")
    return found


async def settled(router: Router, timeout_s: float = SETTLE_S) -> None:
    """Wait (within `timeout_s`) until none of `router`'s requests holds a lease: each has
    given back everything it took, however it ended."""
    try:
        async with asyncio.timeout(timeout_s):
            await router.leases.settled()
    except TimeoutError:
        raise AssertionError(
            f"requests still running {timeout_s:g} s after the test: {outstanding(router)}"
        ) from None


@contextlib.asynccontextmanager
async def proxy(settings: Settings, **app_kwargs: Any) -> AsyncIterator[tuple[str, Any]]:
    """The router app in this event loop: yields (base URL, `Router`). Left cleanly, it waits
    for the router's requests to finish before it stops (`settled`), and the router is checked
    after the test (`checked_routers`)."""
    app = create_app(settings, **app_kwargs)
    router: Router = app.state.router
    async with running_app(app, "127.0.0.1", 0) as url:
        yield url, router
        await settled(router)
        if _built is not None:
            _built.append(router)


plan_fields = parse_plan_header  # the e2e tests' name for it


async def sse_chunks(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of a streamed chat answer's `data:` lines, up to `[DONE]`; none of them
    may be an error."""
    async for line in resp.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk: dict[str, Any] = orjson.loads(line[6:])
        assert "error" not in chunk, chunk
        yield chunk


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


@contextlib.asynccontextmanager
async def proxy_client(
    settings: Settings, **app_kwargs: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """`proxy` plus an HTTP client on it: yields (client, `Router`)."""
    async with (
        proxy(settings, **app_kwargs) as (url, router),
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        yield client, router
