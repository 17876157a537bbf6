"""The sidecar's chunk store view (chunk reuse): chunk artifacts (`ownerserve.chunks.
chunk_artifact_key`, written by the vLLM connector after a chunk prefill) live in the artifact
store like block artifacts; `POST /ownerserve/kv/chunks/verify` says which of some keys are
stored *and* pass their checksum, dropping a corrupted one, so the router prefills those
chunks again before a request needs them (a plain lookup would still count a corrupted file)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ownerserve.errors import InvalidRequestError, NotFoundError
from workers.sidecar.index import valid_key

if TYPE_CHECKING:
    from workers.sidecar.server import Sidecar

VERIFY_PATH = "/ownerserve/kv/chunks/verify"
MAX_VERIFY_KEYS = 4096


class VerifyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    keys: list[str] = Field(max_length=MAX_VERIFY_KEYS)


def add_chunk_routes(app: FastAPI, sidecar: Sidecar) -> None:
    """Register the chunk routes on the sidecar's app."""

    @app.post(VERIFY_PATH)
    async def verify(body: VerifyBody) -> JSONResponse:
        if not all(valid_key(k) for k in body.keys):
            raise InvalidRequestError("artifact key: 1 to 1024 characters, no control characters")
        present: list[bool] = []
        for key in body.keys:
            try:
                # reads and hashes the artifact (an SSD one in a thread); corrupted: dropped
                await sidecar.get(key)
            except NotFoundError:
                present.append(False)
            else:
                present.append(True)
        return JSONResponse({"present": present})
