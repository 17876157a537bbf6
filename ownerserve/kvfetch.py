"""The KV fetch request: what the router sends a worker's KV API (the emulated engine's, or the
worker's sidecar) to make it pull a prompt prefix from another worker. Path and JSON schema,
defined once for the router (builds it), the emulator and the sidecar (parse it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ownerserve.errors import InvalidRequestError
from ownerserve.records import fast_init

FETCH_PATH = "/ownerserve/kv/fetch"
"""Where a worker's KV API takes `POST` of a `KVFetchRequest`. Its 200 answer is a JSON object
whose `blocks` (`fetched_blocks`) says how many of the requested blocks, from the first, the
worker holds once the fetch is done (a source that had only part of them gives fewer); a failed
fetch's error answer may say it too, next to `error` (the whole blocks it kept)."""

FETCH_BRINGS_WINDOWS = False
"""Whether a fetch brings a hybrid-attention model's sliding windows and per-sequence state at
the fetched boundary with the sealed blocks: it does not (the emulated engine's KV API serves
the source's sealed block pool, `/ownerserve/kv/read`; the sidecar knows no windows), so the
destination resumes where its own windows are, or rebuilds them (`ownerserve.kvstate.resume`);
a P/D hand-over's pull does bring them."""

MAX_FETCH_BLOCKS = 100_000
"""Most blocks one request may name (a bound on the work one request body can ask for)."""

MAX_FETCH_BODY_BYTES = 64 << 20
"""Largest fetch body a KV API reads (MAX_FETCH_BLOCKS hashes and a long prompt's token ids
fit with room to spare); a larger one is a 413."""

_U64 = 1 << 64


def _is_http_url(url: str) -> bool:
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unclosed IPv6 bracket
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def _common_fields(
    data: object, hashes_key: str, most: int
) -> tuple[Mapping[str, Any], dict[str, Any]]:
    """The body, and the fields every fetch body has, checked, by their names: `source_url`
    (without a trailing `/`), the hashes under `hashes_key` (a tuple), `model`,
    `source_worker`. `InvalidRequestError` names the first bad field."""
    if not isinstance(data, Mapping):
        raise InvalidRequestError("request body must be a JSON object")
    source_url = data.get("source_url")
    if not isinstance(source_url, str) or not _is_http_url(source_url):
        raise InvalidRequestError("source_url: must be an http(s) URL")
    hashes = data.get(hashes_key)
    if not isinstance(hashes, list) or not all(type(h) is int and 0 <= h < _U64 for h in hashes):
        raise InvalidRequestError(f"{hashes_key}: must be a list of unsigned 64-bit hashes")
    if len(hashes) > most:
        raise InvalidRequestError(f"{hashes_key}: at most {most} per request")
    model = data.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise InvalidRequestError("model: must be a non-empty string")
    source_worker = data.get("source_worker")
    if source_worker is not None and not isinstance(source_worker, str):
        raise InvalidRequestError("source_worker: must be a string")
    return data, {
        "source_url": source_url.rstrip("/"),
        hashes_key: tuple(hashes),
        "model": model,
        "source_worker": source_worker,
    }


class _Body:
    """A fetch request's JSON body is its fields by their names."""

    __slots__ = ()

    def to_json(self) -> dict[str, Any]:
        """The JSON object sent as the request body."""
        names: tuple[str, ...] = self.__slots__
        return {name: getattr(self, name) for name in names}


@fast_init  # the router makes one per fetch, on the request path
@dataclass(frozen=True, slots=True)
class KVFetchRequest(_Body):
    """Pull the first `len(block_hashes)` blocks of a prompt from the worker at `source_url`."""

    source_url: str
    """Base URL of the source's KV API (its sidecar, or the emulated engine), no trailing `/`."""
    block_hashes: tuple[int, ...]
    """The prompt's chained block hashes (unsigned 64-bit), first block first."""
    model: str | None = None
    source_worker: str | None = None
    """The source's worker id, for logs."""
    token_ids: tuple[int, ...] | None = None
    """The tokens of those blocks (`len(block_hashes) * block_size` of them)."""
    block_size: int | None = None

    @classmethod
    def from_json(cls, data: object) -> KVFetchRequest:
        """A request from a decoded JSON body (unknown keys are ignored); `InvalidRequestError`
        names the first field that is missing or malformed."""
        body, fields = _common_fields(data, "block_hashes", MAX_FETCH_BLOCKS)
        token_ids = body.get("token_ids")
        if token_ids is not None and (
            not isinstance(token_ids, list) or not all(type(t) is int for t in token_ids)
        ):
            raise InvalidRequestError("token_ids: must be a list of token ids")
        block_size = body.get("block_size")
        if block_size is not None and (type(block_size) is not int or block_size <= 0):
            raise InvalidRequestError("block_size: must be a positive integer")
        token_ids = None if token_ids is None else tuple(token_ids)
        return cls(**fields, token_ids=token_ids, block_size=block_size)


def fetched_blocks(answer: object) -> int | None:
    """`blocks` of a fetch's 200 answer (a decoded JSON body), or None when it does not say."""
    if isinstance(answer, Mapping):
        blocks = answer.get("blocks")
        if type(blocks) is int and blocks >= 0:
            return blocks
    return None


CHUNK_FETCH_PATH = "/ownerserve/kv/fetch_chunks"
"""Where a worker's KV API takes `POST` of a `KVChunkFetchRequest` (chunk reuse: pull chunk KV
from another worker's chunk store into its own). Its 200 answer is a JSON object whose
`chunks` (`fetched_chunks`) lists the requested chunk hashes its chunk store holds once the
fetch is done; a KV API that cannot fetch chunks answers 4xx (the router then recomputes
them)."""

MAX_FETCH_CHUNKS = 4096
"""Most chunks one chunk fetch may name."""


@fast_init
@dataclass(frozen=True, slots=True)
class KVChunkFetchRequest(_Body):
    """Pull the chunks `chunk_hashes` (content hashes, `ownerserve.chunks`) from the chunk
    store of the worker at `source_url` into this worker's."""

    source_url: str
    """Base URL of the source's KV API, no trailing `/`."""
    chunk_hashes: tuple[int, ...]
    model: str | None = None
    source_worker: str | None = None
    """The source's worker id, for logs."""

    @classmethod
    def from_json(cls, data: object) -> KVChunkFetchRequest:
        """As `KVFetchRequest.from_json`."""
        _, fields = _common_fields(data, "chunk_hashes", MAX_FETCH_CHUNKS)
        return cls(**fields)


def fetched_chunks(answer: object) -> frozenset[int] | None:
    """`chunks` of a chunk fetch's 200 answer (a decoded JSON body): the chunk hashes held
    after it, or None when it does not say."""
    if isinstance(answer, Mapping):
        chunks = answer.get("chunks")
        if isinstance(chunks, list) and all(type(h) is int and 0 <= h < _U64 for h in chunks):
            return frozenset(chunks)
    return None
