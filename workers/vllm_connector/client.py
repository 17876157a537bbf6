"""Blocking HTTP client of the local sidecar's KV API, for the connector's threads (the vLLM
scheduler loop, the load and save threads). Standard library plus `xxhash` (the artifact checksum),
one keep-alive connection per thread, so it imports in the vLLM venv without our HTTP stack.

API (`workers/sidecar/server.py`): `POST /ownerserve/kv/lookup {"keys": [...]}` -> `{"present":
[bool]}`; `GET /ownerserve/kv/artifacts/{key}` -> bytes with `x-ownerserve-checksum`
(XXH3-128 hex, as `workers.sidecar.store.checksum`), 404 when missing;
`PUT /ownerserve/kv/artifacts/{key}` -> 201.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Sequence
from urllib.parse import quote, urlsplit

import xxhash

CHECKSUM_HEADER = "x-ownerserve-checksum"
KV_PREFIX = "/ownerserve/kv"


class SidecarError(Exception):
    """The sidecar could not be reached or answered something unusable."""


class ArtifactRejected(SidecarError):
    """An artifact was refused before loading: missing, or its bytes fail their checksum."""


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
        body: bytes | None = None,
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

    def put(self, key: str, data: bytes, block_artifacts: int | None = None) -> None:
        """Store one artifact; `block_artifacts`: how many artifacts make its block whole (the
        sidecar publishes and serves the block only once they are all stored)."""
        headers = {"content-type": "application/octet-stream"}
        if block_artifacts is not None:
            headers["x-ownerserve-block-artifacts"] = str(block_artifacts)
        status, _, body = self._request("PUT", self._key_path(key), data, headers)
        if status not in (200, 201, 204):
            raise SidecarError(f"PUT {key} answered {status}: {body[:200]!r}")

    def close(self) -> None:
        self._drop()
