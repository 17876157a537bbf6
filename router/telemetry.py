"""The router's telemetry: its metrics, defined once in a Prometheus registry (`RouterMetrics`:
explicit buckets in seconds; the request path's stage timings, `StageTimes`) and read by
`/metrics` scrapes and, with `telemetry.otlp_endpoint` set, by the OTLP export
(`router.otlp`: histograms stay histograms); OpenTelemetry spans (request, tokenize,
directory lookup, plan, each upstream call, the KV transfer) exported over OTLP; W3C trace
context propagated to workers.

Nothing here is global: each app owns its registry, tracer provider and metrics export.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import SummaryMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from ownerserve.config import TelemetrySettings
from planner.types import Plan

log = logging.getLogger(__name__)


def _one_two_five(first: float, last: float) -> tuple[float, ...]:
    """Bucket bounds 1, 2.5 and 5 times each power of ten, from `first` to `last` inclusive
    (parsed from decimal text, so each bound is the float its literal would be)."""
    bounds = (float(f"{m}e{e}") for e in range(-6, 3) for m in ("1", "2.5", "5"))
    return tuple(b for b in bounds if first <= b <= last)


LATENCY_BUCKETS_S = (*_one_two_five(0.001, 10.0), 30.0, 60.0)
TPOT_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 1.0)
QUEUE_WAIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
OVERHEAD_BUCKETS_S = _one_two_five(0.00005, 0.1)
MARGIN_BUCKETS_S = (0.0, *_one_two_five(0.0001, 10.0))
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.11, 1.25, 1.5, 2.0, 4.0, 8.0)
"""Observed over predicted: 1.0 where the cost model was exact."""

_PROPAGATOR = TraceContextTextMapPropagator()
_NO_SPAN = contextlib.nullcontext()
_clock = time.perf_counter

STAGES = (
    "parse",
    "identify",
    "tokenize",
    "admit",
    "look_up",
    "view",
    "plan",
    "execute",
    "stream",
    "commit",
    "observe",
)
"""The request path's stages, in order (`router.pipeline`), as `StageTimes` labels them."""


class StageTimes(Collector):
    """Wall seconds the request path spent in each stage, summed, and how often each ran: the
    summary `ownerserve_stage_seconds{stage}` (its `_sum` and `_count`). Kept as plain numbers
    on the hot path and read only when scraped: a histogram's `observe` costs about a
    microsecond, and a request passes eleven stages. A stage that awaits (admission's queue,
    the directory, the upstream's first byte, the stream) counts its wait."""

    def __init__(self, names: Sequence[str] = STAGES) -> None:
        self.names = tuple(names)
        self.seconds = [0.0] * len(self.names)
        self.runs = [0] * len(self.names)

    def lap(self, stage: int, since: float) -> float:
        """`stage` ran from `since` (`time.perf_counter()`) until now; returns now."""
        now = _clock()
        self.seconds[stage] += now - since
        self.runs[stage] += 1
        return now

    def add(self, stage: int, seconds: float) -> None:
        """`stage` ran for `seconds`."""
        self.seconds[stage] += seconds
        self.runs[stage] += 1

    def collect(self) -> Iterator[SummaryMetricFamily]:
        family = SummaryMetricFamily(
            "ownerserve_stage_seconds",
            "Wall time of each stage of the request path (parse to observe), awaits included",
            labels=["stage"],
        )
        for name, runs, seconds in zip(self.names, self.runs, self.seconds, strict=True):
            family.add_metric([name], runs, seconds)
        yield family


OWNER_LOOKUP_RESULTS = ("hit", "miss", "none")
KV_FETCH_RESULTS = ("full", "partial", "empty", "failed")
MIGRATION_OUTCOMES = ("migrated", "refused_guided", "refused_partial", "refused_limit", "failed")
UPSTREAM_HOPS = ("connect", "first_byte", "kv_transfer", "stream_gap")
TOP_SESSIONS = 10
"""Sessions listed by the KV they hold (the admin status, `ownerserve_session_kv_tokens`)."""
MAX_SESSION_LABEL_CHARS = 128
"""A session id is cut to this many characters as `ownerserve_session_kv_tokens`' label."""
PREFIX_KINDS = ("prompt", "available", "predicted", "delivered", "reported")
"""The kinds of `ownerserve_prefix_tokens_total`, in the order `RouterMetrics.prefix_tokens_of`
gives their counters."""


class RouterMetrics:
    """Every metric the router exports, whoever reads them: a `/metrics` scrape
    (`exposition`) or the OTLP export (`read`). The gauges of the router's state (per worker,
    open leases) are set by the observers given to `on_read` as each read begins: observed on
    the reader's schedule, not on the request path. Counters whose label values are known
    before their first event start at 0 (`rate()` has data from the start): here those of a
    fixed set, per worker and per model through `on_read`'s observer and `start_at_zero`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._observers: list[Callable[[], None]] = []
        # every metric registers in this app's own registry
        counter = functools.partial(Counter, registry=self.registry)
        gauge = functools.partial(Gauge, registry=self.registry)
        histogram = functools.partial(Histogram, registry=self.registry)
        self.requests = counter(
            "ownerserve_requests_total", "Client requests by outcome", ["model", "status"]
        )
        self.actions = counter(
            "ownerserve_plan_actions_total", "Plans by action and policy", ["policy", "action"]
        )
        self.decisions = counter(
            "ownerserve_plan_decisions_total",
            "Plans by request class, action and the cost term the choice turned on "
            "(planner.explain.deciding_term: the term of C(a) in which the chosen candidate "
            "saved the most against the runner-up; only_candidate, or policy when the policy "
            "chose a costlier one by its own rule)",
            ["class", "action", "term"],
        )
        self.margin = histogram(
            "ownerserve_plan_margin_seconds",
            "How much cheaper the chosen candidate was than the runner-up (C(runner-up) - "
            "C(chosen)), by action; plans with a runner-up the cost model ranked below it",
            ["action"],
            buckets=MARGIN_BUCKETS_S,
        )
        self.prediction = histogram(
            "ownerserve_prediction_ratio",
            "Observed over predicted, per answered plan that ran as planned, by phase: ttft "
            "(the router's TTFT less the admission queue against T_queue + T_prefill + "
            "T_network + T_restore) and tpot (against the decode step); the calibration error",
            ["phase", "action"],
            buckets=RATIO_BUCKETS,
        )
        self.owner_lookups = counter(
            "ownerserve_owner_lookups_total",
            "Requests whose prefix had an owner, by whether the plan used it (hit) or not",
            ["result"],
        )
        self.retries = counter(
            "ownerserve_retries_total",
            "Upstream attempts retried before the first byte",
            ["worker", "reason"],
        )
        self.stream_errors = counter(
            "ownerserve_stream_errors_total",
            "Streams ended by an upstream failure mid-stream",
            ["worker"],
        )
        self.migrations = counter(
            "ownerserve_migrations_total",
            "Streams whose worker failed mid-stream, by what followed: migrated (continued on "
            "another worker), refused_guided (constrained output or several choices), "
            "refused_partial (a tool call or reasoning under way), refused_limit "
            "(server.max_migrations spent), failed (no worker took it over)",
            ["outcome"],
        )
        self.fallbacks = counter(
            "ownerserve_fallbacks_total",
            "Hops given up before the first byte, by what ran instead (colocated on the "
            "plan's decode worker, or another worker) and why",
            ["fallback", "reason"],
        )
        self.kv_fetches = counter(
            "ownerserve_kv_fetches_total",
            "Artifact fetches and state migrations run for plans, by result: full (every "
            "planned block arrived), partial (the rest recomputed), empty (the source had none), "
            "failed (the fetch was given up)",
            ["result"],
        )
        self.upstream_timeouts = counter(
            "ownerserve_upstream_timeouts_total",
            "Bounded waits on a worker that ran out (connect, first_byte, kv_transfer, stream_gap)",
            ["worker", "hop"],
        )
        # the per-request latencies, each by the plan's action
        self.ttft, self.tpot, self.e2e, self.transfer = (
            histogram(name, doc, ["action"], buckets=buckets)
            for name, doc, buckets in (
                (
                    "ownerserve_ttft_seconds",
                    "Time to first token seen by the router",
                    LATENCY_BUCKETS_S,
                ),
                (
                    "ownerserve_tpot_seconds",
                    "Time per output token after the first",
                    TPOT_BUCKETS_S,
                ),
                ("ownerserve_e2e_seconds", "Request latency end to end", LATENCY_BUCKETS_S),
                (
                    "ownerserve_transfer_seconds",
                    "KV movement phase: remote prefill until its KV is ready, or an artifact fetch",
                    LATENCY_BUCKETS_S,
                ),
            )
        )
        self.overhead = histogram(
            "ownerserve_router_overhead_seconds",
            "Router time from request bytes to the upstream request (parse, tokenize, plan)",
            buckets=OVERHEAD_BUCKETS_S,
        )
        # the per-worker states
        self.breaker, self.healthy, self.inflight = (
            gauge(name, doc, ["worker"])
            for name, doc in (
                (
                    "ownerserve_breaker_state",
                    "Circuit breaker per worker: 0 closed, 1 half-open, 2 open",
                ),
                ("ownerserve_worker_healthy", "1 if the worker answers its health check"),
                ("ownerserve_worker_inflight", "Requests in flight per worker"),
            )
        )
        self.leases_open = gauge(
            "ownerserve_request_leases_open",
            "Requests holding their lease now (router/lease.py): back to 0 once the router is idle",
        )
        self.directory_errors = counter(
            "ownerserve_directory_lookup_errors_total",
            "Lookups that failed (requests then routed without ownership)",
        )
        self.commit_errors = counter(
            "ownerserve_directory_commit_errors_total", "Failed directory commits"
        )
        self.swept = counter(
            "ownerserve_directory_swept_total",
            "Expired leases and replicas the router's periodic sweep purged",
        )
        self.sweep_errors = counter(
            "ownerserve_directory_sweep_errors_total", "Periodic sweeps that failed"
        )
        self.drop_worker_errors = counter(
            "ownerserve_directory_drop_worker_errors_total",
            "Removed workers the directory failed to forget (their leases stay until retried)",
        )
        self.admission_queued = gauge(
            "ownerserve_admission_queued",
            "Requests waiting in the router's admission queue (every worker's KV working set full)",
        )
        self.admission_wait = histogram(
            "ownerserve_admission_wait_seconds",
            "Time requests spent in the admission queue, by how they left it (admitted, "
            "rejected, client_disconnected, cancelled)",
            ["outcome"],
            buckets=QUEUE_WAIT_BUCKETS_S,
        )
        self.admitted = counter(
            "ownerserve_admission_admitted_total",
            "Requests admitted: at once (a worker had working-set headroom) or after queueing",
            ["path"],
        )
        self.admission_rejected = counter(
            "ownerserve_admission_rejected_total",
            "Requests answered 429: the queue was full (queue_full) or they waited their bound "
            "(queue_timeout)",
            ["reason"],
        )
        self.admission_abandoned = counter(
            "ownerserve_admission_abandoned_total",
            "Queued requests removed because their client went away (client_disconnected) or "
            "they were cancelled (request timeout, shutdown)",
            ["reason"],
        )
        self.sessions_paused = counter(
            "ownerserve_admission_sessions_paused_total",
            "Sessions paused at a tool boundary: the working set of the worker holding their KV "
            "was over the high watermark, so their request waited and their KV was released",
        )
        self.admission_paused = gauge(
            "ownerserve_admission_worker_paused",
            "1 while a worker's KV working set is over the high watermark and not yet back "
            "under the low one (it takes nothing from the admission queue)",
            ["worker"],
        )
        self.admission_kv_usage, self.admission_ws_ratio, self.admission_closed = (
            gauge(name, doc, ["worker"])
            for name, doc in (
                (
                    "ownerserve_admission_kv_usage",
                    "Each worker's KV pool share in use as admission counts it (the scrape's "
                    "plus the router's requests since): new requests queue while every worker "
                    "is at ownerserve_admission_high_watermark",
                ),
                (
                    "ownerserve_admission_working_set_ratio",
                    "Each worker's sessions' KV working set over its KV pool plus CPU tier "
                    "(the tokens admission counts there against that budget)",
                ),
                (
                    "ownerserve_admission_worker_closed",
                    "1 while a worker is closed to new and resuming sessions (its working set "
                    "over the high watermark of its budget)",
                ),
            )
        )
        self.admission_high, self.admission_full = (
            gauge(name, doc)
            for name, doc in (
                (
                    "ownerserve_admission_high_watermark",
                    "admission.high_watermark, as configured (a constant to compare against)",
                ),
                (
                    "ownerserve_admission_cluster_full",
                    "1 while the sessions' working sets fill the whole cluster (sessions are "
                    "then paused at tool boundaries and closed workers take no new ones)",
                ),
            )
        )
        self.session_kv_tokens = gauge(
            "ownerserve_session_kv_tokens",
            "The sessions holding the most KV (the admin status's top sessions, read every "
            "health interval), by the worker holding it: tokens in its working set there",
            ["session", "worker"],
        )
        self.prefix_tokens = counter(
            "ownerserve_prefix_tokens_total",
            "Prompt tokens of answered requests and their prefix reuse, by model and the worker "
            "that ran the prefill: prompt (every prompt token); available (the longest prefix "
            "of the prompt that the request's directory lookup found held anywhere, any worker, "
            "tier or kind, capped at the prompt); predicted (what the plan as it ran expected "
            "its prefill worker to hold or load, the plan's reused blocks); delivered (what the "
            "prefill worker's answer reported cached, usage.prompt_tokens_details.cached_tokens; "
            "only answers that report it); reported (the prompt tokens of those answers). "
            "available low: a cold workload; predicted < available: a routing loss; "
            "delivered < predicted over reported: a stale index",
            ["model", "worker", "kind"],
        )
        self._prefix_children: dict[tuple[str, str], tuple[Any, ...]] = {}
        self._top_sessions: tuple[tuple[str, str, int], ...] = ()
        self.kv_blocks, self.kv_tokens = (
            gauge(name, doc, ["worker", "tier", "source"])
            for name, doc in (
                (
                    "ownerserve_kv_blocks",
                    "KV blocks each worker holds per tier (gpu, cpu, ssd), by source: events "
                    "(a worker publishing KV events: blocks stored less removed, as the router "
                    "applies its event batches) or leases (a worker without KV events: the "
                    "blocks of the live leases this router's commits took there, gpu only)",
                ),
                (
                    "ownerserve_kv_tokens",
                    "Tokens of KV each worker holds per tier: ownerserve_kv_blocks times the "
                    "block size (its events', or its model's for leases)",
                ),
            )
        )
        self.kv_distinct, self.kv_copies = (
            gauge(name, doc, ["tier"])
            for name, doc in (
                (
                    "ownerserve_kv_blocks_distinct",
                    "Distinct KV blocks that at least one worker caches, by tier (gpu), as the "
                    "directory's record of every worker's KV events says (all router replicas' "
                    "workers of the directory); read every health interval",
                ),
                (
                    "ownerserve_kv_block_copies",
                    "(block, worker) pairs of cached KV blocks, by tier (gpu): each worker's "
                    "blocks summed, as the directory records them. The HBM duplicate factor "
                    "is ownerserve_kv_block_copies / ownerserve_kv_blocks_distinct",
                ),
            )
        )
        self.subscriber_close_errors = counter(
            "ownerserve_kv_subscriber_close_errors_total",
            "KV event subscriptions that failed to close",
        )
        self.stages = StageTimes()
        self.registry.register(self.stages)
        for metric, values in (
            (self.owner_lookups, OWNER_LOOKUP_RESULTS),
            (self.kv_fetches, KV_FETCH_RESULTS),
            (self.migrations, MIGRATION_OUTCOMES),
            (self.admitted, ("immediate", "queued")),
            (self.admission_rejected, ("queue_full", "queue_timeout")),
            (self.admission_abandoned, ("client_disconnected", "cancelled")),
        ):
            for value in values:
                self.of(metric, value)

    def start_at_zero(self, models: Iterable[str], policy: str, actions: Iterable[str]) -> None:
        """The counters of a deployment's label values at 0: each model's successful requests,
        the default policy's plans of each action."""
        for model in models:
            self.of(self.requests, model, "ok")
        for action in actions:
            self.of(self.actions, policy, action)

    def worker_at_zero(self, worker: str) -> None:
        """`worker`'s error counters at 0 (called as each read begins, for every worker the
        pool has then: cheap once the label sets exist)."""
        self.of(self.retries, worker, "before_first_byte")
        self.of(self.stream_errors, worker)
        for hop in UPSTREAM_HOPS:
            self.of(self.upstream_timeouts, worker, hop)

    def show_top_sessions(self, top: tuple[tuple[str, str, int], ...]) -> None:
        """`ownerserve_session_kv_tokens` holds `top` alone ((session, worker, tokens); a
        session id cut to `MAX_SESSION_LABEL_CHARS`): redone only when it changed."""
        if top == self._top_sessions:
            return
        self._top_sessions = top
        gauge = self.session_kv_tokens
        gauge.clear()
        for session, worker, tokens in top:
            gauge.labels(session[:MAX_SESSION_LABEL_CHARS], worker).set(tokens)

    def prefix_tokens_of(self, model: str, worker: str) -> tuple[Any, ...]:
        """The `ownerserve_prefix_tokens_total` counters of `model` and `worker`, one per kind
        (`PREFIX_KINDS`' order), memoised: an answered request adds to them with one lookup.
        Created at 0 (what `on_read`'s observer does for every worker and model it serves)."""
        key = (model, worker)
        children = self._prefix_children.get(key)
        if children is None:
            metric = self.prefix_tokens
            children = tuple(metric.labels(model, worker, kind) for kind in PREFIX_KINDS)
            self._prefix_children[key] = children
        return children

    def on_read(self, observe: Callable[[], None]) -> None:
        """Call `observe` as each read of the metrics begins (it sets gauges from the
        router's state). It may run on the OTLP export's thread: it only reads plain
        attributes of the router's state and sets metrics, which lock themselves."""
        self._observers.append(observe)

    def _observe(self) -> None:
        for observe in self._observers:
            observe()

    def of(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, memoised: the hot path skips prometheus_client's label
        validation and locking after the first request of each label set."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def read(self) -> list[Metric]:
        """Every metric family now, as the OTLP export reads them."""
        self._observe()
        return list(self.registry.collect())

    def exposition(self) -> bytes:
        """The Prometheus text exposition, as a scrape of `/metrics` reads it."""
        self._observe()
        return generate_latest(self.registry)


def plan_attributes(plan: Plan) -> dict[str, str | int | float]:
    """A plan as the attributes of its `ownerserve.plan` span: what the `x-ownerserve-plan`
    header says (policy, class, action, workers, KV source, cost, runner-up, margin, replica)
    and the blocks it reuses."""
    c = plan.chosen
    out: dict[str, str | int | float] = {
        "policy": plan.policy,
        "request_class": plan.request_class.value,
        "action": c.action.value,
        "prefill": c.prefill_worker,
        "decode": c.decode_worker,
        "cost_s": c.cost.total,
        "reused_blocks": c.reused_blocks,
        "candidates": plan.candidates_considered,
    }
    if c.source_worker is not None:
        out["source"] = c.source_worker
    if plan.runner_up is not None:
        out["runner_up"] = plan.runner_up.action.value
        out["margin_s"] = plan.margin_s
    if plan.add_replica_on is not None:
        out["replica"] = plan.add_replica_on
    return out


class Telemetry:
    """Tracer and metrics of one router app."""

    def __init__(self, settings: TelemetrySettings) -> None:
        self.settings = settings
        self.metrics = RouterMetrics()
        self._provider: Any = None
        self._metrics_export: Any = None
        self.tracer: Tracer = trace.NoOpTracer()
        self.enabled = bool(settings.otlp_endpoint or settings.console)
        if self.enabled:
            self._setup()

    def _setup(self) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

        resource = Resource.create({"service.name": self.settings.service_name})
        provider = TracerProvider(resource=resource)
        if self.settings.otlp_endpoint:
            from router.otlp import PeriodicExport, exporters, metrics_data

            spans, metrics = exporters(self.settings)
            provider.add_span_processor(BatchSpanProcessor(spans))
            read = functools.partial(metrics_data, resource=resource, start_ns=time.time_ns())
            self._metrics_export = PeriodicExport(
                lambda: read(self.metrics.read()),
                metrics,
                self.settings.otlp_metrics_interval_s,
            )
        if self.settings.console:
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        self._provider = provider
        self.tracer = provider.get_tracer("ownerserve.router")

    def start_span(self, name: str, context: Context | None = None, **attrs: Any) -> Any:
        """A span as a context manager; a shared no-op when tracing is off (the hot path
        then pays no context switching)."""
        if not self.enabled:
            return _NO_SPAN
        return self.tracer.start_as_current_span(name, context=context, attributes=attrs or None)

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """Add `traceparent` (W3C) for the current span to upstream headers."""
        if self.enabled:
            _PROPAGATOR.inject(headers)

    def extract(self, headers: Mapping[str, str]) -> Context | None:
        if not self.enabled or "traceparent" not in headers:
            return None
        return _PROPAGATOR.extract(headers)

    def shutdown(self) -> None:
        for p in (self._provider, self._metrics_export):
            if p is not None:
                try:
                    p.shutdown()
                except Exception:
                    log.warning("telemetry shutdown failed", exc_info=True)
