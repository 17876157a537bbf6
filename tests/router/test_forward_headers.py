"""What of a client's headers reaches a worker (`router.executor.forward_headers`)."""

from __future__ import annotations

from router.executor import forward_headers


def _names(lines: bytes) -> list[str]:
    return [line.split(b":", 1)[0].decode() for line in lines.split(b"\r\n") if line]


def test_the_engines_control_headers_and_hop_headers_never_reach_a_worker():
    client = [
        (b"x-request-id", b"someone-elses-request"),
        (b"X-Data-Parallel-Rank", b"3"),
        (b"connection", b"keep-alive"),
        (b"content-length", b"12"),
        (b"content-type", b"text/plain"),
        (b"x-session-id", b"s1"),
        (b"authorization", b"Bearer sk-client"),
    ]
    names = _names(forward_headers(client, False, {"traceparent": "00-ab-cd-01"}))
    assert names == ["x-session-id", "authorization", "content-type", "traceparent"]


def test_the_routers_own_key_stays_with_the_router_when_it_checks_keys():
    names = _names(forward_headers([(b"authorization", b"Bearer sk-ok")], True, {}))
    assert names == ["content-type"]
