"""Plain-TCP artifact transport between sidecars (the fallback when Mooncake Transfer Engine is
not installed): length-prefixed frames over asyncio streams, one checksum per artifact.

Wire format (all integers big-endian):

    request:  u32 len | JSON {"keys": [key, ...]}
    response, per key in order:
              u32 len | JSON {"key": k, "found": bool, "size": n, "checksum": hex}
              n payload bytes (only when found)

The source verifies each artifact before it sends it (`read_for_transfer`: a corrupted one is
dropped and answered `found: false`), and the receiver verifies each payload against its checksum
again before it stores it (`ArtifactStore.put(expected_checksum=...)`), so a peer that dies
mid-transfer yields a typed `TransferError` and at most the artifacts that arrived whole; no
partial or corrupted artifact is ever stored.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from ownerserve.records import fast_init
from workers.sidecar.store import ArtifactCorrupted, ArtifactMissing, ArtifactStore, new_hasher

_LEN = struct.Struct(">I")
MAX_HEADER = 1 << 20
CHUNK = 1 << 20


class TransferError(Exception):
    """A fetch from a peer sidecar failed (peer unreachable or gone, bad frame, bad checksum)."""


@fast_init
@dataclass(frozen=True, slots=True)
class FetchResult:
    """What a fetch brought: keys stored locally and keys the peer did not have."""

    fetched: tuple[str, ...]
    missing: tuple[str, ...]
    bytes: int
    direct: int = 0
    """How many of `fetched` were read one-sided from the source's arena (Mooncake's direct
    path: no control round trip)."""


async def _read_frame(reader: asyncio.StreamReader) -> dict[str, object]:
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > MAX_HEADER:
        raise TransferError(f"frame header of {n} bytes is too large")
    obj = json.loads(await reader.readexactly(n))
    if not isinstance(obj, dict):
        raise TransferError("frame is not a JSON object")
    return obj


async def _read_hashed(reader: asyncio.StreamReader, size: int, expected: bytes) -> bytes:
    """`size` payload bytes, hashed chunk by chunk as they arrive (overlapping the hash with
    the peer's sending); `TransferError` unless the hash equals `expected`."""
    hasher = new_hasher()
    parts: list[bytes] = []
    left = size
    while left:
        part = await reader.readexactly(min(CHUNK, left))
        hasher.update(part)
        parts.append(part)
        left -= len(part)
    if hasher.digest() != expected:
        raise TransferError("payload does not match its checksum")
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def read_for_transfer(store: ArtifactStore, key: str) -> tuple[bytes, bytes]:
    """An artifact's bytes and checksum for a peer, verified against the checksum taken when it
    was stored (an SSD file read and hashed in a thread, off the event loop). A corrupted one is
    dropped from the store and raises `ArtifactCorrupted`, and the servers answer it as missing:
    the peer's fetch then keeps the blocks before it, where serving it would fail the whole
    fetch at the peer's check (and every later one from here)."""
    reader = store.ssd_reader(key, verify=True)
    loaded = None if reader is None else await asyncio.to_thread(reader)
    return store.get_verified(key, loaded=loaded)


def _frame(obj: object) -> bytes:
    body = json.dumps(obj).encode()
    return _LEN.pack(len(body)) + body


class TransportServer:
    """Serves artifacts of a store to peers over TCP."""

    def __init__(self, store: ArtifactStore) -> None:
        self.store = store
        self._server: asyncio.Server | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self._server = await asyncio.start_server(self._handle, host, port)
        sock = self._server.sockets[0]
        return int(sock.getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    req = await _read_frame(reader)
                except asyncio.IncompleteReadError:
                    return
                keys = req.get("keys")
                if not isinstance(keys, list):
                    return
                for key in keys:
                    try:
                        data, digest = await read_for_transfer(self.store, str(key))
                    except (ArtifactMissing, ArtifactCorrupted):
                        writer.write(_frame({"key": key, "found": False}))
                        continue
                    writer.write(
                        _frame(
                            {
                                "key": key,
                                "found": True,
                                "size": len(data),
                                "checksum": digest.hex(),
                            }
                        )
                    )
                    view = memoryview(data)
                    for off in range(0, len(data), CHUNK):
                        writer.write(view[off : off + CHUNK])
                        await writer.drain()
                await writer.drain()
        except (ConnectionError, TransferError, ValueError):
            return
        finally:
            writer.close()


async def fetch(
    store: ArtifactStore,
    host: str,
    port: int,
    keys: Sequence[str],
    *,
    timeout_s: float = 30.0,
) -> FetchResult:
    """Pull `keys` from the peer at host:port into `store`. Raises `TransferError` when the peer
    is unreachable, closes mid-transfer, times out, or sends bytes that fail their checksum."""
    fetched: list[str] = []
    missing: list[str] = []
    total = 0
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError) as e:
        raise TransferError(f"cannot reach sidecar {host}:{port}: {e}") from e
    try:
        writer.write(_frame({"keys": list(keys)}))
        await writer.drain()
        for want in keys:
            async with asyncio.timeout(timeout_s):  # per frame; no task per await (wait_for)
                head = await _read_frame(reader)
            if head.get("key") != want:
                raise TransferError(f"peer answered {head.get('key')!r} for {want!r}")
            if not head.get("found"):
                missing.append(want)
                continue
            size = head.get("size")
            digest = head.get("checksum")
            if not isinstance(size, int) or not isinstance(digest, str) or size < 0:
                raise TransferError(f"bad frame header for {want!r}")
            expected = bytes.fromhex(digest)
            async with asyncio.timeout(timeout_s):
                data = await _read_hashed(reader, size, expected)
            store.put(want, data, expected_checksum=expected, already_verified=True)
            fetched.append(want)
            total += size
    except asyncio.IncompleteReadError as e:
        raise TransferError(
            f"sidecar {host}:{port} closed mid-transfer ({len(fetched)}/{len(keys)} artifacts)"
        ) from e
    except (ConnectionError, TimeoutError, ValueError) as e:
        raise TransferError(f"fetch from {host}:{port} failed: {e}") from e
    finally:
        writer.close()
    return FetchResult(tuple(fetched), tuple(missing), total)
