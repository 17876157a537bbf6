"""Blocking HTTP client of the local sidecar's KV API, for the connector's threads (the vLLM
scheduler loop, the load and save threads). Standard library plus `xxhash` (the artifact checksum),
one keep-alive connection per thread, so it imports in the vLLM venv without our HTTP stack.

API (`workers/sidecar/server.py`): `POST /ownerserve/kv/lookup {"keys": [...]}` -> `{"present":
[bool]}`; `GET /ownerserve/kv/artifacts/{key}` -> bytes with `x-ownerserve-checksum`
(XXH3-128 hex, as `workers.sidecar.store.checksum`), 404 when missing;
`PUT /ownerserve/kv/artifacts/{key}` -> 201; `POST /ownerserve/kv/batch/get {"keys": [...]}` and
`POST /ownerserve/kv/batch/put` (`workers.sidecar.batch` bodies): many artifacts in one round trip,
each with its own checksum. `get_into` / `get_many_into` read payloads straight into
caller-owned memory (the CUDA load's pinned staging slots) and verify them there. Against a
sidecar without the batch calls (404) the client goes back to one request per artifact.
`report_store` (`POST /ownerserve/kv/store/report`) tells a sidecar on Mooncake Store what the
connector put into the store itself (`store_path.py`).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote, urlsplit

import xxhash

from workers.sidecar.batch import (
    BATCH_GET_PATH,
    BATCH_PUT_PATH,
    LENGTH_BYTES,
    MEDIA_TYPE,
    BatchFormatError,
    decode_batch,
    decode_manifest,
    encode_batch,
    manifest_length,
)

CHECKSUM_HEADER = "x-ownerserve-checksum"
KV_PREFIX = "/ownerserve/kv"
STORE_REPORT_PATH = KV_PREFIX + "/store/report"


class SidecarError(Exception):
    """The sidecar could not be reached or answered something unusable."""


class ArtifactRejected(SidecarError):
    """An artifact was refused before loading: missing, or its bytes fail their checksum."""


MAX_BATCH_BYTES = 64 << 20
"""Most payload bytes one batch call carries: a request's set of artifacts larger than this
goes in several calls."""
MAX_BATCH_KEYS = 4096


def _batches(sizes: Sequence[int]) -> list[range]:
    """Consecutive index ranges of at most MAX_BATCH_KEYS items and MAX_BATCH_BYTES (a larger
    item goes alone)."""
    out: list[range] = []
    start = total = 0
    for i, size in enumerate(sizes):
        if i > start and (total + size > MAX_BATCH_BYTES or i - start >= MAX_BATCH_KEYS):
            out.append(range(start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


class SidecarClient:
    """Thread-safe (one connection per thread) blocking client of one sidecar."""

    def __init__(self, base_url: str, timeout_s: float = 10.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._prefix = parts.path.rstrip("/")
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._batch = True
        """The sidecar has the batch calls (False after one answered 404)."""

    def _conn(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=self.timeout_s)
            conn.connect()
            # Small request/answer pairs: without this, Nagle + delayed ACK add ~40 ms each.
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._local.conn = conn
        return conn

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None

    def _request(
        self,
        method: str,
        path: str,
        body: bytes | memoryview | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        """One request; a stale keep-alive connection is retried once on a fresh one."""
        url = self._prefix + path
        for attempt in (0, 1):
            try:
                conn = self._conn()
                conn.request(method, url, body=body, headers=headers or {})
                resp = conn.getresponse()
                data = resp.read()
                return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
            except (http.client.HTTPException, OSError) as exc:
                self._drop()
                if attempt:
                    raise SidecarError(f"{method} {url}: {exc!r}") from exc
        raise AssertionError("unreachable")

    @staticmethod
    def _key_path(key: str) -> str:
        return f"{KV_PREFIX}/artifacts/{quote(key, safe='')}"

    def health(self) -> bool:
        try:
            status, _, _ = self._request("GET", "/health")
        except SidecarError:
            return False
        return status == 200

    def lookup(self, keys: Sequence[str]) -> list[bool]:
        """Which of `keys` the sidecar holds (one round trip)."""
        if not keys:
            return []
        body = json.dumps({"keys": list(keys)}).encode()
        status, _, data = self._request(
            "POST", f"{KV_PREFIX}/lookup", body, {"content-type": "application/json"}
        )
        if status != 200:
            raise SidecarError(f"lookup answered {status}: {data[:200]!r}")
        try:
            present = json.loads(data)["present"]
        except (ValueError, KeyError, TypeError) as exc:
            raise SidecarError(
                f"lookup answer is not {{'present': [...]}}: {data[:200]!r}"
            ) from exc
        if not isinstance(present, list) or len(present) != len(keys):
            raise SidecarError("lookup answered a different number of keys")
        return [bool(p) for p in present]

    def get(self, key: str) -> bytes:
        """The artifact's bytes, verified against the checksum the sidecar sends with them.
        Raises `ArtifactRejected` when it is missing, corrupted or comes without a checksum."""
        status, headers, data = self._request("GET", self._key_path(key))
        if status == 404:
            raise ArtifactRejected(f"{key}: not stored")
        if status != 200:
            raise ArtifactRejected(f"{key}: sidecar answered {status}: {data[:200]!r}")
        expected = headers.get(CHECKSUM_HEADER)
        if not expected:
            raise ArtifactRejected(f"{key}: no {CHECKSUM_HEADER} header")
        if xxhash.xxh3_128_hexdigest(data) != expected.strip().lower():
            raise ArtifactRejected(f"{key}: bytes do not match their checksum")
        return data

    def get_into(self, key: str, out: memoryview) -> None:
        """`get`, reading the bytes straight into `out` (a pinned staging slot: no copy on the
        host). Raises `ArtifactRejected` when the artifact is missing, is not `out`'s size, comes
        without a checksum or fails it (`out` then holds garbage)."""
        url = self._prefix + self._key_path(key)
        for attempt in (0, 1):
            try:
                conn = self._conn()
                conn.request("GET", url)
                resp = conn.getresponse()
                if resp.status != 200:
                    body = resp.read()
                    if resp.status == 404:
                        raise ArtifactRejected(f"{key}: not stored")
                    raise ArtifactRejected(f"{key}: sidecar answered {resp.status}: {body[:200]!r}")
                length = resp.getheader("content-length")
                if length is None or int(length) != out.nbytes:
                    resp.read()
                    raise ArtifactRejected(f"{key}: {length} bytes, expected {out.nbytes}")
                _read_into(resp, out)
                expected = resp.getheader(CHECKSUM_HEADER)
                break
            except (http.client.HTTPException, OSError) as exc:
                self._drop()
                if attempt:
                    raise SidecarError(f"GET {url}: {exc!r}") from exc
        else:  # pragma: no cover - the loop breaks or raises
            raise AssertionError("unreachable")
        if not expected:
            raise ArtifactRejected(f"{key}: no {CHECKSUM_HEADER} header")
        if xxhash.xxh3_128_hexdigest(out) != expected.strip().lower():
            raise ArtifactRejected(f"{key}: bytes do not match their checksum")

    def put(self, key: str, data: bytes | memoryview, block_artifacts: int | None = None) -> None:
        """Store one artifact (bytes, or a view into staging memory, sent without a copy);
        `block_artifacts`: how many artifacts make its block whole (the sidecar publishes and
        serves the block only once they are all stored)."""
        headers = {"content-type": "application/octet-stream"}
        if block_artifacts is not None:
            headers["x-ownerserve-block-artifacts"] = str(block_artifacts)
        status, _, body = self._request("PUT", self._key_path(key), data, headers)
        if status not in (200, 201, 204):
            raise SidecarError(f"PUT {key} answered {status}: {body[:200]!r}")

    def get_many(
        self, keys: Sequence[str], sizes: Sequence[int] | None = None
    ) -> list[bytes | ArtifactRejected]:
        """Each of `keys`' bytes, verified against its own checksum, in batch calls (`sizes`,
        when known, bound each call's bytes); an `ArtifactRejected` in place of each one
        missing or corrupted. Raises `SidecarError` when a call fails as a whole."""
        if not self._batch:
            return [self._get_or_rejected(k) for k in keys]
        ranges = _batches(sizes) if sizes is not None else [range(len(keys))]
        out: list[bytes | ArtifactRejected] = []
        for r in ranges:
            part = [keys[i] for i in r]
            body = json.dumps({"keys": part}).encode()
            status, _, data = self._request(
                "POST", BATCH_GET_PATH, body, {"content-type": "application/json"}
            )
            if status == 404:
                self._batch = False
                return out + [self._get_or_rejected(k) for k in keys[len(out) :]]
            if status != 200:
                raise SidecarError(f"batch get answered {status}: {data[:200]!r}")
            try:
                entries, payloads = decode_batch(data)
            except BatchFormatError as exc:
                raise SidecarError(f"batch get: {exc}") from exc
            if [e["key"] for e in entries] != part:
                raise SidecarError("batch get answered other keys than asked")
            for entry, payload in zip(entries, payloads, strict=True):
                out.append(_verified(entry, payload))
        return out

    def get_many_into(
        self, keys: Sequence[str], slots: Sequence[memoryview]
    ) -> list[ArtifactRejected | None]:
        """`get_many`, reading each payload of the batch answers straight into its slot
        (`slots[i]` for `keys[i]`: pinned staging, no copy on the host) and verifying it there
        against its own checksum. None for each artifact now in its slot, an `ArtifactRejected`
        for each one missing, not its slot's size or failing its checksum (its slot then holds
        garbage). Raises `SidecarError` when a call fails as a whole."""
        if len(keys) != len(slots):
            raise ValueError(f"{len(keys)} keys for {len(slots)} slots")
        out: list[ArtifactRejected | None] = []
        for r in _batches([s.nbytes for s in slots]) if self._batch else []:
            part = [keys[i] for i in r]
            got = self._batch_get_into(part, [slots[i] for i in r])
            if got is None:  # a sidecar without the batch calls
                self._batch = False
                break
            out.extend(got)
        for i in range(len(out), len(keys)):
            try:
                self.get_into(keys[i], slots[i])
                out.append(None)
            except ArtifactRejected as exc:
                out.append(exc)
        return out

    def _batch_get_into(
        self, keys: list[str], slots: list[memoryview]
    ) -> list[ArtifactRejected | None] | None:
        """One batch GET read into `slots` (see `get_many_into`); None when the sidecar has no
        batch calls (404). A stale keep-alive connection is retried once on a fresh one."""
        url = self._prefix + BATCH_GET_PATH
        body = json.dumps({"keys": keys}).encode()
        headers = {"content-type": "application/json"}
        for attempt in (0, 1):
            try:
                conn = self._conn()
                conn.request("POST", url, body=body, headers=headers)
                resp = conn.getresponse()
                if resp.status != 200:
                    data = resp.read()
                    if resp.status == 404:
                        return None
                    raise SidecarError(f"batch get answered {resp.status}: {data[:200]!r}")
                try:
                    entries = decode_manifest(
                        _read_exactly(resp, manifest_length(_read_exactly(resp, LENGTH_BYTES)))
                    )
                except BatchFormatError as exc:
                    self._drop()
                    raise SidecarError(f"batch get: {exc}") from exc
                if [e["key"] for e in entries] != keys:
                    self._drop()
                    raise SidecarError("batch get answered other keys than asked")
                out = [_read_entry(resp, e, slot) for e, slot in zip(entries, slots, strict=True)]
                if resp.read(1):
                    self._drop()
                    raise SidecarError("batch get: bytes after the last artifact")
                return out
            except (http.client.HTTPException, OSError) as exc:
                self._drop()
                if attempt:
                    raise SidecarError(f"POST {url}: {exc!r}") from exc
        raise AssertionError("unreachable")

    def _get_or_rejected(self, key: str) -> bytes | ArtifactRejected:
        try:
            return self.get(key)
        except ArtifactRejected as exc:
            return exc

    def put_many(
        self,
        items: Sequence[tuple[str, bytes | memoryview]],
        block_artifacts: int | None = None,
    ) -> None:
        """`put` of every (key, bytes) in batch calls, each with its checksum (the sidecar
        stores each artifact that matches its own). Raises `SidecarError` naming the first
        artifact refused, or when a call fails."""
        if not self._batch:
            for key, data in items:
                self.put(key, data, block_artifacts)
            return
        for r in _batches([len(data) for _, data in items]):
            entries: list[dict[str, object]] = []
            for i in r:
                key, data = items[i]
                entry: dict[str, object] = {
                    "key": key,
                    "size": len(data),
                    "checksum": xxhash.xxh3_128_hexdigest(data),
                }
                if block_artifacts is not None:
                    entry["block_artifacts"] = block_artifacts
                entries.append(entry)
            body = encode_batch(entries, [items[i][1] for i in r])
            status, _, data = self._request(
                "POST", BATCH_PUT_PATH, body, {"content-type": MEDIA_TYPE}
            )
            if status == 404:
                self._batch = False
                for i in range(r.start, len(items)):
                    self.put(items[i][0], items[i][1], block_artifacts)
                return
            if status != 200:
                raise SidecarError(f"batch put answered {status}: {data[:200]!r}")
            try:
                stored = json.loads(data)["stored"]
                refused = [s for s in stored if "error" in s]
            except (ValueError, KeyError, TypeError) as exc:
                raise SidecarError(
                    f"batch put answer is not {{'stored': [...]}}: {data[:200]!r}"
                ) from exc
            if refused:
                raise SidecarError(
                    f"batch put refused {len(refused)} artifacts, first {refused[0].get('key')!r}: "
                    f"{refused[0].get('error')}"
                )

    def report_store(
        self,
        stored: Sequence[tuple[str, int, bytes]],
        block_artifacts: int | None = None,
        dropped: Sequence[str] = (),
    ) -> list[str]:
        """Tell a sidecar on Mooncake Store what the connector wrote into the store itself
        ((key, payload bytes, checksum)) and which keys a load found gone (`POST
        /ownerserve/kv/store/report`); returns the stored keys the sidecar did not find in its
        store. Raises `SidecarError` when the call fails."""
        body = json.dumps(
            {
                "stored": [
                    {"key": key, "bytes": size, "checksum": digest.hex()}
                    for key, size, digest in stored
                ],
                "block_artifacts": block_artifacts,
                "dropped": list(dropped),
            }
        ).encode()
        status, _, data = self._request(
            "POST", STORE_REPORT_PATH, body, {"content-type": "application/json"}
        )
        if status != 200:
            raise SidecarError(f"store report answered {status}: {data[:200]!r}")
        try:
            missing = json.loads(data)["missing"]
        except (ValueError, KeyError, TypeError) as exc:
            raise SidecarError(f"store report answer has no 'missing': {data[:200]!r}") from exc
        return [str(k) for k in missing]

    def close(self) -> None:
        self._drop()


def _read_exactly(resp: http.client.HTTPResponse, n: int) -> bytes:
    data = resp.read(n)
    if len(data) != n:
        raise http.client.IncompleteRead(data, n - len(data))
    return data


def _read_into(resp: http.client.HTTPResponse, out: memoryview) -> None:
    got = 0
    while got < out.nbytes:
        k = resp.readinto(out[got:])
        if not k:
            raise http.client.IncompleteRead(b"", out.nbytes - got)
        got += k


_DISCARD_BYTES = 1 << 20


def _read_entry(
    resp: http.client.HTTPResponse, entry: dict[str, Any], slot: memoryview
) -> ArtifactRejected | None:
    """A batch answer's next artifact read into `slot` and verified there (None), or why it is
    refused; a payload of another size than the slot's is read past, not into it."""
    key = entry["key"]
    if entry.get("found", True) is False:
        return ArtifactRejected(f"{key}: not stored")
    size: int = entry["size"]
    if size != slot.nbytes:
        scratch = memoryview(bytearray(min(size, _DISCARD_BYTES)))
        for off in range(0, size, len(scratch) or 1):
            _read_into(resp, scratch[: min(len(scratch), size - off)])
        return ArtifactRejected(f"{key}: {size} bytes, expected {slot.nbytes}")
    _read_into(resp, slot)
    expected = entry.get("checksum")
    if not isinstance(expected, str) or not expected:
        return ArtifactRejected(f"{key}: no checksum")
    if xxhash.xxh3_128_hexdigest(slot) != expected.strip().lower():
        return ArtifactRejected(f"{key}: bytes do not match their checksum")
    return None


def _verified(entry: dict[str, object], payload: memoryview | None) -> bytes | ArtifactRejected:
    """A batch GET entry's bytes, or why they are refused."""
    key = entry["key"]
    if payload is None:
        return ArtifactRejected(f"{key}: not stored")
    expected = entry.get("checksum")
    if not isinstance(expected, str) or not expected:
        return ArtifactRejected(f"{key}: no checksum")
    if xxhash.xxh3_128_hexdigest(payload) != expected.strip().lower():
        return ArtifactRejected(f"{key}: bytes do not match their checksum")
    return bytes(payload)
