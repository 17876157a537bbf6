"""Chunk prefill for vLLM workers (chunk reuse): before a chunked request runs on a vLLM
worker whose connector keeps chunk KV in its sidecar, every chunk whose artifact the sidecar
does not hold intact is computed in isolation there (`ownerserve.chunks.chunk_prefills`: the
system segment and the chunk's load span, `max_tokens` 1, saved by the connector), and the
request gets the chunk `cache_salt`, so its isolated KV stays out of plain prompts' prefix
cache. The sidecar verifies the artifacts it says it holds (`/ownerserve/kv/chunks/verify`:
a corrupted one is dropped and prefilled again). Other workers (emulators, a vLLM worker
without a sidecar) are left alone: `prefill_chunks` returns None for them.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from typing import Any

import orjson

from ownerserve.chunks import CHUNK_CACHE_SALT, chunk_artifact_key, chunk_prefills
from ownerserve.types import BackendKind
from router.executor import HopLimits, PlanExecutor
from router.pool import WorkerState
from router.prompt import Prompt
from router.requests import CompletionRequest
from router.upstream import JSON_HEADER

log = logging.getLogger(__name__)

VERIFY_PATH = "/ownerserve/kv/chunks/verify"


@dataclass(frozen=True, slots=True)
class ChunkPrefillOutcome:
    """What the worker held intact and what was prefilled for a request (the plan header's
    `chunks=REUSED/0/RECOMPUTED`); `failed` prefills leave their chunks to be computed inside
    the request (not isolated: the plan header's `chunk_fallback`)."""

    reused: int
    prefilled: int
    failed: int


def chunk_salt(body: dict[str, Any]) -> str:
    """The `cache_salt` of a chunked request and its chunk prefills (a tenant's own salt kept)."""
    own = body.get("cache_salt")
    return f"{own}|{CHUNK_CACHE_SALT}" if isinstance(own, str) and own else CHUNK_CACHE_SALT


async def prefill_chunks(
    executor: PlanExecutor,
    worker: WorkerState | None,
    req: CompletionRequest,
    prompt: Prompt,
    limits: HopLimits,
) -> tuple[ChunkPrefillOutcome, CompletionRequest] | None:
    """Make sure `worker` holds every chunk of the prompt, and salt the request (see the
    module docstring): what it held and what was prefilled, and the request as it is sent
    now; None when the prompt has no chunks or the worker is not a vLLM worker with a
    sidecar."""
    cp = prompt.chunks
    if cp is None or worker is None:
        return None
    sidecar = worker.settings.sidecar_url
    if worker.settings.kind is not BackendKind.VLLM or sidecar is None:
        return None
    worker_id = worker.worker_id
    http = executor.http
    prefills = chunk_prefills(prompt.tok.token_ids, cp, prompt.block_size)
    keys = [chunk_artifact_key(req.model, p.span.key) for p in prefills]
    present = [False] * len(keys)
    try:
        status, data = await http.call(
            sidecar,
            b"POST",
            VERIFY_PATH,
            JSON_HEADER,
            orjson.dumps({"keys": keys}),
            ("kv_transfer", limits.kv_transfer_timeout_s),
        )
        if status == 200:
            got = orjson.loads(data).get("present")
            if isinstance(got, list) and len(got) == len(keys):
                present = [bool(x) for x in got]
    except (OSError, orjson.JSONDecodeError) as exc:
        log.warning("chunk verify on %s failed (prefilling every chunk): %r", worker_id, exc)
    body = dict(req.body)
    salt = chunk_salt(body)

    async def one(i: int) -> bool:
        p = prefills[i]
        chunk_req = {
            "model": req.model,
            "prompt": list(p.prompt),
            "max_tokens": 1,
            "temperature": 0,
            "cache_salt": salt,
            "kv_transfer_params": {"ownerserve": p.params},
        }
        try:
            status, _ = await http.call(
                worker.address.url,
                b"POST",
                "/v1/completions",
                JSON_HEADER,
                orjson.dumps(chunk_req),
                ("first_byte", limits.first_byte_timeout_s),
            )
        except OSError as exc:
            log.warning("chunk prefill on %s failed: %r", worker_id, exc)
            return False
        return status == 200

    missing = [i for i, ok in enumerate(present) if not ok]
    done = await asyncio.gather(*(one(i) for i in missing))
    body["cache_salt"] = salt
    failed = sum(1 for ok in done if not ok)
    outcome = ChunkPrefillOutcome(len(keys) - len(missing), len(missing) - failed, failed)
    return outcome, replace(req, body=body, raw=orjson.dumps(body))
