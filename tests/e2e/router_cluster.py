"""The router in-process in front of emulated workers (`loadgen.cluster.EmulatedWorker`, real
processes), for the router's e2e tests (`test_router_*.py`)."""

from __future__ import annotations

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


@contextlib.asynccontextmanager
async def proxy(settings: Settings, **app_kwargs: Any) -> AsyncIterator[tuple[str, Any]]:
    """The router app in this event loop: yields (base URL, `Router`)."""
    app = create_app(settings, **app_kwargs)
    async with running_app(app, "127.0.0.1", 0) as url:
        yield url, app.state.router


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
