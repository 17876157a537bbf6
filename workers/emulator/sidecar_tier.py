"""An emulated engine's KV through its own sidecar process (`--sidecar-url`, workers/sidecar), as a
vLLM worker's connector saves and loads it: every computed prompt block is saved there as one
artifact, and a request's prompt blocks past its HBM hit that the sidecar holds (put there by
this engine, or fetched by the sidecar from a peer's: the router's artifact fetch) are loaded
before it is scheduled.

What an artifact holds is what the emulator's KV is: the block's parent hash and token ids (the
bytes the sidecars store, checksum, serve and move); the time a load takes is the profile's for
the modelled bytes. A sidecar that is down, stopped or answers an error costs a save (counted,
dropped) or a load (the blocks are recomputed), never a request.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence

import httpx
import orjson

from ownerserve.kvstate.heads import head_keys
from ownerserve.tasks import cancel_and_wait
from workers.emulator.kv_cache import CachedBlock
from workers.sidecar.batch import (
    BATCH_GET_PATH,
    BATCH_PUT_PATH,
    MEDIA_TYPE,
    BatchFormatError,
    decode_batch,
    encode_batch,
)
from workers.sidecar.store import checksum

log = logging.getLogger(__name__)

SAVE_BATCH = 256
"""Blocks per batch PUT."""
SAVE_QUEUE = 8192
"""Blocks waiting to be saved at most; past it the oldest are dropped (counted)."""
CALL_TIMEOUT_S = 5.0
"""A sidecar call's bound: one that is stopped or gone costs at most this."""
LOOKUP_PATH = "/ownerserve/kv/lookup"


def block_key(model: str, block_hash: int) -> str:
    """A block's artifact key: head 0, pipeline stage 0 (the sidecar finds it by `model` and
    the block hash as the router's fetch names them)."""
    return head_keys(model, block_hash, (0,))[0]


def encode_block(block: CachedBlock) -> bytes:
    return orjson.dumps({"parent": block.parent_hash, "token_ids": list(block.token_ids)})


def decode_block(block_hash: int, data: bytes | memoryview) -> CachedBlock:
    """The block an artifact holds; `ValueError` for a payload of another shape."""
    try:
        body = orjson.loads(bytes(data))
        parent = body["parent"]
        tokens = tuple(int(t) for t in body["token_ids"])
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"not a block artifact: {exc}") from None
    return CachedBlock(block_hash, None if parent is None else int(parent), tokens)


class SidecarTier:
    """Saves to and loads from one sidecar; `close()` stops the saver."""

    def __init__(self, url: str, model: str) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self._queue: deque[CachedBlock] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._client: httpx.AsyncClient | None = None
        self.saved = 0
        self.save_failed = 0
        self.save_dropped = 0
        self.loaded = 0
        self.load_failed = 0

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(CALL_TIMEOUT_S, connect=2.0),
                limits=httpx.Limits(max_connections=16, max_keepalive_connections=8),
            )
        return self._client

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # --- saving: called by the engine as blocks are computed ----------------------------------

    def save(self, blocks: Sequence[CachedBlock]) -> None:
        """Queue `blocks` for the sidecar (needs a running loop)."""
        self._queue.extend(blocks)
        over = len(self._queue) - SAVE_QUEUE
        for _ in range(max(0, over)):
            self._queue.popleft()
            self.save_dropped += 1
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._save_forever())
        self._wake.set()

    async def _save_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch = [self._queue.popleft() for _ in range(min(SAVE_BATCH, len(self._queue)))]
                await self._put(batch)

    async def _put(self, blocks: list[CachedBlock]) -> None:
        payloads = [encode_block(b) for b in blocks]
        entries = [
            {"key": block_key(self.model, b.block_hash), "size": len(p)}
            for b, p in zip(blocks, payloads, strict=True)
        ]
        try:
            resp = await self.client().post(
                self.url + BATCH_PUT_PATH,
                content=encode_batch(entries, payloads),
                headers={"content-type": MEDIA_TYPE},
            )
            stored = resp.json()["stored"] if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            log.warning("saving %d blocks to the sidecar failed: %r", len(blocks), exc)
            stored = None
        if stored is None:
            self.save_failed += len(blocks)
            return
        ok = sum(1 for s in stored if isinstance(s, dict) and "error" not in s)
        self.saved += ok
        self.save_failed += len(blocks) - ok

    # --- loading: before a request is scheduled ----------------------------------------------

    async def load(self, hashes: Sequence[int]) -> list[CachedBlock]:
        """The leading blocks of `hashes` the sidecar holds and serves intact (from the first;
        each checked to continue the chain), [] when it holds none or cannot be reached."""
        if not hashes:
            return []
        keys = [block_key(self.model, h) for h in hashes]
        try:
            # the first block alone first: most requests find nothing past their HBM hit
            present = await self._lookup(keys[:1])
            if not present[0]:
                return []
            present = await self._lookup(keys)
            n = next((i for i, p in enumerate(present) if not p), len(keys))
            got = await self._batch_get(keys[:n])
        except (httpx.HTTPError, ValueError, KeyError, TypeError, BatchFormatError) as exc:
            log.warning("loading from the sidecar failed (recomputed): %r", exc)
            self.load_failed += 1
            return []
        blocks: list[CachedBlock] = []
        for h, key in zip(hashes[:n], keys[:n], strict=True):
            data = got.get(key)
            if data is None:
                break
            try:
                block = decode_block(h, data)
            except ValueError as exc:
                log.warning("artifact %s: %s", key, exc)
                break
            if blocks and block.parent_hash != blocks[-1].block_hash:
                break
            blocks.append(block)
        self.loaded += len(blocks)
        return blocks

    async def _lookup(self, keys: list[str]) -> list[bool]:
        resp = await self.client().post(self.url + LOOKUP_PATH, json={"keys": keys})
        resp.raise_for_status()
        present = resp.json()["present"]
        if not isinstance(present, list) or len(present) != len(keys):
            raise ValueError("lookup answered another number of keys")
        return [bool(p) for p in present]

    async def _batch_get(self, keys: list[str]) -> dict[str, bytes]:
        if not keys:
            return {}
        resp = await self.client().post(self.url + BATCH_GET_PATH, json={"keys": keys})
        resp.raise_for_status()
        entries, payloads = decode_batch(resp.content)
        out: dict[str, bytes] = {}
        for entry, data in zip(entries, payloads, strict=True):
            if data is None:
                continue
            expected = entry.get("checksum")
            if isinstance(expected, str) and checksum(data).hex() != expected:
                log.warning("artifact %s failed its checksum on the way: not loaded", entry["key"])
                continue
            out[str(entry["key"])] = bytes(data)
        return out
