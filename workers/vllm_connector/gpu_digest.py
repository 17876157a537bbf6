"""The store's `KEYED_MAC` digest (`workers.mooncake_store.digest`) computed where the KV is: on
the device, in two launches over all payloads of a save or load, fused with the framing of the
objects (payload then digest, the bytes the store holds).

- `frame`: payloads `[n, unit]` -> objects `[n, unit + 16]`, each payload copied and its digest
  written after it (a save, before the objects go down to the store's memory).
- `unframe`: objects `[n, unit + 16]` -> payloads `[n, unit]` and a flag per object, 1 where its
  digest is the keyed MAC of its payload under its key (a load, after the objects came up).
- `digests` / `check`: the same digests of payloads read in place, written into or checked
  against a separate `[n, 16]` buffer (the grouped layout's path: payloads and digests move
  apart, so no framing copy; the copy engine moves payloads while these run).

Each launch splits every payload into slices (`_slices`: enough programs to fill the device),
sums its slice's lane products in uint64 (wrapping, as the numpy implementation), and a second,
small launch adds the slices and the key terms. On CPU tensors the same functions run the numpy
implementation (`mac_digests`), so the store path's logic is tested without a device; under
`TRITON_INTERPRET=1` the Triton kernels run on CPU tensors too (the agreement test).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

import numpy as np
import torch

from workers.mooncake_store.digest import (
    DIGEST_BYTES,
    GAMMA,
    LANE1_MASK,
    MAC_TAG,
    MIX1,
    MIX2,
    SEEDS,
    finish,
    key_lanes,
    mac_multipliers,
)

BLOCK = 1024
"""64-bit words per program and step."""
TARGET_PROGRAMS = 2048
"""Programs a launch aims for (payloads x slices)."""
MAX_SLICES = 256
"""Slices per payload at most (a few large objects still fill the device)."""


def keys_tensor(keys: list[str], nbytes: int, device: torch.device) -> torch.Tensor:
    """The key terms of `keys` (`key_lanes`) as a `[n, 2]` int64 tensor on `device` (the same
    bits), copied without a host wait."""
    lanes = torch.from_numpy(key_lanes(keys, nbytes).view(np.int64))
    if device.type != "cuda":
        return lanes
    return lanes.pin_memory().to(device, non_blocking=True)


def _checked(payloads: torch.Tensor, objects: torch.Tensor, lanes: torch.Tensor) -> int:
    n, unit = payloads.shape
    if unit % 8:
        raise ValueError(f"payloads of {unit} bytes: the device digest needs a multiple of 8")
    if tuple(objects.shape) != (n, unit + DIGEST_BYTES) or tuple(lanes.shape) != (n, 2):
        raise ValueError("payloads, objects and key terms disagree on their shapes")
    for t in (payloads, objects):
        if t.dtype != torch.uint8 or t.stride(1) != 1 or t.stride(0) % 8 or t.data_ptr() % 8:
            raise ValueError("payloads and objects must be uint8 rows, 8-byte aligned")
    return int(n)


def frame(payloads: torch.Tensor, lanes: torch.Tensor, objects: torch.Tensor) -> None:
    """Write each payload row, then its `KEYED_MAC` digest, into `objects` (queued on the current
    stream for CUDA tensors)."""
    n = _checked(payloads, objects, lanes)
    if n == 0:
        return
    if payloads.device.type == "cuda" or _interpreting():
        _launch(payloads, objects, lanes, verify=None)
        return
    unit = payloads.shape[1]
    objects[:, :unit].copy_(payloads)
    objects[:, unit:].copy_(torch.from_numpy(_cpu_digests(payloads, lanes)))


def unframe(
    objects: torch.Tensor,
    lanes: torch.Tensor,
    payloads: torch.Tensor,
    ok: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy each object's payload into `payloads`; an int32 flag per object (on its device), 1
    where its digest is the `KEYED_MAC` of the payload under its key: written into `ok` when
    given (a contiguous int32 `[n]` slice, say of a load's flags of all its objects)."""
    n = _checked(payloads, objects, lanes)
    if ok is None:
        ok = torch.zeros(n, dtype=torch.int32, device=objects.device)
    elif tuple(ok.shape) != (n,) or ok.dtype != torch.int32 or not ok.is_contiguous():
        raise ValueError("ok must be a contiguous int32 flag per object")
    if n == 0:
        return ok
    if objects.device.type == "cuda" or _interpreting():
        _launch(objects, payloads, lanes, verify=ok)
        return ok
    unit = payloads.shape[1]
    payloads.copy_(objects[:, :unit])
    want = torch.from_numpy(_cpu_digests(payloads, lanes))
    ok.copy_((objects[:, unit:] == want).all(dim=1).to(torch.int32))
    return ok


def digests(payloads: torch.Tensor, lanes: torch.Tensor, out: torch.Tensor) -> None:
    """Write each payload row's `KEYED_MAC` digest into the row of `out` (`[n, 16]` uint8),
    the payloads read in place (no framing copy: the caller moves payload and digest apart)."""
    n = _checked_digests(payloads, lanes, out)
    if n == 0:
        return
    if payloads.device.type == "cuda" or _interpreting():
        _run(payloads, None, lanes, out, None)
        return
    out.copy_(torch.from_numpy(_cpu_digests(payloads, lanes)))


def check(payloads: torch.Tensor, lanes: torch.Tensor, digests: torch.Tensor) -> torch.Tensor:
    """An int32 flag per payload row (on its device), 1 where the row of `digests` is its
    `KEYED_MAC` under its key; the payloads read in place."""
    n = _checked_digests(payloads, lanes, digests)
    ok = torch.zeros(n, dtype=torch.int32, device=payloads.device)
    if n == 0:
        return ok
    if payloads.device.type == "cuda" or _interpreting():
        _run(payloads, None, lanes, digests, ok)
        return ok
    want = torch.from_numpy(_cpu_digests(payloads, lanes))
    ok.copy_((digests == want).all(dim=1).to(torch.int32))
    return ok


def _checked_digests(payloads: torch.Tensor, lanes: torch.Tensor, digests: torch.Tensor) -> int:
    n, unit = payloads.shape
    if unit % 8:
        raise ValueError(f"payloads of {unit} bytes: the device digest needs a multiple of 8")
    if tuple(digests.shape) != (n, DIGEST_BYTES) or tuple(lanes.shape) != (n, 2):
        raise ValueError("payloads, digests and key terms disagree on their shapes")
    if not digests.is_contiguous() or digests.dtype != torch.uint8 or digests.data_ptr() % 8:
        raise ValueError("digests must be contiguous uint8 rows, 8-byte aligned")
    if payloads.dtype != torch.uint8 or payloads.stride(1) != 1 or payloads.stride(0) % 8:
        raise ValueError("payloads must be uint8 rows, 8-byte aligned")
    if payloads.data_ptr() % 8:
        raise ValueError("payloads must be uint8 rows, 8-byte aligned")
    return int(n)


def _run(
    payloads: torch.Tensor,
    dst: torch.Tensor | None,
    lanes: torch.Tensor,
    digests: torch.Tensor,
    verify: torch.Tensor | None,
) -> None:
    """The two launches over payloads read in place: digests written into `digests`
    (`verify` None) or checked against them (flags into `verify`)."""
    jit = _jit()
    n, unit = payloads.shape
    words = unit // 8
    slices, per = _slices(n, words)
    partial = torch.empty((n, slices, 2), dtype=torch.int64, device=payloads.device)
    s64 = payloads.view(torch.int64)
    jit.mac_partials_kernel[(n, slices)](
        s64, s64.stride(0), s64, s64.stride(0), partial, words, per, slices,
        GAMMA, SEEDS[0], SEEDS[1], MIX1, MIX2,
        BLOCK=BLOCK, num_warps=4, COPY=False,
    )  # fmt: skip
    d64 = digests.view(torch.int64)
    jit.mac_finish_kernel[(n,)](
        partial, slices, lanes, d64, d64.stride(0),
        verify if verify is not None else partial,
        LANE1_MASK, MAC_TAG << 56,
        VERIFY=verify is not None, SP=max(2, 1 << (slices - 1).bit_length()),
    )  # fmt: skip


def _cpu_digests(payloads: torch.Tensor, lanes: torch.Tensor) -> np.ndarray:
    rows = payloads.numpy()
    mult = mac_multipliers(rows.shape[1] // 8)
    sums = rows.view("<u8").astype(np.uint64, copy=False) @ mult.T
    return finish(sums + lanes.numpy().view(np.uint64))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _slices(n: int, words: int) -> tuple[int, int]:
    """(slices per payload, words per slice, a multiple of BLOCK)."""
    blocks = -(-words // BLOCK)
    want = max(1, min(MAX_SLICES, blocks, -(-TARGET_PROGRAMS // n)))
    per = -(-blocks // want) * BLOCK
    return -(-words // per), per


def _launch(src: torch.Tensor, dst: torch.Tensor, lanes: torch.Tensor, verify: Any) -> None:
    """`frame` (verify None: src payloads, dst objects) or `unframe` (verify the flags: src
    objects, dst payloads), both as two launches."""
    jit = _jit()
    n = src.shape[0]
    unit = dst.shape[1] if verify is not None else src.shape[1]
    words = unit // 8
    slices, per = _slices(n, words)
    partial = torch.empty((n, slices, 2), dtype=torch.int64, device=src.device)
    s64, d64 = src.view(torch.int64), dst.view(torch.int64)
    jit.mac_partials_kernel[(n, slices)](
        s64, s64.stride(0), d64, d64.stride(0), partial, words, per, slices,
        GAMMA, SEEDS[0], SEEDS[1], MIX1, MIX2,
        BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip
    objects = src if verify is not None else dst
    o64 = objects.view(torch.int64)
    jit.mac_finish_kernel[(n,)](
        partial, slices, lanes, o64[:, words:], o64.stride(0),
        verify if verify is not None else partial,
        LANE1_MASK, MAC_TAG << 56,
        VERIFY=verify is not None, SP=max(2, 1 << (slices - 1).bit_length()),
    )  # fmt: skip


def _jit() -> ModuleType:
    """The kernels' module, imported at first use (triton imports only then)."""
    return importlib.import_module("workers.vllm_connector._digest_jit")
