"""The emulated engine's Prometheus metrics, under vLLM's names, plus OwnerServe's own counters.

vLLM names (what routers and dashboards scrape): `vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, `vllm:prefix_cache_queries_total`,
`vllm:prefix_cache_hits_total`, `vllm:prompt_tokens_by_source_total{source=...}`,
`vllm:prompt_tokens_cached_by_source_total{source=device|host|...}`, TTFT, inter-token latency
and end-to-end histograms; with a CPU tier, vLLM's KV offloading metrics
(`vllm:kv_offload_cpu_cache_usage_perc`, `vllm:kv_offload_load_bytes_total`, ...).
`ownerserve_emulator_*` counters are what the benchmarks need beyond them: KV bytes moved by
transfer (P->D and artifact fetch), prefill tokens computed, blocks held (resident prefix
blocks; summed over workers they give the HBM duplicate factor; `cpu_kv_blocks_held` for the
CPU tier). Plain attributes updated in place and rendered on scrape: an update is an
integer add, and a histogram observation one bisect.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.emulator.sidecar_tier import SidecarTier

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
"""vLLM's `CacheHitSource`: where cached prompt tokens came from (HBM, CPU tier, another
instance, disk, a connector that does not say)."""
FINISH_REASONS = ("stop", "length", "abort", "error")
TRANSFER_KINDS = ("pd", "fetch", "chunk", "sidecar")
_G, _C = "gauge", "counter"
"""Metric kinds (Prometheus `# TYPE`)."""
_OWN = "ownerserve_emulator_"
"""Prefix of OwnerServe's own metrics."""


class Histogram:
    """Cumulative-bucket histogram in Prometheus' sense."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, name: str, labels: str, out: list[str]) -> None:
        cum = 0
        sep = "," if labels else ""
        for bound, n in zip(self.bounds, self.counts, strict=False):
            cum += n
            out.append(f'{name}_bucket{{{labels}{sep}le="{bound}"}} {cum}')
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
        out.append(f"{name}_count{{{labels}}} {self.count}")
        out.append(f"{name}_sum{{{labels}}} {self.sum!r}")


class _Exposition:
    """Prometheus text lines, one metric family after another."""

    __slots__ = ("out",)

    def __init__(self) -> None:
        self.out: list[str] = []

    def family(self, name: str, kind: str, help_: str) -> None:
        self.out.append(f"# HELP {name} {help_}")
        self.out.append(f"# TYPE {name} {kind}")

    def singles(
        self, prefix: str, labels: str, families: Iterable[tuple[str, str, str, float]]
    ) -> None:
        """Families of one sample each, (name after `prefix`, kind, help, value), under
        `labels`; a counter's sample is `<name>_total`."""
        for name, kind, help_, value in families:
            self.family(prefix + name, kind, help_)
            total = "_total" if kind == _C else ""
            self.out.append(f"{prefix}{name}{total}{{{labels}}} {value!r}")

    def by_label(
        self, name: str, help_: str, labels: str, label: str, values: Mapping[str, int]
    ) -> None:
        """A counter family with one sample per value of `label`."""
        self.family(name, "counter", help_)
        for key, n in values.items():
            self.out.append(f'{name}_total{{{labels},{label}="{key}"}} {n}')


class EngineMetrics:
    """Counters and histograms of one engine; gauges are read from the engine at scrape time."""

    def __init__(self, model: str, worker_id: str, role: str, profile: str) -> None:
        self.model = model
        self.worker_id = worker_id
        self.role = role
        self.profile = profile
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prompt_tokens_by_source = dict.fromkeys(SOURCES, 0)
        self.prompt_tokens_cached_by_source = dict.fromkeys(CACHE_HIT_SOURCES, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.request_success = dict.fromkeys(FINISH_REASONS, 0)
        self.preemptions = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.queue_time = Histogram(E2E_BUCKETS)
        self.prefill_tokens_computed = 0
        self.decode_tokens_computed = 0
        self.steps = 0
        self.busy_s = 0.0
        self.active_s = 0.0
        self.late_s = 0.0
        self.kv_received_bytes = dict.fromkeys(TRANSFER_KINDS, 0)
        self.kv_received_blocks = dict.fromkeys(TRANSFER_KINDS, 0)
        self.kv_sent_bytes = dict.fromkeys(TRANSFER_KINDS, 0)
        self.kv_sent_blocks = dict.fromkeys(TRANSFER_KINDS, 0)
        self.transfers_failed = 0
        self.kv_link_queue_s = 0.0
        self.kv_offload_load_bytes = 0
        self.kv_offload_load_s = 0.0
        """Modelled host-to-device copy time of CPU-tier loads (queueing excluded)."""
        self.kv_events_published = 0
        self.chunk_tokens_reused = 0
        """Prompt tokens taken from the chunk store (copied and re-rotated, not computed)."""
        self.chunk_tokens_stored = 0
        self.chunks_reused = 0
        self.chunks_stored = 0
        self.chunks_fetched = 0
        """Chunks stored here from another worker's chunk store (chunk fetch)."""
        self.chunk_tokens_fetched = 0
        self.sidecar: SidecarTier | None = None
        """Its KV sidecar, whose saves and loads are rendered below; None: none."""
        self.hybrid = False
        """A hybrid-attention spec is served: render the HeteroCache families below."""
        self.resumes: dict[str, int] = {}
        """Prefix hits by how their mutable state was restored
        (`ownerserve.kvstate.resume.RESUME_KINDS`)."""
        self.window_rebuild_tokens = 0
        """Tokens recomputed to rebuild sliding windows at a resumed boundary (n_win·L each)."""
        self.state_loaded_bytes: dict[str, int] = {}
        """Bytes loaded from the CPU tier, by state type."""

    def _render_hetero(self, own: str, e: _Exposition) -> None:
        """HeteroCache: how resumes restored their state, the windows rebuilt, bytes loaded."""
        e.family(f"{_OWN}resumes_total", _C, "Prefix resumes by how windows were restored.")
        for how in ("cached", "rebuilt", "truncated", "cold"):
            e.out.append(f'{_OWN}resumes_total{{{own},how="{how}"}} {self.resumes.get(how, 0)}')
        e.singles(_OWN, own, (
            ("window_rebuild_tokens", _C, "Tokens recomputed to rebuild sliding windows.",
             self.window_rebuild_tokens),
        ))  # fmt: skip
        if self.state_loaded_bytes:
            e.by_label(f"{_OWN}state_loaded_bytes", "KV bytes loaded from the CPU tier by "
                       "state type.", own, "state_type", self.state_loaded_bytes)  # fmt: skip

    def _render_offload(self, g: dict[str, float], base: str, own: str, e: _Exposition) -> None:
        """The CPU tier: vLLM's OffloadingConnector metrics, then OwnerServe's occupancy."""
        stored = int(g["cpu_stored"] * g["block_bytes"])
        # fmt: off
        e.singles("vllm:", base, (
            ("kv_offload_cpu_cache_usage_perc", _G, "CPU KV cache usage.", g["cpu_usage"]),
            ("kv_offload_load_bytes", _C, "Bytes loaded from offload to GPU.",
             self.kv_offload_load_bytes),
            ("kv_offload_load_time", _C, "Load time from offload to GPU (s).",
             self.kv_offload_load_s),
            ("kv_offload_store_bytes", _C, "Bytes stored from GPU to offload.", stored),
            ("kv_offload_allocation_failure", _C, "Offload stores refused.",
             g["cpu_store_failures"]),
        ))
        e.singles(_OWN, own, (
            ("cpu_kv_blocks_held", _G, "Blocks resident in the CPU tier.", g["cpu_held"]),
            ("cpu_kv_blocks_capacity", _G, "CPU tier capacity in blocks.", g["cpu_capacity"]),
            ("cpu_kv_blocks_evicted", _C, "Blocks evicted from the CPU tier.", g["cpu_evicted"]),
        ))
        # fmt: on

    def render(self, gauges: Callable[[], dict[str, float]]) -> str:
        """Prometheus text exposition (format 0.0.4) of everything, with current gauges."""
        g = gauges()
        base = f'model_name="{self.model}",engine="0"'
        own = f'worker_id="{self.worker_id}"'
        e = _Exposition()
        # fmt: off
        e.singles("vllm:", base, (
            ("num_requests_running", _G, "Requests in model execution batches.", g["running"]),
            ("num_requests_waiting", _G, "Requests waiting to be processed.", g["waiting"]),
            ("kv_cache_usage_perc", _G, "KV-cache usage. 1 means 100 percent usage.",
             g["kv_usage"]),
        ))
        # fmt: on
        # vLLM's info metric (a gauge at 1 whose labels are the cache config): the router reads
        # the pool's size from it, as from a real engine
        e.family("vllm:cache_config_info", _G, "Information of the LLMEngine CacheConfig")
        e.out.append(
            f'vllm:cache_config_info{{block_size="{int(g["block_size"])}",engine="0",'
            f'num_gpu_blocks="{int(g["capacity"])}"}} 1.0'
        )
        # fmt: off
        e.singles("vllm:", base, (
            ("prefix_cache_queries", _C, "Prefix cache queries, in tokens.",
             self.prefix_cache_queries),
            ("prefix_cache_hits", _C, "Prefix cache hits, in tokens.", self.prefix_cache_hits),
        ))
        # fmt: on
        by_source = "Prefix-cache hit tokens by the cache tier that supplied them."
        e.by_label("vllm:prompt_tokens_by_source", "Prompt tokens by source.", base, "source",
                   self.prompt_tokens_by_source)  # fmt: skip
        e.by_label("vllm:prompt_tokens_cached_by_source", by_source, base, "source",
                   self.prompt_tokens_cached_by_source)  # fmt: skip
        # fmt: off
        e.singles("vllm:", base, (
            ("prompt_tokens", _C, "Prefill tokens processed.", self.prompt_tokens),
            ("generation_tokens", _C, "Generation tokens processed.", self.generation_tokens),
        ))
        # fmt: on
        e.by_label(
            "vllm:request_success",
            "Finished requests by finish reason.",
            base,
            "finished_reason",
            self.request_success,
        )  # fmt: skip
        e.singles("vllm:", base, (
            ("num_preemptions", _C, "Cumulative number of preemptions.", self.preemptions),
        ))  # fmt: skip
        if g["cpu_capacity"]:
            self._render_offload(g, base, own, e)
        for name, help_, hist in (
            ("vllm:time_to_first_token_seconds", "Time to first token.", self.ttft),
            ("vllm:inter_token_latency_seconds", "Inter-token latency.", self.itl),
            ("vllm:e2e_request_latency_seconds", "End-to-end request latency.", self.e2e),
            ("vllm:request_queue_time_seconds", "Time spent waiting.", self.queue_time),
        ):
            e.family(name, "histogram", help_)
            hist.render(name, base, e.out)

        p = _OWN
        e.family(f"{p}info", _G, "Emulated engine identity.")
        e.out.append(
            f'{p}info{{{own},role="{self.role}",profile="{self.profile}",'
            f'model_name="{self.model}"}} 1'
        )
        # fmt: off
        e.singles(p, own, (
            ("kv_blocks_held", _G, "Resident prefix-cached KV blocks.", g["blocks_held"]),
            ("kv_blocks_in_use", _G, "KV blocks referenced by requests or holds.",
             g["blocks_in_use"]),
            ("kv_blocks_capacity", _G, "KV capacity in blocks.", g["capacity"]),
            ("kv_block_bytes", _G, "Bytes of KV per block.", g["block_bytes"]),
            ("kv_blocks_evicted", _C, "Cached blocks evicted.", g["evicted"]),
            ("kv_transfers_held", _G, "Prefill results held for a remote decode.",
             g["held_transfers"]),
            ("kv_transfers_expired", _C, "Held prefill results never pulled in time.",
             g["expired_transfers"]),
            ("prefill_tokens_computed", _C, "Prompt tokens computed (not reused).",
             self.prefill_tokens_computed),
            ("decode_tokens_computed", _C, "Tokens computed by decode steps.",
             self.decode_tokens_computed),
            ("engine_steps", _C, "Scheduler steps run.", self.steps),
            ("engine_busy_seconds", _C, "Emulated compute time (before --speed).", self.busy_s),
            ("engine_active_seconds", _C, "Wall time spent running steps.", self.active_s),
            ("engine_late_seconds", _C, "Step sleeps' overshoot past their end.", self.late_s),
        ))
        # fmt: on
        for name, table, help_ in (
            ("kv_received_bytes", self.kv_received_bytes, "KV bytes received by transfer."),
            ("kv_received_blocks", self.kv_received_blocks, "KV blocks received by transfer."),
            ("kv_sent_bytes", self.kv_sent_bytes, "KV bytes sent to other workers."),
            ("kv_sent_blocks", self.kv_sent_blocks, "KV blocks sent to other workers."),
        ):
            e.by_label(f"{p}{name}", help_, own, "kind", table)
        # fmt: off
        e.singles(p, own, (
            ("kv_link_queue_seconds", _C, "Modelled time pulls waited for the link.",
             self.kv_link_queue_s),
            ("kv_transfers_failed", _C, "KV pulls that failed.", self.transfers_failed),
            ("chunk_tokens_reused", _C, "Prompt tokens reused from chunk KV.",
             self.chunk_tokens_reused),
            ("chunks_reused", _C, "Cached chunks reused by requests.", self.chunks_reused),
            ("chunks_stored", _C, "Chunks whose KV was stored by content hash.",
             self.chunks_stored),
            ("chunk_tokens_stored", _C, "Tokens of the chunks stored.", self.chunk_tokens_stored),
            ("chunks_fetched", _C, "Chunks fetched from another worker's store.",
             self.chunks_fetched),
            ("chunk_tokens_fetched", _C, "Tokens of the chunks fetched.",
             self.chunk_tokens_fetched),
            ("chunk_store_tokens", _G, "Tokens of chunk KV held in the chunk store.",
             g.get("chunk_tokens", 0)),
            ("chunk_store_capacity_tokens", _G, "Chunk store capacity in tokens.",
             g.get("chunk_capacity", 0)),
            ("kv_events_published", _C, "KV event batches published.", self.kv_events_published),
        ))
        # fmt: on
        if self.sidecar is not None:
            sc = self.sidecar
            # fmt: off
            e.singles(p, own, (
                ("sidecar_blocks_saved", _C, "Blocks saved to its sidecar.", sc.saved),
                ("sidecar_save_failures", _C, "Blocks its sidecar did not take (down, error).",
                 sc.save_failed),
                ("sidecar_saves_dropped", _C, "Blocks dropped unsaved (the save queue full).",
                 sc.save_dropped),
                ("sidecar_blocks_loaded", _C, "Blocks loaded from its sidecar.", sc.loaded),
                ("sidecar_load_failures", _C, "Loads from its sidecar that failed (recomputed).",
                 sc.load_failed),
            ))
            # fmt: on
        if self.hybrid:
            self._render_hetero(own, e)
        e.out.append("")
        return "\n".join(e.out)
