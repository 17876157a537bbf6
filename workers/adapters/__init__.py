"""Adapters that speak each worker kind's protocol (vLLM, SGLang, emulator)."""

from __future__ import annotations

from ownerserve.types import BackendKind
from workers.adapters.base import WorkerAdapter, WorkerAddress, WorkerLoad, parse_load_metrics
from workers.adapters.emulator import EmulatorAdapter
from workers.adapters.sglang import SGLangAdapter
from workers.adapters.vllm import VLLMAdapter, VLLMRequestFlow


def adapter_for(kind: BackendKind) -> EmulatorAdapter | VLLMAdapter | SGLangAdapter:
    """The adapter of a worker kind."""
    if kind == BackendKind.VLLM:
        return VLLMAdapter()
    if kind == BackendKind.SGLANG:
        return SGLangAdapter()
    return EmulatorAdapter()


__all__ = [
    "EmulatorAdapter",
    "SGLangAdapter",
    "VLLMAdapter",
    "VLLMRequestFlow",
    "WorkerAdapter",
    "WorkerAddress",
    "WorkerLoad",
    "adapter_for",
    "parse_load_metrics",
]
