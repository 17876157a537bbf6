"""SGLang's P/D protocol as the router speaks it: the same request goes to the prefill and the
decode server at once, both carrying `bootstrap_host`, `bootstrap_port` and a random 63-bit
`bootstrap_room`; the decode side pulls KV from the prefill side's room and streams the answer.
(As sglang-router's `--pd-disaggregation` mode sends it.)
"""

from __future__ import annotations

import secrets
from typing import Any

from ownerserve.types import BackendKind
from workers.adapters.base import WorkerAddress, WorkerLoad, parse_load_metrics

BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def new_bootstrap_room() -> int:
    """A random room id in [0, 2^63), as sglang-router draws it."""
    return secrets.randbits(63)


class SGLangAdapter:
    """Adapter for SGLang servers (and emulated engines speaking SGLang's P/D protocol)."""

    kind = BackendKind.SGLANG
    health_path = "/health"
    metrics_path = "/metrics"

    def parse_load(self, metrics_text: str) -> WorkerLoad:
        return parse_load_metrics(metrics_text)

    def bootstrap_body(
        self, body: dict[str, Any], prefill: WorkerAddress, room: int
    ) -> dict[str, Any]:
        """The body both sides receive: the client's, plus the prefill side's bootstrap room."""
        if prefill.bootstrap_port is None:
            raise ValueError(f"worker {prefill.worker_id!r} has no bootstrap_port configured")
        out = dict(body)
        out["bootstrap_host"] = prefill.host
        out["bootstrap_port"] = prefill.bootstrap_port
        out["bootstrap_room"] = room
        return out

    def prefill_body(self, both: dict[str, Any]) -> dict[str, Any]:
        """The prefill side answers without streaming: the router only waits for its status."""
        out = dict(both)
        out["stream"] = False
        out.pop("stream_options", None)
        return out
