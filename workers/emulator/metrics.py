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
from collections.abc import Callable, Sequence

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
TRANSFER_KINDS = ("pd", "fetch", "chunk")


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

    def _render_offload(
        self,
        g: dict[str, float],
        base: str,
        own: str,
        metric: Callable[[str, str, str], None],
        out: list[str],
    ) -> None:
        """The CPU tier: vLLM's OffloadingConnector metrics, then OwnerServe's occupancy."""
        metric("vllm:kv_offload_cpu_cache_usage_perc", "gauge", "CPU KV cache usage.")
        out.append(f"vllm:kv_offload_cpu_cache_usage_perc{{{base}}} {g['cpu_usage']!r}")
        metric("vllm:kv_offload_load_bytes", "counter", "Bytes loaded from offload to GPU.")
        out.append(f"vllm:kv_offload_load_bytes_total{{{base}}} {self.kv_offload_load_bytes}")
        metric("vllm:kv_offload_load_time", "counter", "Load time from offload to GPU (s).")
        out.append(f"vllm:kv_offload_load_time_total{{{base}}} {self.kv_offload_load_s!r}")
        metric("vllm:kv_offload_store_bytes", "counter", "Bytes stored from GPU to offload.")
        stored = int(g["cpu_stored"] * g["block_bytes"])
        out.append(f"vllm:kv_offload_store_bytes_total{{{base}}} {stored}")
        metric("vllm:kv_offload_allocation_failure", "counter", "Offload stores refused.")
        out.append(f"vllm:kv_offload_allocation_failure_total{{{base}}} {g['cpu_store_failures']}")
        p = "ownerserve_emulator_"
        metric(f"{p}cpu_kv_blocks_held", "gauge", "Blocks resident in the CPU tier.")
        out.append(f"{p}cpu_kv_blocks_held{{{own}}} {g['cpu_held']}")
        metric(f"{p}cpu_kv_blocks_capacity", "gauge", "CPU tier capacity in blocks.")
        out.append(f"{p}cpu_kv_blocks_capacity{{{own}}} {g['cpu_capacity']}")
        metric(f"{p}cpu_kv_blocks_evicted", "counter", "Blocks evicted from the CPU tier.")
        out.append(f"{p}cpu_kv_blocks_evicted_total{{{own}}} {g['cpu_evicted']}")

    def render(self, gauges: Callable[[], dict[str, float]]) -> str:
        """Prometheus text exposition (format 0.0.4) of everything, with current gauges."""
        g = gauges()
        base = f'model_name="{self.model}",engine="0"'
        own = f'worker_id="{self.worker_id}"'
        out: list[str] = []

        def metric(name: str, kind: str, help_: str) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")

        metric("vllm:num_requests_running", "gauge", "Requests in model execution batches.")
        out.append(f"vllm:num_requests_running{{{base}}} {g['running']}")
        metric("vllm:num_requests_waiting", "gauge", "Requests waiting to be processed.")
        out.append(f"vllm:num_requests_waiting{{{base}}} {g['waiting']}")
        metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.")
        out.append(f"vllm:kv_cache_usage_perc{{{base}}} {g['kv_usage']!r}")
        # vLLM's info metric (a gauge at 1 whose labels are the cache config): the router reads
        # the pool's size from it, as from a real engine
        metric("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig")
        out.append(
            f'vllm:cache_config_info{{block_size="{int(g["block_size"])}",engine="0",'
            f'num_gpu_blocks="{int(g["capacity"])}"}} 1.0'
        )
        metric("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in tokens.")
        out.append(f"vllm:prefix_cache_queries_total{{{base}}} {self.prefix_cache_queries}")
        metric("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in tokens.")
        out.append(f"vllm:prefix_cache_hits_total{{{base}}} {self.prefix_cache_hits}")
        metric("vllm:prompt_tokens_by_source", "counter", "Prompt tokens by source.")
        for src, n in self.prompt_tokens_by_source.items():
            out.append(f'vllm:prompt_tokens_by_source_total{{{base},source="{src}"}} {n}')
        metric(
            "vllm:prompt_tokens_cached_by_source",
            "counter",
            "Prefix-cache hit tokens by the cache tier that supplied them.",
        )
        for src, n in self.prompt_tokens_cached_by_source.items():
            out.append(f'vllm:prompt_tokens_cached_by_source_total{{{base},source="{src}"}} {n}')
        metric("vllm:prompt_tokens", "counter", "Prefill tokens processed.")
        out.append(f"vllm:prompt_tokens_total{{{base}}} {self.prompt_tokens}")
        metric("vllm:generation_tokens", "counter", "Generation tokens processed.")
        out.append(f"vllm:generation_tokens_total{{{base}}} {self.generation_tokens}")
        metric("vllm:request_success", "counter", "Finished requests by finish reason.")
        for reason, n in self.request_success.items():
            out.append(f'vllm:request_success_total{{{base},finished_reason="{reason}"}} {n}')
        metric("vllm:num_preemptions", "counter", "Cumulative number of preemptions.")
        out.append(f"vllm:num_preemptions_total{{{base}}} {self.preemptions}")
        if g["cpu_capacity"]:
            self._render_offload(g, base, own, metric, out)
        metric("vllm:time_to_first_token_seconds", "histogram", "Time to first token.")
        self.ttft.render("vllm:time_to_first_token_seconds", base, out)
        metric("vllm:inter_token_latency_seconds", "histogram", "Inter-token latency.")
        self.itl.render("vllm:inter_token_latency_seconds", base, out)
        metric("vllm:e2e_request_latency_seconds", "histogram", "End-to-end request latency.")
        self.e2e.render("vllm:e2e_request_latency_seconds", base, out)
        metric("vllm:request_queue_time_seconds", "histogram", "Time spent waiting.")
        self.queue_time.render("vllm:request_queue_time_seconds", base, out)

        p = "ownerserve_emulator_"
        metric(f"{p}info", "gauge", "Emulated engine identity.")
        out.append(
            f'{p}info{{{own},role="{self.role}",profile="{self.profile}",'
            f'model_name="{self.model}"}} 1'
        )
        metric(f"{p}kv_blocks_held", "gauge", "Resident prefix-cached KV blocks.")
        out.append(f"{p}kv_blocks_held{{{own}}} {g['blocks_held']}")
        metric(f"{p}kv_blocks_in_use", "gauge", "KV blocks referenced by requests or holds.")
        out.append(f"{p}kv_blocks_in_use{{{own}}} {g['blocks_in_use']}")
        metric(f"{p}kv_blocks_capacity", "gauge", "KV capacity in blocks.")
        out.append(f"{p}kv_blocks_capacity{{{own}}} {g['capacity']}")
        metric(f"{p}kv_block_bytes", "gauge", "Bytes of KV per block.")
        out.append(f"{p}kv_block_bytes{{{own}}} {g['block_bytes']}")
        metric(f"{p}kv_blocks_evicted", "counter", "Cached blocks evicted.")
        out.append(f"{p}kv_blocks_evicted_total{{{own}}} {g['evicted']}")
        metric(f"{p}kv_transfers_held", "gauge", "Prefill results held for a remote decode.")
        out.append(f"{p}kv_transfers_held{{{own}}} {g['held_transfers']}")
        metric(f"{p}kv_transfers_expired", "counter", "Held prefill results never pulled in time.")
        out.append(f"{p}kv_transfers_expired_total{{{own}}} {g['expired_transfers']}")
        metric(f"{p}prefill_tokens_computed", "counter", "Prompt tokens computed (not reused).")
        out.append(f"{p}prefill_tokens_computed_total{{{own}}} {self.prefill_tokens_computed}")
        metric(f"{p}decode_tokens_computed", "counter", "Tokens computed by decode steps.")
        out.append(f"{p}decode_tokens_computed_total{{{own}}} {self.decode_tokens_computed}")
        metric(f"{p}engine_steps", "counter", "Scheduler steps run.")
        out.append(f"{p}engine_steps_total{{{own}}} {self.steps}")
        metric(f"{p}engine_busy_seconds", "counter", "Emulated compute time (before --speed).")
        out.append(f"{p}engine_busy_seconds_total{{{own}}} {self.busy_s!r}")
        metric(f"{p}engine_active_seconds", "counter", "Wall time spent running steps.")
        out.append(f"{p}engine_active_seconds_total{{{own}}} {self.active_s!r}")
        metric(f"{p}engine_late_seconds", "counter", "Step sleeps' overshoot past their end.")
        out.append(f"{p}engine_late_seconds_total{{{own}}} {self.late_s!r}")
        for name, table, help_ in (
            ("kv_received_bytes", self.kv_received_bytes, "KV bytes received by transfer."),
            ("kv_received_blocks", self.kv_received_blocks, "KV blocks received by transfer."),
            ("kv_sent_bytes", self.kv_sent_bytes, "KV bytes sent to other workers."),
            ("kv_sent_blocks", self.kv_sent_blocks, "KV blocks sent to other workers."),
        ):
            metric(f"{p}{name}", "counter", help_)
            for kind, n in table.items():
                out.append(f'{p}{name}_total{{{own},kind="{kind}"}} {n}')
        metric(f"{p}kv_link_queue_seconds", "counter", "Modelled time pulls waited for the link.")
        out.append(f"{p}kv_link_queue_seconds_total{{{own}}} {self.kv_link_queue_s!r}")
        metric(f"{p}kv_transfers_failed", "counter", "KV pulls that failed.")
        out.append(f"{p}kv_transfers_failed_total{{{own}}} {self.transfers_failed}")
        metric(f"{p}chunk_tokens_reused", "counter", "Prompt tokens reused from chunk KV.")
        out.append(f"{p}chunk_tokens_reused_total{{{own}}} {self.chunk_tokens_reused}")
        metric(f"{p}chunks_reused", "counter", "Cached chunks reused by requests.")
        out.append(f"{p}chunks_reused_total{{{own}}} {self.chunks_reused}")
        metric(f"{p}chunks_stored", "counter", "Chunks whose KV was stored by content hash.")
        out.append(f"{p}chunks_stored_total{{{own}}} {self.chunks_stored}")
        metric(f"{p}chunk_tokens_stored", "counter", "Tokens of the chunks stored.")
        out.append(f"{p}chunk_tokens_stored_total{{{own}}} {self.chunk_tokens_stored}")
        metric(f"{p}chunks_fetched", "counter", "Chunks fetched from another worker's store.")
        out.append(f"{p}chunks_fetched_total{{{own}}} {self.chunks_fetched}")
        metric(f"{p}chunk_tokens_fetched", "counter", "Tokens of the chunks fetched.")
        out.append(f"{p}chunk_tokens_fetched_total{{{own}}} {self.chunk_tokens_fetched}")
        metric(f"{p}chunk_store_tokens", "gauge", "Tokens of chunk KV held in the chunk store.")
        out.append(f"{p}chunk_store_tokens{{{own}}} {g.get('chunk_tokens', 0)}")
        metric(f"{p}chunk_store_capacity_tokens", "gauge", "Chunk store capacity in tokens.")
        out.append(f"{p}chunk_store_capacity_tokens{{{own}}} {g.get('chunk_capacity', 0)}")
        metric(f"{p}kv_events_published", "counter", "KV event batches published.")
        out.append(f"{p}kv_events_published_total{{{own}}} {self.kv_events_published}")
        out.append("")
        return "\n".join(out)
