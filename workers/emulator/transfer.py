"""KV movement between emulated engines: P->D pulls and artifact fetches, over real HTTP.

No KV bytes travel: a pull asks the source for the blocks it holds (hashes, and token ids for a
fetch), then the receiver sleeps `link.transfer_s(bytes)` / speed and inserts the blocks in its
cache, so they show up in its prefix cache, its KV events and its byte counters.

- P->D (vLLM style): once the decode side's scheduler has allocated the request's blocks, it
  calls `POST {remote}/ownerserve/kv/pull` with the prefill's `remote_request_id`; the prefill
  side answers with the held blocks (the first line of its answer) and keeps them until the
  decode side closes the connection, the transfer time over (NIXL's producer frees the blocks
  when the consumer notifies it has read them): a prefill side that dies during the transfer
  fails it, and the request with it (vLLM's `kv_load_failure_policy` "fail"). While the
  request waits, the decode side renews the prefill side's lease on them every `lease_s / 6`
  (`POST .../kv/heartbeat`, as NixlConnector's heartbeats do); a request that ends unpulled
  releases them at once (a pull of no blocks).
- P->D (SGLang style): the same call to the prefill's bootstrap port with the `bootstrap_room`;
  the prefill side waits up to the transfer timeout for that room's prefill to finish.
- Artifact fetch: the destination calls `POST {source}/ownerserve/kv/read` for chosen hashes.
- Chunk fetch (chunk reuse): the destination calls `POST {source}/ownerserve/kv/read_chunks`
  for chunk hashes its chunk store lacks; the source answers each one it holds with its token
  count, and the destination stores them after their bytes' transfer time.

The decode side pulls only blocks it does not already hold, as vLLM's NIXL connector does.
Transfers into one engine queue on its inbound link (one for its own node, one for others), so
concurrent pulls share the modelled bandwidth instead of each getting all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import orjson

from ownerserve.errors import InvalidRequestError, UpstreamError
from ownerserve.profiles import kv_transport_into
from ownerserve.tasks import cancel_and_wait
from ownerserve.types import KVTransport
from workers.emulator.engine import Engine, RemotePrefill, Sequence
from workers.emulator.kv_cache import CachedBlock

log = logging.getLogger(__name__)

PULL_PATH = "/ownerserve/kv/pull"
READ_PATH = "/ownerserve/kv/read"
HEARTBEAT_PATH = "/ownerserve/kv/heartbeat"
CHUNK_READ_PATH = "/ownerserve/kv/read_chunks"
CONNECT_TIMEOUT_S = 3.0
PULL_ANSWER_S = 5.0
"""How long a P->D pull waits for the source's answer past the source's own wait (`wait_s`):
a source that does not answer by then (stopped, overloaded) fails the pull, and the request
fails (vLLM's `kv_load_failure_policy` "fail")."""


@dataclass(frozen=True, slots=True)
class _FetchOutcome:
    """What a fetch did, whatever it moved (blocks or chunks): counts of the requested
    hashes, the bytes and seconds its transfer took, and the source's node."""

    requested: int
    already_held: int
    fetched: int
    missing: list[int]
    bytes: int
    seconds: float
    source_node: str | None

    def as_json(self) -> dict[str, Any]:
        """Every field, by its name."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class FetchResult(_FetchOutcome):
    blocks: int = field(kw_only=True)
    """Requested blocks held here after the fetch, from the first (`ownerserve.kvfetch`)."""


@dataclass(frozen=True, slots=True)
class ChunkFetchResult(_FetchOutcome):
    chunks: list[int] = field(kw_only=True)
    """The requested chunk hashes the chunk store holds after the fetch (`ownerserve.kvfetch`)."""


def _error_message(resp: httpx.Response) -> str:
    try:
        body = orjson.loads(resp.content)
        return str(body["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return resp.text[:200]


class KVMover:
    """The receiving side of KV movement for one engine."""

    def __init__(self, engine: Engine, node: str, worker_id: str, lease_s: float = 30.0) -> None:
        self.engine = engine
        self.node = node
        self.worker_id = worker_id
        self.lease_s = lease_s
        self._client: httpx.AsyncClient | None = None
        # When this engine's inbound links (same node, other nodes) are next free.
        self._link_free_at = {True: 0.0, False: 0.0}
        self._renewer: asyncio.Task[None] | None = None
        self._releases: set[asyncio.Task[None]] = set()
        engine.loader = self.load
        engine.on_abandon = self.abandon

    @property
    def block_bytes(self) -> int:
        return self.engine.block_bytes

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
                limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
            )
        return self._client

    async def close(self) -> None:
        await cancel_and_wait(self._renewer)
        self._renewer = None
        for task in list(self._releases):
            await cancel_and_wait(task)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _post(
        self, url: str, body: dict[str, Any], timeout_s: float, what: str
    ) -> dict[str, Any]:
        try:
            resp = await self.client().post(
                url,
                content=orjson.dumps(body),
                headers={"content-type": "application/json"},
                timeout=httpx.Timeout(timeout_s + 5.0, connect=CONNECT_TIMEOUT_S),
            )
        except httpx.HTTPError as exc:
            self.engine.metrics.transfers_failed += 1
            raise InvalidRequestError(f"{what}: cannot reach {url}: {exc!r}") from None
        if resp.status_code != 200:
            self.engine.metrics.transfers_failed += 1
            raise InvalidRequestError(
                f"{what}: {url} answered {resp.status_code}: {_error_message(resp)}"
            )
        data = orjson.loads(resp.content)
        if not isinstance(data, dict):
            raise InvalidRequestError(f"{what}: {url} answered a non-object")
        return data

    async def wait_for_link(self, nbytes: int, source_node: str | None) -> float:
        """Wait while `nbytes` arrive: `link.transfer_s` on this engine's inbound link, after
        the transfers already queued on it (concurrent pulls share the bandwidth FIFO).
        Returns the modelled seconds of this transfer, queueing included."""
        same = source_node == self.node
        # the emulated engine takes a same-node peer's KV through host memory, others' over
        # the store's RDMA transport: the planner's defaults (`WorkerView`)
        path = kv_transport_into(same, True, KVTransport.STORE_RDMA)
        seconds = self.engine.profile.link.transfer_s(nbytes, path)
        if seconds <= 0:
            return 0.0
        speed = self.engine.speed
        now = time.perf_counter()
        start = max(now, self._link_free_at[same])
        end = start + seconds / speed
        self._link_free_at[same] = end
        self.engine.metrics.kv_link_queue_s += (start - now) * speed
        await asyncio.sleep(end - now)
        return (end - now) * speed

    async def load(self, seq: Sequence, remote: RemotePrefill, missing: list[int]) -> list[int]:
        """Pull the prompt blocks `missing` of `seq` from its prefill side (the engine has
        allocated their blocks); returns the leading hashes received, after their transfer."""
        body = {
            "transfer_id": remote.transfer_id,
            "engine_id": remote.engine_id,
            "block_hashes": missing,
            "wait_s": remote.wait_s,
            "requester": self.worker_id,
            "until_read": True,
        }
        url = remote.source_url + PULL_PATH
        what = remote.what
        request = self.client().build_request(
            "POST",
            url,
            content=orjson.dumps(body),
            headers={"content-type": "application/json"},
            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
        )
        try:
            async with contextlib.AsyncExitStack() as stack:
                async with asyncio.timeout(remote.wait_s + PULL_ANSWER_S):
                    resp = await self.client().send(request, stream=True)
                    stack.push_async_callback(resp.aclose)
                    chunks = resp.aiter_bytes()
                    answer = await self._pull_answer(resp, chunks, url, what)
                got = answer.get("block_hashes")
                if not isinstance(got, list) or got != missing[: len(got)]:
                    raise InvalidRequestError(f"{what}: source answered blocks of another prompt")
                nbytes = len(got) * self.block_bytes
                if got:  # and a hybrid model's windows and tail at the pulled boundary
                    nbytes += self.engine.state_bytes_at(seq.num_hashed + len(got))
                await self._read_while_open(chunks, nbytes, answer.get("node"), what)
        except TimeoutError:
            self.engine.metrics.transfers_failed += 1
            limit = remote.wait_s + PULL_ANSWER_S
            raise InvalidRequestError(f"{what}: {url} did not answer within {limit:g} s") from None
        except httpx.HTTPError as exc:
            self.engine.metrics.transfers_failed += 1
            raise InvalidRequestError(f"{what}: cannot pull from {url}: {exc!r}") from None
        m = self.engine.metrics
        m.kv_received_bytes["pd"] += nbytes
        m.kv_received_blocks["pd"] += len(got)
        return got

    async def _pull_answer(
        self, resp: httpx.Response, chunks: AsyncIterator[bytes], url: str, what: str
    ) -> dict[str, Any]:
        """The pull's answer: its first line (the source keeps the response open while the
        blocks are read), or its error."""
        if resp.status_code != 200:
            await resp.aread()
            self.engine.metrics.transfers_failed += 1
            raise InvalidRequestError(
                f"{what}: {url} answered {resp.status_code}: {_error_message(resp)}"
            )
        line = b""
        async for chunk in chunks:
            line += chunk
            if b"\n" in line:
                break
        head, sep, _ = line.partition(b"\n")
        try:
            data = orjson.loads(head) if sep else None
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            raise InvalidRequestError(f"{what}: {url} answered no transfer")
        return data

    async def _read_while_open(
        self, chunks: AsyncIterator[bytes], nbytes: int, source_node: str | None, what: str
    ) -> None:
        """Wait while `nbytes` arrive from a source that holds the blocks until this side
        lets go of the pull's connection (as NIXL's producer frees them on the consumer's
        notification that it read them): a source that dies, or ends the answer (it let the
        blocks go), before they are all in failed the transfer."""

        async def until_closed() -> None:
            async for _ in chunks:
                pass

        source = asyncio.ensure_future(until_closed())
        transfer = asyncio.ensure_future(self.wait_for_link(nbytes, source_node))
        try:
            await asyncio.wait({source, transfer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            source.cancel()
            if not transfer.done():
                transfer.cancel()
            await asyncio.gather(source, transfer, return_exceptions=True)
        if not transfer.done() or transfer.cancelled():
            self.engine.metrics.transfers_failed += 1
            raise InvalidRequestError(f"{what}: the source went away during the transfer")

    def track(self, remote: RemotePrefill) -> None:
        """A request waits here on `remote`: keep renewing its lease until it is pulled."""
        if remote.renews_lease and (self._renewer is None or self._renewer.done()):
            self._renewer = asyncio.get_running_loop().create_task(
                self._renew_leases(), name="kv-lease-renewal"
            )

    async def _renew_leases(self) -> None:
        """Every `lease_s / 6`, tell each prefill side which of its holds requests here still
        wait on (vLLM's NixlConnector heartbeat; the holder extends them by 2/3 of its lease).
        Ends when none is left."""
        interval = self.lease_s / 6
        while True:
            await asyncio.sleep(interval)
            by_source: dict[str, list[str]] = {}
            for seq in self.engine.awaiting_remote():
                remote = seq.remote
                if remote is not None and remote.renews_lease:
                    by_source.setdefault(remote.source_url, []).append(remote.transfer_id)
            if not by_source:
                return
            await asyncio.gather(*(self._heartbeat(url, ids) for url, ids in by_source.items()))

    async def _heartbeat(self, source_url: str, transfer_ids: list[str]) -> None:
        try:
            await self.client().post(
                source_url + HEARTBEAT_PATH,
                content=orjson.dumps({"transfer_ids": transfer_ids}),
                headers={"content-type": "application/json"},
                timeout=httpx.Timeout(self.lease_s / 6, connect=CONNECT_TIMEOUT_S),
            )
        except httpx.HTTPError as exc:  # the lease then runs out, as in vLLM
            log.warning("KV lease heartbeat to %s failed: %r", source_url, exc)

    def abandon(self, remote: RemotePrefill) -> None:
        """A request here ended without pulling `remote`: the source frees it now (a pull of
        no blocks), instead of when its lease runs out."""
        if not remote.renews_lease:
            return
        task = asyncio.get_running_loop().create_task(self._release(remote))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, remote: RemotePrefill) -> None:
        body: dict[str, Any] = {
            "transfer_id": remote.transfer_id,
            "engine_id": remote.engine_id,
            "block_hashes": [],
            "wait_s": 0.0,
            "requester": self.worker_id,
        }
        with contextlib.suppress(httpx.HTTPError):  # unreachable: its lease runs out instead
            await self.client().post(
                remote.source_url + PULL_PATH,
                content=orjson.dumps(body),
                headers={"content-type": "application/json"},
                timeout=httpx.Timeout(5.0, connect=CONNECT_TIMEOUT_S),
            )

    async def fetch(self, source_url: str, hashes: list[int], timeout_s: float) -> FetchResult:
        """Copy the blocks `hashes` that this engine lacks from the worker at `source_url`."""
        engine = self.engine
        pool = engine.pool
        wanted = [h for h in hashes if not pool.contains(h)]
        held = len(hashes) - len(wanted)
        if not wanted:
            return FetchResult(len(hashes), held, 0, [], 0, 0.0, None, blocks=len(hashes))
        try:
            answer = await self._post(
                source_url.rstrip("/") + READ_PATH, {"block_hashes": wanted}, timeout_s, "fetch"
            )
        except InvalidRequestError as exc:
            raise UpstreamError(str(exc)) from None
        try:
            blocks = [
                CachedBlock(
                    int(b["hash"]),
                    None if b.get("parent") is None else int(b["parent"]),
                    tuple(int(t) for t in b["token_ids"]),
                )
                for b in answer.get("blocks", ())
            ]
        except (KeyError, TypeError, ValueError):
            raise UpstreamError("fetch: source answered malformed blocks") from None
        nbytes = len(blocks) * self.block_bytes
        seconds = await self.wait_for_link(nbytes, answer.get("node"))
        ids = pool.insert(blocks)
        pool.free(ids)  # resident and reusable, referenced by nobody yet
        m = engine.metrics
        m.kv_received_bytes["fetch"] += nbytes
        m.kv_received_blocks["fetch"] += len(blocks)
        engine.flush_events()
        got = {b.block_hash for b in blocks}
        missing = [h for h in wanted if h not in got]
        prefix = next((i for i, h in enumerate(hashes) if not pool.contains(h)), len(hashes))
        return FetchResult(
            len(hashes), held, len(ids), missing, nbytes, seconds, answer.get("node"), blocks=prefix
        )

    async def fetch_chunks(
        self, source_url: str, hashes: list[int], timeout_s: float
    ) -> ChunkFetchResult:
        """Copy the chunks `hashes` that this engine's chunk store lacks from the chunk store
        of the worker at `source_url`, paying the link's time for their KV bytes."""
        store = self.engine.chunks
        if store is None:
            raise InvalidRequestError("this worker has no chunk store")
        wanted = [h for h in hashes if h not in store]
        held = len(hashes) - len(wanted)
        if not wanted:
            return ChunkFetchResult(len(hashes), held, 0, [], 0, 0.0, None, chunks=list(hashes))
        try:
            answer = await self._post(
                source_url.rstrip("/") + CHUNK_READ_PATH,
                {"chunk_hashes": wanted},
                timeout_s,
                "chunk fetch",
            )
        except InvalidRequestError as exc:
            raise UpstreamError(str(exc)) from None
        try:
            got = [(int(c["hash"]), int(c["tokens"])) for c in answer.get("chunks", ())]
        except (KeyError, TypeError, ValueError):
            raise UpstreamError("chunk fetch: source answered malformed chunks") from None
        asked = set(wanted)
        got = [(h, t) for h, t in got if h in asked and t > 0]
        nbytes = sum(t for _, t in got) * self.engine.profile.kv_bytes_per_token
        seconds = await self.wait_for_link(nbytes, answer.get("node"))
        m = self.engine.metrics
        fetched = 0
        for h, t in got:
            if store.store(h, t):
                fetched += 1
                m.chunks_fetched += 1
                m.chunk_tokens_fetched += t
        m.kv_received_bytes["chunk"] += nbytes
        holds = [h for h in hashes if h in store]
        missing = [h for h in wanted if h not in store]
        return ChunkFetchResult(
            len(hashes), held, fetched, missing, nbytes, seconds, answer.get("node"), chunks=holds
        )
