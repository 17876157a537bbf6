"""The emulated engine (`workers.emulator`) speaks vLLM's OpenAI API and both P/D protocols, plus
the worker-side KV API of OwnerServe that a real sidecar will provide later: pull a prefix
from another worker (`artifact fetch`, `state migration`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ownerserve.types import BackendKind
from workers.adapters.base import WorkerAddress, WorkerLoad, parse_load_metrics
from workers.adapters.vllm import VLLMRequestFlow

# The worker-side KV API (emulator now, sidecar later).
FETCH_PATH = "/ownerserve/kv/fetch"


class EmulatorAdapter(VLLMRequestFlow):
    """Adapter for emulated engines: vLLM's request flow plus the KV fetch API."""

    kind = BackendKind.EMULATOR
    health_path = "/health"
    metrics_path = "/metrics"

    def parse_load(self, metrics_text: str) -> WorkerLoad:
        return parse_load_metrics(metrics_text)

    def fetch_url(self, destination: WorkerAddress) -> str:
        """Where to ask `destination` to pull a prefix from another worker."""
        return (destination.sidecar_url or destination.url) + FETCH_PATH

    def fetch_body(
        self,
        source: WorkerAddress,
        model: str,
        block_hashes: Sequence[int],
        token_ids: Sequence[int],
        block_size: int,
    ) -> dict[str, Any]:
        """Pull the first `len(block_hashes)` blocks of the prompt from `source`."""
        n = len(block_hashes) * block_size
        return {
            "source_url": source.sidecar_url or source.url,
            "source_worker": source.worker_id,
            "model": model,
            "block_hashes": [int(h) for h in block_hashes],
            "token_ids": list(token_ids[:n]),
            "block_size": block_size,
        }
