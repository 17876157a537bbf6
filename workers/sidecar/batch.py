"""The body of a batch call (`POST /ownerserve/kv/batch/get` answers, `/batch/put` requests):
many artifacts in one message, each with its own checksum so a bad one is refused alone.
Standard library only: the vLLM connector's client imports it in the vLLM venv.

    u32 big-endian manifest length | manifest (UTF-8 JSON) | payloads back to back

The manifest is `{"artifacts": [entry, ...]}`, one entry per artifact in payload order:
`{"key", "size", "checksum"}` (XXH3-128 hex), or `{"key", "found": false}` (no payload) for a
key a batch GET does not hold; a batch PUT entry may omit `checksum` and may carry
`block_artifacts` (`x-ownerserve-block-artifacts` of a single PUT).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

MEDIA_TYPE = "application/x-ownerserve-kv-batch"
BATCH_GET_PATH = "/ownerserve/kv/batch/get"
BATCH_PUT_PATH = "/ownerserve/kv/batch/put"
MAX_MANIFEST_BYTES = 64 << 20
_LEN = struct.Struct(">I")
LENGTH_BYTES = _LEN.size
"""Bytes of the manifest length a body starts with."""


class BatchFormatError(ValueError):
    """A batch body that does not follow the format (its message says where)."""


def encode_batch(
    entries: Sequence[Mapping[str, Any]], payloads: Sequence[bytes | memoryview]
) -> bytes:
    """One batch body: `entries` (each found one's `size` must be its payload's length) and
    the payloads of the found ones, in order."""
    manifest = json.dumps({"artifacts": list(entries)}, separators=(",", ":")).encode()
    return b"".join([_LEN.pack(len(manifest)), manifest, *payloads])


def manifest_length(head: bytes | memoryview) -> int:
    """The manifest length a body starts with (its first `LENGTH_BYTES`); raises
    `BatchFormatError` when it is over `MAX_MANIFEST_BYTES`."""
    if len(head) < _LEN.size:
        raise BatchFormatError("batch body shorter than its manifest length")
    (n,) = _LEN.unpack(head[: _LEN.size])
    if n > MAX_MANIFEST_BYTES:
        raise BatchFormatError(f"manifest of {n} bytes is too large")
    return int(n)


def decode_manifest(raw: bytes | memoryview) -> list[dict[str, Any]]:
    """The entries of a manifest (the JSON after the length), each checked for its form: a
    string key, and for a found one an int size >= 0 and a string checksum, if any (whether
    the sizes fit the body is the caller's to check)."""
    try:
        entries = json.loads(bytes(raw))["artifacts"]
    except (ValueError, KeyError, TypeError) as exc:
        raise BatchFormatError("manifest is not {'artifacts': [...]} JSON") from exc
    if not isinstance(entries, list):
        raise BatchFormatError("manifest artifacts: must be a list")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), str):
            raise BatchFormatError(f"artifact {i}: must be an object with a string key")
        if entry.get("found", True) is False:
            continue
        size = entry.get("size")
        if type(size) is not int or size < 0:
            raise BatchFormatError(f"artifact {i}: size must be an integer >= 0")
        checksum = entry.get("checksum")
        if checksum is not None and not isinstance(checksum, str):
            raise BatchFormatError(f"artifact {i}: checksum must be a hex string")
    return entries


def decode_batch(body: bytes | memoryview) -> tuple[list[dict[str, Any]], list[memoryview | None]]:
    """The entries of a batch body and each one's payload (a view into `body`; None for a key
    not found). Raises `BatchFormatError` when the sizes do not add up or an entry is
    malformed; checksums are the caller's to verify."""
    view = memoryview(body)
    n = manifest_length(view)
    if _LEN.size + n > len(view):
        raise BatchFormatError(f"manifest of {n} bytes does not fit the body")
    entries = decode_manifest(view[_LEN.size : _LEN.size + n])
    pos = _LEN.size + n
    payloads: list[memoryview | None] = []
    for i, entry in enumerate(entries):
        if entry.get("found", True) is False:
            payloads.append(None)
            continue
        size = entry["size"]
        if pos + size > len(view):
            raise BatchFormatError(f"artifact {i}: size does not fit the body")
        payloads.append(view[pos : pos + size])
        pos += size
    if pos != len(view):
        raise BatchFormatError(f"{len(view) - pos} bytes after the last artifact")
    return entries, payloads
