"""The emulated engine's backend (`workers.emulator`): it speaks vLLM's OpenAI API and P/D
protocol, and serves OwnerServe's worker-side KV API itself when it has no sidecar (pull a
prefix from another worker: artifact fetch, state migration).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from ownerserve.config import WorkerSettings
from ownerserve.errors import UpstreamError
from ownerserve.types import BackendKind
from router.backends.base import WorkerAddress
from router.backends.kv_events import KVEventSink, KVEventSubscriber, subscriber_for
from router.backends.vllm import VLLMRequestFlow, transfer_params_of

PULL_PATH = "/ownerserve/kv/pull"
"""Where a decode side takes the KV a prefill holds for it (`workers.emulator.transfer`)."""


class EmulatorBackend(VLLMRequestFlow):
    """Emulated engines: vLLM's request flow, the KV API on the engine, KV events it binds."""

    kind = BackendKind.EMULATOR
    rebuilds_windows = True  # `workers.emulator.hetero`: the resume rule, rebuilds included

    def kv_event_subscriber(
        self, settings: WorkerSettings, sink: KVEventSink
    ) -> KVEventSubscriber | None:
        return subscriber_for(settings, sink, bind=False)

    def handoff_release(self, prefill_answer: Mapping[str, Any]) -> tuple[str, bytes] | None:
        """A pull of no blocks: the engine frees the hold at once (what its own decode side
        sends for a request that ends unpulled)."""
        try:
            params = transfer_params_of(prefill_answer)
        except UpstreamError:
            return None
        request_id = params.get("remote_request_id")
        if not isinstance(request_id, str) or not request_id:
            return None
        body: dict[str, Any] = {
            "transfer_id": f"req:{request_id}",
            "engine_id": params.get("remote_engine_id"),
            "block_hashes": [],
            "wait_s": 0.0,
        }
        return PULL_PATH, orjson.dumps(body)

    def kv_api_url(self, address: WorkerAddress) -> str | None:
        return address.sidecar_url or address.url
