"""An oversized request body and a `urllib` POST of it, for the tests that an HTTP server
answers such a body 413 (and does not reset the connection under the client)."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping


def body_of_64_mib(declared: bool) -> bytes | Iterator[bytes]:
    """64 MiB: one `bytes` (sent with a content-length) when `declared`, else 1 MiB pieces
    (sent chunked)."""
    mib = b"x" * (1 << 20)
    return mib * 64 if declared else iter([mib] * 64)


def urllib_post(
    url: str, body: bytes | Iterator[bytes], headers: Mapping[str, str] | None = None
) -> tuple[int, bytes]:
    """POST with `urllib`: `http.client` writes the whole body before it reads the answer, and
    urllib asks the server to close the connection after it (`connection: close`). Returns the
    status and the body of the answer, an error's too."""
    req = urllib.request.Request(url, data=body, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
