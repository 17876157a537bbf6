"""The router's ASGI app: `create_app(settings)` returns a FastAPI app serving the OpenAI API
(`/v1/chat/completions`, `/v1/completions`, `/v1/models`), the front doors
(`/v1/responses`, `/v1/messages`: `router.frontdoors`), `/health`, `/metrics` and the
token-protected admin API (`/admin/...`).

The two completion endpoints are served by a raw ASGI layer in front of FastAPI (the hot path
pays for no routing or request objects); everything else goes through FastAPI.

    from router.app import create_app
    app = create_app(load_settings("configs/cluster.sample.yaml"))   # any ASGI server runs it

`router.server.serve(settings)` runs it in-process on the router's own HTTP server
(`router.httpserver`), which serves the completion endpoints without the ASGI layer.
"""

from __future__ import annotations

import hmac
import os
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from ownerserve.config import Settings, WorkerSettings
from ownerserve.directory.base import Directory
from ownerserve.errors import (
    AuthenticationError,
    InvalidRequestError,
    MethodNotAllowedError,
    NotFoundError,
)
from ownerserve.http import send_error, service_app
from planner.calibration import Calibrator
from planner.policies import Planner
from router import membership
from router.asgi import Receive, Scope, Send, handle_completion
from router.frontdoors import FrontDoors
from router.memdebug import MemoryDebug
from router.requests import Endpoint
from router.state import Router
from router.status import router_status

_HOT_PATHS = {e.value: e for e in Endpoint}


class CompletionsASGI:
    """Serves the completion endpoints directly; passes everything else to FastAPI."""

    def __init__(self, app: Any, router: Router, doors: FrontDoors | None = None) -> None:
        self.app = app
        self.router = router
        self.doors = doors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            endpoint = _HOT_PATHS.get(scope["path"])
            if endpoint is not None:
                if scope["method"] == "POST":
                    await handle_completion(self.router, scope, receive, send, endpoint)
                else:
                    message = f"method {scope['method']} not allowed on {scope['path']}"
                    await send_error(send, MethodNotAllowedError(message))
                return
            door = self.doors.handler(scope["method"], scope["path"]) if self.doors else None
            if door is not None:
                await door(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(
    settings: Settings,
    *,
    directory: Directory | None = None,
    planner: Planner | None = None,
    calibrator: Calibrator | None = None,
) -> FastAPI:
    """The router app for `settings`. `directory` defaults to `open_directory(settings.directory)`,
    policies to `planner.policies.get_policy`; the `Router` is at `app.state.router`."""
    router = Router(settings, directory=directory, planner=planner, calibrator=calibrator)

    doors = FrontDoors(router)
    memory = MemoryDebug(settings.server.debug_memory_frames if settings.server.debug_memory else 0)

    async def start() -> None:
        memory.start()
        await router.start()

    async def close() -> None:
        await router.close()
        await doors.close()
        memory.stop()

    app = service_app("OwnerServe router", start, close)
    app.state.router = router
    app.add_middleware(CompletionsASGI, router=router, doors=doors)

    # --- OpenAI API -----------------------------------------------------------------------

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        router.check_auth({k.lower(): v for k, v in request.headers.items()})
        served = set(router.pool.models())
        if any(not w.settings.models for w in router.pool.all()):
            served |= {m.name for m in settings.models}
        data = [
            {
                "id": m.name,
                "object": "model",
                "created": 0,
                "owned_by": "ownerserve",
                "max_model_len": m.max_model_len,
            }
            for m in settings.models
            if m.name in served
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with either
    async def health() -> JSONResponse:
        workers = router.pool.all()
        healthy = [w.worker_id for w in workers if w.healthy and not w.draining]
        body: dict[str, Any] = {
            "status": "ok" if healthy else "degraded",
            "workers": {"total": len(workers), "healthy": len(healthy)},
            # which of `ownerserve serve --processes N`'s processes answered
            "process": {"pid": os.getpid(), "processes": settings.server.processes},
        }
        if router.directory is not None:
            dh = await router.directory.health()
            body["directory"] = {"backend": dh.backend, "healthy": dh.healthy, "detail": dh.detail}
        return JSONResponse(body)

    @app.get("/metrics")
    async def metrics() -> Response:
        # the gauges of the router's state are set as the read begins (Router._observe_metrics)
        body = router.metrics.exposition()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    # --- admin API (separate token) -------------------------------------------------------

    def admin_auth(request: Request) -> None:
        token = settings.server.admin_token
        if not token:
            raise AuthenticationError("admin API disabled: set server.admin_token")
        given = request.headers.get("x-admin-token") or ""
        auth = request.headers.get("authorization", "")
        if not given and auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise AuthenticationError("invalid admin token")

    def worker_json(w: Any) -> dict[str, Any]:
        return {
            **w.settings.model_dump(mode="json"),
            "healthy": w.healthy,
            "draining": w.draining,
            "breaker": w.breaker.state.name.lower(),
            "inflight": w.inflight,
            # its KV API (a sidecar's, probed) reachable: it takes part in fetches
            "kv_api_ok": w.kv_api_ok,
            "load": {
                "running": w.load.running,
                "waiting": w.load.waiting,
                "kv_usage": w.load.kv_usage,
                "kv_capacity_tokens": w.load.kv_capacity_tokens,
                "offloads": w.load.offloads,
            },
            # the sessions' KV the router counts there (planner.workingset)
            "working_set_tokens": router.working_sets.tokens(w.worker_id, time.monotonic()),
        }

    @app.get("/admin/workers")
    async def list_workers(request: Request) -> JSONResponse:
        admin_auth(request)
        return JSONResponse({"workers": [worker_json(w) for w in router.pool.all()]})

    @app.post("/admin/workers")
    async def add_worker(request: Request) -> JSONResponse:
        admin_auth(request)
        try:
            ws = WorkerSettings.model_validate_json(await request.body())
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise InvalidRequestError(f"invalid worker: {loc}: {err['msg']}") from None
        names = {m.name for m in settings.models}
        unknown = [m for m in ws.models if m not in names]
        if unknown:
            raise InvalidRequestError(f"invalid worker: unknown model {unknown[0]!r}")
        if router.pool.get(ws.id) is not None:
            raise InvalidRequestError(f"worker {ws.id!r} already exists")
        await membership.add_worker(router, ws)
        state = router.pool.get(ws.id)
        return JSONResponse(worker_json(state), status_code=201)

    @app.post("/admin/workers/{worker_id}/drain")
    @app.post("/admin/workers/{worker_id}/undrain")
    async def drain(worker_id: str, request: Request) -> JSONResponse:
        admin_auth(request)
        on = request.url.path.rsplit("/", 1)[1] == "drain"
        state = router.pool.drain(worker_id, on)
        if state is None:
            raise NotFoundError(f"no worker {worker_id!r}")
        return JSONResponse(worker_json(state))

    @app.delete("/admin/workers/{worker_id}")
    async def remove(worker_id: str, request: Request) -> JSONResponse:
        admin_auth(request)
        if not await membership.remove_worker(router, worker_id):
            raise NotFoundError(f"no worker {worker_id!r}")
        return JSONResponse({"removed": worker_id})

    @app.get("/admin/plans")
    async def plans(request: Request) -> JSONResponse:
        admin_auth(request)
        return JSONResponse({"plans": [p.as_dict() for p in router.recent_plans]})

    @app.get("/admin/calibration")
    async def calibration(request: Request) -> JSONResponse:
        admin_auth(request)
        snap = router.calibrator.snapshot()
        return JSONResponse(
            {
                w: {
                    "prefill": s.prefill,
                    "decode": s.decode,
                    "link": s.link,
                    "handover_s": s.handover_s,
                }
                for w, s in snap.items()
            }
        )

    @app.get("/admin/status")
    async def status(request: Request) -> JSONResponse:
        admin_auth(request)
        return JSONResponse(await router_status(router))

    @app.get("/admin/debug/memory")
    async def debug_memory(request: Request, top: int = 25, reset: bool = False) -> JSONResponse:
        admin_auth(request)
        if not settings.server.debug_memory:
            raise NotFoundError("memory debugging is off: set server.debug_memory")
        report = memory.report(top=top, reset=reset)
        if router.directory is not None:  # its sizes: the local mirror's cached pairs
            report["directory"] = (await router.directory.health()).stats
        return JSONResponse(report)

    @app.get("/admin/links")
    async def links(request: Request) -> JSONResponse:
        admin_auth(request)
        return JSONResponse({"nic_backlog_s": router.nics.snapshot(time.monotonic())})

    return app
