"""Picks the artifact transport between sidecars: Mooncake Transfer Engine
(`workers.sidecar.mooncake_transport`, imported lazily) or the plain-TCP one
(`workers.sidecar.transport`). Both modules expose `TransportServer(store)` with
`start(host, port) -> int` / `close()`, an async `fetch(store, host, port, keys, timeout_s=...)`
returning a `FetchResult`, and `TransferError`.

`auto` is Mooncake when its module imports and says `AVAILABLE`, else TCP; `mooncake` when it is
unavailable is a `TransportUnavailable` error naming the reason.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

from workers.sidecar import transport as tcp_transport
from workers.sidecar.store import ArtifactStore

TransportName = Literal["auto", "mooncake", "tcp"]
TRANSPORT_NAMES: tuple[str, ...] = ("auto", "mooncake", "tcp")
MOONCAKE_MODULE = "workers.sidecar.mooncake_transport"

FetchFn = Callable[..., Awaitable[Any]]


class TransportUnavailable(RuntimeError):
    """The transport asked for cannot run on this machine."""


@dataclass(frozen=True, slots=True)
class Transport:
    """One transport: its name (as `/health` reports it), server class, fetch and error types."""

    name: str
    server_factory: Callable[[ArtifactStore], Any]
    fetch: FetchFn
    errors: tuple[type[BaseException], ...]

    async def fetch_keys(
        self, store: ArtifactStore, host: str, port: int, keys: Sequence[str], timeout_s: float
    ) -> Any:
        return await self.fetch(store, host, port, keys, timeout_s=timeout_s)


def _from_module(name: str, module: ModuleType) -> Transport:
    errors: tuple[type[BaseException], ...] = (tcp_transport.TransferError,)
    own = getattr(module, "TransferError", None)
    if isinstance(own, type) and issubclass(own, BaseException) and own not in errors:
        errors = (*errors, own)
    return Transport(name, module.TransportServer, module.fetch, errors)


TCP = _from_module("tcp", tcp_transport)


def mooncake_status() -> tuple[ModuleType | None, str]:
    """The Mooncake transport module when it can run here, else None and why not."""
    try:
        module = importlib.import_module(MOONCAKE_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name == MOONCAKE_MODULE:
            return None, f"{MOONCAKE_MODULE} is not in this tree"
        return None, f"{MOONCAKE_MODULE} does not import: {exc}"
    except Exception as exc:  # a broken optional dependency must not stop a TCP sidecar
        return None, f"{MOONCAKE_MODULE} does not import: {exc!r}"
    if not getattr(module, "AVAILABLE", False):
        reason = getattr(module, "UNAVAILABLE_REASON", "") or "AVAILABLE is false"
        return None, f"Mooncake Transfer Engine is unavailable: {reason}"
    return module, ""


def select_transport(name: str) -> Transport:
    """The transport for `--transport NAME` (see the module docstring)."""
    if name == "tcp":
        return TCP
    if name not in ("auto", "mooncake"):
        raise TransportUnavailable(f"unknown transport {name!r} (choose {TRANSPORT_NAMES})")
    module, reason = mooncake_status()
    if module is not None:
        return _from_module("mooncake", module)
    if name == "mooncake":
        raise TransportUnavailable(f"--transport mooncake: {reason}")
    return TCP


def transport_for_peer(own: Transport, peer: str) -> Transport:
    """The transport to pull from a peer that serves `peer` (its `/health` transport)."""
    if peer == own.name:
        return own
    if peer == "tcp":
        return TCP
    if peer == "mooncake":
        module, reason = mooncake_status()
        if module is None:
            raise TransportUnavailable(f"the source serves over mooncake, but here: {reason}")
        return _from_module("mooncake", module)
    raise TransportUnavailable(f"the source serves over an unknown transport {peer!r}")
