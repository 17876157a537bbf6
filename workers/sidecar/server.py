"""The sidecar process of one worker: its KV artifact store behind an HTTP API (the vLLM
connector saves and loads artifacts through it; the router asks it to pull a prefix from another
worker's sidecar), a transfer server peers pull artifacts from, and the replicas it publishes
to the ownership directory.

HTTP API (JSON unless said otherwise; every error is OpenAI-shaped, `ownerserve.http`):

- `GET /health` -> `{"worker_id", "transport", "transfer_port", "artifacts", "bytes", "url"}`
- `POST /ownerserve/kv/lookup {"keys": [str]}` -> `{"present": [bool]}` (same order)
- `GET /ownerserve/kv/artifacts/{key}` -> raw bytes + `x-ownerserve-checksum: <XXH3-128 hex>`
  (verified against the stored checksum first: a corrupted artifact is dropped and answered 404)
- `PUT /ownerserve/kv/artifacts/{key}` raw bytes (optional `x-ownerserve-checksum` verified;
  optional `x-ownerserve-block-artifacts: N`, how many artifacts make the key's block whole)
  -> 201 `{"key", "bytes", "checksum", "tier"}`
- `POST /ownerserve/kv/index {"model", "chunk_hashes": [int]}` -> `{"keys": [[str], ...],
  "transport", "transfer_port", "transfer_host"}`: the keys held per whole chunk, [] for a
  chunk not (yet) whole (what a peer's fetch asks first)
- `POST /ownerserve/kv/fetch {source_url, source_worker, model, block_hashes, token_ids,
  block_size}` -> 200 `{"blocks", "artifacts", "bytes"}`; 502 when the source is unreachable,
  dies mid-transfer or sends bytes failing their checksum (blocks left incomplete are deleted),
  its error answer with `"blocks"`: the whole blocks of the prefix held after it, from the
  first. A source drops an artifact that fails its checksum instead of serving it, and answers
  it missing: the fetch then keeps the blocks before it (200, `blocks` < requested).
- `POST /ownerserve/kv/store/report {"stored": [{"key", "bytes", "checksum"}],
  "block_artifacts": N, "dropped": [key]}` -> `{"held": [key], "missing": [key]}` (with
  `--store` only): artifacts the engine's connector put into Mooncake Store itself are held,
  indexed and published once found there; `dropped` ones (its load found them missing or
  corrupted) are no longer held
- `GET /metrics` -> Prometheus text

With `--store mooncake://HOST:PORT` the artifacts' bytes live in Mooncake Store
(`workers.sidecar.store_tier`) instead of this process's memory and SSD tiers: a put goes to
the store, a get reads it back verified, and a fetch from a peer on the same store is this
sidecar's store client reading what the peer put (no transfer server involved). A store that
cannot be reached answers 503 `kv_store_unavailable` (a fetch: 502 with `blocks`).

Run it with `ownerserve worker sidecar --worker-id ID --port N --store-dir DIR ...`
(`workers/cli.py`); `serving(config)` runs one inside an event loop (tests, benchmarks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field

from ownerserve.config import DirectorySettings
from ownerserve.directory import Directory, open_directory
from ownerserve.errors import (
    InvalidRequestError,
    NotFoundError,
    OwnerServeError,
    PayloadTooLargeError,
    UpstreamError,
    error_body_for,
)
from ownerserve.http import json_object, read_request_body, service_app
from ownerserve.kvfetch import FETCH_PATH, MAX_FETCH_BODY_BYTES, KVFetchRequest
from ownerserve.types import Tier
from workers.mooncake_store import MasterAddress
from workers.mooncake_store import StoreError as MooncakeStoreError
from workers.sidecar.arena import Arena
from workers.sidecar.batch import (
    BATCH_GET_PATH,
    BATCH_PUT_PATH,
    MEDIA_TYPE,
    BatchFormatError,
    decode_batch,
    encode_batch,
)
from workers.sidecar.index import (
    MAX_BLOCK_ARTIFACTS,
    ChunkId,
    ChunkIndex,
    stored_prefix,
    valid_key,
)
from workers.sidecar.publisher import ReplicaPublisher
from workers.sidecar.store import (
    CHECKSUM_BYTES,
    CHECKSUM_NAME,
    ArtifactCorrupted,
    ArtifactMissing,
    ArtifactStore,
    ArtifactTooLarge,
    StoreError,
)
from workers.sidecar.store import Tier as StoreTier
from workers.sidecar.store_tier import HeldArtifact
from workers.sidecar.store_tier import StoreTier as SharedTier
from workers.sidecar.transports import Transport, TransportUnavailable, transport_for_peer

log = logging.getLogger(__name__)

CHECKSUM_HEADER = "x-ownerserve-checksum"
BLOCK_ARTIFACTS_HEADER = "x-ownerserve-block-artifacts"
KV_PREFIX = "/ownerserve/kv"
STORE_REPORT_PATH = KV_PREFIX + "/store/report"
GiB = 1 << 30
MAX_BLOCKS_PER_FETCH = 100_000


class ArtifactNotFoundError(NotFoundError):
    code = "artifact_not_found"


class KVStoreUnavailableError(OwnerServeError):
    """The Mooncake Store behind `--store` cannot be reached (or did not take an artifact)."""

    status_code = 503
    error_type = "kv_store_unavailable"
    code = "kv_store_unavailable"


class FetchFailedError(UpstreamError):
    """A fetch that could not bring the source's prefix whole; `blocks`: the whole blocks of the
    requested prefix this sidecar holds after it, from the first (its error answer says so)."""

    code = "kv_fetch_failed"

    def __init__(self, *args: object, blocks: int | None = None) -> None:
        super().__init__(*args)
        self.blocks = blocks


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    """Settings of one sidecar process (`ownerserve worker sidecar` flags)."""

    worker_id: str
    store_dir: Path
    host: str = "127.0.0.1"
    port: int = 8200
    memory_bytes: int = 2 * GiB
    ssd_bytes: int = 16 * GiB
    directory: str = "memory"
    """`memory` (in-process, visible only to this process) or a `redis://` URL."""
    directory_prefix: str = "os"
    transfer_port: int = 0
    transport: str = "auto"
    advertise_url: str | None = None
    replica_ttl_s: float = 30.0
    fetch_timeout_s: float = 60.0
    max_artifact_bytes: int = 1 * GiB
    clear_ssd: bool = False
    """Delete the SSD tier's files of an earlier run at start instead of recovering them."""
    store: str | None = None
    """`mooncake://HOST:PORT[?metadata_port=P]`: artifacts live in that Mooncake Store."""
    store_segment_bytes: int = 1 * GiB
    """Memory this sidecar mounts into the store (its own artifacts are put there first)."""
    store_timeout_s: float = 5.0
    """Deadline of one store call (plus its bytes at 250 MB/s)."""

    def directory_settings(self) -> DirectorySettings:
        if self.directory == "memory":
            return DirectorySettings(backend="memory")
        return DirectorySettings(
            backend="redis", redis_url=self.directory, key_prefix=self.directory_prefix
        )


# --- request bodies ---------------------------------------------------------------------------

U64 = Annotated[int, Field(ge=0, lt=1 << 64)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class LookupBody(_Body):
    keys: list[str] = Field(max_length=1_000_000)


class IndexBody(_Body):
    model: str = Field(min_length=1)
    chunk_hashes: list[U64] = Field(max_length=MAX_BLOCKS_PER_FETCH)


class StoredArtifact(_Body):
    key: str
    bytes: int = Field(ge=0)
    checksum: str


class StoreReportBody(_Body):
    stored: list[StoredArtifact] = Field(default=[], max_length=1_000_000)
    block_artifacts: int | None = Field(default=None, ge=1, le=MAX_BLOCK_ARTIFACTS)
    dropped: list[str] = Field(default=[], max_length=1_000_000)


@dataclass(frozen=True, slots=True)
class FetchOutcome:
    """What one `POST /ownerserve/kv/fetch` did."""

    blocks: int
    artifacts: int
    bytes: int

    def as_json(self) -> dict[str, int]:
        return {"blocks": self.blocks, "artifacts": self.artifacts, "bytes": self.bytes}


# --- the sidecar --------------------------------------------------------------------------------


@dataclass(slots=True)
class _Counters:
    registry: CollectorRegistry
    fetches: Counter
    fetched_bytes: Counter
    fetched_artifacts: Counter
    direct_artifacts: Counter
    served: Counter
    served_bytes: Counter
    stored: Counter
    not_found: Counter
    store_lost: Counter

    @classmethod
    def new(cls) -> _Counters:
        r = CollectorRegistry(auto_describe=True)
        p = "ownerserve_sidecar_"
        return cls(
            r,
            Counter(p + "fetches", "Fetches from peer sidecars", ["result"], registry=r),
            Counter(p + "fetched_bytes", "Artifact bytes pulled from peers", registry=r),
            Counter(p + "fetched_artifacts", "Artifacts pulled from peers", registry=r),
            Counter(
                p + "direct_fetched_artifacts",
                "Artifacts pulled by one-sided reads of a peer's arena (no control round trip)",
                registry=r,
            ),
            Counter(p + "served_artifacts", "Artifacts answered to GET", registry=r),
            Counter(p + "served_bytes", "Artifact bytes answered to GET", registry=r),
            Counter(p + "stored_artifacts", "Artifacts stored by PUT", registry=r),
            Counter(p + "lookup_misses", "GETs of artifacts not stored", registry=r),
            Counter(
                p + "store_lost_artifacts",
                "Held artifacts the Mooncake Store no longer had at an audit (no longer held)",
                registry=r,
            ),
        )


class _StoreCollector(Collector):
    """Gauges read from the store at scrape time."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar

    def collect(self) -> Iterable[GaugeMetricFamily]:
        s = self.sidecar.store.stats()
        shared = self.sidecar.shared
        p = "ownerserve_sidecar_"
        artifacts = s.artifacts + (shared.count() if shared else 0)
        yield GaugeMetricFamily(p + "artifacts", "Artifacts stored", value=artifacts)
        tier = GaugeMetricFamily(p + "bytes", "Artifact bytes stored per tier", labels=["tier"])
        tier.add_metric(["memory"], s.memory_bytes)
        tier.add_metric(["ssd"], s.ssd_bytes)
        if shared is not None:
            tier.add_metric(["mooncake_store"], shared.held_bytes())
        yield tier
        yield GaugeMetricFamily(
            p + "corrupted_artifacts", "Artifacts that failed their checksum", value=s.corrupted
        )
        yield GaugeMetricFamily(p + "demoted_artifacts", "Moved memory -> SSD", value=s.demoted)
        yield GaugeMetricFamily(p + "dropped_artifacts", "Evicted for room", value=s.dropped)
        yield GaugeMetricFamily(
            p + "ssd_pending_bytes",
            "Bytes on their way to the SSD tier (written behind, held in memory until then)",
            value=s.ssd_pending_bytes,
        )
        yield GaugeMetricFamily(
            p + "ssd_write_errors",
            "SSD tier writes that failed (their artifacts are dropped on their next load)",
            value=s.ssd_write_errors,
        )
        yield GaugeMetricFamily(
            p + "fetches_in_flight",
            "Fetches from peer sidecars running now",
            value=sum(self.sidecar.fetching.values()),
        )
        pub = self.sidecar.publisher.stats() if self.sidecar.publisher else None
        yield GaugeMetricFamily(
            p + "replica_publish_failures",
            "Directory writes of replicas that failed",
            value=pub.failures if pub else 0,
        )


@dataclass(slots=True)
class Sidecar:
    """State of one sidecar: store, chunk index, transport, directory publisher, metrics."""

    config: SidecarConfig
    transport: Transport
    store: ArtifactStore
    index: ChunkIndex = field(default_factory=ChunkIndex)
    counters: _Counters = field(default_factory=_Counters.new)
    directory: Directory | None = None
    publisher: ReplicaPublisher | None = None
    transfer_server: Any = None
    transfer_port: int = 0
    bound_port: int = 0
    http: httpx.AsyncClient | None = None
    shared: SharedTier | None = None
    """The Mooncake Store tier (`--store`): when set, artifacts live there, not in `store`."""
    _inflight: dict[str, asyncio.Future[None]] = field(default_factory=dict)
    fetching: dict[str, int] = field(default_factory=dict)
    """Fetches running now, by source worker (the body's `source_worker`, else its URL)."""

    @classmethod
    def create(cls, config: SidecarConfig, transport: Transport) -> Sidecar:
        ssd_dir = config.store_dir / "ssd"
        if config.clear_ssd and ssd_dir.is_dir():
            shutil.rmtree(ssd_dir)
        # over Mooncake the memory tier is one arena the engine registers once: peers read
        # what it holds one-sided (workers.sidecar.arena), fetches land in it in place
        mooncake = transport.name == "mooncake" and config.memory_bytes > 0
        arena = Arena(config.memory_bytes) if mooncake else None
        store = ArtifactStore(
            memory_capacity_bytes=config.memory_bytes,
            ssd_dir=ssd_dir,
            ssd_capacity_bytes=config.ssd_bytes,
            arena=arena,
            write_behind=True,  # SSD writes in the store's thread: the loop never waits on disk
        )
        sidecar = cls(config, transport, store)
        if config.store is not None:
            host = urlsplit(config.advertise_url).hostname if config.advertise_url else None
            if host is None:
                host = config.host if config.host not in ("0.0.0.0", "::") else "127.0.0.1"
            sidecar.shared = SharedTier.open(
                MasterAddress.parse(config.store),
                host=host,
                segment_bytes=config.store_segment_bytes,
                timeout_s=config.store_timeout_s,
            )
        # the SSD tier survives a restart: its files are indexed again (and published at start)
        for key in store.recover_ssd():
            sidecar.index.add(key)
        sidecar.counters.registry.register(_StoreCollector(sidecar))
        for result in ("ok", "failed"):
            sidecar.counters.fetches.labels(result)
        return sidecar

    @property
    def url(self) -> str:
        if self.config.advertise_url:
            return self.config.advertise_url.rstrip("/")
        host = self.config.host if self.config.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{self.bound_port or self.config.port}"

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        self.transfer_server = self.transport.server_factory(self.store)
        self.transfer_port = int(
            await self.transfer_server.start(self.config.host, self.config.transfer_port)
        )
        self.http = httpx.AsyncClient(timeout=self.config.fetch_timeout_s)
        self.directory = open_directory(self.config.directory_settings(), resilient=False)
        self.publisher = ReplicaPublisher(
            self.directory,
            self.config.worker_id,
            self.holdings,
            ttl_s=self.config.replica_ttl_s,
            audit=self.audit_store if self.shared is not None else None,
        )
        self.publisher.note(self.holdings())  # what the SSD tier kept over a restart
        self.publisher.start()

    async def close(self) -> None:
        if self.publisher is not None:
            await self.publisher.close()
        if self.directory is not None:
            try:
                await self.directory.close()
            except Exception:
                # closing must go on (HTTP client, transfer server); the failure is reported
                log.exception("sidecar %s: closing the directory failed", self.config.worker_id)
        if self.http is not None:
            await self.http.aclose()
        if self.transfer_server is not None:
            await self.transfer_server.close()
        await asyncio.to_thread(self.store.close)  # SSD writes still waiting reach their files
        if self.shared is not None:
            await asyncio.to_thread(self.shared.close)

    async def audit_store(self) -> None:
        """Stop holding (and indexing) what the Mooncake Store lost behind this sidecar
        (`StoreTier.audit`); the publisher's renewal then withdraws those blocks."""
        assert self.shared is not None
        lost = await self.shared.audit()
        for key in lost:
            self.index.discard(key)
        if lost:
            self.counters.store_lost.inc(len(lost))
            log.warning(
                "sidecar %s: %d held artifacts are gone from Mooncake Store (%s...)",
                self.config.worker_id,
                len(lost),
                lost[0],
            )

    # --- the store, indexed -------------------------------------------------------------------

    def has(self, key: str) -> bool:
        """Whether this sidecar holds the artifact (in its own tiers, or put or fetched into
        the Mooncake Store it uses)."""
        if self.shared is not None:
            return self.shared.has(key)
        return self.store.has(key)

    def size_of(self, key: str) -> int:
        """A held artifact's size in bytes (0 when not held)."""
        if self.shared is not None:
            held = self.shared.held(key)
            return 0 if held is None else held.size_bytes
        return self.store.meta(key).size_bytes if self.store.has(key) else 0

    def _forget(self, key: str) -> bool:
        if self.shared is not None:
            return self.shared.forget(key)
        return self.store.delete(key)

    def _tier(self, keys: Iterable[str]) -> Tier:
        if self.shared is not None:
            return Tier.CPU  # the store's DRAM (its SSD tier is not used yet)
        tiers = {self.store.meta(k).tier for k in keys if self.store.has(k)}
        return Tier.CPU if StoreTier.MEMORY in tiers else Tier.SSD

    def holdings(self) -> dict[int, Tier]:
        """Every chunk with an artifact stored -> the fastest tier one of them is in."""
        out: dict[int, Tier] = {}
        for chunk in self.index.chunks():
            keys = self.index.keys_of(chunk, self.has)
            if keys:
                out[chunk.chunk_hash] = self._tier(keys)
        return out

    def _note(self, keys: Iterable[tuple[str, int | None]]) -> None:
        """Index stored (key, artifacts that make its block whole) and publish the blocks that
        are whole now."""
        chunks: dict[int, Tier] = {}
        for key, whole in keys:
            chunk = self.index.add(key, whole)
            if chunk is not None and chunk.chunk_hash not in chunks:
                present = self.index.keys_of(chunk, self.has)
                if present:
                    chunks[chunk.chunk_hash] = self._tier(present)
        if self.publisher is not None and chunks:
            self.publisher.note(chunks)

    async def put(
        self, key: str, data: bytes, expected: bytes | None, whole: int | None = None
    ) -> dict[str, Any]:
        """Store one artifact; `whole`: how many artifacts make its block whole, as the writer
        declared (`x-ownerserve-block-artifacts`)."""
        try:
            if self.shared is not None:
                held = await self.shared.put(key, data, expected)
                size, digest, tier = held.size_bytes, held.checksum, "mooncake_store"
            else:
                meta = self.store.put(key, data, expected_checksum=expected)
                size, digest = meta.size_bytes, meta.checksum
                tier = "memory" if meta.tier is StoreTier.MEMORY else "ssd"
        except ArtifactCorrupted as exc:
            raise InvalidRequestError(f"{key}: body does not match {CHECKSUM_HEADER}") from exc
        except ArtifactTooLarge as exc:
            raise PayloadTooLargeError(str(exc)) from exc
        except MooncakeStoreError as exc:
            raise KVStoreUnavailableError(f"{key}: Mooncake Store: {exc}") from exc
        self.counters.stored.inc()
        self._note([(key, whole)])
        return {"key": key, "bytes": size, "checksum": digest.hex(), "tier": tier}

    async def get(self, key: str) -> tuple[bytes, bytes]:
        """An artifact's bytes and checksum, verified (an SSD file read and hashed in a
        thread, off the event loop)."""
        try:
            if self.shared is not None:
                data, digest = await self.shared.get(key)
            else:
                reader = self.store.ssd_reader(key, verify=True)
                loaded = None if reader is None else await asyncio.to_thread(reader)
                data, digest = self.store.get_verified(key, loaded=loaded)
        except MooncakeStoreError as exc:
            raise KVStoreUnavailableError(f"{key}: Mooncake Store: {exc}") from exc
        except ArtifactMissing:
            self.index.discard(key)
            self.counters.not_found.inc()
            raise ArtifactNotFoundError(f"artifact {key!r} is not stored") from None
        except ArtifactCorrupted:
            self.index.discard(key)
            self.counters.not_found.inc()
            raise ArtifactNotFoundError(
                f"artifact {key!r} failed its checksum and was dropped"
            ) from None
        self.counters.served.inc()
        self.counters.served_bytes.inc(len(data))
        return data, digest

    async def adopt(self, body: StoreReportBody) -> dict[str, Any]:
        """What the connector reported it wrote into (or found gone from) the Mooncake Store
        this sidecar uses: objects found there are held, indexed and published like its own
        puts; dropped keys are no longer held."""
        if self.shared is None:
            raise InvalidRequestError("this sidecar keeps no artifacts in Mooncake Store (--store)")
        reported = []
        for a in body.stored:
            digest = _checksum_header(a.checksum)
            assert digest is not None
            reported.append(HeldArtifact(_checked_key(a.key), a.bytes, digest))
        for key in body.dropped:
            _checked_key(key)
        try:
            found = await self.shared.adopt(reported)
        except MooncakeStoreError as exc:
            raise KVStoreUnavailableError(f"Mooncake Store: {exc}") from exc
        held = [a.key for a, there in zip(reported, found, strict=True) if there]
        self.counters.stored.inc(len(held))
        self._note([(key, body.block_artifacts) for key in held])
        for key in body.dropped:
            self.shared.forget(key)
            self.index.discard(key)
        return {
            "held": held,
            "missing": [a.key for a, t in zip(reported, found, strict=True) if not t],
        }

    def keys_of_chunks(self, model: str, chunk_hashes: Sequence[int]) -> list[list[str]]:
        return [self.index.keys_of(ChunkId(model, h), self.has) for h in chunk_hashes]

    def held_prefix(self, model: str, chunk_hashes: Sequence[int]) -> int:
        """How many leading chunks of `chunk_hashes` this sidecar holds whole."""
        return stored_prefix(self.keys_of_chunks(model, chunk_hashes))

    # --- fetch from a peer --------------------------------------------------------------------

    async def _source_index(self, body: KVFetchRequest) -> dict[str, Any]:
        assert self.http is not None
        url = body.source_url + KV_PREFIX + "/index"
        req = {"model": body.model, "chunk_hashes": body.block_hashes}
        try:
            resp = await self.http.post(url, json=req)
        except httpx.HTTPError as exc:
            raise FetchFailedError(
                f"source sidecar {body.source_url} unreachable: {exc!r}"
            ) from exc
        if resp.status_code != 200:
            raise FetchFailedError(
                f"source sidecar {body.source_url} answered {resp.status_code} to its index: "
                f"{resp.text[:200]}"
            )
        try:
            answer = resp.json()
            keys = answer["keys"]
            assert isinstance(keys, list) and len(keys) == len(body.block_hashes)
            assert all(isinstance(k, list) for k in keys)
            int(answer["transfer_port"])
        except (ValueError, KeyError, TypeError, AssertionError) as exc:
            raise FetchFailedError(f"source sidecar {body.source_url}: bad index answer") from exc
        return dict(answer)

    def _drop_incomplete(self, blocks: Sequence[Sequence[str]], fetched_now: set[str]) -> int:
        """Delete what this fetch stored of blocks it did not complete; returns whole blocks
        (leading) now present."""
        whole = 0
        counting = True
        for keys in blocks:
            complete = all(self.has(k) for k in keys)
            if not complete:
                for k in keys:
                    if k in fetched_now and self._forget(k):
                        self.index.discard(k)
                counting = False
            elif counting:
                whole += 1
        return whole

    async def fetch(self, body: KVFetchRequest) -> FetchOutcome:
        """Pull the stored prefix of `body.block_hashes` from the source sidecar; raises
        `FetchFailedError` (502) when the source cannot deliver it whole."""
        source = body.source_worker or body.source_url
        self.fetching[source] = self.fetching.get(source, 0) + 1
        try:
            outcome = await self._fetch(body)
        except FetchFailedError as exc:
            self.counters.fetches.labels("failed").inc()
            if exc.blocks is None:  # failed before any transfer: what was already here
                exc.blocks = self.held_prefix(body.model or "", body.block_hashes)
            raise
        finally:
            left = self.fetching[source] - 1
            if left:
                self.fetching[source] = left
            else:
                del self.fetching[source]
        self.counters.fetches.labels("ok").inc()
        return outcome

    async def _fetch(self, body: KVFetchRequest) -> FetchOutcome:
        if not body.block_hashes:
            return FetchOutcome(0, 0, 0)
        answer = await self._source_index(body)
        per_block: list[list[str]] = [[str(k) for k in ks] for ks in answer["keys"]]
        n = stored_prefix(per_block)
        blocks = per_block[:n]
        for keys in blocks:
            if not all(valid_key(k) for k in keys):
                raise FetchFailedError("source sidecar listed an invalid artifact key")
        wanted = [k for keys in blocks for k in keys if not self.has(k)]
        # Single flight: keys another fetch is already pulling are waited for, not pulled twice
        # (the router may ask for the same prefix from a plan and a background replication).
        mine = [k for k in wanted if k not in self._inflight]
        theirs = {self._inflight[k] for k in wanted if k in self._inflight}
        got: set[str] = set()
        if mine:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            for k in mine:
                self._inflight[k] = done
            try:
                await self._pull(body, answer, mine)
            except BaseException as exc:  # failed, or cancelled: no incomplete block stays
                got = {k for k in mine if self.has(k)}
                whole = self._drop_incomplete(blocks, got)
                self._account({k for k in got if self.has(k)})
                if isinstance(exc, FetchFailedError):
                    exc.blocks = whole
                raise
            finally:
                for k in mine:
                    if self._inflight.get(k) is done:
                        del self._inflight[k]
                done.set_result(None)
            got = {k for k in mine if self.has(k)}
        if theirs:
            await asyncio.gather(*theirs)
        whole = self._drop_incomplete(blocks, got)
        got = {k for k in got if self.has(k)}
        size = self._account(got)
        # chunks that were already here count as replicas of the fetched prefix too
        self._note((k, len(keys)) for keys in blocks[:whole] for k in keys)
        return FetchOutcome(whole, len(got), size)

    async def _pull(self, body: KVFetchRequest, answer: dict[str, Any], keys: list[str]) -> None:
        """Move `keys` from the source's transfer server into the store (whole, verified
        artifacts only); `FetchFailedError` when the transport fails."""
        if self.shared is not None or answer.get("store") is not None:
            await self._pull_from_store(body, answer, keys)
            return
        host = answer.get("transfer_host") or urlsplit(body.source_url).hostname or ""
        port = int(answer["transfer_port"])
        try:
            transport = transport_for_peer(self.transport, str(answer.get("transport")))
        except TransportUnavailable as exc:
            raise FetchFailedError(str(exc)) from exc
        try:
            res = await transport.fetch_keys(
                self.store, host, port, keys, self.config.fetch_timeout_s
            )
        except transport.errors as exc:
            raise FetchFailedError(
                f"fetch from {body.source_worker or body.source_url} failed: {exc}"
            ) from exc
        except (StoreError, OSError) as exc:  # e.g. an artifact larger than every tier here
            raise FetchFailedError(
                f"fetch from {body.source_worker or body.source_url}: cannot store: {exc!r}"
            ) from exc
        self.counters.direct_artifacts.inc(getattr(res, "direct", 0))

    async def _pull_from_store(
        self, body: KVFetchRequest, answer: dict[str, Any], keys: list[str]
    ) -> None:
        """Read `keys` through this sidecar's Mooncake Store client: what the source put there.
        Keys the store no longer has, or whose bytes fail their digest, are left out (the
        prefix stops before them); `FetchFailedError` when the two sidecars are not on one
        store or the store cannot be reached."""
        source = body.source_worker or body.source_url
        source_store = answer.get("store")
        if self.shared is None or source_store != self.shared.master.url:
            mine = self.shared.master.url if self.shared is not None else "its own tiers"
            raise FetchFailedError(
                f"fetch from {source}: the source keeps its artifacts in "
                f"{source_store or 'its own tiers'}, this sidecar in {mine}"
            )
        listed: dict[str, int] = {}
        sizes = answer.get("sizes")
        if isinstance(sizes, list) and len(sizes) == len(answer["keys"]):
            for ks, ss in zip(answer["keys"], sizes, strict=True):
                if isinstance(ss, list) and len(ss) == len(ks):
                    listed.update(
                        (str(k), n) for k, n in zip(ks, ss, strict=True) if isinstance(n, int)
                    )
        try:
            result = await self.shared.fetch(keys, [listed.get(k) for k in keys])
        except MooncakeStoreError as exc:
            raise FetchFailedError(f"fetch from {source} through Mooncake Store: {exc}") from exc
        if result.missing or result.corrupted:
            log.warning(
                "fetch from %s: %d artifacts no longer in the store, %d failing their checksum",
                source,
                len(result.missing),
                len(result.corrupted),
            )

    def _account(self, keys: set[str]) -> int:
        """Index, publish and count artifacts this fetch stored (all present, of whole blocks:
        `_drop_incomplete` ran first); their bytes."""
        size = sum(self.size_of(k) for k in keys if self.has(k))
        self._note((k, None) for k in keys)
        self.counters.fetched_artifacts.inc(len(keys))
        self.counters.fetched_bytes.inc(size)
        return size

    def health(self) -> dict[str, Any]:
        s = self.store.stats()
        shared = self.shared
        return {
            "worker_id": self.config.worker_id,
            "transport": self.transport.name,
            "transfer_port": self.transfer_port,
            "artifacts": s.artifacts + (shared.count() if shared else 0),
            "bytes": s.memory_bytes + s.ssd_bytes + (shared.held_bytes() if shared else 0),
            "url": self.url,
            "store": shared.master.url if shared else None,
            "fetching_from": dict(self.fetching),
        }


# --- HTTP ---------------------------------------------------------------------------------------


def _checked_key(key: str) -> str:
    if not valid_key(key):
        raise InvalidRequestError("artifact key: 1 to 1024 characters, no control characters")
    return key


def _checksum_header(value: str | None) -> bytes | None:
    if value is None:
        return None
    try:
        digest = bytes.fromhex(value.strip())
    except ValueError:
        digest = b""
    if len(digest) != CHECKSUM_BYTES:
        raise InvalidRequestError(
            f"{CHECKSUM_HEADER}: must be a {CHECKSUM_NAME} hex digest "
            f"({2 * CHECKSUM_BYTES} hex digits)"
        )
    return digest


def _block_artifacts_header(value: str | None) -> int | None:
    if value is None:
        return None
    value = value.strip()
    if not value.isdigit() or not 1 <= int(value) <= MAX_BLOCK_ARTIFACTS:
        raise InvalidRequestError(
            f"{BLOCK_ARTIFACTS_HEADER}: must be an integer from 1 to {MAX_BLOCK_ARTIFACTS}"
        )
    return int(value)


def create_app(sidecar: Sidecar) -> FastAPI:
    from workers.sidecar.chunks import add_chunk_routes

    """The sidecar's HTTP app; its lifespan starts and stops the transfer server, the directory
    connection and the replica publisher."""

    app = service_app("OwnerServe sidecar", sidecar.start, sidecar.close)
    app.state.sidecar = sidecar

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse(sidecar.health())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(
            generate_latest(sidecar.counters.registry),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )

    @app.post(KV_PREFIX + "/lookup")
    async def lookup(body: LookupBody) -> JSONResponse:
        return JSONResponse({"present": [sidecar.has(k) for k in body.keys]})

    @app.post(KV_PREFIX + "/index")
    async def index(body: IndexBody) -> JSONResponse:
        host = (
            urlsplit(sidecar.config.advertise_url).hostname
            if sidecar.config.advertise_url
            else None
        )
        keys = sidecar.keys_of_chunks(body.model, body.chunk_hashes)
        answer: dict[str, Any] = {
            "keys": keys,
            "transport": sidecar.transport.name,
            "transfer_port": sidecar.transfer_port,
            "transfer_host": host,
        }
        if sidecar.shared is not None:  # a peer on the same store reads these keys there
            answer["store"] = sidecar.shared.master.url
            answer["sizes"] = [[sidecar.size_of(k) for k in ks] for ks in keys]
        return JSONResponse(answer)

    @app.get(KV_PREFIX + "/artifacts/{key:path}")
    async def get_artifact(key: str) -> Response:
        data, digest = await sidecar.get(_checked_key(key))
        return Response(
            data,
            media_type="application/octet-stream",
            headers={CHECKSUM_HEADER: digest.hex()},
        )

    @app.put(KV_PREFIX + "/artifacts/{key:path}")
    async def put_artifact(key: str, request: Request) -> JSONResponse:
        key = _checked_key(key)
        expected = _checksum_header(request.headers.get(CHECKSUM_HEADER))
        whole = _block_artifacts_header(request.headers.get(BLOCK_ARTIFACTS_HEADER))
        limit = sidecar.config.max_artifact_bytes
        data = await read_request_body(request.scope, request.receive, limit)
        return JSONResponse(await sidecar.put(key, data, expected, whole), status_code=201)

    @app.post(STORE_REPORT_PATH)
    async def store_report(body: StoreReportBody) -> JSONResponse:
        return JSONResponse(await sidecar.adopt(body))

    @app.post(BATCH_GET_PATH)
    async def batch_get(body: LookupBody) -> Response:
        # each artifact verified as a single GET's (a corrupted one is dropped and answered
        # not found); the client checks every payload against its own checksum again
        entries: list[dict[str, Any]] = []
        payloads: list[bytes] = []
        for key in body.keys:
            try:
                data, digest = await sidecar.get(_checked_key(key))
            except ArtifactNotFoundError:
                entries.append({"key": key, "found": False})
                continue
            entries.append({"key": key, "size": len(data), "checksum": digest.hex()})
            payloads.append(data)
        return Response(encode_batch(entries, payloads), media_type=MEDIA_TYPE)

    @app.post(BATCH_PUT_PATH)
    async def batch_put(request: Request) -> JSONResponse:
        limit = sidecar.config.max_artifact_bytes
        raw = await read_request_body(request.scope, request.receive, limit)
        try:
            entries, payloads = decode_batch(raw)
        except BatchFormatError as exc:
            raise InvalidRequestError(f"batch body: {exc}") from None
        # the whole body is checked before anything is stored: a malformed one stores nothing
        checked = []
        for entry, data in zip(entries, payloads, strict=True):
            if data is None:
                raise InvalidRequestError(f"batch body: {entry['key']!r} has no payload")
            whole = entry.get("block_artifacts")
            checked.append(
                (
                    _checked_key(entry["key"]),
                    data,
                    _checksum_header(entry.get("checksum")),
                    None if whole is None else _block_artifacts_header(str(whole)),
                )
            )
        # then each artifact alone: one failing its checksum is refused, the others stored
        stored: list[dict[str, Any]] = []
        for key, data, expected, whole in checked:
            try:
                stored.append(await sidecar.put(key, bytes(data), expected, whole))
            except (InvalidRequestError, PayloadTooLargeError) as exc:
                stored.append({"key": key, "error": str(exc)})
        return JSONResponse({"stored": stored})

    @app.post(FETCH_PATH)
    async def fetch(request: Request) -> JSONResponse:
        raw = await read_request_body(request.scope, request.receive, MAX_FETCH_BODY_BYTES)
        body = KVFetchRequest.from_json(json_object(raw))
        if body.model is None:
            raise InvalidRequestError("model: required (artifacts are kept per model)")
        started = time.perf_counter()
        try:
            outcome = await sidecar.fetch(body)
        except FetchFailedError as exc:
            log.warning(
                "fetch from %s failed, %s whole blocks held: %s",
                body.source_worker or body.source_url,
                exc.blocks,
                exc,
            )
            # the error answer also says what the failed fetch kept (the router reads `blocks`)
            answer = {**error_body_for(exc), "blocks": exc.blocks or 0}
            return JSONResponse(answer, status_code=exc.status_code)
        log.info(
            "fetched %d blocks (%d artifacts, %d bytes) from %s in %.3f s",
            outcome.blocks,
            outcome.artifacts,
            outcome.bytes,
            body.source_worker or body.source_url,
            time.perf_counter() - started,
        )
        return JSONResponse(outcome.as_json())

    add_chunk_routes(app, sidecar)  # chunk reuse (workers/sidecar/chunks.py)
    return app


# --- running it ---------------------------------------------------------------------------------


def build(config: SidecarConfig, transport: Transport) -> tuple[Sidecar, FastAPI]:
    sidecar = Sidecar.create(config, transport)
    return sidecar, create_app(sidecar)


# Connections from the connector, peers and the router stay open this long when idle: longer than
# any client's expiry (httpx: 5 s), so a client never sends on a connection the sidecar is closing.
KEEPALIVE_S = 75


def _uvicorn_config(app: FastAPI, config: SidecarConfig) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="warning",
        timeout_keep_alive=KEEPALIVE_S,
    )


class _InLoopServer(uvicorn.Server):
    """A uvicorn server that leaves the process's signal handlers alone (it runs inside
    someone else's event loop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def serving(config: SidecarConfig, transport: Transport) -> AsyncIterator[Sidecar]:
    """Run a sidecar in this event loop (port 0 = any free port); yields it once it serves."""
    sidecar, app = build(config, transport)
    server = _InLoopServer(_uvicorn_config(app, config))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("sidecar server exited before it started")
            await asyncio.sleep(0.01)
        sidecar.bound_port = int(server.servers[0].sockets[0].getsockname()[1])
        yield sidecar
    finally:
        server.should_exit = True
        try:
            await task
        except Exception:
            log.exception("sidecar server ended with an error")


def run_forever(config: SidecarConfig, transport: Transport) -> int:
    """Process entry point: serve until SIGINT/SIGTERM."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    sidecar, app = build(config, transport)
    sidecar.bound_port = config.port
    server = uvicorn.Server(_uvicorn_config(app, config))
    log.info(
        "sidecar %s on %s, transport %s, store %s",
        config.worker_id,
        sidecar.url,
        transport.name,
        config.store_dir,
    )
    try:
        server.run()
    except SystemExit as exc:  # uvicorn exits 3 when a port cannot be bound or startup fails
        log.error("sidecar %s did not start (uvicorn exit %s)", config.worker_id, exc.code)
        return 1
    return 0 if server.started else 1
