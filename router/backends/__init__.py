"""Backends: each worker kind's wire protocol as the router speaks it (vLLM, SGLang, the
emulated engine), behind one `Backend` protocol, and the registry of them by kind."""

from __future__ import annotations

from collections.abc import Mapping

from ownerserve.types import BackendKind
from router.backends.base import (
    Backend,
    PDHandoff,
    WorkerAddress,
    WorkerLoad,
    parse_load_metrics,
)
from router.backends.emulator import EmulatorBackend
from router.backends.sglang import SGLangBackend
from router.backends.vllm import VLLMBackend

# Backends are stateless: one instance serves every worker of its kind.
BACKENDS: Mapping[BackendKind, Backend] = {
    BackendKind.VLLM: VLLMBackend(),
    BackendKind.SGLANG: SGLangBackend(),
    BackendKind.EMULATOR: EmulatorBackend(),
}


def backend_for(kind: BackendKind) -> Backend:
    """The backend of a worker kind."""
    return BACKENDS[kind]


__all__ = [
    "BACKENDS",
    "Backend",
    "EmulatorBackend",
    "PDHandoff",
    "SGLangBackend",
    "VLLMBackend",
    "WorkerAddress",
    "WorkerLoad",
    "backend_for",
    "parse_load_metrics",
]
