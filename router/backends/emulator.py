"""The emulated engine's backend (`workers.emulator`): it speaks vLLM's OpenAI API and P/D
protocol, and serves OwnerServe's worker-side KV API itself when it has no sidecar (pull a
prefix from another worker: artifact fetch, state migration).
"""

from __future__ import annotations

from ownerserve.config import WorkerSettings
from ownerserve.types import BackendKind
from router.backends.base import WorkerAddress
from router.backends.kv_events import KVEventSink, KVEventSubscriber, subscriber_for
from router.backends.vllm import VLLMRequestFlow


class EmulatorBackend(VLLMRequestFlow):
    """Emulated engines: vLLM's request flow, the KV API on the engine, KV events it binds."""

    kind = BackendKind.EMULATOR

    def kv_event_subscriber(
        self, settings: WorkerSettings, sink: KVEventSink
    ) -> KVEventSubscriber | None:
        return subscriber_for(settings, sink, bind=False)

    def kv_api_url(self, address: WorkerAddress) -> str | None:
        return address.sidecar_url or address.url
