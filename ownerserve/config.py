"""The one settings object: a cluster topology YAML plus `OWNERSERVE_*` environment overrides.

Validated with pydantic at this boundary; errors become one-line `ConfigError`s that name the
file and the key (unknown keys, bad URLs, duplicate worker ids...).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ownerserve.errors import ConfigError
from ownerserve.kvstate.registry import load_spec, spec_for_model
from ownerserve.types import PD_PATHS, BackendKind, KVPath, KVTransport, Role
from ownerserve.yamlfile import load_yaml


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_url(value: str, schemes: tuple[str, ...] = ("http", "https")) -> str:
    parsed = urlparse(value)
    # ipc:// and unix:// name a socket file: a path, no host.
    located = parsed.path if parsed.scheme in ("ipc", "unix") else parsed.hostname
    if parsed.scheme not in schemes or not located:
        raise ValueError(f"not a valid {'/'.join(schemes)} URL: {value!r}")
    try:
        _ = parsed.port
    except ValueError as exc:
        raise ValueError(f"bad port in URL {value!r}") from exc
    return value.rstrip("/")


class ServerSettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_keys: tuple[str, ...] = ()
    admin_token: str | None = None
    max_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    read_timeout_s: float = Field(default=60.0, gt=0)
    """Reading one whole request, its headers and body, from its first byte (and a new
    connection's first request from the connect): then a 408 and the connection closes. A
    client that trickles bytes holds a connection no longer than this."""
    max_connections: int = Field(default=4096, gt=0)
    """Client connections open at once; one more is answered 503 and closed."""
    processes: int = Field(default=1, ge=1)
    """Router processes serving this port on this host (`ownerserve serve --processes` sets
    it): more than one needs `directory.backend: redis` and shares in-flight reservations
    there (`router.reservations`)."""
    max_connections_per_client: int = Field(default=512, gt=0)
    """Client connections open at once from one IP address; one more is answered 429 and
    closed."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Bounds a whole request, stream included (then a 504, or an SSE error event)."""
    connect_timeout_s: float = Field(default=3.0, gt=0)
    """Opening a connection to a worker (then the request goes to another worker)."""
    first_byte_timeout_s: float = Field(default=120.0, gt=0)
    """From sending a streamed request to a worker until its first body bytes: its queueing
    and prefill (then another worker). 120 s: a 128K-token prefill is ~16 s on one H100 for
    an 8B model (`h100-llama3-8b`) and several times that for a bigger model, a slower card or
    behind a queue. A non-streamed answer's first byte is its last: only `request_timeout_s`
    bounds it."""
    kv_transfer_timeout_s: float = Field(default=120.0, gt=0)
    """A KV hand-over (then the decode worker computes the prompt itself): a P/D plan's, from
    P's call (queueing and prefill on P, as `first_byte_timeout_s`) until D's first streamed
    bytes (D's pull; D's `first_byte_timeout_s` also runs, the sooner decides), and an
    artifact fetch or state migration until its answer is complete."""
    stream_gap_timeout_s: float = Field(default=120.0, gt=0)
    """Most seconds between two pieces of a streamed answer, while the client keeps up (then
    the stream ends with an error event). A preempted request recomputes its whole context
    before its next token: as long as a prefill, so the same bound."""
    stall_timeout_s: float = Field(default=30.0, gt=0)
    """Most seconds between two pieces of a streamed answer that may still move to another
    worker (`max_migrations`; then it continues there, `router/README.md`, *Mid-stream
    migration*): shorter than `stream_gap_timeout_s`, which bounds a stream that cannot move.
    Keep it above the recompute a preemption costs on the longest contexts served."""
    max_migrations: int = Field(default=1, ge=0)
    """Times one streamed answer may continue on another worker after its worker died or
    stalled mid-stream (0: never; the stream then ends with an error event)."""
    retries: int = Field(default=2, ge=0)
    health_interval_s: float = Field(default=2.0, gt=0)
    tokenizer_cache_mib: int = Field(default=256, ge=1)
    """What the tokenizer's caches may hold, every model together (`router/tokens.py`: each
    session's last prompt, rendered messages by content), least recently used first out."""
    tokenizer_cache_sessions: int = Field(default=8192, ge=1)
    """Sessions whose last prompt each model's tokenizer keeps (within `tokenizer_cache_mib`):
    a session's next turn reuses the blocks of its unchanged leading messages. Past it the
    least recently seen session goes, and its next turn is tokenized whole."""
    heap_trim_interval_s: float = Field(default=30.0, ge=0)
    """Every this many seconds the router hands the free pages glibc malloc keeps back to the
    OS (`router/heap.py`); 0: never. Without it RSS climbs while the heap in use stays flat
    (2026-12-03 chaos run: +0.6-0.8 MB/min with the heap flat, malloc keeping 20 MB free)."""
    debug_memory: bool = False
    """Debugging only: serve `GET /admin/debug/memory` (the allocators' heap, asyncio tasks,
    descriptors by peer; `router/memdebug.py`). Off (the default): that route is a 404."""
    debug_memory_frames: int = Field(default=0, ge=0, le=64)
    """With `debug_memory`: > 0 traces every allocation (tracemalloc, this many frames a
    trace) from the router's start, and the route adds the top allocation sites gained since
    its first call and objects by type. Tracing slows every allocation and takes memory."""

    @field_validator("api_keys")
    @classmethod
    def _api_keys(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        # an empty key would let a request without one in; a padded one could never match
        # (the router strips the header's value); a duplicate is a copy-paste slip
        seen: set[str] = set()
        for i, key in enumerate(v):
            if not key.strip():
                raise ValueError(f"key {i} is empty")
            if key != key.strip():
                raise ValueError(f"key {i} begins or ends with whitespace")
            if key in seen:
                raise ValueError(f"key {i} repeats an earlier key")
            seen.add(key)
        return v


class DirectorySettings(_Strict):
    backend: Literal["memory", "redis"] = "memory"
    redis_url: str | None = None
    lease_s: float = Field(default=300.0, gt=0)
    session_ttl_s: float = Field(default=3600.0, gt=0)
    sweep_interval_s: float = Field(default=300.0, ge=0)
    """How often the router purges expired leases, replicas and sessions (0: never). A sweep
    costs ~0.6 s of router CPU (in-process) or ~7 s of Redis time per 20,000 sessions
    (`bench.directory.sweep`): every 5 minutes that is ~0.2% and ~2% of a core."""
    key_prefix: str = "os"
    redis_step_entries: int = Field(default=256, ge=1)
    """Redis: at most about this many entries per script call of the writes that touch
    unboundedly many (the sweep, a dead worker's drop, a replica over a long chain, a dropped
    cached view, a cached view restored), which then go in several calls: Redis serves
    nothing else while a script runs, and one call over 10^5 entries had held it for seconds
    (`ownerserve/directory/README.md`). Smaller: shorter waits for the other clients, more
    round trips."""
    engine_map_entries: int = Field(default=32_768, ge=1)
    """Redis: per worker, the engine hash -> block hash pairs the router keeps from its KV
    events (~150 B each; a stored block's parent not kept costs one more read of Redis).
    Sized to a worker's cached blocks, it is read from Redis only after restarts."""
    mirror_cached_blocks: int = Field(default=65_536, ge=1)
    """Redis: the (block, worker) pairs of the workers' caches the router's local view keeps
    (~220 B each), what it routes by while Redis is unreachable and pushes back after Redis lost
    its data. Past it the coldest go (the oldest stored; the chains the latest sessions looked
    up last), so the router's memory is bounded by this, not by the cluster's KV: what it
    forgot costs prefix misses during an outage, never a wrong owner."""
    max_pending_writes: int = Field(default=100_000, ge=1)
    """Redis: writes the router queues while Redis is unreachable (it serves from its local
    view meanwhile, and replays them when Redis is back); past it the oldest goes (counted as
    `dropped` in `/health`'s directory stats)."""

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        return None if v is None else _check_url(v, ("redis", "rediss", "unix"))

    @model_validator(mode="after")
    def _needs_url(self) -> DirectorySettings:
        if self.backend == "redis" and not self.redis_url:
            raise ValueError("backend 'redis' needs redis_url")
        return self


class ResponsesSettings(_Strict):
    """The Responses API's stored conversations (`router/README.md`, *Front doors*): kept in
    the directory's backend (in-process, or the same Redis), so any router replica continues
    any conversation."""

    ttl_s: float = Field(default=86400.0, gt=0)
    """A stored response is forgotten this long after it was made."""
    max_conversation_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    """A conversation whose stored messages exceed this is not continued (400): a size bound
    per conversation, as a response stores the whole conversation up to it."""
    memory_max_bytes: int = Field(default=256 * 1024 * 1024, gt=0)
    """The in-process store drops its least recently used responses beyond this many bytes."""


class PlannerSettings(_Strict):
    policy: str = "ownerserve"
    profile: str = "h100-llama3-8b"
    lambda_hbm: float = Field(default=1e-11, ge=0, description="seconds per duplicated HBM byte")
    mu_interference: float = Field(default=1.0, ge=0, description="weight of decode interference")
    nu_displacement: float = Field(
        default=1.0,
        ge=0,
        description="weight of the reload of other sessions' working-set KV a placement "
        "displaces (0: not priced)",
    )
    xi_duplicate: float = Field(
        default=1.0,
        ge=0,
        description="weight of a duplicate's price: the reload of what the copy displaces on "
        "its worker (0: a duplicate is priced by lambda_hbm alone)",
    )
    copy_reuse_floor: float = Field(
        default=0.25,
        gt=0,
        le=1,
        description="the least reuse rate a copy's duplicate price is divided by: a kind of "
        "copy whose blocks are hit again before eviction at the rate u pays 1/max(u, floor) "
        "times its price (1: copies are priced as if always reused)",
    )
    retention_prior_gap_s: float = Field(
        default=2.0, ge=0, description="predicted tool gap of a session and tool never seen"
    )
    retention_max_gap_s: float = Field(
        default=60.0,
        ge=0,
        description="a session's KV stays in its worker's working set through a gap predicted "
        "at most this long",
    )
    retention_factor: float = Field(
        default=2.0, ge=0, description="kept for this many predicted gaps"
    )
    retention_max_sessions: int = Field(
        default=65_536,
        ge=1,
        description="sessions whose working set and gap history the router remembers (the "
        "least recently active idle one goes first; ~0.3 KB each)",
    )
    retention_max_tools: int = Field(
        default=1_024,
        ge=1,
        description="tool names whose gap averages the router keeps (the oldest name goes first)",
    )
    migration_margin_s: float = Field(
        default=0.05, ge=0, description="hysteresis of a state migration: fixed margin, seconds"
    )
    migration_margin_rel: float = Field(
        default=0.1, ge=0, description="hysteresis of a state migration: share of its cost"
    )
    kv_measurements: str | None = Field(
        default=None,
        description="a KV transport measurements file (`ownerserve.kvprobe`, written by the "
        "start-up probe `python -m workers.mooncake_store.probe`): each transport it names is "
        "planned at its measured price instead of the profile's; unreadable: the configured "
        "prices, said in `GET /admin/status` and the log",
    )
    allow_policy_header: bool = Field(
        default=False,
        description="let a request pick its routing policy with `x-ownerserve-policy` (for "
        "experiments: a client would choose how the cluster serves it)",
    )


class AdmissionSettings(_Strict):
    """Program-level admission (`router/README.md`, *Admission*): while every worker that could
    serve a request has its KV working set full, the request waits in the router's queue. The
    one declaration of its numbers: its rules (`planner.admission`) and the simulator's copy of
    the router's queue (`loadgen.sim.AdmissionConfig` is this class) read them here."""

    enabled: bool = True
    high_watermark: float = Field(default=0.95, gt=0, le=1)
    """A worker whose working set (share of its KV pool) reaches this takes no more requests
    from the queue (ThunderAgent pauses programs at 95%)..."""
    low_watermark: float = Field(default=0.80, gt=0, le=1)
    """... until it is back below this (hysteresis)."""
    max_queued: int = Field(default=1024, ge=0)
    """New sessions' requests the queue holds; one more is answered 429 at once (a started
    session's request is never refused: it is part of a program under way)."""
    max_queue_wait_s: float = Field(default=60.0, gt=0)
    """A new session's request still queued after this long is answered 429; a started
    session's then waits only for KV headroom, no longer for the programs' working sets."""
    aging_s: float = Field(default=10.0, ge=0)
    """A started session's request queued this long goes before every younger one (oldest
    first), whatever its attained service, and below the knee (`pause_watermark`) waits only
    for KV headroom: no program under way starves. A new session's request does not age: it
    waits for a worker open to programs (one whose working set has room, or holds at most one
    session), or for its 429 after `max_queue_wait_s`."""
    retry_after_s: int = Field(default=2, ge=0)
    """The `Retry-After` header of a 429."""
    max_inflight_per_worker: int | None = Field(default=None, ge=1)
    """Requests in flight on one worker at once over every router process sharing the Redis
    directory (reserved there atomically with the choice of the worker,
    `router.reservations`); a request whose plan picks a full worker is planned again without
    it, and waits while every worker is full (a 429 after `max_queue_wait_s`). None: no such
    bound."""
    pause_watermark: float | None = Field(default=None, gt=0)
    """Past the knee: while the sessions' working sets over the whole cluster's KV pools plus
    CPU tiers reach this share (until back under it by high − low), sessions on a worker over
    the high watermark are paused at their tool boundaries, closed workers take no session
    from elsewhere, and queued requests no longer age into the cluster. None (the default):
    never — on every workload measured here pausing cost more than it saved
    (bench/history/capacity.md, bench/history/sim.md)."""

    @model_validator(mode="after")
    def _ordered(self) -> AdmissionSettings:
        if self.low_watermark > self.high_watermark:
            raise ValueError("low_watermark must not exceed high_watermark")
        return self


class ChunkSettings(_Strict):
    """Position-independent chunk reuse for one model (`ownerserve/chunks.py`, as in EPIC): the
    router parses chunked prompts, prices where their chunks' KV is and tells the worker the
    layout. Off unless the model has a `chunks:` section."""

    separator: str | None = "##"
    """The plain-text chunk format `system ## chunk1 ## chunk2 ## question` (matched on token ids:
    it must tokenize the same wherever it appears; a string no document contains, e.g. a
    special token, is safest). None: only chat parts marked `"ownerserve_chunk": true`."""
    marked_parts: bool = True
    """Chat content parts (`{"type": "text", "text": ..., "ownerserve_chunk": true}`) and
    messages (`"ownerserve_chunk": true`) are chunks."""
    max_chunks: int = Field(default=64, gt=0)
    """More chunks in one prompt is a 400."""


class ModelSettings(_Strict):
    name: str
    tokenizer: str = "byte"
    chat_template: str | None = None
    block_size: int = Field(default=16, gt=0)
    salt: str = ""
    kv_spec: str | None = None
    """Its HeteroCache KV state spec (`configs/models/NAME.yaml`, or a YAML path): the planner
    prices its requests with it (`RequestView.kv_spec`: sealed bytes per token, windows and
    tail, restores by `planner.restore`). Unset: the shipped spec whose name or alias is the
    model's name (`ownerserve.kvstate.spec_for_model`), else none; null: none (a dense model
    of the profile's `kv_bytes_per_token`)."""
    max_model_len: int = Field(default=131072, gt=0)
    chunks: ChunkSettings | None = None
    """Chunk reuse (`ChunkSettings`); None: off (prompts are prefix-cached only)."""

    @model_validator(mode="before")
    @classmethod
    def _spec_by_name(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "kv_spec" not in data and "name" in data:
            spec = spec_for_model(str(data["name"]))
            if spec is not None:
                return {**data, "kv_spec": spec.name}
        return data

    @field_validator("kv_spec")
    @classmethod
    def _spec_loads(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                load_spec(value)
            except (ConfigError, OSError) as exc:
                raise ValueError(f"kv_spec {value!r}: {exc}") from exc
        return value


WORKER_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$"
"""Worker ids: a letter or digit, then letters, digits and `._:@+-`, at most 128 characters.
They name workers in URL paths (the admin API), the plan header, metric labels and directory
keys, so none of those needs escaping."""


class WorkerSettings(_Strict):
    id: str = Field(pattern=WORKER_ID_PATTERN)
    url: str
    role: Role = Role.HYBRID
    kind: BackendKind = BackendKind.EMULATOR
    models: tuple[str, ...] = ()
    node: str = "node0"
    profile: str | None = None
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    sidecar_url: str | None = None
    cpu_kv_tokens: int = Field(default=0, ge=0)
    """Tokens of KV its CPU tier holds (vLLM's KV offloading, `--kv-offloading-size`): the
    sessions' working set there is counted against its HBM pool plus this (a session whose KV
    was offloaded comes back with a load, not a recompute). 0: none, or not said."""
    kv_paths: tuple[KVPath, ...] | None = None
    """How KV moves into and out of it (`ownerserve.types.KVPath`); None: its kind's defaults
    (`kv_paths_of`)."""
    kv_same_host: bool = True
    """A peer on its node hands it KV through host memory (the same_host KV transport); False:
    through the store even within its node (`kv_transport`), e.g. a store over TCP loopback."""
    kv_transport: KVTransport = KVTransport.STORE_RDMA
    """The store transport its KV client speaks (`store_rdma` or `store_tcp`): the data path
    KV takes into it from another node, priced by its profile's `kv_transports:`."""

    @model_validator(mode="after")
    def _paths(self) -> WorkerSettings:
        if self.kv_transport is KVTransport.SAME_HOST:
            raise ValueError("kv_transport: store_rdma or store_tcp (same_host: kv_same_host)")
        if self.kv_paths is None:
            return self
        own = PD_PATHS[self.kind]
        for path in self.kv_paths:
            if path in PD_PATHS.values() and path is not own:
                raise ValueError(
                    f"kv_paths: a {self.kind.value} worker speaks {own.value}, not {path.value}"
                )
        if KVPath.CHUNK_FETCH in self.kv_paths and self.kind is not BackendKind.EMULATOR:
            raise ValueError("kv_paths: chunk_fetch is served by the emulated engine only")
        if (
            KVPath.SIDECAR in self.kv_paths
            and self.sidecar_url is None
            and self.kind is not BackendKind.EMULATOR
        ):
            raise ValueError("kv_paths: sidecar needs sidecar_url")
        return self

    def kv_paths_of(self) -> frozenset[KVPath]:
        """Its KV paths: `kv_paths` when set, else its kind's defaults — an emulated engine has
        them all (its own KV API); vLLM and SGLang workers have their P/D hand-over when their role
        is prefill or decode (a hybrid takes part in remote prefill only when `kv_paths` says
        so: it needs a KV connector configured) and the sidecar path when `sidecar_url` is
        set."""
        if self.kv_paths is not None:
            return frozenset(self.kv_paths)
        if self.kind is BackendKind.EMULATOR:
            return frozenset((KVPath.NIXL_PD, KVPath.SIDECAR, KVPath.CHUNK_FETCH))
        paths = set()
        if self.role is not Role.HYBRID:
            paths.add(PD_PATHS[self.kind])
        if self.sidecar_url is not None:
            paths.add(KVPath.SIDECAR)
        return frozenset(paths)

    @field_validator("url", "sidecar_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        return None if v is None else _check_url(v)

    @field_validator("kv_events_endpoint", "kv_events_replay_endpoint")
    @classmethod
    def _zmq(cls, v: str | None) -> str | None:
        return None if v is None else _check_url(v, ("tcp", "ipc"))


class TelemetrySettings(_Strict):
    service_name: str = "ownerserve"
    otlp_endpoint: str | None = None
    """The OTLP receiver (a collector): spans and metrics go there. Over `http/protobuf` its
    base URL (`/v1/traces` and `/v1/metrics` are added); over `grpc` the gRPC server's
    address (`http://` for a plain connection, `https://` for TLS)."""
    otlp_protocol: Literal["http/protobuf", "grpc"] = "http/protobuf"
    """The OTLP transport, named as `OTEL_EXPORTER_OTLP_PROTOCOL` names it."""
    otlp_metrics_interval_s: float = Field(default=10.0, gt=0)
    """The router's metrics are read and exported over OTLP this often (and once more at
    shutdown)."""
    console: bool = False

    @field_validator("otlp_endpoint")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        return None if v is None else _check_url(v)

    @field_validator("otlp_protocol")
    @classmethod
    def _grpc_installed(cls, v: str) -> str:
        # checked here so that a missing package is a config error, not a failed start; the
        # package is no dependency (it brings grpcio): the extra ownerserve[otlp-grpc] has it
        if v != "grpc":
            return v
        try:
            found = importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc")
        except ModuleNotFoundError:  # a parent package is missing
            found = None
        if found is None:
            raise ValueError(
                "grpc needs the opentelemetry-exporter-otlp-proto-grpc package "
                "(pip install 'ownerserve[otlp-grpc]')"
            )
        return v


class Settings(_Strict):
    server: ServerSettings = ServerSettings()
    directory: DirectorySettings = DirectorySettings()
    planner: PlannerSettings = PlannerSettings()
    telemetry: TelemetrySettings = TelemetrySettings()
    admission: AdmissionSettings = AdmissionSettings()
    responses: ResponsesSettings = ResponsesSettings()
    models: tuple[ModelSettings, ...] = (ModelSettings(name="ownerserve-tiny"),)
    workers: tuple[WorkerSettings, ...] = ()

    @model_validator(mode="after")
    def _unique(self) -> Settings:
        seen: set[str] = set()
        for i, w in enumerate(self.workers):
            if w.id in seen:
                raise ValueError(f"workers.{i}.id: duplicate worker id {w.id!r}")
            seen.add(w.id)
        names = {m.name for m in self.models}
        if len(names) != len(self.models):
            raise ValueError("models: duplicate model name")
        for i, w in enumerate(self.workers):
            for m in w.models:
                if m not in names:
                    raise ValueError(f"workers.{i}.models: unknown model {m!r}")
        return self

    def model(self, name: str) -> ModelSettings | None:
        for m in self.models:
            if m.name == name:
                return m
        return None


_ENV_PREFIX = "OWNERSERVE_"
# environment variables that override settings: OWNERSERVE_SERVER__PORT=9000 etc.


def _apply_env(data: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    for key, value in env.items():
        if not key.startswith(_ENV_PREFIX) or "__" not in key:
            continue
        section, _, field_name = key[len(_ENV_PREFIX) :].lower().partition("__")
        if section in ("server", "directory", "planner", "telemetry", "admission", "responses"):
            sect = dict(data.get(section) or {})
            sect[field_name] = value
            data[section] = sect
    return data


def _format_error(source: str, exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    msg = str(err["msg"])
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    msg = msg.removeprefix("Value error, ")
    return f"{source}: {loc}: {msg}" if loc else f"{source}: {msg}"


def settings_from_dict(
    data: Mapping[str, Any], *, source: str = "<config>", env: Mapping[str, str] | None = None
) -> Settings:
    """Validate a mapping (as loaded from YAML) into `Settings`; raise `ConfigError` on problems."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: top level must be a mapping, got {type(data).__name__}")
    merged = _apply_env(dict(data), env or {})
    try:
        return Settings.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_format_error(source, exc)) from None


def load_settings(path: str | Path, env: Mapping[str, str] | None = None) -> Settings:
    """Load and validate a YAML config file."""
    p = Path(path)
    data = load_yaml(p, "settings")
    return settings_from_dict(data if data is not None else {}, source=str(p), env=env)
