"""Run at start-up by every Python process of an SGLang P/D server on CPU (this directory is on
its PYTHONPATH; `workers.sglang_cpu.server` puts it there for the prefill and decode roles only).

SGLang's prefill side sends a chunk's KV page indices to its transfer engine through a pinned
host tensor and a CUDA event, unconditionally on the Mooncake path
(`sglang/srt/disaggregation/prefill.py`, `_send_kv_chunk`), which fails on a machine without an
accelerator ("pin_memory=True requires a CUDA or other accelerator backend", then "Torch not
compiled with CUDA enabled"). Where no CUDA device exists, and only then, this gives those calls
their CPU meaning instead of editing SGLang:
- `torch.empty(..., pin_memory=True)` allocates ordinary host memory: pinning is page-locking
  for a device's DMA, and there is no device;
- `torch.cuda.Event` is an event that is complete when recorded, and `torch.cuda.current_stream`
  names no stream: a copy between CPU tensors has finished when `copy_` returns, even with
  `non_blocking=True`, so waiting on an event recorded after it has nothing to wait for.
"""

from __future__ import annotations

from typing import Any

import torch

if not torch.cuda.is_available():
    _empty = torch.empty

    def _empty_unpinned(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        return _empty(*args, **kwargs)

    class _CompletedEvent:
        """A CUDA event's interface on a machine where every copy completes synchronously."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            return None

        def record(self, stream: object = None) -> None:
            return None

        def wait(self, stream: object = None) -> None:
            return None

        def synchronize(self) -> None:
            return None

        def query(self) -> bool:
            return True

    def _no_stream(*args: Any, **kwargs: Any) -> None:
        return None

    torch.empty = _empty_unpinned  # type: ignore[assignment]
    torch.cuda.Event = _CompletedEvent  # type: ignore[assignment,misc]
    torch.cuda.current_stream = _no_stream  # type: ignore[assignment]
