"""The router's telemetry as an operator's tools see it, over real requests through the router
to emulated engines (real processes): an OTLP/HTTP receiver (`tests.otlp_receiver`) gets every
histogram with the bucket bounds and counts that `/metrics` shows, counters as monotonic sums,
the workers' gauges without any scrape, and plan spans carrying the plan; a real Prometheus
(Debian's `prometheus`, which `scripts/setup.sh` installs where it can) scraping the router and
the workers answers every PromQL expression of the Grafana dashboard with data."""

from __future__ import annotations

import contextlib
import json
import math
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loadgen.cluster import EmulatedWorker
from tests.e2e.router_cluster import (
    MODEL,
    REPO,
    plan_fields,
    proxy_client,
    router_settings,
    sse_chunks,
    workers_fixture,
)
from tests.otlp_receiver import OtlpReceiver, attributes
from tests.router.fake_worker import free_port
from tests.waiting import until

pytestmark = pytest.mark.timeout(180)

DASHBOARD = REPO / "configs" / "grafana" / "ownerserve-router.json"
SCRAPE_INTERVAL_S = 1

cluster = workers_fixture(
    lambda: (
        EmulatedWorker("p0", "prefill", speed=20),
        EmulatedWorker("d0", "decode", speed=20),
        EmulatedWorker("h0", "hybrid", speed=20),
    )
)


def _settings(workers: Any, **telemetry: Any) -> Any:
    """Static P/D by default (every plan moves KV: the transfer histogram fills), colocated
    for requests that ask for it (`x-ownerserve-policy`)."""
    sections: dict[str, Any] = {"planner": {"policy": "static-pd", "allow_policy_header": True}}
    if telemetry:
        sections["telemetry"] = telemetry
    return router_settings(workers, **sections)


async def _chat(client: httpx.AsyncClient, i: int, policy: str | None = None) -> dict[str, str]:
    """One streamed turn of its own session, in a trace of its own; its plan header's fields,
    with `trace` (the trace id the router continued)."""
    trace = secrets.token_hex(16)
    headers = {"x-session-id": f"telemetry-{i}", "traceparent": f"00-{trace}-{'1' * 16}-01"}
    if policy is not None:
        headers["x-ownerserve-policy"] = policy
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Request {i}: summarise the logs. " * 20}],
        "max_tokens": 6,
        "stream": True,
    }
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status_code == 200, (await resp.aread()).decode()
        plan = plan_fields(resp.headers["x-ownerserve-plan"])
        async for _ in sse_chunks(resp):
            pass
    return {**plan, "trace": trace}


async def _turns(client: httpx.AsyncClient, first: int, n: int) -> list[dict[str, str]]:
    """`n` turns, every third colocated, the rest static P/D."""
    return [
        await _chat(client, i, "colocated" if i % 3 == 2 else None) for i in range(first, first + n)
    ]


Histograms = dict[tuple[str, tuple[tuple[str, str], ...]], tuple[Any, ...]]
"""(name, label set) -> (bounds, cumulative bucket counts, count, sum)."""


def exposition_histograms(text: str) -> Histograms:
    """Every histogram series of a Prometheus text exposition (parsed by prometheus_client)."""
    out: Histograms = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            continue
        series: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
        for s in family.samples:
            key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            one = series.setdefault(key, {"buckets": []})
            if s.name.endswith("_bucket"):
                one["buckets"].append((float(s.labels["le"]), int(s.value)))
            elif s.name.endswith("_count"):
                one["count"] = int(s.value)
            elif s.name.endswith("_sum"):
                one["sum"] = s.value
        for key, one in series.items():
            buckets = sorted(one["buckets"])
            bounds = tuple(le for le, _ in buckets if not math.isinf(le))
            out[family.name, key] = (bounds, tuple(c for _, c in buckets), one["count"], one["sum"])
    return out


def otlp_histograms(metrics: dict[str, Any], names: set[str]) -> Histograms:
    """The same for the OTLP metrics named `names` (bucket counts summed up to each bound)."""
    out: Histograms = {}
    for name in names:
        metric = metrics.get(name)
        if metric is None or metric.WhichOneof("data") != "histogram":
            continue
        for p in metric.histogram.data_points:
            key = tuple(sorted(attributes(p).items()))
            cumulative = tuple(sum(p.bucket_counts[: i + 1]) for i in range(len(p.bucket_counts)))
            out[name, key] = (tuple(p.explicit_bounds), cumulative, p.count, p.sum)
    return out


def counter_values(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


async def test_otlp_gets_every_histogram_the_exposition_shows_gauges_unscraped_and_plan_spans(
    cluster,
):
    receiver = await OtlpReceiver().start()
    workers = {w.worker_id for w in cluster}
    settings = _settings(cluster, otlp_endpoint=receiver.url, otlp_metrics_interval_s=0.2)
    try:
        async with proxy_client(settings) as (client, _):

            def all_healthy() -> bool:
                gauge = receiver.latest_metrics().get("ownerserve_worker_healthy")
                if gauge is None:
                    return False
                seen = {attributes(p)["worker"]: p.as_double for p in gauge.gauge.data_points}
                return seen == dict.fromkeys(workers, 1.0)

            # nothing has scraped /metrics: the export observes the gauges on its own schedule
            await until(all_healthy, what="every worker healthy in an OTLP export")

            plans = await _turns(client, 0, 6)
            assert {p["action"] for p in plans} == {"remote_prefill", "colocated_prefill"}
            n = len(plans)
            last: dict[str, Any] = {}

            async def agree() -> bool:
                text = (await client.get("/metrics")).text
                shown = exposition_histograms(text)
                names = {name for name, _ in shown}
                got = otlp_histograms(receiver.latest_metrics(), names)
                last.update(shown=shown, got=got, text=text)
                e2e = sum(
                    v[2] for (name, _), v in shown.items() if name == "ownerserve_e2e_seconds"
                )
                return e2e == n and got == shown

            with contextlib.suppress(AssertionError):
                await until(agree, what="the OTLP histograms equal to /metrics")
            assert last["got"] == last["shown"]
        histogram_names = {name for name, _ in last["shown"]}
        assert {
            "ownerserve_ttft_seconds",
            "ownerserve_tpot_seconds",
            "ownerserve_e2e_seconds",
            "ownerserve_transfer_seconds",
            "ownerserve_router_overhead_seconds",
        } <= histogram_names
        transfer = {k: v for k, v in last["shown"].items() if k[0] == "ownerserve_transfer_seconds"}
        assert sum(v[2] for v in transfer.values()) == sum(
            p["action"] == "remote_prefill" for p in plans
        )

        metrics = receiver.latest_metrics()
        for name in histogram_names:  # seconds, or observed over predicted
            assert metrics[name].unit == ("1" if name.endswith("_ratio") else "s"), name
            assert metrics[name].histogram.aggregation_temporality == 2  # cumulative
        requests = metrics["ownerserve_requests_total"]
        assert requests.sum.is_monotonic and requests.sum.aggregation_temporality == 2
        otlp_requests = {
            tuple(sorted(attributes(p).items())): p.as_double for p in requests.sum.data_points
        }
        assert otlp_requests == counter_values(last["text"], "ownerserve_requests_total")
        assert otlp_requests[("model", MODEL), ("status", "ok")] == n

        # every plan's span carries the plan its header showed, in the client's trace
        def plan_spans() -> dict[str, Any]:
            return {s.trace_id.hex(): s for s in receiver.spans() if s.name == "ownerserve.plan"}

        await until(lambda: len(plan_spans()) >= n, what="a plan span per request")
        spans = plan_spans()
        for plan in plans:
            attrs = attributes(spans[plan["trace"]])
            assert attrs["policy"] == plan["policy"]
            assert attrs["request_class"] == plan["class"]
            assert (attrs["action"], attrs["prefill"], attrs["decode"]) == (
                plan["action"],
                plan["p"],
                plan["d"],
            )
            assert attrs["cost_s"] == pytest.approx(float(plan["cost"]), rel=1e-5)
            if "runner_up" in plan:
                assert attrs["runner_up"] == plan["runner_up"].split("@")[0]
                assert attrs["margin_s"] == pytest.approx(float(plan["margin"]), rel=1e-4)
        assert not receiver.refused
    finally:
        await receiver.stop()


# --- a real Prometheus and the Grafana dashboard ------------------------------------------------

PROMETHEUS = shutil.which("prometheus")


@contextlib.contextmanager
def prometheus(tmp_path: Path, jobs: dict[str, list[str]]) -> Iterator[str]:
    """Prometheus scraping `jobs` (name -> host:port targets) every second, its TSDB in
    `tmp_path`; yields its base URL."""
    assert PROMETHEUS is not None
    port = free_port()
    config = {
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": targets}]}
            for job, targets in jobs.items()
        ],
    }
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    command = [
        PROMETHEUS,
        f"--config.file={config_path}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    with (tmp_path / "prometheus.log").open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def dashboard_queries(rate_interval: str) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of the dashboard, its variables substituted:
    Grafana's `$__rate_interval` and `$__interval` by what the test gives, the dashboard's own
    variables by their current values ("All": the variable's `allValue`)."""
    dashboard = json.loads(DASHBOARD.read_text())
    values = {"__rate_interval": rate_interval, "__interval": f"{SCRAPE_INTERVAL_S}s"}
    for var in dashboard.get("templating", {}).get("list", []):
        current = var.get("current", {}).get("value")
        if current == "$__all":  # "All" of a multi-value variable: its allValue regex
            current = var["allValue"]
        if current is not None:
            values[var["name"]] = str(current)

    def substitute(expr: str) -> str:
        def one(m: re.Match[str]) -> str:
            name = m.group(1) or m.group(2)
            assert name in values, f"dashboard variable ${name} has no value: {expr}"
            return values[name]

        return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)

    return [
        (panel["title"], substitute(target["expr"]))
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


@pytest.mark.skipif(
    PROMETHEUS is None,
    reason="no prometheus binary (scripts/setup.sh installs Debian's prometheus as root when "
    "apt-get can: apt-get install prometheus)",
)
async def test_a_real_prometheus_answers_every_dashboard_query_with_data(cluster, tmp_path):
    started = time.monotonic()
    async with proxy_client(_settings(cluster)) as (client, _):
        router_target = urlparse(str(client.base_url)).netloc
        jobs = {
            "ownerserve-router": [router_target],
            "ownerserve-workers": [urlparse(w.url).netloc for w in cluster],
        }
        with prometheus(tmp_path, jobs) as base:
            async with httpx.AsyncClient(base_url=base, timeout=10) as prom:

                async def query(expr: str) -> list[dict[str, Any]]:
                    resp = await prom.get("/api/v1/query", params={"query": expr})
                    body = resp.json()
                    assert body["status"] == "success", (expr, body)
                    assert body["data"]["resultType"] == "vector", (expr, body)
                    result: list[dict[str, Any]] = body["data"]["result"]
                    return result

                async def ready() -> bool:
                    with contextlib.suppress(httpx.HTTPError):
                        return (await prom.get("/-/ready")).status_code == 200
                    return False

                await until(ready, timeout_s=60, what="prometheus ready")

                async def all_up() -> bool:
                    up = await query("up")
                    return len(up) == 1 + len(cluster) and all(r["value"][1] == "1" for r in up)

                await until(all_up, what="prometheus scraping the router and every worker")

                async def scraped(n: int) -> bool:
                    got = await query("sum(ownerserve_e2e_seconds_count)")
                    return bool(got) and float(got[0]["value"][1]) == n

                # two rounds, each scraped before the next: every series grows between scrapes
                plans = await _turns(client, 0, 6)
                await until(lambda: scraped(6), what="the first round scraped")
                plans += await _turns(client, 6, 6)
                await until(lambda: scraped(12), what="the second round scraped")
                assert {p["action"] for p in plans} == {"remote_prefill", "colocated_prefill"}

                # the rate window: the whole run (Grafana's floor, 4 scrape intervals, at least)
                window = max(4 * SCRAPE_INTERVAL_S, math.ceil(time.monotonic() - started) + 2)
                empty = []
                for title, expr in dashboard_queries(f"{window}s"):
                    values = [float(r["value"][1]) for r in await query(expr)]
                    if not any(math.isfinite(v) for v in values):
                        empty.append(f"{title}: {expr} -> {values}")
                assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
