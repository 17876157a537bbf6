"""The SGLang backend. P/D protocol: the same request goes to the prefill and the decode server
at once, both carrying `bootstrap_host`, `bootstrap_port` and a random 63-bit `bootstrap_room`;
the decode side pulls KV from the prefill side's room and streams the answer.
(As sglang-router's `--pd-disaggregation` mode sends it.) Load from SGLang's `/metrics`
(`--enable-metrics`: `sglang:num_running_reqs`, `num_queue_reqs`, `token_usage`,
`max_total_num_tokens`, the prompt and cached token counters); KV events in vLLM's wire format,
which SGLang publishes too (`--kv-events-config`, the publisher binding). Checked against real
SGLang 0.5.23 servers on CPU, colocated and P/D (`tests/e2e/sglang/`). SGLang's `/health`
generates one token and answers after at least a second.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

from ownerserve.config import WorkerSettings
from ownerserve.types import BackendKind
from router.backends.base import PDHandoff, WorkerAddress, WorkerLoad, parse_load_metrics
from router.backends.kv_events import KVEventSink, KVEventSubscriber, subscriber_for

BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def new_bootstrap_room() -> int:
    """A random room id in [0, 2^63), as sglang-router draws it."""
    return secrets.randbits(63)


class SGLangBackend:
    """SGLang servers (and emulated engines speaking SGLang's P/D protocol); an artifact fetch
    goes through the worker's sidecar."""

    kind = BackendKind.SGLANG
    rebuilds_windows = True  # not measured against a hybrid SGLang: the resume rule as written
    health_path = "/health"
    metrics_path = "/metrics"
    pd_handoff = PDHandoff.RENDEZVOUS

    def parse_load(self, metrics_text: str) -> WorkerLoad:
        return parse_load_metrics(metrics_text)

    def kv_event_subscriber(
        self, settings: WorkerSettings, sink: KVEventSink
    ) -> KVEventSubscriber | None:
        return subscriber_for(settings, sink, bind=False)

    def prefill_body(self, body: Mapping[str, Any], prefill: WorkerAddress) -> dict[str, Any]:
        """The client's body plus a new bootstrap room on `prefill`; the prefill side answers
        without streaming (the router only waits for its status)."""
        if prefill.bootstrap_port is None:
            raise ValueError(f"worker {prefill.worker_id!r} has no bootstrap_port configured")
        out = dict(body)
        out["bootstrap_host"] = prefill.host
        out["bootstrap_port"] = prefill.bootstrap_port
        out["bootstrap_room"] = new_bootstrap_room()
        out["stream"] = False
        out.pop("stream_options", None)
        return out

    def decode_body(
        self,
        body: Mapping[str, Any],
        prefill_body: Mapping[str, Any],
        prefill_answer: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        """The client's body plus the prefill side's bootstrap room."""
        out = dict(body)
        for name in BOOTSTRAP_FIELDS:
            out[name] = prefill_body[name]
        return out

    def handoff_release(self, prefill_answer: Mapping[str, Any]) -> tuple[str, bytes] | None:
        """None: P and D meet at the room at once (no hand-over after P answered); closing
        P's connection aborts its side."""
        return None

    def kv_api_url(self, address: WorkerAddress) -> str | None:
        return address.sidecar_url
